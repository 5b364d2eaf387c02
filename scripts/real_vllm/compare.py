"""Send the same requests to a real vLLM and to the engine simulator and print what differs.

    python scripts/real_vllm/compare.py --real http://127.0.0.1:8100 --real-events tcp://127.0.0.1:5570 \
        --tokenizer /tmp/real_vllm/model/tokenizer.json [--json out.json]

The real engine is the one ``serve_tiny_vllm.sh`` starts (model ``tiny``, block size 128 on CPU,
``--max-model-len 512``, ``PYTHONHASHSEED=0``, events bound on ``tcp://*:5570``). The simulator is
started here as a subprocess with the same name, tokenizer, block size, context length and hash
seed, its events bound on a free port. Compared (each a list of findings, empty when equal):

* ``shapes``: key paths of completion, chat, streamed chunks (with ``include_usage``), ``/tokenize``,
  ``/v1/models`` and the usage block, ignoring values;
* ``tokens``: prompt token counts of the same prompts; ``cached_tokens`` on a repeat;
* ``errors``: status, ``type``, ``param`` and message of the same bad requests;
* ``metrics``: every ``vllm:`` sample name the simulator exports must exist in vLLM's output with
  at least the simulator's label names (vLLM's extra families are listed as ``real_only``);
* ``events``: batch layout, ``BlockStored`` field names, and whether the two engines give the same
  ``block_hashes`` and ``token_ids`` for the same prompt.

Exit status 0 always: this is a report, the pytest module ``tests/conformance/test_fleet_real_vllm.py``
asserts the parts that must match.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import msgpack
import zmq

MODEL = "tiny"
# a fresh first line per run: a long-lived real engine must not have this prompt cached already
PROMPT = f"run {uuid.uuid4().hex}\n" + "The quick brown fox jumps over the lazy dog while the engine caches blocks. " * 12
BAD_REQUESTS: dict[str, tuple[str, Any]] = {
    "unknown model": ("/v1/completions", {"model": "nope", "prompt": "x"}),
    "max_tokens 0": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
    "max_tokens over context": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 600}),
    "prompt + max_tokens over context": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 500}),
    "empty messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    "top_logprobs without logprobs": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
    "top_logprobs 30": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}),
    "n 0": ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}),
    "priority under fcfs": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": 3}),
    "missing prompt": ("/v1/completions", {"model": MODEL}),
    "invalid JSON": ("/v1/completions", b"not json"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paths(obj: Any, prefix: str = "") -> set[str]:
    """Key paths of a JSON value (list items merged as ``[]``), values ignored."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(f"{prefix}.{k}")
            out |= paths(v, f"{prefix}.{k}")
    elif isinstance(obj, list):
        for v in obj:
            out |= paths(v, f"{prefix}[]")
    return out


def shape_diff(name: str, real: Any, sim: Any) -> list[str]:
    r, s = paths(real), paths(sim)
    found = []
    if r - s:
        found.append(f"{name}: only real: {sorted(r - s)}")
    if s - r:
        found.append(f"{name}: only sim: {sorted(s - r)}")
    return found


def sse(client: httpx.Client, url: str, body: dict) -> list[Any]:
    with client.stream("POST", url, json=body) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(x) if x != "[DONE]" else x for x in lines]


def metric_families(text: str) -> dict[str, set[str]]:
    """``vllm:`` sample names (``_total``/``_count`` kept) mapped to their label names."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, _, rest = line.partition("{")
            labels = {kv.split("=", 1)[0] for kv in rest.rsplit("}", 1)[0].split(",") if "=" in kv}
            out.setdefault(name.split()[0], set()).update(labels)
    return out


def collect_events(sub: zmq.Socket, seconds: float) -> list[tuple[bytes, Any]]:
    got = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, _seq, payload = sub.recv_multipart()
            got.append((topic, msgpack.unpackb(payload)))
    return got


def probe(url: str, events: str) -> dict[str, Any]:
    """Everything compared, from one engine."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(events)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # let the subscription reach the publisher
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        out["completion"] = c.post("/v1/completions", json=body).json()
        out["events_first"] = collect_events(sub, 2.0)
        out["completion_again"] = c.post("/v1/completions", json=body).json()
        out["events_again"] = collect_events(sub, 1.0)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        out["chat"] = c.post("/v1/chat/completions", json=chat).json()
        out["chat_stream"] = sse(c, "/v1/chat/completions",
                                 {**chat, "stream": True, "stream_options": {"include_usage": True}})
        out["completion_stream"] = sse(c, "/v1/completions",
                                       {**body, "stream": True, "stream_options": {"include_usage": True}})
        out["tokenize"] = c.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
        out["models"] = c.get("/v1/models").json()
        out["errors"] = {}
        for name, (path, req) in BAD_REQUESTS.items():
            r = (c.post(path, content=req, headers={"content-type": "application/json"}) if isinstance(req, bytes)
                 else c.post(path, json=req))
            out["errors"][name] = (r.status_code, r.json() if r.headers.get("content-type", "").startswith(
                "application/json") else r.text)
        out["metrics"] = c.get("/metrics").text
    sub.close(linger=0)
    ctx.term()
    return out


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, list[str]]:
    report: dict[str, list[str]] = {k: [] for k in ("shapes", "tokens", "errors", "metrics", "events")}
    for key in ("completion", "chat", "tokenize", "models"):
        report["shapes"] += shape_diff(key, real[key], sim[key])
    for key in ("chat_stream", "completion_stream"):
        r, s = real[key], sim[key]
        report["shapes"] += shape_diff(f"{key} chunks", r[:-2], s[:-2])
        report["shapes"] += shape_diff(f"{key} usage chunk", r[-2], s[-2])
        if (r[-1], s[-1]) != ("[DONE]", "[DONE]"):
            report["shapes"].append(f"{key}: last lines {r[-1]!r} / {s[-1]!r}")
    for key in ("completion", "completion_again", "chat"):
        ru, su = real[key]["usage"], sim[key]["usage"]
        for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if ru[field] != su[field]:
                report["tokens"].append(f"{key}.usage.{field}: real {ru[field]} / sim {su[field]}")
        rc = (ru.get("prompt_tokens_details") or {}).get("cached_tokens")
        sc = (su.get("prompt_tokens_details") or {}).get("cached_tokens")
        if rc != sc:
            report["tokens"].append(f"{key}.usage.prompt_tokens_details.cached_tokens: real {rc} / sim {sc}")
    if real["tokenize"].get("tokens") != sim["tokenize"].get("tokens"):
        report["tokens"].append(f"/tokenize 'hello world': real {real['tokenize'].get('tokens')} / "
                                f"sim {sim['tokenize'].get('tokens')}")
    for name in BAD_REQUESTS:
        (rs, rb), (ss, sb) = real["errors"][name], sim["errors"][name]
        if rs != ss:
            report["errors"].append(f"{name}: status real {rs} / sim {ss}")
            continue
        if rs >= 400:
            re_, se = rb["error"], sb["error"]
            for field in ("type", "param", "message", "code"):
                if re_.get(field) != se.get(field):
                    report["errors"].append(f"{name}: {field} real {re_.get(field)!r} / sim {se.get(field)!r}")
    rm, sm = metric_families(real["metrics"]), metric_families(sim["metrics"])
    for name in sorted(sm):
        if name not in rm:
            report["metrics"].append(f"only sim: {name}")
        elif sm[name] - rm[name]:
            report["metrics"].append(f"{name}: labels only sim {sorted(sm[name] - rm[name])}")
    report["real_only_metrics"] = sorted(set(rm) - set(sm))
    report["events"] += _events(real, sim)
    return report


def _stored(batches: list[tuple[bytes, Any]]) -> list[dict]:
    return [e for _t, b in batches for e in b[1] if isinstance(e, dict) and e.get("type") == "BlockStored"]


def _events(real: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    found = []
    rb, sb = real["events_first"], sim["events_first"]
    if not rb or not sb:
        return [f"no events received: real {len(rb)} batches / sim {len(sb)}"]
    for label, batches in (("real", rb), ("sim", sb)):
        topic, batch = batches[0]
        found.append(f"{label}: topic {topic!r}, batch = list of {len(batch)} "
                     f"[{type(batch[0]).__name__}, {type(batch[1]).__name__}, {type(batch[2]).__name__}]")
    rs, ss = _stored(rb), _stored(sb)
    if rs and ss:
        if set(rs[0]) != set(ss[0]):
            found.append(f"BlockStored fields: only real {sorted(set(rs[0]) - set(ss[0]))}, "
                         f"only sim {sorted(set(ss[0]) - set(rs[0]))}")
        for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_id",
                      "group_idx", "kv_cache_spec_kind"):
            rv, sv = rs[0].get(field), ss[0].get(field)
            if rv != sv:
                show = (lambda v: f"{len(v)} items, first {v[:3]}") if isinstance(rv, list) else repr
                found.append(f"BlockStored.{field}: real {show(rv)} / sim {show(sv) if isinstance(sv, list) else sv!r}")
    else:
        found.append(f"BlockStored seen: real {len(rs)} / sim {len(ss)}")
    again = (len(_stored(real["events_again"])), len(_stored(sim["events_again"])))
    found.append(f"BlockStored after repeating the prompt: real {again[0]} / sim {again[1]}")
    return found


def start_sim(tokenizer: str) -> tuple[subprocess.Popen, str, str]:
    from engine_twin.launch import sim_engine_argv, wait_ready

    port, events = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
    argv = sim_engine_argv(port, [MODEL], block_size=128, max_model_len=512, hash_seed="0", time_scale=0.0,
                           tokenizer=tokenizer, scheduling_policy="fcfs",
                           extra=["--kv-events-config", json.dumps(cfg)])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}", timeout=30, process=proc)
    return proc, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}"


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", default=os.environ.get("REAL_VLLM_URL", "http://127.0.0.1:8100"))
    parser.add_argument("--real-events", default=os.environ.get("REAL_VLLM_EVENTS", "tcp://127.0.0.1:5570"))
    parser.add_argument("--tokenizer", default="/tmp/real_vllm/model/tokenizer.json")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    real = probe(args.real, args.real_events)
    proc, url, events = start_sim(args.tokenizer)
    try:
        sim = probe(url, events)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    report = compare(real, sim)
    report["real_version"] = [httpx.get(f"{args.real}/version").text]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": report, "real": _jsonable(real), "sim": _jsonable(sim)}, f, indent=1, default=str)
    for section, lines in report.items():
        print(f"## {section}")
        for line in lines:
            print(f"- {line}")
    return report


def _jsonable(probe_out: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if not k.startswith("events") else [[t.decode(), b] for t, b in v]) for k, v in probe_out.items()}


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
