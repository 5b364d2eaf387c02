"""The scenarios both engines run (with the plugin and without), each returning what it observed.

Each scenario leaves the engine idle. Figures come from vLLM's own request state after each step
(:meth:`conftest.Engine.step`), not from the plugin's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from conftest import ASYNC, BATCH, INTERACTIVE, Engine, prompt


@dataclass
class BudgetRun:
    """Background prefill tokens per step before the interactive request came (``alone``), in the step
    it was waiting (``while_interactive_waits``), and the interactive prefill tokens of that step."""

    alone: list[int]
    while_interactive_waits: int
    interactive_first_step: int


def _prefill_tokens(computed: dict[str, int], ids: list[str]) -> int:
    """Prefill tokens ``ids`` computed in one step (a decode is 1 token; a preemption is negative)."""
    return sum(n for rid, n in computed.items() if rid in ids and n > 1)


def background_budget(engine: Engine, tag: str) -> BudgetRun:
    """Two batch and one async request with 300-token prompts and 30 output tokens; after four steps
    an interactive one with a 300-token prompt arrives."""
    bg = [f"{tag}b0", f"{tag}b1", f"{tag}a0"]
    for i, rid in enumerate(bg):
        engine.add(rid, prompt(100 + i + sum(map(ord, tag)), 300), BATCH if "b" in rid[len(tag):] else ASYNC,
                   max_tokens=30)
    alone = [_prefill_tokens(engine.step()[0], bg) for _ in range(4)]
    engine.add(f"{tag}i0", prompt(200 + sum(map(ord, tag)), 300), INTERACTIVE)
    computed, _ = engine.step()
    run = BudgetRun(alone, _prefill_tokens(computed, bg), computed.get(f"{tag}i0", 0))
    engine.run_until_idle()
    return run


def fill_slots(engine: Engine, requests: list[tuple[str, int]]) -> None:
    """Start ``requests`` (id, priority) one step apart (arrival order = list order), 40-token
    prompts, 60 output tokens each, and step until all of them are running."""
    for i, (rid, priority) in enumerate(requests):
        engine.add(rid, prompt(300 + i, 40), priority, max_tokens=60)
        engine.step()
    for _ in range(20):
        if {rid for rid, _ in requests} <= engine.running():
            return
        engine.step()
    raise AssertionError(f"not all running: {engine.running()}")


def admit_one(engine: Engine, rid: str, length: int = 40) -> set[str]:
    """Add an interactive request and run one step; returns who is running after it."""
    engine.add(rid, prompt(400 + length + len(rid), length), INTERACTIVE, max_tokens=4)
    engine.step()
    return engine.running()


def fill_blocks(engine: Engine, tag: str) -> None:
    """Two batch requests with 448-token prompts (14 blocks each, 16 once decoding) on a 39-block
    cache, stepped until both are decoding."""
    for i in range(2):
        engine.add(f"{tag}b{i}", prompt(500 + i, 448), BATCH, max_tokens=60)
        engine.step()
    for _ in range(40):
        reqs = [engine.request(f"{tag}b{i}") for i in range(2)]
        if all(r.num_computed_tokens > r.num_prompt_tokens for r in reqs):
            return
        engine.step()
    raise AssertionError("batch prefills did not finish")


def retention(engine: Engine, tag: str) -> int:
    """An interactive request with a 256-token prompt, then four batch requests with distinct
    320-token prompts (40 blocks written on a 39-block cache), then the interactive prompt again:
    returns the prompt tokens its repeat found cached (vLLM's ``num_cached_tokens``)."""
    assert engine.llm.reset_prefix_cache()
    shared = prompt(600, 256)
    engine.add(f"{tag}i0", shared, INTERACTIVE, max_tokens=1)
    engine.run_until_idle()
    for i in range(4):
        engine.add(f"{tag}b{i}", prompt(700 + i, 320), BATCH, max_tokens=1)
        engine.run_until_idle()
    engine.add(f"{tag}i1", shared, INTERACTIVE, max_tokens=1)
    (out,) = engine.run_until_idle()
    return int(out.num_cached_tokens)
