"""The router's prompt tokenizer backends (ROUTING.md "Tokenizer backends").

One async protocol, :class:`PromptTokenizer` (``await tokenizer.prompt(parsed) -> Prompt``), three
backends, chosen by name with :func:`build_tokenizer`:

* ``estimate`` (:class:`EstimateTokenizer`): no tokenizer. The prompt is the UTF-8 bytes of
  ``parsed.prompt_text`` and counts :data:`ESTIMATE_BYTES_PER_TOKEN` bytes per token. Chat is
  rendered with the same ChatML as the simulator (:func:`common.chatml.render_chat`), so
  against the simulator's built-in 4-byte tokenizer the bytes are exactly the engine's tokens.
* ``hf`` (:class:`HFPromptTokenizer`): a ``tokenizers`` tokenizer.json; chat rendered with the
  tokenizer's own Jinja chat template when one sits beside it, else ChatML.
* ``engine`` (:class:`EngineTokenizer`): the engine's ``POST /tokenize``; falls back to the
  estimate (and counts it) when the engine does not answer properly.

Whatever the backend, a prompt the client sent as token ids is used as is.
:func:`to_llm_request` turns a parsed request and its :class:`Prompt` into the scheduler's
:class:`~router.scheduling.types.LLMRequest`.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from common.chatml import content_text
from router.chat_template import ChatTemplateError, JinjaChatTemplate
from router.parsing import ParsedRequest, RequestError
from router.scheduling.types import ESTIMATE_BYTES_PER_TOKEN, LLMRequest

log = logging.getLogger(__name__)

#: Kinds whose prompt is a chat rendering (messages), as opposed to a plain text prompt.
_CHAT_KINDS = ("chat", "response")


@dataclass(frozen=True, slots=True)
class Prompt:
    """A tokenized prompt, as :class:`~router.scheduling.types.LLMRequest` takes it.

    Attributes:
        token_ids: the prompt's token ids (``hf`` / ``engine`` backends, or ids the client sent),
            else None.
        prompt_bytes: the prompt text as UTF-8 (``estimate`` backend, or ``engine`` fallback), else None.
        prompt_tokens: prompt length in tokens: ``len(token_ids)``, or ``ceil(len(prompt_bytes) / 4)``
            for an estimate (what the simulator's built-in 4-byte tokenizer counts).
    """

    token_ids: Sequence[int] | None
    prompt_bytes: bytes | None
    prompt_tokens: int


class PromptTokenizer(Protocol):
    """A tokenizer backend. ``kind`` is its name in :func:`build_tokenizer`."""

    kind: str

    async def prompt(self, parsed: ParsedRequest) -> Prompt:
        """The prompt of ``parsed``. Raises :class:`~router.parsing.RequestError` (400) when the
        request cannot be rendered (e.g. a chat template refuses its messages)."""
        ...

    async def aclose(self) -> None:
        """Release what the backend owns (an HTTP client it made itself)."""
        ...


def _given_ids(parsed: ParsedRequest) -> Prompt | None:
    ids = parsed.prompt_token_ids
    return None if ids is None else Prompt(ids, None, len(ids))


def estimate_prompt(parsed: ParsedRequest) -> Prompt:
    """The ``estimate`` prompt of ``parsed``: the given token ids, else ``prompt_text`` as UTF-8 bytes
    at :data:`ESTIMATE_BYTES_PER_TOKEN` bytes per token (rounded up)."""
    given = _given_ids(parsed)
    if given is not None:
        return given
    data = parsed.prompt_text.encode()
    return Prompt(None, data, -(-len(data) // ESTIMATE_BYTES_PER_TOKEN))


class EstimateTokenizer:
    """``estimate``: no tokenizer, about 4 bytes per token (ROUTING.md). Cost: one UTF-8 encode."""

    kind = "estimate"

    async def prompt(self, parsed: ParsedRequest) -> Prompt:
        return estimate_prompt(parsed)

    async def aclose(self) -> None:
        return None


def _add_special_tokens(parsed: ParsedRequest) -> bool:
    """vLLM's ``add_special_tokens`` default: False for chat and responses (the chat template already
    writes BOS and the like; vLLM's ``ChatCompletionRequest`` default), True for completions and
    embeddings (vLLM's ``CompletionRequest`` / ``EmbeddingCompletionRequest`` default); a boolean
    ``add_special_tokens`` in the body (vLLM's extension) wins."""
    value = parsed.body.get("add_special_tokens")
    if isinstance(value, bool):
        return value
    return parsed.kind not in _CHAT_KINDS


class HFPromptTokenizer:
    """``hf``: a Hugging Face ``tokenizers`` tokenizer.json, applying the chat template.

    Chat and responses prompts are rendered with the tokenizer's own template
    (:meth:`JinjaChatTemplate.from_tokenizer_dir`: ``chat_template.jinja`` or
    ``tokenizer_config.json`` beside the tokenizer.json) with the body's ``add_generation_prompt``,
    ``tools`` and ``chat_template_kwargs``, else with ChatML; then encoded with
    ``add_special_tokens`` as vLLM does (:func:`_add_special_tokens`). A list of string prompts is
    encoded as its ``"\\n"``-joined text (one token sequence for the router; the engine runs each).

    Cost, measured on the 2-core CI machine with a 32k-vocabulary byte-level BPE (``tokenizers``
    0.23): about 6 ms for an 8k-token prompt of prose (0.75 µs per token; 1 ms for 1k tokens), and
    up to about 20 ms for 8k tokens of code or markdown (long whitespace and symbol runs cost more).
    ``tokenizers`` releases the GIL while encoding (two threads ran 1.5× faster than one), so texts
    of at least ``offload_min_chars`` characters are encoded in a worker thread
    (``asyncio.to_thread``, ~50 µs of overhead) instead of stalling the event loop; shorter inline.

    Args:
        path: the tokenizer.json.
        chat_template: the template to use, None for ChatML, or ``"beside"`` (the default) for the one
            found beside ``path`` (ChatML when there is none).
        offload_min_chars: text length from which encoding leaves the event loop (default 4096
            characters: about 1k tokens, 1 ms of encoding by the figures above).

    Raises:
        Exception: from ``tokenizers`` when the file is missing or malformed.
        ChatTemplateError: the template beside it does not compile.
    """

    kind = "hf"

    def __init__(self, path: str | Path, *, chat_template: JinjaChatTemplate | None | Literal["beside"] = "beside",
                 offload_min_chars: int = 4096):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))
        self.template = (JinjaChatTemplate.from_tokenizer_dir(Path(path).parent) if chat_template == "beside"
                         else chat_template)
        self.offload_min_chars = offload_min_chars

    def text(self, parsed: ParsedRequest) -> str:
        """The prompt text to encode: the chat rendering (own template or ChatML) or ``prompt_text``.

        Raises:
            RequestError: 400 when the chat template fails on these messages (as vLLM answers it).
        """
        if parsed.kind not in _CHAT_KINDS or parsed.messages is None:
            return parsed.prompt_text
        if self.template is None:
            return parsed.prompt_text  # already ChatML-rendered by the parser
        body = parsed.body if parsed.kind == "chat" else {}
        tools = body.get("tools")
        kwargs = body.get("chat_template_kwargs")
        try:
            return self.template.render(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                        tools=tools if isinstance(tools, list) else None,
                                        variables=kwargs if isinstance(kwargs, dict) else None)
        except ChatTemplateError as exc:
            raise RequestError(400, str(exc), "messages" if parsed.kind == "chat" else "input",
                               "invalid_value") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (synchronous CPU work; see the class docstring for its cost)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def prompt(self, parsed: ParsedRequest) -> Prompt:
        given = _given_ids(parsed)
        if given is not None:
            return given
        text = self.text(parsed)
        special = _add_special_tokens(parsed)
        if len(text) >= self.offload_min_chars:
            ids = await asyncio.to_thread(self.encode, text, special)
        else:
            ids = self.encode(text, special)
        return Prompt(ids, None, len(ids))

    async def aclose(self) -> None:
        return None


class EngineTokenizer:
    """``engine``: the engine's ``POST {engine_url}/tokenize`` (vLLM's tokenizer endpoint).

    Sends ``{"model", "messages"}`` for chat and responses (responses items flattened to string
    contents; plus a chat body's
    ``add_generation_prompt``, ``tools``, ``chat_template_kwargs`` and ``add_special_tokens``) and
    ``{"model", "prompt"}`` for completions and embeddings (plus ``add_special_tokens``); reads
    ``tokens``. On any failure — connection error, timeout, a non-200 answer, a body without a list
    of token ids — the prompt is estimated instead (:func:`estimate_prompt`), ``fallbacks`` is
    incremented and a warning is logged (``action=tokenize_fallback``).

    Args:
        engine_url: the engine's base URL, e.g. ``http://10.0.0.7:8000``, or a callable returning
            one per call (the router passes "some healthy endpoint", so a dead engine is not asked;
            None from it means no engine: estimate).
        client: the HTTP client to use (not closed by :meth:`aclose`); None makes one that
            :meth:`aclose` closes.
        timeout_s: per-call timeout in seconds (default 2 s, our choice: a tokenize call is one CPU
            pass on the engine's API server, a few ms when healthy; longer means trouble, and the
            estimate is better than a stalled request).
    """

    kind = "engine"

    def __init__(self, engine_url: str | Callable[[], str | None], client: httpx.AsyncClient | None = None, *,
                 timeout_s: float = 2.0):
        self._engine_url = engine_url
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient()
        self.timeout_s = timeout_s
        self.fallbacks = 0

    @staticmethod
    def request_body(parsed: ParsedRequest) -> dict[str, Any]:
        """The ``/tokenize`` body for ``parsed``."""
        body: dict[str, Any] = {"model": parsed.model}
        if parsed.kind == "response" and parsed.messages is not None:
            # responses items as chat messages: their input_text parts are not chat content parts
            body["messages"] = [{"role": m.get("role", "user"), "content": content_text(m.get("content"))}
                                for m in parsed.messages]
        elif parsed.kind == "chat" and parsed.messages is not None:
            body["messages"] = parsed.messages
            body["add_generation_prompt"] = parsed.add_generation_prompt
            for name in ("tools", "chat_template_kwargs"):
                if parsed.body.get(name) is not None:
                    body[name] = parsed.body[name]
        else:
            body["prompt"] = parsed.prompt_text
        if isinstance(parsed.body.get("add_special_tokens"), bool):
            body["add_special_tokens"] = parsed.body["add_special_tokens"]
        return body

    async def prompt(self, parsed: ParsedRequest) -> Prompt:
        given = _given_ids(parsed)
        if given is not None:
            return given
        error: str
        base = self._engine_url() if callable(self._engine_url) else self._engine_url
        url = f"{base.rstrip('/')}/tokenize" if base else None
        try:
            if url is None:
                raise ValueError("no engine to ask")
            response = await self._client.post(url, json=self.request_body(parsed), timeout=self.timeout_s)
            if response.status_code == 200:
                tokens = response.json().get("tokens")
                if isinstance(tokens, list):
                    ids = array("I", tokens)
                    return Prompt(ids, None, len(ids))
                error = "no token list in the answer"
            else:
                error = f"HTTP {response.status_code}"
        except (httpx.HTTPError, ValueError, TypeError, OverflowError, AttributeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.fallbacks += 1
        log.warning("engine tokenize failed, estimating the prompt", extra={
            "action": "tokenize_fallback", "engine": url, "error": error, "request_id": parsed.request_id})
        return estimate_prompt(parsed)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _build_estimate(tokenizer_path: str | None, engine_url: str | None,
                    client: httpx.AsyncClient | None) -> PromptTokenizer:
    return EstimateTokenizer()


def _build_hf(tokenizer_path: str | None, engine_url: str | None,
              client: httpx.AsyncClient | None) -> PromptTokenizer:
    if not tokenizer_path:
        raise ValueError("the hf tokenizer backend needs tokenizer_path (a tokenizer.json)")
    return HFPromptTokenizer(tokenizer_path)


def _build_engine(tokenizer_path: str | None, engine_url: str | None,
                  client: httpx.AsyncClient | None) -> PromptTokenizer:
    if not engine_url:
        raise ValueError("the engine tokenizer backend needs engine_url")
    return EngineTokenizer(engine_url, client)


#: Backend name → builder (the ``tokenizer`` setting's values).
TOKENIZER_BACKENDS: dict[str, Callable[[str | None, str | None, httpx.AsyncClient | None], PromptTokenizer]] = {
    "estimate": _build_estimate,
    "hf": _build_hf,
    "engine": _build_engine,
}


def build_tokenizer(kind: str, *, tokenizer_path: str | None = None, engine_url: str | None = None,
                    client: httpx.AsyncClient | None = None) -> PromptTokenizer:
    """The tokenizer backend named ``kind``: ``estimate``, ``hf`` or ``engine``.

    Args:
        kind: the backend's name.
        tokenizer_path: the tokenizer.json (``hf``; required there).
        engine_url: the engine base URL whose ``/tokenize`` to call (``engine``; required there).
        client: the ``httpx.AsyncClient`` for ``engine`` (None: the backend makes and owns one).

    Raises:
        ValueError: an unknown ``kind``, or a missing argument the backend needs.
        Exception: from ``tokenizers`` for a missing or malformed tokenizer.json (``hf``).
    """
    builder = TOKENIZER_BACKENDS.get(kind)
    if builder is None:
        raise ValueError(f"unknown tokenizer backend {kind!r}; expected one of {sorted(TOKENIZER_BACKENDS)}")
    return builder(tokenizer_path, engine_url, client)


def to_llm_request(parsed: ParsedRequest, prompt: Prompt, priority: int) -> LLMRequest:
    """The scheduler's :class:`~router.scheduling.types.LLMRequest` for ``parsed``.

    Args:
        parsed: the parsed request (id, model, session, objective, cache salt).
        prompt: its tokenized prompt.
        priority: the objective's priority in llm-d's convention (higher is more important).
    """
    return LLMRequest(request_id=parsed.request_id, model=parsed.model, prompt_token_ids=prompt.token_ids,
                      prompt_bytes=prompt.prompt_bytes, session_id=parsed.session_id, objective=parsed.objective,
                      priority=priority, cache_salt=parsed.cache_salt)
