"""The long-prompt + chat mix of ``backfill bench pd`` (prefill/decode disaggregation), which
``backfill simulate --workload pd-mix`` replays too: :class:`PdOptions` (fleet and trace of one
run), :func:`pd_trace` (the seeded trace) and :func:`tenant_of` (who sends each request)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lab.toolkit.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRecord,
    TimedRequest,
    agentic_sessions,
    merge,
    mooncake_trace,
)


@dataclass(frozen=True)
class PdOptions:
    """Fleet and trace of one run. Token counts are the simulator's built-in tokenizer's; times are
    model seconds; rates and session counts are per engine of the fleet, so every layout of a run,
    and runs of other sizes, get the same load per engine.

    ``long_rate_per_engine_s``: 0.4 long prompts per second per engine (mean 20k tokens) keeps an
    aggregated engine prefilling about 38 % of the time: on the step model a 20,480-token prompt
    takes 0.91 model seconds in three 8,192-token steps of about 0.3 s, a 32,768-token one 1.67 s
    in four, against 8.3 ms for a decode step; the prefill steps' gaps reach the ITL p99 only when
    they are over 1 % of all gaps, which at about 3 such steps a second against 120 decode steps
    takes prefilling a quarter of the time or more. The same load then keeps one prefill engine of
    four busy for 1.5 s a second (the 1:3 split is overloaded: its prefill queue grows), two at
    76 %, three at 51 %. ``num_gpu_blocks``: 24,576 blocks of 16 tokens (393k tokens, 48 GiB of KV at 128 KiB
    per token): Llama-3.1-8B bf16 on an 80 GB H100 leaves about 60 GB for KV at vLLM's 0.9 memory
    utilisation after 16 GB of weights, rounded down. ``max_model_len`` holds the longest prompt
    plus its answer.
    """

    engines: int = 4
    time_scale: float = 1.0
    duration_s: float = 60.0
    long_rate_per_engine_s: float = 0.4
    long_prompt_tokens: tuple[int, int] = (8192, 32768)
    long_output_tokens: tuple[int, int] = (32, 128)
    chat_sessions_per_engine: int = 24
    chat_turns: tuple[int, int] = (1, 3)
    chat_max_tokens: int = 384
    chat_pause_s: float = 2.0
    tenants: int = 3
    seed: int = 0
    num_gpu_blocks: int = 24_576
    max_model_len: int = 40_960
    block_size: int = 16

    @classmethod
    def quick(cls, seed: int = 0, time_scale: float = 1.0) -> PdOptions:
        """The ``--quick`` run: 2 engines, a 6-second trace, 4k–8k prompts (a smoke run for tests)."""
        return cls(engines=2, time_scale=time_scale, duration_s=6.0, long_rate_per_engine_s=0.5,
                   long_prompt_tokens=(4096, 8192), long_output_tokens=(16, 32), chat_sessions_per_engine=4,
                   chat_turns=(1, 2), chat_max_tokens=64, chat_pause_s=0.5, seed=seed)



def pd_trace(opts: PdOptions) -> list[TimedRequest]:
    """The long-prompt + chat mix of ``opts`` (module docstring), in nominal arrival order.

    Long prompts: Poisson arrivals at ``long_rate_per_engine_s`` × ``engines`` over ``duration_s``, each a Mooncake
    record of a length uniform in ``long_prompt_tokens`` with block ids of its own (no prefix shared
    with any other call, so all of it is uncached) and ``long_output_tokens`` out; workload
    ``long-prompt``. Chat: ``chat_sessions_per_engine`` × ``engines`` sessions of ``chat_turns`` turns started over
    ``duration_s``, a 120-token system prompt shared by the sessions of one of two assistants,
    messages of 20–150 tokens, ``chat_max_tokens`` out, ``chat_pause_s`` between turns; workload
    ``chat``. Raises ``ValueError`` for a non-positive duration or rate, or an empty range.
    """
    low, high = opts.long_prompt_tokens
    rate = opts.long_rate_per_engine_s * opts.engines
    if opts.duration_s <= 0 or rate <= 0 or not 0 < low <= high:
        raise ValueError("duration_s, engines and long_rate_per_engine_s must be positive and long_prompt_tokens "
                         "a range")
    rng = random.Random(f"pd-long-{opts.seed}")
    records: list[MooncakeRecord] = []
    t, next_id = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= opts.duration_s:
            break
        length = rng.randint(low, high)
        blocks = -(-length // MOONCAKE_BLOCK_TOKENS)
        records.append(MooncakeRecord(round(t * 1000), length, rng.randint(*opts.long_output_tokens),
                                      tuple(range(next_id, next_id + blocks))))
        next_id += blocks
    long = mooncake_trace(records, max_model_len=opts.max_model_len, workload="long-prompt")
    chat = agentic_sessions(seed=opts.seed, sessions=opts.chat_sessions_per_engine * opts.engines, agents=2, system_tokens=120,
                            task_tokens=(20, 150), call_tokens=(20, 60), result_tokens=(20, 150),
                            turns=opts.chat_turns, pause_s=opts.chat_pause_s, one_off_share=0.0,
                            duration_s=opts.duration_s, max_tokens=opts.chat_max_tokens, workload="chat")
    return merge(long, chat)


def tenant_of(request: TimedRequest, tenants: int) -> str:
    """The tenant (fairness id) sending ``request``: ``docs`` sends the long prompts, the chat
    sessions are spread over ``chat-1`` … ``chat-<tenants − 1>`` by session (one tenant: ``docs``
    sends everything)."""
    if request.workload == "long-prompt" or tenants < 2:
        return "docs"
    return f"chat-{sum(request.session_id.encode()) % (tenants - 1) + 1}"
