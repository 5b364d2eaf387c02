"""The bodies of a disaggregated request, as vLLM's NixlConnector expects them.

The request flow is vLLM's (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, and
llm-d's routing sidecar ``pkg/sidecar/proxy/connector_nixlv2.go``):

1. the **prefill engine** gets a copy of the body with ``kv_transfer_params`` =
   :data:`PREFILL_KV_TRANSFER_PARAMS` (``do_remote_decode: true``: keep the KV blocks for a remote
   decode engine to pull), ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when the body has
   it), ``stream: false`` without ``stream_options``, ``n: 1`` when the body names ``n``, and
   without ``min_tokens`` / ``min_completion_tokens`` (vLLM's proxy drops them: a prefill engine
   generates one token); :func:`prefill_body`;
2. its JSON answer carries a top-level ``kv_transfer_params`` dict (``do_remote_prefill: true``,
   ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, …), which the
   router treats as opaque: :func:`kv_transfer_params_of`;
3. the **decode engine** gets the ORIGINAL body plus ``kv_transfer_params`` = that dict, copied:
   :func:`decode_body`. Its answer (streamed or not) is the client's, usage included, with one
   change (:class:`ClientUsage`): ``usage.prompt_tokens_details.cached_tokens`` is the prefill
   engine's. vLLM's decode side reports every prompt token but the last as cached (they arrived
   over NIXL); the client gets what one engine would have reported, the prompt tokens found in
   the prefix cache of the engine that computed the prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from router.usage import cached_tokens_from_json, sse_events, with_cached_tokens

#: The ``kv_transfer_params`` of the prefill leg (vLLM's toy proxy sends exactly these keys).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Body fields a prefill engine is not sent (vLLM's toy proxy: "not supported for P").
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def single_sequence(body: Mapping[str, Any]) -> bool:
    """Whether ``body`` asks for one sequence: ``n`` absent, null or 1, and one prompt (a chat, or a
    completions ``prompt`` that is a string, token ids, or a list of one of either). Only such a
    request is disaggregated: vLLM's NixlConnector hands over one request's blocks per
    ``kv_transfer_params`` (n > 1 is not supported, vLLM PR #38900 "Support kv_transfer_params for
    parallel sampling": each child request has its own blocks and request id), and a prompt list
    is one engine request per prompt with one ``kv_transfer_params`` in the answer, so the rest of
    the prefill would be computed for nothing and its blocks held until
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``."""
    n = body.get("n")
    if n is not None and n != 1:
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return False
    return True


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill leg's body for the client's ``body`` (module docstring, step 1); ``body`` is
    not modified."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    if "n" in body:
        out["n"] = 1
    return orjson.dumps(out)


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> bytes:
    """The decode leg's body: ``body`` with ``kv_transfer_params`` set to a copy of the prefill
    answer's (module docstring, step 3)."""
    return orjson.dumps({**body, "kv_transfer_params": dict(kv_transfer_params)})


def kv_transfer_params_of(answer: bytes) -> dict[str, Any] | None:
    """The top-level ``kv_transfer_params`` object of a prefill engine's JSON answer; None when the
    answer is not a JSON object or has no such object (null, absent, empty, or not a mapping),
    which the router counts as a failed prefill."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) and params else None


class ClientUsage:
    """The decode leg's answer as the client would get it from one engine (module docstring, 3):
    ``cached_tokens`` (the prefill engine's report) in place of the decode engine's.

    ``engine_cached_tokens`` keeps what the decode engine reported (its cache now holds the prompt:
    the router's prefix learning reads it). Bodies that are not JSON, and events without a
    ``usage.prompt_tokens_details.cached_tokens``, pass unchanged.
    """

    def __init__(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens
        self.engine_cached_tokens: int | None = None

    def answer(self, data: bytes) -> bytes:
        """A non-streamed answer for the client."""
        self.engine_cached_tokens = cached_tokens_from_json(data)
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(answer, dict) and with_cached_tokens(answer, self.cached_tokens):
            return orjson.dumps(answer)
        return data

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed answer for the client, cut at event boundaries; the usage event rewritten."""
        async for events in sse_events(chunks):
            yield b"".join([self._event(event) if b'"cached_tokens"' in event else event for event in events])

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                answer = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return event
            if not isinstance(answer, dict):
                return event
            self.engine_cached_tokens = cached_tokens_from_json(line[5:])
            if with_cached_tokens(answer, self.cached_tokens):
                lines[i] = b"data: " + orjson.dumps(answer) + (b"\r" if line.endswith(b"\r") else b"")
            return b"\n".join(lines)
        return event
