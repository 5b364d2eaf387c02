"""Prefill/decode disaggregation in the virtual-time fleet: a case by hand, the short-prompt path,
the fallback, determinism, the production P/D plugins, the held blocks, the CLI's layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine_twin.core import EngineCore
from engine_twin.step_model import StepModel
from lab.simulate.cli import parse_layout, simulate_command
from lab.simulate.sim import SimConfig, Simulation
from lab.simulate.workload import mooncake_requests, pd_mix_requests
from lab.toolkit.pd_mix import PdOptions
from lab.toolkit.workloads import MooncakeRecord
from router.scheduling.plugins.disagg import RoleFilter
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import PDDecision

_REAL_TIME = {"wall_s", "wall_us_per_request", "decision_p50_ms", "decision_p99_ms", "max_rss_mib"}


def _one(prompt: int, max_tokens: int, **cfg: object) -> Simulation:
    blocks = -(-prompt // 512)
    record = MooncakeRecord(0, prompt, max_tokens, tuple(range(blocks)))
    config = SimConfig(engines=0, prefill_engines=1, decode_engines=1, **cfg)  # type: ignore[arg-type]
    return Simulation(config, "pd", mooncake_requests([record]))


def _step_s(model: StepModel, tokens: int, pairs: int, context: int) -> float:
    """One step by the model's formula (engine_twin/step_model.py), spelled out."""
    return model.fixed_s + tokens * model.token_s + pairs * model.pair_s + context * model.context_token_s


def test_a_long_prompt_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, out = 8192, 3  # one 8,192-token prefill step (the default budget) on the prefill engine
    released: list[tuple[str, float]] = []
    original = EngineCore.release_held

    sim = _one(prompt, out)

    def spy(core: EngineCore, rid: str) -> bool:
        released.append((rid, sim.clock.now))
        return original(core, rid)

    monkeypatch.setattr(EngineCore, "release_held", spy)
    figures = sim.run()
    s = sim.settings
    model = StepModel.from_settings(s)
    # prefill engine: the whole prompt in one step, causal pairs n(n+1)/2, no context; its 1 token
    prefill_s = _step_s(model, prompt, prompt * (prompt + 1) // 2, 0)
    # transfer: 512 blocks x 16 tokens x (2 x layers x KV heads x head dim x dtype bytes) over 50 GB/s
    kv_bytes = 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * s.model_dtype_bytes
    transfer_s = (prompt // 16) * 16 * kv_bytes / (s.kv_transfer_bandwidth_gb_s * 1e9)
    # decode engine: every prompt token but the last arrived; it computes the last one and samples
    first_decode_s = _step_s(model, 1, (prompt - 1) + 1, prompt - 1)
    assert s.kv_transfer_bandwidth_gb_s == 50.0
    assert figures["ttft_p50_s"] == pytest.approx(prefill_s + transfer_s + first_decode_s, rel=1e-9)
    # the decode engine's next tokens: one-token steps over the growing context (1 % ITL bins)
    second = _step_s(model, 1, prompt + 1, prompt)
    assert figures["itl_p99_s"] == pytest.approx(_step_s(model, 1, prompt + 2, prompt + 1), rel=0.011)
    assert figures["itl_p99_s"] == pytest.approx(second, rel=0.011)
    pd = figures["pd"]
    assert pd["decisions"] == {"disaggregated": 1}
    assert pd["kv_transfers"] == 1 and pd["kv_transfer_blocks"] == prompt // 16
    assert pd["kv_transfer_bytes"] == prompt * kv_bytes
    assert pd["kv_transfer_s_total"] == pytest.approx(transfer_s, rel=1e-12)
    assert pd["prefill_tokens_per_request"] == 1.0
    assert figures["generated_tokens_by_role"] == {"both": 0, "prefill": 1, "decode": out}
    # the prefill engine's held blocks were freed at the KV's arrival (the notification), not before
    assert released == [("req-1", pytest.approx(prefill_s + transfer_s, rel=1e-12))]
    assert pd["held_released"] == 1 and pd["held_blocks_at_end"] == 0
    # the client's cached tokens are the prefill leg's (none: a cold cache), not the decode engine's prompt - 1
    assert figures["cached_tokens"] == 0
    # the decode engine's cache holds the prompt's blocks (received, and the last computed there)
    decode = next(e for e in sim.engines if e.role == "decode")
    prefill = next(e for e in sim.engines if e.role == "prefill")
    hashes = sim.memo.engine_hashes(sim_request(prompt, out))
    assert decode.cache.find_hits(hashes, len(hashes)).gpu == prompt // 16
    assert prefill.steps == 1 and prefill.core.held == {}


def sim_request(prompt: int, out: int):  # type: ignore[no-untyped-def]
    return next(mooncake_requests([MooncakeRecord(0, prompt, out, tuple(range(-(-prompt // 512))))]))


def test_a_short_prompt_runs_whole_on_the_decode_engine() -> None:
    sim = _one(100, 4)
    figures = sim.run()
    model = StepModel.from_settings(sim.settings)
    assert figures["pd"]["decisions"] == {"below_threshold": 1}
    assert figures["pd"]["kv_transfers"] == 0 and figures["pd"]["disaggregated"] == 0
    assert figures["generated_tokens_by_role"] == {"both": 0, "prefill": 0, "decode": 4}
    prefill = next(e for e in sim.engines if e.role == "prefill")
    assert prefill.steps == 0
    assert figures["ttft_p50_s"] == pytest.approx(_step_s(model, 100, 100 * 101 // 2, 0), rel=1e-9)


def test_a_prefill_engine_that_refuses_falls_back_to_the_decode_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _one(4096, 2)
    prefill = next(e for e in sim.engines if e.role == "prefill")

    def refuse(req: object, now: float) -> None:
        raise ValueError("too long")

    monkeypatch.setattr(prefill.core, "add", refuse)
    figures = sim.run()
    assert figures["completed"] == 1
    assert figures["pd"]["fallbacks"] == 1 and figures["pd"]["kv_transfers"] == 0
    assert figures["generated_tokens_by_role"]["decode"] == 2
    assert sim.pool.states[prefill.name].endpoint.in_flight_requests == 0


def _mix(layout: tuple[int, int, int], seed: int = 3) -> dict:
    opts = PdOptions(engines=sum(layout), duration_s=6.0, long_prompt_tokens=(2048, 6144), chat_sessions_per_engine=4,
                     chat_max_tokens=32, long_output_tokens=(8, 16), seed=seed, max_model_len=8192)
    config = SimConfig(engines=layout[0], prefill_engines=layout[1], decode_engines=layout[2], seed=seed,
                       gpu_blocks=4096)
    policy = "pd" if layout[1] else "approximate"
    return Simulation(config, policy, pd_mix_requests(opts)).run()


def test_same_seed_gives_the_same_pd_figures() -> None:
    a, b = _mix((0, 1, 2)), _mix((0, 1, 2))
    assert {k: v for k, v in a.items() if k not in _REAL_TIME} == {k: v for k, v in b.items() if k not in _REAL_TIME}
    assert a["completed"] == a["requests"]
    assert a["pd"]["disaggregated"] > 0 and a["pd"]["kv_transfers"] == a["pd"]["disaggregated"]
    assert a["pd"]["prefill_tokens_per_request"] == 1.0
    assert a["pd"]["held_blocks_at_end"] == 0 and a["pd"]["held_released"] == a["pd"]["kv_transfers"]
    # every output token comes from the decode engines
    assert a["generated_tokens_by_role"]["decode"] == _mix((3, 0, 0))["generated_tokens_by_role"]["both"]
    assert _mix((0, 1, 2), seed=4)["prompt_tokens"] != a["prompt_tokens"]


def test_the_production_pd_plugins_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    decisions: list[PDDecision] = []
    original = Scheduler.decide

    def spy(self: Scheduler, *args: object, **kwargs: object) -> PDDecision:
        decision = original(self, *args, **kwargs)  # type: ignore[arg-type]
        decisions.append(decision)
        return decision

    monkeypatch.setattr(Scheduler, "decide", spy)
    sim = _one(8192, 2)
    assert sim.scheduler.profile_handler is not None and sim.director.profile is None
    assert any(isinstance(p, RoleFilter) for p in sim.plugins())
    sim.run()
    assert len(decisions) == 1 and decisions[0].prefill is not None
    assert decisions[0].prefill.endpoint.role == "prefill" and decisions[0].decode.endpoint.role == "decode"
    assert {e.role for e in sim.engines} == {"prefill", "decode"}


def test_bad_fleets_are_refused() -> None:
    with pytest.raises(ValueError, match="decode"):
        Simulation(SimConfig(engines=0, prefill_engines=2), "pd", iter([]))
    with pytest.raises(ValueError, match="'pd'"):
        Simulation(SimConfig(engines=0, prefill_engines=1, decode_engines=1), "approximate", iter([]))
    with pytest.raises(ValueError, match="prefill engines"):
        Simulation(SimConfig(engines=2), "pd", iter([]))


def test_cli_layouts_and_usage_errors(tmp_path: Path) -> None:
    assert parse_layout("12:4") == (0, 12, 4) and parse_layout("8") == (8, 0, 0)
    runner = CliRunner()
    bad = runner.invoke(simulate_command, ["--synthetic-requests", "5", "--prefill-engines", "1"])
    assert bad.exit_code == 2 and "--decode-engines" in bad.output
    bad = runner.invoke(simulate_command, ["--synthetic-requests", "5", "--layout", "0:2"])
    assert bad.exit_code == 2
    out = tmp_path / "pd.json"
    ok = runner.invoke(simulate_command, ["--workload", "pd-mix", "--duration-s", "3", "--gpu-blocks", "4096",
                                          "--max-model-len", "40960", "--layout", "2", "--layout", "1:1",
                                          "--policy", "approximate", "--no-progress", "--json", str(out)])
    assert ok.exit_code == 0, ok.output
    data = json.loads(out.read_text())
    assert [r["run"] for r in data["runs"]] == ["aggregated approximate", "1:1 pd"]
    ratios = data["pd_comparison"]["1:1 pd"]
    assert ratios["itl_p99_agg_over_pd"] == data["runs"][0]["itl_p99_s"] / data["runs"][1]["itl_p99_s"]
