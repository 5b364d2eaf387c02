"""``backfill simulate`` end to end through click: figures in JSON, and bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from backfill.cli import main

BATCHES = Path("/work/shared/data/batches")
KEYS = {"policy", "engines", "requests", "captured_reuse", "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "throughput_rps",
        "decision_p50_ms", "index_bytes", "wall_s", "virtual_s", "by_lane_tenant"}


def test_simulate_writes_every_figure(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 100 * i, "input_length": 900 + 10 * i, "output_length": 8,
                                           "hash_ids": [1, 2 + i % 3]}) for i in range(30)) + "\n")
    out = tmp_path / "o.json"
    batch = next(iter(sorted(BATCHES.glob("*.jsonl"))), None)
    args = ["simulate", "--trace", str(trace), "--synthetic-requests", "100", "--engines", "2", "--policy", "all",
            "--json", str(out), "--no-progress"]
    if batch is not None:
        args += ["--batch", str(batch)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["round-robin", "approximate", "precise"]
    for r in runs:
        assert KEYS <= set(r)
        assert r["completed"] == r["requests"]
        assert r["captured_reuse"] > 0  # above 1 only by what ran out of arrival order (make-room retries)
        assert r["cached_tokens"] - r["cached_above_oracle_tokens"] <= r["oracle_reusable_tokens"]
    assert runs[1]["ttft_p50_vs_round_robin"] == runs[1]["ttft_p50_s"] / runs[0]["ttft_p50_s"]


def _fails(args: list[str], text: str) -> None:
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code == 2, result.output
    assert text in result.output
    assert "Traceback" not in result.output


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnot json\n')
    _fails(["--trace", str(tmp_path / "missing.jsonl")], "does not exist")
    _fails(["--trace", str(bad)], "bad.jsonl:2")
    _fails(["--synthetic-requests", "10", "--engines", "0"], "--engines")
    _fails([], "give a workload")
    notbatch = tmp_path / "b.jsonl"
    notbatch.write_text('{"custom_id": "a"}\n')
    _fails(["--batch", str(notbatch)], "b.jsonl:1")
    _fails(["--synthetic-requests", "10", "--gpu-blocks", "4", "--max-model-len", "4096"], "--gpu-blocks")


def test_the_tables_are_whole_in_100_columns_when_redirected() -> None:
    """CliRunner's output is no terminal: plain rows no wider than 100 columns, no cell cut."""
    result = CliRunner().invoke(main, ["simulate", "--synthetic-requests", "60", "--engines", "2", "--policy", "all",
                                       "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and "┃" not in result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    text = "\n".join(lines)
    for header in ("policy", "answered", "captured reuse", "TTFT p50 s", "TTFT p99 s", "ITL p99 s", "req/s",
                   "vs RR p50", "decision p50 ms", "index MiB", "wall s", "virtual s", "lane/tenant"):
        assert header in text, header
    for policy in ("round-robin", "approximate", "precise"):  # the runs' names, each whole in every block
        assert sum(line.split()[0] == policy for line in lines if line.strip()) >= 2, policy
