"""Prefill/decode disaggregation in the scheduling layer, the settings and the pool (no HTTP).

The P/D profile handler's decision at its threshold, the role filters, the shipped config and its
errors, the pod label ``llm-d.ai/role``, the per-pool gate, and the prefill/decode bodies.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import aiohttp
import orjson
import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from scheduling_helpers import FakeClock

from router.cli import router_argv, router_command
from router.disagg import PREFILL_KV_TRANSFER_PARAMS, decode_body, kv_transfer_params_of, prefill_body
from router.pool import ROLE_LABEL, EndpointPool, KubernetesSource, pod_role, ready_pod_roles, ready_pod_urls
from router.scheduling import DEFAULT_CONFIG_PATH, PD_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config, parse_config
from router.scheduling.errors import ConfigError, NoCandidatesError
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.disagg import DECODE_FILTER_TYPE, PREFILL_FILTER_TYPE, RoleFilter
from router.scheduling.saturation import SaturationThresholds, fleet_saturation, pd_fleet_saturation, pd_gate_saturation
from router.scheduling.scheduler import SINGLE_PROFILE, Scheduler
from router.scheduling.types import CycleState, Endpoint, LLMRequest
from router.settings import DEFAULT_SCHEDULING_CONFIG, PD_SCHEDULING_CONFIG, RouterSettings, build_settings

P, D, B = "http://prefill", "http://decode", "http://both"


def fresh(name: str, role: str, clock: FakeClock, **fields) -> Endpoint:
    return Endpoint(name, role=role, metrics_updated_at=clock(), **fields)


def pd_scheduler(clock: FakeClock, threshold: int | None = None) -> Scheduler:
    text = PD_CONFIG_PATH.read_text()
    if threshold is not None:
        text = text.replace("threshold: 256 ", f"threshold: {threshold} ")
    return build_scheduler(parse_config(text), PluginHandle(rng=random.Random(1), clock=clock))


def request(n_tokens: int, seed: int = 0) -> LLMRequest:
    return LLMRequest(request_id=f"r{seed}-{n_tokens}", model="m",
                      prompt_token_ids=[seed * 100_000 + i for i in range(n_tokens)])


# ---- the handler's decision ------------------------------------------------------------------------
def test_the_shipped_config_loads_with_the_handler_and_decode_as_default(clock: FakeClock) -> None:
    scheduler = pd_scheduler(clock)
    assert scheduler.profile_handler is not None
    assert scheduler.profile_handler.threshold == 256
    assert scheduler.default_profile == "decode"
    assert set(scheduler.profiles) == {"decode", "prefill"}
    # the default config has no handler: its first profile stays the default
    assert build_scheduler(load_config(DEFAULT_CONFIG_PATH)).profile_handler is None


@pytest.mark.parametrize(("tokens", "reason"), [(255, "below_threshold"), (256, "disaggregated"),
                                                (257, "disaggregated")])
def test_disaggregates_at_the_threshold_of_uncached_tokens(clock: FakeClock, tokens: int, reason: str) -> None:
    scheduler = pd_scheduler(clock)
    eps = [fresh(P, "prefill", clock), fresh(D, "decode", clock)]
    decision = scheduler.decide(request(tokens), eps)
    assert decision.reason == reason
    assert decision.decode.endpoint.name == D
    assert decision.uncached_tokens == tokens
    assert (decision.prefill.endpoint.name if decision.prefill else None) == (P if reason == "disaggregated" else None)


def test_the_prefix_the_decode_engine_holds_is_not_counted(clock: FakeClock) -> None:
    scheduler = pd_scheduler(clock)
    eps = [fresh(P, "prefill", clock), fresh(D, "decode", clock)]
    first = request(512)
    decision = scheduler.decide(first, eps)
    assert decision.disaggregated
    scheduler.pre_request(first, decision.decode)  # the decode engine now holds the 8 blocks
    scheduler.pre_request(first, decision.prefill)
    longer = LLMRequest("r2", "m", prompt_token_ids=[*first.prompt_token_ids, *range(900_000, 900_200)])
    again = scheduler.decide(longer, eps)
    # 712 tokens, 512 cached on the decode engine: 200 uncached < 256
    assert (again.reason, again.uncached_tokens, again.prefill) == ("below_threshold", 200, None)
    bigger = LLMRequest("r3", "m", prompt_token_ids=[*first.prompt_token_ids, *range(800_000, 800_300)])
    assert scheduler.decide(bigger, eps).reason == "disaggregated"  # 300 uncached


def test_threshold_zero_always_disaggregates(clock: FakeClock) -> None:
    scheduler = pd_scheduler(clock, threshold=0)
    eps = [fresh(P, "prefill", clock), fresh(D, "decode", clock)]
    assert scheduler.decide(request(3), eps).reason == "disaggregated"


def test_no_prefill_engine_means_aggregated_and_no_decode_engine_means_no_candidates(clock: FakeClock) -> None:
    scheduler = pd_scheduler(clock)
    decision = scheduler.decide(request(1000), [fresh(D, "decode", clock)])
    assert (decision.reason, decision.decode.endpoint.name, decision.prefill) == ("no_prefill_endpoint", D, None)
    with pytest.raises(NoCandidatesError):
        scheduler.decide(request(1000), [fresh(P, "prefill", clock)])


def test_a_both_engine_is_never_its_own_prefill(clock: FakeClock) -> None:
    scheduler = pd_scheduler(clock)
    alone = scheduler.decide(request(1000), [fresh(B, "both", clock)])
    assert (alone.decode.endpoint.name, alone.reason) == (B, "no_prefill_endpoint")
    # a decode engine and a both engine: whichever decodes, the other may prefill only if it can
    eps = [fresh(B, "both", clock), fresh(D, "decode", clock, num_requests_waiting=3)]
    decision = scheduler.decide(request(1000), eps)
    assert decision.decode.endpoint.name == B  # the idle one by load
    assert decision.reason == "no_prefill_endpoint"  # the decode engine cannot prefill


def test_the_prefill_profile_is_prefix_aware_and_can_be_retried_elsewhere(clock: FakeClock) -> None:
    scheduler = pd_scheduler(clock)
    p2 = "http://prefill-2"
    eps = [fresh(P, "prefill", clock), fresh(p2, "prefill", clock), fresh(D, "decode", clock)]
    first = request(2000, seed=7)
    decision = scheduler.decide(first, eps)
    assert decision.prefill is not None
    warm = decision.prefill.endpoint.name
    scheduler.pre_request(first, decision.prefill)
    repeat = LLMRequest("r9", "m", prompt_token_ids=[*first.prompt_token_ids, *range(10)])
    assert scheduler.decide(repeat, eps).prefill.endpoint.name == warm  # sticks to the cached prefix
    retry = scheduler.schedule_prefill(repeat, eps, exclude=[D, warm])
    assert retry is not None and retry.endpoint.name == ({P, p2} - {warm}).pop()
    assert scheduler.schedule_prefill(repeat, eps, exclude=[D, P, p2]) is None


def test_without_a_handler_decide_is_the_one_profile(clock: FakeClock) -> None:
    scheduler = build_scheduler(load_config(DEFAULT_CONFIG_PATH), PluginHandle(clock=clock))
    eps = [fresh("http://a", "both", clock)]
    decision = scheduler.decide(request(5000), eps)
    assert (decision.reason, decision.prefill, decision.decode.profile) == (SINGLE_PROFILE, None, "default")
    assert scheduler.schedule_prefill(request(5000), eps) is None


# ---- filters --------------------------------------------------------------------------------------
def test_role_filters_keep_their_roles() -> None:
    eps = [Endpoint(P, role="prefill"), Endpoint(D, role="decode"), Endpoint(B, role="both")]
    state, req = CycleState(), request(1)
    assert [e.name for e in RoleFilter("p", PREFILL_FILTER_TYPE).filter(state, req, eps)] == [P, B]
    assert [e.name for e in RoleFilter("d", DECODE_FILTER_TYPE).filter(state, req, eps)] == [D, B]


# ---- config errors --------------------------------------------------------------------------------
HANDLER_CONFIG = """
plugins:
- type: decode-filter
- type: prefill-filter
- type: pd-profile-handler
  parameters: {params}
schedulingProfiles:
- name: decode
  plugins: [{{pluginRef: decode-filter}}]
- name: prefill
  plugins: [{{pluginRef: prefill-filter}}]
"""


@pytest.mark.parametrize(("params", "message"), [
    ("{prefillProfile: nope}", "prefillProfile 'nope' is not a profile"),
    ("{decodeProfile: prefill}", "both 'prefill'"),
    ("{hashBlockSize: 16}", "hashBlockSize 16 differs"),
    ("{primaryPort: 8000}", "primaryPort"),
    ("{threshold: -1}", "threshold"),
    ("{thresh: 5}", "thresh"),
    ("{prefixPluginName: missing}", "'missing', which is not declared"),
])
def test_bad_handler_parameters_are_config_errors(params: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_scheduler(parse_config(HANDLER_CONFIG.format(params=params)))


def test_the_handler_is_not_a_profile_member_and_there_is_only_one() -> None:
    text = HANDLER_CONFIG.format(params="{}").replace("[{pluginRef: prefill-filter}]",
                                                     "[{pluginRef: prefill-filter}, {pluginRef: pd-profile-handler}]")
    with pytest.raises(ConfigError, match="declared in plugins only"):
        build_scheduler(parse_config(text))
    two = HANDLER_CONFIG.format(params="{}").replace("schedulingProfiles:", "- type: pd-profile-handler\n"
                                                      "  name: second\nschedulingProfiles:")
    with pytest.raises(ConfigError, match="two profile handlers"):
        build_scheduler(parse_config(two))


def test_llm_d_prefill_header_handler_is_accepted() -> None:
    text = HANDLER_CONFIG.format(params="{threshold: 10, hashBlockSize: 64}").replace(
        "plugins:\n- type: decode-filter", "plugins:\n- type: prefill-header-handler\n- type: decode-filter", 1)
    assert build_scheduler(parse_config(text)).profile_handler.threshold == 10


# ---- Kubernetes labels ----------------------------------------------------------------------------
def pod(ip: str, labels: dict[str, str] | None) -> SimpleNamespace:
    status = SimpleNamespace(phase="Running", pod_ip=ip, conditions=[SimpleNamespace(type="Ready", status="True")])
    return SimpleNamespace(status=status, metadata=SimpleNamespace(labels=labels, annotations=None))


@pytest.mark.parametrize(("labels", "role"), [
    ({ROLE_LABEL: "prefill"}, "prefill"), ({ROLE_LABEL: "decode"}, "decode"), ({ROLE_LABEL: "both"}, "both"),
    ({ROLE_LABEL: "prefill-decode"}, "both"), ({}, "both"), (None, "both"), ({"app": "vllm"}, "both"),
    ({ROLE_LABEL: "Decode "}, "decode"), ({ROLE_LABEL: "encode"}, None),
])
def test_pod_role_label(labels: dict[str, str] | None, role: str | None) -> None:
    assert pod_role(pod("10.0.0.1", labels)) == role


def test_pods_with_an_unknown_role_are_not_routed_to() -> None:
    pods = [pod("10.0.0.1", {ROLE_LABEL: "prefill"}), pod("10.0.0.2", {ROLE_LABEL: "decode"}),
            pod("10.0.0.3", None), pod("10.0.0.4", {ROLE_LABEL: "bogus"})]
    assert ready_pod_urls(pods, 8000) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert ready_pod_roles(pods, 8000) == {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "decode",
                                           "http://10.0.0.3:8000": "both"}


# ---- the gate per pool ------------------------------------------------------------------------------
def test_without_prefill_engines_the_gate_is_the_least_saturated_endpoint() -> None:
    eps = [Endpoint("a"), Endpoint("b", role="decode")]
    assert pd_gate_saturation(eps, [0.4, 1.5]) == 0.4


def test_a_pd_fleet_needs_room_in_both_pools() -> None:
    eps = [Endpoint(P, role="prefill"), Endpoint(D, role="decode"), Endpoint("http://d2", role="decode")]
    assert pd_gate_saturation(eps, [0.3, 1.2, 0.9]) == 0.9  # prefill room 0.3, decode room 0.9
    assert pd_gate_saturation(eps, [1.0, 0.1, 0.2]) == 1.0  # the prefill pool is full: hold sheddable work
    assert pd_gate_saturation(eps, [0.2, 1.0, 1.1]) == 1.0  # the decode pool is full
    # a both engine counts in either pool
    mixed = [Endpoint(P, role="prefill"), Endpoint(B, role="both")]
    assert pd_gate_saturation(mixed, [1.0, 0.5]) == 0.5


def test_pending_requests_are_placed_in_each_pool(clock: FakeClock) -> None:
    t = SaturationThresholds(in_flight_credit=True)
    eps = [fresh(P, "prefill", clock, max_num_seqs=4), fresh(D, "decode", clock, max_num_seqs=4),
           fresh("http://d2", "decode", clock, max_num_seqs=4)]
    values = pd_fleet_saturation(eps, clock(), t, pending=3)
    decode_only = fleet_saturation(eps[1:], clock(), t, pending=3)
    prefill_only = fleet_saturation(eps[:1], clock(), t, pending=3)
    assert values == [*prefill_only, *decode_only]
    assert values[0] > values[1]  # three pending on the single prefill engine, split over two decode ones
    plain = [fresh("a", "both", clock, max_num_seqs=4), fresh("b", "decode", clock, max_num_seqs=4)]
    assert pd_fleet_saturation(plain, clock(), t, pending=3) == fleet_saturation(plain, clock(), t, pending=3)


# ---- settings -----------------------------------------------------------------------------------------
def test_prefill_engines_select_the_pd_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_ROUTER_PREFILL_ENGINES", "http://p1:8000, http://p2:8000/")
    settings = build_settings(decode_engines=["http://d1:8000"], engines=["http://b1:8000"])
    assert settings.prefill_engines == ["http://p1:8000", "http://p2:8000"]
    assert settings.all_engines == ["http://b1:8000", "http://p1:8000", "http://p2:8000", "http://d1:8000"]
    assert settings.engine_roles == {"http://p1:8000": "prefill", "http://p2:8000": "prefill",
                                     "http://d1:8000": "decode"}
    assert settings.scheduling_config == PD_SCHEDULING_CONFIG
    monkeypatch.delenv("BACKFILL_ROUTER_PREFILL_ENGINES")
    assert RouterSettings(engines=["http://a:1"]).scheduling_config == DEFAULT_SCHEDULING_CONFIG
    assert RouterSettings(prefill_engines=["http://a:1"], config="x.yaml").scheduling_config.name == "x.yaml"


def test_one_role_per_engine() -> None:
    with pytest.raises(ValidationError, match="one role per engine"):
        RouterSettings(prefill_engines=["http://a:1"], decode_engines=["http://a:1/"])
    with pytest.raises(ValidationError, match="http:// or https://"):
        RouterSettings(decode_engines=["a:1"])


# ---- the bodies ---------------------------------------------------------------------------------------
def test_prefill_body_is_vllm_nixl_shape() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 50, "max_completion_tokens": 40, "n": 2,
            "min_tokens": 5, "temperature": 0.2}
    sent = orjson.loads(prefill_body(body))
    assert sent == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                    "max_tokens": 1, "max_completion_tokens": 1, "n": 1, "temperature": 0.2,
                    "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    assert body["stream"] is True and "kv_transfer_params" not in body  # the original is untouched
    minimal = orjson.loads(prefill_body({"model": "m", "prompt": "x"}))
    assert minimal == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False,
                       "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}


def test_decode_body_and_the_prefill_answer() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e", "tp_size": 1}
    body = {"model": "m", "prompt": "x", "max_tokens": 9, "stream": True}
    assert orjson.loads(decode_body(body, params)) == {**body, "kv_transfer_params": params}
    answer = orjson.dumps({"id": "c", "choices": [], "kv_transfer_params": params})
    assert kv_transfer_params_of(answer) == params
    for bad in (b"not json", b"[1]", b'{"kv_transfer_params": null}', b'{"kv_transfer_params": {}}',
                b'{"kv_transfer_params": [1]}', b'{"id": "x"}'):
        assert kv_transfer_params_of(bad) is None, bad


def test_discovery_gives_the_pool_each_pods_role_and_follows_a_relabel() -> None:
    async def scenario() -> list[dict[str, str]]:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            source = KubernetesSource(pool, "app=vllm", 8000, namespace="llm", static=["http://static:1"],
                                      static_roles={"http://static:1": "decode"})
            seen = []
            source.apply([pod("10.0.0.1", {ROLE_LABEL: "prefill"}), pod("10.0.0.2", None)])
            seen.append({n: s.endpoint.role for n, s in pool.states.items()})
            source.apply([pod("10.0.0.1", {ROLE_LABEL: "decode"}), pod("10.0.0.2", None)])
            seen.append({n: s.endpoint.role for n, s in pool.states.items()})
            await pool.close()
            return seen

    first, second = asyncio.run(scenario())
    assert first == {"http://static:1": "decode", "http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "both"}
    assert second["http://10.0.0.1:8000"] == "decode"


def test_the_cli_wants_somewhere_to_decode() -> None:
    result = CliRunner().invoke(router_command, ["--prefill-engine", "http://p:1"])
    assert result.exit_code == 2 and "--decode-engine or --engine" in result.output
    result = CliRunner().invoke(router_command, ["--prefill-engine", "http://p:1", "--decode-engine", "http://p:1"])
    assert result.exit_code == 2 and "one role per engine" in result.output
    argv = router_argv(8100, [], prefill_engines=["http://p:1"], decode_engines=["http://d:1"])
    assert argv[-4:] == ["--prefill-engine", "http://p:1", "--decode-engine", "http://d:1"]
