"""Tokenizers of the simulated engine: a ``tokenizers`` tokenizer.json, or a built-in one.

The token ids these return are exactly what the prefix cache hashes, what ``/tokenize`` answers and
what KV events carry, so a router that tokenizes with the same tokenizer sees the same blocks.

* :class:`HFTokenizer` wraps ``tokenizers.Tokenizer.from_file(path)``.
* :class:`BuiltinTokenizer` needs no file: every 4 bytes of UTF-8 text are one token (the id is the
  little-endian value of the 4 bytes, padded with NUL), so a shared text prefix gives shared tokens,
  decoding is exact, and counts match the router's ``estimate`` backend (about 4 bytes per token).

Chat messages are rendered with one ChatML template for both: :func:`common.chatml.render_chat`,
the same rendering the router's ``estimate`` tokenizer backend uses (re-exported here).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol

__all__ = ["BuiltinTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer. Token ids are non-negative ints below 2**32."""

    name: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def filler(self, n: int) -> tuple[str, list[int]]:
        """``n`` deterministic generated tokens: (their text, their ids)."""
        ...


_FILLER_TEXT = " the engine simulator writes these words as its answer "  # 56 bytes: whole tokens


@dataclass
class BuiltinTokenizer:
    """Four UTF-8 bytes per token; exact round trip; no vocabulary file."""

    name: str = "builtin-4byte"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        pad = -len(data) % 4
        if pad:
            data += b"\0" * pad
        words = array("I")
        words.frombytes(data)
        if words.itemsize != 4:  # pragma: no cover - every CPython platform we run has 4-byte I
            raise RuntimeError("array('I') is not 4 bytes on this platform")
        return words.tolist()

    def decode(self, ids: list[int]) -> str:
        return array("I", ids).tobytes().rstrip(b"\0").decode("utf-8", errors="replace")

    def filler(self, n: int) -> tuple[str, list[int]]:
        unit = self.encode(_FILLER_TEXT)
        ids = (unit * (n // len(unit) + 1))[:n]
        return self.decode(ids), ids


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json (for example the one inside the ``litellm`` wheel)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(path)
        self.name = path
        self._filler_ids = self._tok.encode(_FILLER_TEXT, add_special_tokens=False).ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def filler(self, n: int) -> tuple[str, list[int]]:
        unit = self._filler_ids
        ids = (unit * (n // len(unit) + 1))[:n]
        return self.decode(ids), ids


def load_tokenizer(path: str | None) -> Tokenizer:
    """A :class:`HFTokenizer` for a tokenizer.json path, else the :class:`BuiltinTokenizer`.

    Raises ``Exception`` from ``tokenizers`` when the file is missing or malformed.
    """
    return HFTokenizer(path) if path else BuiltinTokenizer()
