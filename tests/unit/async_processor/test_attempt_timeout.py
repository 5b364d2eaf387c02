"""The per-attempt bound (async_processor.attempt_timeout) and how the router client reports a
timeout after sending (NoAnswer.timed_out) apart from a failed connection."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from async_processor.attempt_timeout import attempt_timeout
from async_processor.router_client import HttpxRouterClient, NoAnswer
from common.contracts.openai_request import requested_output_tokens as requested_tokens


@pytest.mark.parametrize(("payload", "tokens"), [
    ({"max_tokens": 100}, 100),
    ({"max_completion_tokens": 50, "max_tokens": 100}, 50),
    ({"max_output_tokens": 30}, 30),
    ({"max_tokens": 100, "n": 4}, 400),
    ({"max_tokens": 100, "n": True}, 100),  # a bool is no count
    ({"max_tokens": "100"}, 0),
    ({"max_tokens": 0}, 0),
    ({}, 0),
])
def test_requested_tokens(payload, tokens):
    assert requested_tokens(payload) == tokens


def test_the_bound_grows_with_the_tokens_asked_for_and_stops_at_the_deadline():
    small = attempt_timeout({"max_tokens": 10}, 10_000, base_s=600, per_token_s=0.25)
    assert (small.total_s, small.idle_s, small.capped) == (602.5, None, False)
    long = attempt_timeout({"max_tokens": 13_200}, 86_400, base_s=600, per_token_s=0.25)
    assert long.total_s == 600 + 3_300  # the 11-minute inference of 13,200 tokens at 50 ms fits
    capped = attempt_timeout({"max_tokens": 13_200}, 900, base_s=600, per_token_s=0.25)
    assert (capped.total_s, capped.capped) == (900, True)
    unnamed = attempt_timeout({}, 10_000, base_s=600, per_token_s=0.25)
    assert unnamed.total_s == 600 and "names no max_tokens" in unnamed.describe(600, 0.25)


def test_a_stream_is_bounded_by_its_silence_and_the_deadline():
    bound = attempt_timeout({"max_tokens": 10, "stream": True}, 5_000, base_s=600, per_token_s=0.25)
    assert (bound.total_s, bound.idle_s, bound.capped) == (5_000, 600, True)
    assert "without a byte" in bound.describe(600, 0.25)


def _client(error: Exception) -> HttpxRouterClient:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error
    return HttpxRouterClient(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


@pytest.mark.parametrize(("error", "timed_out"), [
    (httpx.ReadTimeout("slow"), True),
    (httpx.ConnectTimeout("no route"), False),
    (httpx.ConnectError("refused"), False),
    (httpx.PoolTimeout("pool"), False),
])
def test_no_answer_says_whether_the_router_had_the_request(error, timed_out):
    async def post() -> NoAnswer:
        client = _client(error)
        try:
            await client.post("http://router/v1/chat/completions", b"{}", {}, 1.0, idle_s=0.5)
        except NoAnswer as exc:
            return exc
        finally:
            await client.aclose()
        raise AssertionError("no NoAnswer")
    assert asyncio.run(post()).timed_out is timed_out
