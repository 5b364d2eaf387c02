"""KV-pressure calibration: the same burst to a real vLLM and to the engine simulator, side by side.

    scripts/real_vllm/serve_tiny_vllm.sh /tmp/real_vllm 8100 5570 \\
        --num-gpu-blocks-override 16 --max-num-seqs 16 --max-num-batched-tokens 256
    python scripts/real_vllm/pressure.py --real http://127.0.0.1:8100 \\
        --tokenizer /tmp/real_vllm/model/tokenizer.json [--json out.json]

Both engines run the same tiny configuration: block size 128 (vLLM's CPU block size),
``--max-model-len 512``, ``--num-gpu-blocks-override`` blocks (vLLM's own flag: "used for testing
preemption"; without it vLLM CPU sizes the cache from ``VLLM_CPU_KVCACHE_SPACE``, 1 GiB = 4096
blocks of this model, which never fills), ``--max-num-seqs`` and ``--max-num-batched-tokens``. The
simulator is started here with those numbers (default step model, ``--time-scale 1``). Measured on
each engine (deltas of ``/metrics`` counters, so a long-lived real engine is fine):

* ``burst``: ``--requests`` concurrent ``/v1/completions`` with distinct prompts of about
  ``--prompt-tokens`` tokens and ``max_tokens`` = ``--max-tokens`` (``ignore_eos``), whose running set
  needs more blocks than the cache holds: status of each, ``usage`` summed, preemptions
  (``vllm:num_preemptions_total``), ``num_requests_running`` / ``waiting`` and
  ``kv_cache_usage_perc`` sampled every ``--sample-interval`` seconds during it, and wall time;
* ``prefix``: one prompt sent twice in a quiet engine: ``vllm:prefix_cache_queries_total`` /
  ``hits_total`` deltas and ``cached_tokens`` of each;
* ``chunked``: one prompt longer than ``--max-num-batched-tokens`` completes (status, usage).

Exit status 0 always: a report, numbers side by side (they need not be equal: preemption counts
depend on timing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

MODEL = "tiny"
FILLER = "The engine keeps every block of this prompt until the cache runs short and then recomputes it. "


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict[str, float]:
    """``vllm:`` sample name → value, summed over label sets (one engine, one model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            head, _, value = line.rpartition(" ")
            name = head.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def prompt_of(client: httpx.Client, tokens: int, tag: str) -> str:
    """A prompt of about ``tokens`` tokens (± the tokenizer's special tokens) by the engine's ``/tokenize`` (prefix ``tag`` makes it unique)."""
    text = f"{tag}\n" + FILLER * (tokens // 10 + 2)
    ids = client.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]
    return client.post("/detokenize", json={"model": MODEL, "tokens": ids[: tokens - 1]}).json()["prompt"]


def burst(url: str, prompts: list[str], max_tokens: int, interval: float) -> dict[str, Any]:
    """Send every prompt at once; sample the queue gauges meanwhile; return what was seen."""
    seen: list[tuple[float, float, float, float]] = []
    done = threading.Event()
    with httpx.Client(base_url=url, timeout=600) as c:
        before = samples(c.get("/metrics").text)

        def sampler() -> None:
            with httpx.Client(base_url=url, timeout=10) as m:
                start = time.monotonic()
                while not done.is_set():
                    s = samples(m.get("/metrics").text)
                    seen.append((round(time.monotonic() - start, 2), s.get("vllm:num_requests_running", 0.0),
                                 s.get("vllm:num_requests_waiting", 0.0), s.get("vllm:kv_cache_usage_perc", 0.0)))
                    done.wait(interval)

        def one(prompt: str) -> tuple[int, dict]:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                "ignore_eos": True, "temperature": 0})
            return r.status_code, r.json()

        t = threading.Thread(target=sampler)
        t.start()
        start = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        wall = time.monotonic() - start
        done.set()
        t.join()
        after = samples(c.get("/metrics").text)
    usage = {k: 0 for k in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")}
    finish: dict[str, int] = {}
    for status, body in results:
        if status == 200:
            u = body["usage"]
            for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                usage[k] += u[k]
            usage["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            reason = body["choices"][0]["finish_reason"]
            finish[reason] = finish.get(reason, 0) + 1
    return {
        "statuses": sorted({s for s, _ in results}), "ok": sum(s == 200 for s, _ in results), "sent": len(prompts),
        "usage": usage, "finish_reason": finish, "wall_s": round(wall, 2),
        "preemptions": after.get("vllm:num_preemptions_total", 0.0) - before.get("vllm:num_preemptions_total", 0.0),
        "max_running": max((r for _, r, _, _ in seen), default=0.0),
        "mean_running": round(sum(r for _, r, _, _ in seen) / max(len(seen), 1), 2),
        "max_waiting": max((w for _, _, w, _ in seen), default=0.0),
        "max_kv_usage": round(max((k for _, _, _, k in seen), default=0.0), 3),
        "samples": seen,
    }


def repeat_prefix(url: str, prompt: str) -> dict[str, Any]:
    """The same prompt twice: prefix-cache counter deltas and ``cached_tokens`` of each."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for label in ("first", "again"):
            before = samples(c.get("/metrics").text)
            body = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                   "ignore_eos": True}).json()
            after = samples(c.get("/metrics").text)
            out[label] = {
                "prompt_tokens": body["usage"]["prompt_tokens"],
                "cached_tokens": (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
                "queries": after.get("vllm:prefix_cache_queries_total", 0.0)
                - before.get("vllm:prefix_cache_queries_total", 0.0),
                "hits": after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0),
            }
    return out


def chunked(url: str, prompt: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
    body = r.json()
    return {"status": r.status_code, "usage": body.get("usage"), "error": body.get("error")}


def run_all(url: str, args: argparse.Namespace, prompts: list[str], repeated: str, long_prompt: str) -> dict[str, Any]:
    return {"burst": burst(url, prompts, args.max_tokens, args.sample_interval),
            "prefix": repeat_prefix(url, repeated), "chunked": chunked(url, long_prompt)}


def start_sim(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from engine_twin.launch import sim_engine_argv, wait_ready

    port = free_port()
    argv = sim_engine_argv(port, [MODEL], block_size=128, num_gpu_blocks=args.sim_num_blocks or args.num_blocks,
                           max_num_seqs=args.max_num_seqs, max_model_len=512, hash_seed="0", time_scale=1.0,
                           tokenizer=args.tokenizer, scheduling_policy="fcfs", retention_priority_threshold=None,
                           extra=["--max-num-batched-tokens", str(args.max_num_batched_tokens)])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}", timeout=30, process=proc)
    return proc, f"http://127.0.0.1:{port}"


def table(real: dict[str, Any], sim: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    rows: list[tuple[str, Any, Any]] = []
    rb, sb = real["burst"], sim["burst"]
    for key in ("sent", "ok", "statuses", "finish_reason", "preemptions", "max_running", "mean_running", "max_waiting",
                "max_kv_usage", "wall_s"):
        rows.append((f"burst.{key}", rb[key], sb[key]))
    for key in rb["usage"]:
        rows.append((f"burst.usage.{key}", rb["usage"][key], sb["usage"][key]))
    rows.append(("burst.samples taken", len(rb["samples"]), len(sb["samples"])))
    for label in ("first", "again"):
        for key in real["prefix"][label]:
            rows.append((f"prefix.{label}.{key}", real["prefix"][label][key], sim["prefix"][label][key]))
    rows.append(("chunked.status", real["chunked"]["status"], sim["chunked"]["status"]))
    rows.append(("chunked.usage", real["chunked"]["usage"], sim["chunked"]["usage"]))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", default=os.environ.get("REAL_VLLM_URL", "http://127.0.0.1:8100"))
    parser.add_argument("--tokenizer", default="/tmp/real_vllm/model/tokenizer.json")
    parser.add_argument("--num-blocks", type=int, default=16, help="the real engine's --num-gpu-blocks-override")
    parser.add_argument("--sim-num-blocks", type=int, help="the simulator's blocks (default: --num-blocks; vLLM keeps "
                        "one of its blocks as the null block, so --num-blocks − 1 gives the twin the same usable cache)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=180)
    parser.add_argument("--long-prompt-tokens", type=int, default=450, help="over --max-num-batched-tokens")
    parser.add_argument("--sample-interval", type=float, default=0.2)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:8]
    with httpx.Client(base_url=args.real, timeout=60) as c:
        prompts = [prompt_of(c, args.prompt_tokens, f"request {i} of run {run}") for i in range(args.requests)]
        repeated = prompt_of(c, args.prompt_tokens, f"repeated prompt of run {run}")
        long_prompt = prompt_of(c, args.long_prompt_tokens, f"long prompt of run {run}")
        version = c.get("/version").text
    real = run_all(args.real, args, prompts, repeated, long_prompt)
    proc, url = start_sim(args)
    try:
        sim = run_all(url, args, prompts, repeated, long_prompt)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    rows = table(real, sim)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "real_version": version, "real": real, "sim": sim}, f, indent=1)
    print(f"real vLLM {version}; {args.requests} requests of {args.prompt_tokens} prompt tokens, max_tokens "
          f"{args.max_tokens}; {args.num_blocks} blocks of 128 (twin {args.sim_num_blocks or args.num_blocks}), max-num-seqs {args.max_num_seqs}, "
          f"max-num-batched-tokens {args.max_num_batched_tokens}")
    print("| measure | real vLLM | twin |\n|---|---|---|")
    for name, r, s in rows:
        print(f"| {name} | {r} | {s} |")
    return {"real": real, "sim": sim, "rows": rows}


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
