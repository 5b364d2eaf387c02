"""Seeded generator of OpenAI batch input files for benchmarks (``backfill bench ingest`` and others).

:func:`write_batch_file` streams valid batch lines to disk: ``custom_id`` ``request-<n>`` (n from 1),
``method`` POST, ``url`` the endpoint, one model, and a prompt made of one of a few shared system
prompts (so ordering by ``(model, prefix)`` has something to group) plus user text padded so the file
comes to about ``target_bytes``. The same arguments always give the same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson

__all__ = ["write_batch_file"]

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no will can more "
    "about out up them some could what into than then its time only new like other these two may first "
    "any how our over such after most also made did many before must well back through years where "
    "much your way down should because each just those people take day good same world great"
).split()

_TOPICS = (
    "summarise the quarterly report",
    "classify the customer ticket",
    "translate the paragraph into French",
    "extract the named entities",
    "answer the question about the passage",
    "write a product description",
    "grade the student essay",
    "find the bug in the snippet",
)

_POOL_BYTES = 1 << 20  # 1 MiB of filler text, sliced at random offsets
_FLUSH_BYTES = 1 << 20  # write to disk in ~1 MiB pieces


def _filler(rng: random.Random, size: int) -> str:
    words: list[str] = []
    total = 0
    while total < size:
        word = rng.choice(_WORDS)
        words.append(word)
        total += len(word) + 1
    return " ".join(words)


def _system_prompts(rng: random.Random, count: int) -> list[str]:
    prompts = []
    for k in range(count):
        topic = _TOPICS[k % len(_TOPICS)]
        prompts.append(
            f"You are assistant #{k:04d}. Your task: {topic}. Follow the house style guide strictly. "
            + _filler(rng, 200 + rng.randrange(400))
        )
    return prompts


def _body(endpoint: str, model: str, system: str, user: str, max_tokens: int) -> dict[str, Any]:
    if endpoint == "/v1/chat/completions":
        return {
            "model": model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens,
        }
    if endpoint == "/v1/completions":
        return {"model": model, "prompt": system + "\n" + user, "max_tokens": max_tokens}
    if endpoint == "/v1/responses":
        return {
            "model": model,
            "instructions": system,
            "input": [{"role": "user", "content": user}],
            "max_output_tokens": max_tokens,
        }
    # /v1/embeddings, /v1/moderations and anything else take "input".
    return {"model": model, "input": system + "\n" + user}


def write_batch_file(
    path: Path,
    *,
    lines: int,
    target_bytes: int,
    endpoint: str = "/v1/chat/completions",
    model: str = "sim-model",
    seed: int = 0,
    shared_prefixes: int = 50,
    max_tokens: int | None = None,
) -> int:
    """Write ``lines`` batch request lines to ``path`` (LF-terminated); return the bytes written.

    ``target_bytes``: the wanted file size in bytes; each line's user text is padded with ASCII filler
    so the file is exactly ``target_bytes`` long whenever that is at least the size of the unpadded
    lines (a system prompt of 280–680 bytes plus ~220 bytes of request, so ≤ ~900 bytes a line);
    below that the lines are written unpadded and the file is larger than asked.
    ``shared_prefixes``: how many distinct system prompts the lines draw from (each line picks one at
    random; they differ within their first 30 bytes, so ``(model, prefix)`` ordering groups them).
    ``max_tokens``: every line's output limit (``max_tokens`` / ``max_output_tokens``); None draws
    one from 16–256 per line. Either way the rest of the file is the same for the same seed.
    ``seed`` fixes every random choice, so equal arguments give identical files. The file is streamed
    in ~1 MiB writes, never held whole in memory. Raises ``ValueError`` if ``lines``,
    ``shared_prefixes`` or ``max_tokens`` is below 1, and ``OSError`` from the file system.
    """
    if lines < 1 or shared_prefixes < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError("lines, shared_prefixes and max_tokens must be at least 1")
    rng = random.Random(seed)
    prompts = _system_prompts(rng, shared_prefixes)
    pool = _filler(rng, _POOL_BYTES)
    pool_len = len(pool)
    written = 0
    buffer: list[bytes] = []
    buffered = 0
    with open(path, "wb") as out:
        for n in range(1, lines + 1):
            system = prompts[rng.randrange(shared_prefixes)]
            question = f"Item {n}: "
            drawn = 16 + rng.randrange(241)
            limit = drawn if max_tokens is None else max_tokens
            record = {
                "custom_id": f"request-{n}",
                "method": "POST",
                "url": endpoint,
                "body": _body(endpoint, model, system, question, limit),
            }
            bare = len(orjson.dumps(record)) + 1  # + the newline
            # Spread what is left of the budget evenly over the lines still to write.
            want = (target_bytes - written - buffered) // (lines - n + 1)
            pad = want - bare
            if pad > 0:
                start = rng.randrange(pool_len)
                text = pool[start : start + pad]
                while len(text) < pad:  # wrap around the pool (or repeat it for huge lines)
                    text += pool[: pad - len(text)]
                record["body"] = _body(endpoint, model, system, question + text, limit)
            line = orjson.dumps(record) + b"\n"
            buffer.append(line)
            buffered += len(line)
            if buffered >= _FLUSH_BYTES:
                out.write(b"".join(buffer))
                written += buffered
                buffer.clear()
                buffered = 0
        if buffer:
            out.write(b"".join(buffer))
            written += buffered
    return written
