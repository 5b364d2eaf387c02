"""The CPU offload tier's retention: vLLM's own ``CPUOffloadingManager`` (the ``OffloadingConnector``'s
scheduler side) with the plugin's cache policy, loaded by name and module path as the connector loads
it (``eviction_policy`` / ``cache_policy_module_path``), beside vLLM's ``lru`` on the same traffic.

vLLM 0.32 runs the offload worker only on CUDA-alike or XPU GPUs, so no tier runs here; the manager's
bookkeeping (which chunk is evicted, what a lookup finds) is vLLM's real code."""

from __future__ import annotations

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from backfill_vllm.offload import OFFLOAD_EVICTIONS, BackfillLRUCachePolicy, record_request


def _key(name: str) -> bytes:
    return make_offload_key(name.encode().ljust(32, b"\0"), 0)


def _manager(policy: str) -> CPUOffloadingManager:
    if policy == "lru":
        return CPUOffloadingManager(num_chunks=4, cache_policy="lru")
    return CPUOffloadingManager(num_chunks=4, cache_policy="BackfillLRUCachePolicy",
                                cache_policy_module_path="backfill_vllm.offload")


def _request(req_id: str, background: bool) -> ReqContext:
    record_request(req_id, background)
    return ReqContext(req_id=req_id)


def _store(manager: CPUOffloadingManager, ctx: ReqContext, *names: str) -> list[bytes]:
    keys = [_key(n) for n in names]
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return [k for k in out.evicted_keys]


def _sweep(policy: str, tag: str) -> tuple[set[str], list[bytes]]:
    """An interactive request stores 2 chunks, a batch request 2 (the tier is full), then another batch
    request stores 2 more: which of the first four are still there, and what was evicted."""
    manager = _manager(policy)
    _store(manager, _request(f"{tag}-i0", False), "i-a", "i-b")
    _store(manager, _request(f"{tag}-b0", True), "b-a", "b-b")
    evicted = _store(manager, _request(f"{tag}-b1", True), "b-c", "b-d")
    probe = _request(f"{tag}-probe", False)
    kept = {n for n in ("i-a", "i-b", "b-a", "b-b") if manager.lookup(_key(n), probe) == LookupResult.HIT}
    return kept, evicted


def test_the_connector_loads_the_plugins_policy() -> None:
    assert isinstance(_manager("backfill")._policy, BackfillLRUCachePolicy)


def test_batch_chunks_are_evicted_before_an_older_interactive_prefix() -> None:
    before = dict(OFFLOAD_EVICTIONS)
    kept, evicted = _sweep("backfill", "p")
    assert kept == {"i-a", "i-b"}
    assert sorted(evicted) == sorted([_key("b-a"), _key("b-b")])
    assert OFFLOAD_EVICTIONS["background"] - before["background"] == 2
    assert OFFLOAD_EVICTIONS["foreground"] == before["foreground"]


def test_vllms_lru_evicts_the_interactive_prefix_first() -> None:
    kept, evicted = _sweep("lru", "l")
    assert kept == {"b-a", "b-b"}
    assert sorted(evicted) == sorted([_key("i-a"), _key("i-b")])


def test_a_batch_chunk_an_interactive_request_loaded_is_kept_like_an_interactive_one() -> None:
    manager = _manager("backfill")
    _store(manager, _request("r-b0", True), "b-a", "b-b")
    _store(manager, _request("r-b1", True), "b-c", "b-d")
    reader = _request("r-i0", False)
    manager.prepare_load([_key("b-a")], reader)  # an interactive prefix hit on a batch chunk
    manager.complete_load([_key("b-a")], reader)
    manager.on_request_finished(reader)
    evicted = _store(manager, _request("r-b2", True), "b-e", "b-f", "b-g")
    assert _key("b-a") not in evicted  # the oldest, but an interactive request read it
    assert sorted(evicted) == sorted([_key("b-b"), _key("b-c"), _key("b-d")])


def test_with_only_interactive_chunks_left_vllms_lru_order_holds() -> None:
    manager = _manager("backfill")
    _store(manager, _request("o-i0", False), "i-a", "i-b")
    _store(manager, _request("o-i1", False), "i-c", "i-d")
    evicted = _store(manager, _request("o-b0", True), "b-a")
    assert evicted == [_key("i-b")]  # the oldest request's deepest chunk, as vLLM's LRU orders them
