"""Prefill/decode disaggregation in the pure core (vLLM NixlConnector's scheduler side), in model time:
the prefill side holds a finished request's blocks until a decode engine's notification or the abort
timeout, the decode side waits in WAITING_FOR_REMOTE_KVS for the modeled transfer and then has the
prompt's blocks computed and cached, a partly cached prompt reads only the rest, and a failed load
recomputes or fails as ``kv_load_failure_policy`` says."""

import json

import pytest

from engine_twin.core import CoreRequest, EngineCore, Status
from engine_twin.kv_cache import TieredPrefixCache, block_hashes, none_hash
from engine_twin.kv_events import BlockStored
from engine_twin.settings import build_settings

BS = 16
ROOT = none_hash("0")
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def make_core(policy="fail", **overrides):
    s = build_settings(**{"block_size": BS, "num_gpu_blocks": 256, "max_model_len": 2048, "time_scale": 0.0,
                          "kv_transfer_config": json.dumps({**NIXL, "kv_load_failure_policy": policy}),
                          "nixl_abort_request_timeout_s": 30.0, **overrides})
    events: list = []
    cache = TieredPrefixCache(s.num_gpu_blocks, BS, sink=events.extend)
    return EngineCore(s, cache), events


def request(rid, prompt, max_tokens=4):
    return CoreRequest(rid, prompt, max_tokens, block_hashes(prompt, BS, ROOT))


def until_idle(core, t=0.0, limit=200):
    outcomes = []
    while core.has_work():
        out = core.step(t)
        t += out.duration
        outcomes.append(out)
        assert len(outcomes) < limit
    return outcomes, t


PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks and 4 tokens of a 7th


def test_bytes_per_token_are_llama_3_1_8b_bf16_and_the_transfer_time_follows_the_bandwidth():
    core, _ = make_core(kv_transfer_bandwidth_gb_s=25.0)
    assert core.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert core.model.kv_transfer_seconds(4) == pytest.approx(4 * BS * 131_072 / 25e9)


def test_the_prefill_side_holds_a_finished_requests_blocks_until_the_decode_side_reads_them():
    core, _ = make_core()
    req = request("p", PROMPT, max_tokens=1)
    req.remote_decode = True
    core.add(req, 0.0)
    out = core.step(0.0)
    assert out.sampled == ["p"] and out.finished == ["p"]
    assert list(core.held) == ["p"] and len(req.block_ids) == 7 == core.held_blocks
    assert core.cache.used_blocks == 7 and core.num_running == 0
    assert core.expire_held(29.0) == []  # before the timeout nothing is freed
    assert core.release_held("p") is True
    assert core.cache.used_blocks == 0 and core.held == {}
    assert core.release_held("p") is False
    # the freed prompt blocks stay cached (evictable): a later request hits them
    assert core.cache.find_hits(req.hashes, 99 // BS).gpu == 6


def test_held_blocks_are_freed_after_the_abort_timeout_when_no_decode_engine_reads_them():
    core, _ = make_core(nixl_abort_request_timeout_s=5.0)
    req = request("p", PROMPT, max_tokens=1)
    req.remote_decode = True
    core.add(req, 0.0)
    core.step(10.0)
    assert core.next_expiry() == pytest.approx(15.0)
    assert core.expire_held(14.9) == [] and core.cache.used_blocks == 7
    assert core.expire_held(15.0) == ["p"] and core.cache.used_blocks == 0 and core.next_expiry() is None


def test_a_request_without_remote_decode_frees_its_blocks_at_once():
    core, _ = make_core()
    core.add(request("a", PROMPT, max_tokens=1), 0.0)
    core.step(0.0)
    assert core.held == {} and core.cache.used_blocks == 0


def test_the_decode_side_waits_the_modeled_transfer_then_has_the_prompt_cached_and_decodes():
    core, events = make_core()
    req = request("d", PROMPT, max_tokens=3)
    core.add_remote(req, 0.0)
    out = core.step(0.0)
    assert out.scheduled == {} and out.duration == 0.0  # not scheduled while loading
    [load] = out.kv_loads
    assert (load.request_id, load.tokens, load.blocks) == ("d", 100, 7)
    assert load.bytes == 7 * BS * 131_072
    assert load.seconds == pytest.approx(load.bytes / 50e9)
    assert req.status == Status.WAITING_FOR_REMOTE_KVS and core.num_waiting == 1 and core.num_running == 0
    assert core.cache.used_blocks == 7  # it holds the blocks it allocated
    assert not core.has_work() and core.step(0.001).scheduled == {}  # nothing to run until the KV is there
    events.clear()
    assert core.kv_arrived("d", load.seconds) is True
    assert core.kv_arrived("d", load.seconds) is False
    out = core.step(load.seconds)
    assert out.scheduled == {"d": 1} and out.sampled == ["d"]  # only the last prompt token is computed
    assert req.num_cached_tokens == 99
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == 6  # the loaded full blocks are cached on the decode engine
    assert [core.cache.tier_of(h) for h in req.hashes] == ["GPU"] * 6
    outcomes, _ = until_idle(core, load.seconds)
    assert outcomes[-1].finished == ["d"] and req.output_tokens == 3
    assert core.cache.used_blocks == 0


def test_a_partly_cached_prompt_transfers_only_the_blocks_the_decode_engine_lacks():
    core, _ = make_core()
    core.add(request("warm", PROMPT[:64] + [7] * 10, max_tokens=1), 0.0)
    until_idle(core)
    req = request("d", PROMPT, max_tokens=2)
    core.add_remote(req, 1.0)
    [load] = core.step(1.0).kv_loads
    assert (load.tokens, load.blocks) == (100 - 64, 3)  # 4 cached blocks; blocks 4, 5 and the partial 6th
    assert load.seconds == pytest.approx(3 * BS * 131_072 / 50e9)
    assert core.cache.stats.connector_hits_tokens == 36
    core.kv_arrived("d", 2.0)
    core.step(2.0)
    assert req.num_cached_tokens == 99


def test_a_failed_load_recomputes_the_prompt_locally_under_the_recompute_policy():
    core, _ = make_core(policy="recompute")
    req = request("d", PROMPT, max_tokens=2)
    core.add_remote(req, 0.0)
    core.step(0.0)
    assert core.kv_load_failed("d", 0.5) == Status.WAITING
    assert core.cache.used_blocks == 0 and core.num_waiting == 1
    out = core.step(0.5)
    assert out.scheduled == {"d": 100} and out.kv_loads == []  # the whole prompt, computed here
    outcomes, _ = until_idle(core, 1.0)
    assert outcomes[-1].finished == ["d"] and req.output_tokens == 2


def test_a_failed_load_fails_the_request_under_vllms_default_policy():
    core, _ = make_core()
    req = request("d", PROMPT)
    core.add_remote(req, 0.0)
    core.step(0.0)
    assert core.kv_load_failed("d", 0.5) == Status.FAILED
    assert req.status == Status.FAILED and "d" not in core.requests
    assert core.cache.used_blocks == 0 and core.num_waiting == 0 and not core.has_work()
    assert core.kv_load_failed("d", 0.6) is None


def test_aborting_a_request_while_it_loads_frees_its_blocks():
    core, _ = make_core()
    core.add_remote(request("d", PROMPT), 0.0)
    core.step(0.0)
    assert core.abort("d") is not None
    assert core.cache.used_blocks == 0 and core.transferring == {} and core.num_waiting == 0
    assert core.kv_arrived("d", 1.0) is False


def test_a_loading_request_whose_blocks_do_not_fit_waits_head_of_line():
    core, _ = make_core(num_gpu_blocks=128, max_model_len=2048)
    core.add(request("big", list(range(5000, 5000 + 1950)), max_tokens=50), 0.0)
    core.step(0.0)  # 1,950 tokens: 122 of the 128 blocks
    core.add_remote(request("d", PROMPT), 0.0)
    out = core.step(0.01)
    assert out.kv_loads == [] and core.num_waiting == 1  # 7 blocks do not fit in the 6 left
    core.abort("big")
    assert [load.request_id for load in core.step(0.02).kv_loads] == ["d"]


def test_other_connectors_and_roles_are_refused_at_startup():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="NixlConnector"):
        build_settings(kv_transfer_config='{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}')
    with pytest.raises(ValidationError, match="kv_role"):
        build_settings(kv_transfer_config='{"kv_connector": "NixlConnector", "kv_role": "kv_prefill"}')
    with pytest.raises(ValidationError, match="kv_load_failure_policy"):
        build_settings(kv_transfer_config=json.dumps({**NIXL, "kv_load_failure_policy": "retry"}))
    s = build_settings(kv_transfer_config=json.dumps(NIXL))
    assert s.nixl and s.kv_transfer_config is not None and s.kv_transfer_config.engine_id
    assert s.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default


def test_aborting_a_request_whose_kv_arrived_but_is_not_scheduled_yet_frees_its_blocks():
    core, _ = make_core()
    core.add_remote(request("d", PROMPT), 0.0)
    core.step(0.0)
    core.kv_arrived("d", 0.1)
    assert core.cache.used_blocks == 7 and core.num_waiting == 1
    core.abort("d")
    assert core.cache.used_blocks == 0 and core.num_waiting == 0 and not core.has_work()
