"""``backfill bench interference``: prefill/decode interference and KV pressure on the twin's core
(model time, deterministic), as issue 13's goals state them."""

from __future__ import annotations

from click.testing import CliRunner

from lab.bench.interference import interference, interference_command, pressure


def test_a_long_prefill_stretches_a_running_streams_gaps_and_a_smaller_budget_bounds_it():
    small, default = (interference(budget, 1000, 24_000, 20) for budget in (2048, 8192))
    assert default.ratio >= 3  # vLLM V1: the prefill chunks share the stream's steps
    assert small.ratio < default.ratio and small.largest_gap_ms < default.largest_gap_ms
    assert small.prefill_steps > default.prefill_steps  # more, shorter chunks


def test_kv_pressure_preempts_and_every_request_completes_under_both_policies():
    for policy in ("fcfs", "priority"):
        run = pressure(policy, 16, 600, 200, 384)
        assert run.preemptions > 0
        assert run.completed == 16 and run.tokens_generated == run.tokens_expected == 16 * 200


def test_values_the_engine_would_refuse_are_usage_errors_not_hangs():
    runner = CliRunner()
    for args in (["--budget", "2"], ["--pressure-blocks", "10"], ["--pressure-output", "0"]):
        result = runner.invoke(interference_command, args)
        assert result.exit_code == 2, (args, result.output)
        assert "Error: Invalid value" in result.output
