"""``backfill router``'s trusted identities (issue 17, item 12; ``router/trust.py``) in front of
simulated engines, one stack per test (split from ``test_router_proxy.py`` so the files run on
separate test workers): random fairness ids without the trusted token are one tenant and get 429s,
one tenant's flood is refused while another tenant is served, and the async processor's objective
and fairness id are honoured only with the token."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import httpx

from tests.router_stack import RouterStack
from tests.waiting import wait_for

#: ~15 s per request: the 300-request flood is all sent, however slowly a busy machine sends it,
#: while the first 16 still run, and the 16 queued behind them wait well under the band's 30-s TTL.
FLOOD_TOKENS = 1200
#: ~48 s per request: a flood that outlasts anything the test waits for however busy the machine
#: (the twin keeps wall time, the test's own steps slow down), cancelled once the test has looked.
ENDLESS_TOKENS = 4000
FAIRNESS = "x-llm-d-inference-fairness-id"


async def _post_all(url: str, headers: list[dict[str, str]], max_tokens: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(headers), max_keepalive_connections=len(headers))
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post(
            f"{url}/v1/completions", headers=h,
            json={"model": "sim-model", "prompt": f"flood {i}", "max_tokens": max_tokens})
            for i, h in enumerate(headers)))


async def _post(client: httpx.AsyncClient, url: str, headers: dict[str, str], max_tokens: int,
                i: int) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", headers=headers,
                             json={"model": "sim-model", "prompt": f"flood {i}", "max_tokens": max_tokens})


def _band(s: RouterStack, objective: str) -> dict:
    return next(b for b in s.state()["bands"] if b["objective"] == objective)


def _metric(s: RouterStack, series: str) -> float:
    line = next((ln for ln in httpx.get(f"{s.url}/metrics", timeout=10).text.splitlines()
                 if ln.startswith(series + " ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_random_fairness_ids_without_the_token_are_one_tenant_and_get_429s(tmp_path: Path) -> None:
    """Before: every random fairness id was its own tenant, so no per-tenant limit ever bound."""
    with RouterStack(tmp_path, engines=2, engine_options=[{"time_scale": 1.0}] * 2) as s:
        spoofed = [{FAIRNESS: secrets.token_hex(8), "x-llm-d-inference-objective": "batch"} for _ in range(300)]

        async def scenario() -> tuple[list[httpx.Response], dict]:
            flood = asyncio.create_task(_post_all(s.url, spoofed, FLOOD_TOKENS))
            deadline = time.monotonic() + 60  # generous: a busy machine slows the flood, not the verdict
            while (during := await asyncio.to_thread(_band, s, "interactive"))["queued_requests"] < 16:
                assert time.monotonic() < deadline, "the flood never reached the quota"
                await asyncio.sleep(0.05)
            return await flood, during

        answers, during = asyncio.run(scenario())
        band = _band(s, "interactive")
        ignored = _metric(s, f'backfill_router_untrusted_headers_total{{header="{FAIRNESS}"}}')
    refused = [a for a in answers if a.status_code == 429]
    # one tenant "anonymous" in the default band: 16 in flight + 16 queued, the rest refused at once
    assert {a.status_code for a in answers} == {200, 429}
    assert len(refused) >= 300 - 2 * 32, len(refused)
    assert {a.headers["x-llm-d-request-dropped-reason"] for a in refused} == {"rejected-quota"}
    assert {a.headers["retry-after"] for a in refused} == {"30"}  # the interactive band's TTL
    assert during["flows"] == 1 and during["in_flight"] == 16  # one flow, at its in-flight quota
    assert band["refused_total"]["rejected_quota"] == len(refused)
    assert sum(1 for a in answers if a.status_code == 200) == band["dispatched_total"]
    assert ignored == 300


def test_one_tenants_flood_is_refused_while_another_tenant_is_served(tmp_path: Path) -> None:
    with RouterStack(tmp_path, engines=2, engine_options=[{"time_scale": 1.0}] * 2) as s:
        async def scenario() -> tuple[list[httpx.Response], list[httpx.Response], dict]:
            limits = httpx.Limits(max_connections=120, max_keepalive_connections=120)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                a, b = s.trusted({FAIRNESS: "tenant-a"}), s.trusted({FAIRNESS: "tenant-b"})
                flood = [asyncio.create_task(_post(client, s.url, a, ENDLESS_TOKENS, i)) for i in range(100)]
                await asyncio.to_thread(wait_for, lambda: _band(s, "interactive")["queued_requests"] >= 16,
                                        "tenant-a reaching its quota")
                other = await asyncio.gather(*(_post(client, s.url, b, 4, i) for i in range(8)))
                during = await asyncio.to_thread(_band, s, "interactive")

                def refusals_answered() -> bool:  # each flood request admitted or refused, each refusal back
                    band = _band(s, "interactive")
                    refused = band["refused_total"].get("rejected_quota", 0)
                    return (band["in_flight"] + band["queued_requests"] + refused == 100
                            and sum(t.done() for t in flood) == refused)

                await asyncio.to_thread(wait_for, refusals_answered, "the flood's refusals")
                answered = [t.result() for t in flood if t.done()]
                for t in flood:  # the admitted ones would run ~48 s: the client goes away instead
                    t.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
                return answered, other, during

        flood, other, during = asyncio.run(scenario())
    # tenant-b: all answered, while tenant-a still had its quota's worth waiting behind its own work
    assert [a.status_code for a in other] == [200] * 8
    assert during["queued_requests"] >= 1 and during["in_flight"] >= 16
    refused = [a for a in flood if a.status_code == 429]
    assert refused == flood  # the flood's only answers before it was cancelled: refusals
    assert len(refused) >= 100 - 2 * 32
    assert {a.headers["x-llm-d-request-dropped-reason"] for a in refused} == {"rejected-quota"}
    assert all(a.headers["retry-after"] == "30" and a.json()["error"]["code"] == "rejected-quota" for a in refused)


def test_the_processors_objective_and_fairness_id_are_honoured_only_with_the_token(tmp_path: Path, stores) -> None:
    from tests.integration.processor.test_processor_end_to_end import InProcess, Ns, message

    with RouterStack(tmp_path, engines=1, model="m") as s:
        for n, token in enumerate((s.token, None)):
            ns = Ns(stores.redis_url)
            before = {b["objective"]: b["dispatched_total"] for b in s.state()["bands"]}
            for i in range(3):
                ns.put("batch", message(f"m{n}-{i}", tenant="acme"))
            with InProcess(ns.settings(s.url, router_token=token)):
                results = ns.wait_results(3, timeout_s=30)
            assert [r.status_code for r in results] == [200] * 3
            after = {b["objective"]: b["dispatched_total"] for b in s.state()["bands"]}
            grew = {k: after[k] - before[k] for k in after if after[k] != before[k]}
            # with the token: the batch band; without: the default band, as tenant "anonymous"
            assert grew == ({"batch": 3} if token else {"interactive": 3}), (token, grew)
        assert _metric(s, f'backfill_router_untrusted_headers_total{{header="{FAIRNESS}"}}') == 3
        assert _metric(s, 'backfill_router_untrusted_headers_total{header="x-llm-d-inference-objective"}') == 3
