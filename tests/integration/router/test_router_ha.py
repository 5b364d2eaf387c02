"""Router HA, active-active: two simulated engines BIND their KV-event publishers (with vLLM's
replay socket) and two ``backfill router`` processes connect to both (``--kv-events-connect``).
Traffic through router A only fills router B's index as well, and B routes the prompt to its
holder; a third router started after the traffic learns the engines' caches from their replay
sockets, and routes the same way. One module-scoped fleet; every wait is a condition with a
deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine_twin.launch import sim_engine_argv
from lab.toolkit.launch import ProcessGroup, free_port
from router.cli import router_argv

MODEL = "sim-model"
PRECISE = str(Path(__file__).parents[3] / "router" / "scheduling" / "precise-config.yaml")
#: 2,000 bytes = 500 estimate tokens (the twin's built-in tokenizer counts 4 bytes per token too):
#: 7 of the router's 64-token blocks.
PREFIX = "".join(f"Rule {i}: answer politely and cite the handbook section {i}. " for i in range(40))[:2000]


@dataclass
class Fleet:
    group: ProcessGroup
    engines: list[str]
    connect: dict[str, str]  # engine URL -> "tcp://PUB,tcp://REPLAY"
    routers: list[str]

    def start_router(self, name: str) -> str:
        port = free_port()
        argv = router_argv(port, self.engines, config=PRECISE, kv_events_connect=self.connect, replicas=2)
        proc = self.group.start(name, argv)
        url = f"http://127.0.0.1:{port}"
        self.group.wait_ready(proc, url, timeout=30)
        self.routers.append(url)
        return url


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    group = ProcessGroup(tmp_path_factory.mktemp("router-ha"))
    try:
        engines, connect, procs = [], {}, []
        for i in range(2):
            port, pub, replay = free_port(), free_port(), free_port()
            argv = sim_engine_argv(port, [MODEL], f"tcp://*:{pub}", kv_events_replay_endpoint=f"tcp://*:{replay}",
                                   time_scale=0.0)
            procs.append(group.start(f"engine-{i}", argv))
            url = f"http://127.0.0.1:{port}"
            engines.append(url)
            connect[url] = f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"
        for proc, url in zip(procs, engines):
            group.wait_ready(proc, url, timeout=30)
        fleet = Fleet(group, engines, connect, [])
        fleet.start_router("router-a")
        fleet.start_router("router-b")
        yield fleet
    finally:
        group.stop()


def state(router: str) -> dict:
    return httpx.get(f"{router}/admin/state", timeout=5).json()


def blocks(router: str) -> dict[str, int]:
    return {e["name"]: e["cache_blocks"]["gpu"] for e in state(router)["endpoints"]}


def wait_for(condition: Callable[[], object], what: str, timeout: float = 15.0,
             show: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f": {show()}" if show else ""))
        time.sleep(0.05)


def served(engines: list[str]) -> list[int]:
    counts = []
    for url in engines:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        counts.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("vllm:request_success_total"))))
    return counts


def chat(router: str, user: str) -> dict:
    r = httpx.post(f"{router}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 1,
        "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return r.json()


def routes_to(fleet: Fleet, router: str, holder: str, user: str) -> int:
    """Send one chat through ``router``; assert ``holder`` served it; its cached tokens."""
    before = served(fleet.engines)
    answer = chat(router, user)
    after = served(fleet.engines)
    assert [b - a for a, b in zip(before, after)] == [int(url == holder) for url in fleet.engines]
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_every_replica_holds_the_same_index_and_routes_to_the_holder(fleet: Fleet) -> None:
    a, b = fleet.routers[:2]
    wait_for(lambda: all(s["healthy"] for r in (a, b) for s in state(r)["endpoints"]), "healthy engines")
    chat(a, "first, through router A only")
    wait_for(lambda: max(blocks(a).values()) >= 7, "router A's index", show=lambda: blocks(a))
    holder = max(blocks(a), key=lambda name: blocks(a)[name])
    wait_for(lambda: blocks(b) == blocks(a), "router B's index equal to A's", show=lambda: (blocks(a), blocks(b)))
    assert routes_to(fleet, b, holder, "then through router B") >= 448
    events = state(b)["index"]["events"]
    assert set(events["sources"]) == set(fleet.engines)
    assert events["drops"] == 0 and events["unresolved"] == 0


def test_a_replica_started_after_the_traffic_learns_it_from_the_replay_sockets(fleet: Fleet) -> None:
    a = fleet.routers[0]
    chat(a, "again through router A")
    wait_for(lambda: max(blocks(a).values()) >= 7, "router A's index")
    holder = max(blocks(a), key=lambda name: blocks(a)[name])
    late = fleet.start_router("router-late")
    wait_for(lambda: blocks(late).get(holder, 0) == blocks(a)[holder], "the late router's index",
             show=lambda: (blocks(a), blocks(late), state(late)["index"]["events"]))
    events = state(late)["index"]["events"]
    assert events["replays"] >= 1 and events["replayed_batches"] >= 1 and events["drops"] == 0
    assert routes_to(fleet, late, holder, "through the late router") >= 448
    metrics = httpx.get(f"{late}/metrics", timeout=5).text
    assert 'backfill_router_kv_events_total{kind="replays"}' in metrics
