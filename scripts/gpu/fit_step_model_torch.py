#!/usr/bin/env python3
"""Step times of a Llama-3.1-8B-shaped forward on one GPU, for the twin's step-model fit — PyTorch only.

The ``device`` machines have PyTorch and no vLLM (vLLM cannot be carried there), so this times what one
vLLM V1 step computes, with the same shapes, in plain PyTorch: random bf16 weights of Llama-3.1-8B's
shape (32 layers, hidden 4,096, 32 query / 8 KV heads of 128, MLP 14,336, vocabulary 128,256; Meta's
``config.json``), one forward over a step's tokens:

* every scheduled token (a prefill chunk of ``P`` tokens and ``D`` decode tokens, concatenated)
  through RMSNorm, the QKV / output projections and the SwiGLU MLP of every layer;
* attention per sequence kind: the chunk causally over itself
  (``scaled_dot_product_attention(is_causal=True)``), the decodes each over its ``C`` cached keys
  plus itself (one query against a per-layer KV tensor of ``D × C`` tokens, GQA);
* the LM head on the last token of each sequence (``D + 1`` rows), as vLLM samples.

No paged KV cache, CUDA graphs, sampling or scheduler: the figures are the model's compute and
memory traffic, the part the twin's step model describes (its ``step_overhead_ms`` for the rest can
be raised by the difference to a real vLLM's idle decode step). Each point: 3 warm-up runs, then the
median of ``--reps`` timed with CUDA events.

Grid (``D`` decodes at context ``C``, ``P``-token prefill beside ``D`` decodes), every point's KV
bounded by ``--max-kv-tokens`` (default 131,072 tokens = 17 GiB over 32 layers):

* decode: D ∈ {1, 8, 32, 64, 128, 256} × C ∈ {512, 2048, 8192};
* prefill: P ∈ {256, 1024, 2048, 4096, 8192} × D ∈ {0, 32} at C = 1,024.

Output (stdout and ``--out``): JSON with ``points`` (``tokens``, ``attention_pairs``,
``context_tokens``, ``seconds``, ``label``) and ``shape`` — what ``backfill bench engine-fit --points
FILE`` refits into engine-sim flags. About 2–5 minutes on an H100 (weights 16 GB, KV ≤ 17 GiB);
``--tiny`` runs a 2-layer, 256-wide model on the CPU in seconds (to check the script without a GPU).

    python3 scripts/gpu/fit_step_model_torch.py --out $OUT/gpu-steps.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LLAMA_31_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
               "intermediate": 14336, "vocab": 128256}
TINY = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512, "vocab": 1024}


def params(s: dict[str, int]) -> int:
    """Parameters of the shape (norms left out; untied embeddings, as Llama-3.1-8B)."""
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * s["intermediate"]
    return s["layers"] * per_layer + 2 * s["vocab"] * h


class Model:
    """Random bf16 weights of the shape on ``device`` (seed 0; scaled so activations stay finite)."""

    def __init__(self, s: dict[str, int], device: str, dtype: torch.dtype):
        g = torch.Generator(device="cpu").manual_seed(0)
        h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(device=device, dtype=dtype)

        self.s, self.device, self.dtype = s, device, dtype
        self.layers = [{"qkv": w(q + 2 * kv, h), "o": w(h, q), "gate_up": w(2 * s["intermediate"], h),
                        "down": w(h, s["intermediate"]), "n1": torch.ones(h, device=device, dtype=dtype),
                        "n2": torch.ones(h, device=device, dtype=dtype)} for _ in range(s["layers"])]
        self.embed = w(s["vocab"], h)
        self.lm_head = w(s["vocab"], h)

    def kv_cache(self, decodes: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K and V of ``decodes`` sequences × ``context`` tokens (random values)."""
        shape = (decodes, self.s["kv_heads"], context, self.s["head_dim"])
        return [(torch.randn(shape, device=self.device, dtype=self.dtype),
                 torch.randn(shape, device=self.device, dtype=self.dtype)) for _ in self.layers]

    @torch.inference_mode()
    def step(self, prefill: int, decodes: int, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One step: a ``prefill``-token chunk (fresh prompt) and ``decodes`` decode tokens over ``cache``."""
        s = self.s
        hq, hk, hd = s["heads"], s["kv_heads"], s["head_dim"]
        n = prefill + decodes
        x = self.embed[torch.randint(0, s["vocab"], (n,), device=self.device)]
        for layer, (k_cache, v_cache) in zip(self.layers, cache):
            y = F.rms_norm(x, (s["hidden"],), layer["n1"])
            qkv = y @ layer["qkv"].T
            q, k, v = qkv.split([hq * hd, hk * hd, hk * hd], dim=-1)
            outs = []
            if prefill:
                qp = q[:prefill].view(prefill, hq, hd).transpose(0, 1)[None]
                kp = k[:prefill].view(prefill, hk, hd).transpose(0, 1)[None]
                vp = v[:prefill].view(prefill, hk, hd).transpose(0, 1)[None]
                outs.append(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)[0]
                            .transpose(0, 1).reshape(prefill, hq * hd))
            if decodes:
                qd = q[prefill:].view(decodes, hq, 1, hd)
                kd = torch.cat([k_cache, k[prefill:].view(decodes, hk, 1, hd)], dim=2)
                vd = torch.cat([v_cache, v[prefill:].view(decodes, hk, 1, hd)], dim=2)
                outs.append(F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True).reshape(decodes, hq * hd))
            x = x + torch.cat(outs) @ layer["o"].T
            y = F.rms_norm(x, (s["hidden"],), layer["n2"])
            gate, up = (y @ layer["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        last = ([prefill - 1] if prefill else []) + list(range(prefill, n))
        return x[last] @ self.lm_head.T


def timed(model: Model, prefill: int, decodes: int, context: int, reps: int) -> float:
    """Median seconds of one step (3 warm-up runs first)."""
    cache = model.kv_cache(decodes, context) if decodes else [(None, None)] * len(model.layers)  # type: ignore[list-item]
    cuda = model.device.startswith("cuda")
    times = []
    for i in range(3 + reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.step(prefill, decodes, cache)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            model.step(prefill, decodes, cache)
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    del cache
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(times)


def point(tokens: int, pairs: int, context: int, seconds: float, label: str) -> dict[str, object]:
    return {"tokens": tokens, "attention_pairs": pairs, "context_tokens": context, "seconds": seconds,
            "label": label}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (checks the script)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-kv-tokens", type=int, default=131_072)
    parser.add_argument("--budget-s", type=float, default=780.0, help="stop adding points after this (15-min lease)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else LLAMA_31_8B
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started = time.monotonic()
    model = Model(shape, device, dtype)
    decodes = (1, 8, 32) if args.tiny else (1, 8, 32, 64, 128, 256)
    contexts = (128, 512) if args.tiny else (512, 2048, 8192)
    prefills = (64, 256) if args.tiny else (256, 1024, 2048, 4096, 8192)
    points = []
    for c in contexts:
        for d in decodes:
            if d * c > args.max_kv_tokens or time.monotonic() - started > args.budget_s:
                continue
            sec = timed(model, 0, d, c, args.reps)
            points.append(point(d, d * (c + 1), d * c, sec, f"decode D={d} C={c}"))
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    c = 1024 if not args.tiny else 128
    for p in prefills:
        for d in (0, 32):
            if time.monotonic() - started > args.budget_s:
                continue
            sec = timed(model, p, d, c, args.reps)
            points.append(point(p + d, p * (p + 1) // 2 + d * (c + 1), d * c, sec, f"prefill P={p} + {d} decodes"))
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    out = {"benchmark": "fit_step_model_torch", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "model": "Llama-3.1-8B shape" if not args.tiny else "tiny",
           "shape": {"params": float(params(shape)), "layers": shape["layers"], "kv_heads": shape["kv_heads"],
                     "head_dim": shape["head_dim"], "dtype_bytes": 2.0 if dtype == torch.bfloat16 else 4.0},
           "elapsed_s": round(time.monotonic() - started, 1), "points": points}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
