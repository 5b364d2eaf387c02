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
   :func:`decode_body`. Its answer (streamed or not) is the client's, usage included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

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
