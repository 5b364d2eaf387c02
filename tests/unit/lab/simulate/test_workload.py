"""Lazy prompts: the memoised hashes and keys equal production hashing; the piece oracle equals
PERFORMANCE.md's; the in-process KV events equal what the router decodes off the wire."""

from __future__ import annotations

from pathlib import Path

from engine_twin.kv_cache import TieredPrefixCache, block_hashes, none_hash
from engine_twin.kv_events import BlockRemoved, BlockStored, encode_batch
from lab.simulate.fleet import to_router_events
from lab.simulate.workload import LazyTokens, PieceTokens, PromptMemo, mooncake_requests, synthetic_requests
from lab.toolkit.workloads import MooncakeRecord, TimedRequest, oracle_reusable_tokens
from router.kv_index.events import decode_payload
from router.scheduling.hashing import request_block_keys
from router.scheduling.types import LLMRequest


def _memo() -> PromptMemo:
    return PromptMemo(16, none_hash("0"), "sim-model", PieceTokens("t"))


def test_memoised_hashes_and_keys_equal_hashing_the_tokens() -> None:
    memo = _memo()
    reqs = list(synthetic_requests(40, seed=4))
    reqs += list(mooncake_requests([MooncakeRecord(0, 1300, 4, (7, 8, 9)), MooncakeRecord(1, 700, 4, (7, 11))]))
    for _ in range(2):  # the second pass reads the memo
        for req in reqs:
            tokens = list(memo.lazy_tokens(req))
            assert len(tokens) == req.input_tokens
            assert memo.engine_hashes(req) == block_hashes(tokens, 16, memo.root_hash)
            llm = LLMRequest("r", "sim-model", prompt_token_ids=tokens)
            assert memo.router_keys(req, 64, 2048) == request_block_keys(llm, 64, 2048)
            assert memo.router_keys(req, 64, 3) == request_block_keys(llm, 64, 3)


def test_lazy_tokens_slice_like_a_list() -> None:
    req = next(iter(mooncake_requests([MooncakeRecord(0, 1100, 1, (1, 2, 3))])))
    lazy = LazyTokens(req.pieces or (), PieceTokens("x"))
    full = list(lazy)
    assert len(lazy) == len(full) == 1100
    for a, b in ((0, 16), (500, 530), (1000, 1100), (1090, 2000), (5, 5)):
        assert lazy[a:b] == full[a:b]
    assert lazy[511] == full[511] and lazy[-1] == full[-1]


def test_the_piece_oracle_is_performance_md_oracle() -> None:
    memo = _memo()
    records = [MooncakeRecord(0, 1024, 1, (1, 2)), MooncakeRecord(1, 1500, 1, (1, 2, 3)),
               MooncakeRecord(2, 700, 1, (1, 5)), MooncakeRecord(3, 1600, 1, (1, 2, 3, 4)),
               MooncakeRecord(4, 300, 1, (1,)), MooncakeRecord(5, 512, 1, (1,))]
    reqs = list(mooncake_requests(records)) + list(synthetic_requests(60, seed=9))
    ours = [memo.oracle(r) for r in reqs]
    trace = [TimedRequest(0.0, str(i), 0, 0.0, {"ids": list(_memo().lazy_tokens(r))}, 1, "x")
             for i, r in enumerate(reqs)]
    expected = oracle_reusable_tokens(trace, tokenize=lambda body: body["ids"], block_size=16).reusable_tokens
    assert ours == expected
    assert ours[:6] == [0, 1024, 512, 1488, 288, 496]  # 1,488: 1,024 + the 476 tokens of id 3 seen, whole blocks


def test_events_in_process_equal_the_wire_decode() -> None:
    events: list = []
    cache = TieredPrefixCache(4, 16, cpu_blocks=2, sink=events.extend)
    tokens = list(range(80))
    hashes = block_hashes(tokens, 16, none_hash("0"))
    table = cache.admit(hashes, cache.find_hits(hashes, 4), 4, tokens, 35)
    assert table is not None
    cache.commit(table, 0, 4, hashes, tokens, 35)
    cache.free(table)
    cache.flush()
    other = block_hashes(list(range(100, 164)), 16, none_hash("0"))
    table = cache.admit(other, cache.find_hits(other, 4), 4, list(range(100, 164)), 35)  # evicts to CPU
    cache.flush()
    events += [BlockRemoved([1, 2]), BlockStored([3], 2, [], 16, "CPU")]
    assert len(events) > 2
    wire = decode_payload(encode_batch(events, "map", 0)).events
    assert to_router_events(events) == wire


def test_the_conversation_generator_writes_a_trace_simulate_replays(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from lab.simulate.cli import simulate_command
    from lab.toolkit.workloads import conversation_records, read_mooncake

    trace, out = tmp_path / "conv.jsonl", tmp_path / "run.json"
    runner = CliRunner()
    wrote = runner.invoke(simulate_command, ["--write-trace", str(trace), "--trace-shape", "conversation",
                                             "--duration-s", "10", "--seed", "5"])
    assert wrote.exit_code == 0, wrote.output
    assert read_mooncake(trace) == conversation_records(5, duration_s=10.0)
    ran = runner.invoke(simulate_command, ["--trace", str(trace), "--max-output-tokens", "8", "--policy", "approximate",
                                           "--gpu-blocks", "16384", "--no-progress", "--json", str(out)])
    assert ran.exit_code == 0, ran.output
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == len(read_mooncake(trace))
