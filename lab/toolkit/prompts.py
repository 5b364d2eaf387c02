"""Prompt text and chat bodies of the open-loop benchmarks (isolation, mixed): unique user messages
of a given length in the simulator's built-in tokenizer (4 bytes per token), so no request hits
another's prefix cache, and the OpenAI chat body that carries them."""

from __future__ import annotations

import random
from typing import Any

MODEL = "sim-model"
"""The model the simulated engines serve (``backfill up``'s default)."""
ENDPOINT = "/v1/chat/completions"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def prompt_text(rng: random.Random, tokens: int) -> str:
    """A unique user message of about ``tokens`` tokens (4 bytes each, the simulator's builtin
    tokenizer and the router's ``estimate``), so no request hits another's prefix cache."""
    words: list[str] = [f"{rng.getrandbits(64):016x}"]
    size = len(words[0])
    while size < tokens * 4:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[: tokens * 4]


def chat_body(text: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """The OpenAI chat body of one request (streamed with usage, or not)."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body
