"""The workload shapes of ``backfill bench prefix`` — each shape's trace and fleet — shared by the
bench (real time, :mod:`lab.bench.prefix`) and ``backfill simulate --sweep`` (virtual time,
:mod:`lab.simulate.sweep`), so both run the same requests on the same engines."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lab.toolkit.launch import EngineOptions
from lab.toolkit.workloads import (
    MooncakeRecord,
    TimedRequest,
    agentic_sessions,
    long_context_records,
    merge,
    mooncake_trace,
    shared_prefix_batch,
    shared_prefix_groups,
    tool_agents,
)


def build_trace(seed: int = 0, quick: bool = False, load: float = 1.0) -> list[TimedRequest]:
    """The benchmark's trace: agentic sessions and shared-prefix groups with their default
    parameters, merged (full: about 260 calls, most sent in the first 10 model seconds; quick:
    about 14 calls over a few model seconds). ``load`` multiplies the arrival rates (session starts
    and shared-prefix requests); raises ``ValueError`` when it is not positive."""
    if load <= 0:
        raise ValueError("load must be positive")
    if quick:
        agentic = agentic_sessions(seed, sessions=3, system_tokens=300, task_tokens=(40, 80), call_tokens=(10, 20),
                                   result_tokens=(40, 80), turns=(2, 3), pause_s=0.5, one_off_share=0.1,
                                   one_off_tokens=(100, 200), duration_s=2.0, max_tokens=4)
        shared = shared_prefix_groups(seed, groups=2, users=2, questions_per_user=1, prefix_tokens=300,
                                      question_tokens=50, max_tokens=4, rate_per_s=4.0)
        return merge(agentic, shared)
    return merge(agentic_sessions(seed, duration_s=9.0 / load), shared_prefix_groups(seed, rate_per_s=14.0 * load))

LONG_CONTEXT_OUTPUT_CAP = 64
"""Output tokens per long-context request at most (the trace's ``output_length`` otherwise): TTFT
and reuse do not depend on it, and 300-token answers would only lengthen every run."""


@dataclass(frozen=True)
class Shape:
    """One workload shape of the bench: its trace and its fleet (full and ``--quick``)."""

    name: str
    summary: str
    full: EngineOptions
    quick: EngineOptions

    def options(self, quick: bool, engines: int | None, time_scale: float | None) -> EngineOptions:
        """The fleet, with ``--engines`` / ``--time-scale`` applied."""
        base = self.quick if quick else self.full
        return replace(base, engines=engines or base.engines,
                       time_scale=base.time_scale if time_scale is None else time_scale)


_QUICK = EngineOptions(engines=2, num_gpu_blocks=160, cpu_offload_blocks=160, max_model_len=2048, time_scale=0.1)
SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("agentic", "agentic sessions + llm-d shared-prefix groups (the original bench)", EngineOptions(), _QUICK),
    Shape("shared-prefix", "cookbook-shaped batch: one system prompt + a movie per line, 80 requests/s burst",
          EngineOptions(engines=2, num_gpu_blocks=512, cpu_offload_blocks=512, max_model_len=2048), _QUICK),
    Shape("long-context", "long multi-turn conversations (Mooncake form): mean prompt ~12k tokens, tail to 122k",
          EngineOptions(engines=4, num_gpu_blocks=8192, cpu_offload_blocks=8192, max_model_len=131072),
          replace(_QUICK, num_gpu_blocks=320, max_model_len=4096)),
    Shape("tool-agent", "48 parallel agents, 10-24 short tool calls each, growing histories",
          EngineOptions(engines=4, num_gpu_blocks=2048, cpu_offload_blocks=2048), _QUICK),
)}
"""The shapes of ``--shape all``, in table order. Every full fleet holds less than its trace's
working set in GPU blocks (evictions happen; the bench prints both)."""


def long_context_trace(seed: int = 0, quick: bool = False, load: float = 1.0,
                       max_model_len: int = 131072) -> tuple[list[TimedRequest], list[MooncakeRecord]]:
    """The long-context shape: :func:`~lab.toolkit.workloads.long_context_records` (quick: 4
    short conversations), replayed open loop at ``load`` × the generated rate; the requests and the
    records (to write as a Mooncake file)."""
    records = (long_context_records(seed, conversations=4, duration_s=2.0, median_tokens=800, max_tokens=3000,
                                    multi_turn_share=0.5, think_s=0.5) if quick else long_context_records(seed))
    return mooncake_trace(records, speed=load, max_model_len=max_model_len, max_output_tokens=LONG_CONTEXT_OUTPUT_CAP,
                          workload="long-context"), records


def shape_trace(shape: str, seed: int = 0, quick: bool = False, load: float = 1.0,
                max_model_len: int = 131072) -> list[TimedRequest]:
    """The trace of ``shape`` (a key of :data:`SHAPES`); ``load`` multiplies its arrival rates.
    Raises ``KeyError`` for an unknown shape, ``ValueError`` for a non-positive load."""
    if load <= 0:
        raise ValueError("load must be positive")
    if shape == "agentic":
        return build_trace(seed, quick, load)
    if shape == "shared-prefix":
        return shared_prefix_batch(seed, lines=30 if quick else 1000, rate_per_s=80.0 * load,
                                   max_tokens=4 if quick else 32)
    if shape == "long-context":
        return long_context_trace(seed, quick, load, max_model_len)[0]
    if shape == "tool-agent":
        if quick:
            return tool_agents(seed, sessions=3, tool_sets=2, system_tokens=200, turns=(2, 4), duration_s=1.0,
                               max_tokens=4)
        return tool_agents(seed, duration_s=4.0 / load)
    raise KeyError(shape)


def engine_options(quick: bool, engines: int | None, time_scale: float | None) -> EngineOptions:
    """The agentic shape's fleet. Full: 4 engines × 1,536 GPU blocks (24,576 tokens) + 3,072 CPU
    blocks, time scale 1. Quick: 2 engines × 160 GPU blocks + 160 CPU blocks, max_model_len 2,048,
    time scale 0.1."""
    return SHAPES["agentic"].options(quick, engines, time_scale)
