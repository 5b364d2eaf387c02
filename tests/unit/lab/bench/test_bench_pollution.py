"""``backfill bench pollution``: its workload, and one small run of the command checked for the JSON's
shape and sense (model time on the twin's core: deterministic, no sockets)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from engine_twin.kv_cache import DEFAULT_RETENTION, block_hashes
from engine_twin.launch import FLEET_RETENTION_PRIORITY_THRESHOLD
from engine_twin.retention import request_retention
from lab.bench.pollution import (
    ROOT,
    BatchDocs,
    Conversation,
    Workload,
    band_engine_priorities,
    pollution_command,
)

SMALL = ["--batch-requests", "300", "--batch-concurrency", "8", "--conversations", "4", "--tenants", "2",
         "--system-tokens", "256", "--longest-conversation", "4000", "--turns-before", "2",
         "--doc-tokens-min", "100", "--doc-tokens-max", "300", "--gpu-blocks", "2048", "--cpu-blocks", "1024"]


def test_the_fleet_threshold_puts_batch_alone_at_the_lowest_retention():
    priorities = band_engine_priorities()
    assert {objective: request_retention(p, FLEET_RETENTION_PRIORITY_THRESHOLD) for objective, p in priorities.items()} \
        == {"interactive": DEFAULT_RETENTION, "async": DEFAULT_RETENTION, "flex": DEFAULT_RETENTION, "batch": 0}
    assert request_retention(priorities["batch"], None) == DEFAULT_RETENTION


def test_conversations_grow_on_their_own_prefix_and_documents_share_only_the_batch_prefix():
    work = Workload(conversations=3, system_tokens=64, longest_conversation=1000, doc_tokens_min=40,
                    doc_tokens_max=80)
    assert [work.first_prompt_tokens(i) for i in range(3)] == [364, 500, 1000]  # halved, floor system + user
    conv = Conversation(2, [7] * 64, work.first_prompt_tokens(2), work)
    first = conv.next_prompt()
    second = conv.next_prompt()
    assert len(first) == 1000 and second[:1000] == first and len(second) == 1000 + 150 + 300
    docs = BatchDocs([5] * 70, work)
    a, b = docs.prompt(0), docs.prompt(1)
    assert a[:70] == b[:70] == [5] * 70 and a[70:86] != b[70:86] and 40 <= len(a) - 70 <= 80
    assert docs.hashes(0, a) == block_hashes(a, 16, ROOT)  # chained on the prefix's, unaligned prefix too


def test_a_small_run_shows_the_sweep_wiping_the_cache_without_the_guard_and_not_with_it(tmp_path):
    out = tmp_path / "pollution.json"
    result = CliRunner().invoke(pollution_command, [*SMALL, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {(r["cache"], r["scenario"]): r for r in data["results"]}
    assert set(rows) == {(cache, scenario) for cache in ("GPU only", "GPU + CPU tier")
                         for scenario in ("no sweep", "sweep, guard off", "sweep, guard on")}
    for cache in ("GPU only", "GPU + CPU tier"):
        ref, off, on = (rows[cache, s] for s in ("no sweep", "sweep, guard off", "sweep, guard on"))
        assert ref["hit_pct_before"] == off["hit_pct_before"] == on["hit_pct_before"] > 80
        assert off["batch_requests"] == on["batch_requests"] == 300 and ref["batch_requests"] == 0
        assert on["drop_points"] <= 2 < off["drop_points"]
        assert on["interactive_blocks_kept_pct"] == 100.0 > off["interactive_blocks_kept_pct"]
        assert off["longest_ttft_ms_after"] > 3 * on["longest_ttft_ms_after"]
        assert on["batch_hit_pct"] > 0  # batch still reads its shared prefix with the guard on
        assert len(on["turns"]) == 4 * (1 + 2 + 1)
    assert "pollution" in result.output
