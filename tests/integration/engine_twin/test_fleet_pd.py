"""Prefill/decode disaggregation between engine twins, by hand as vLLM's toy proxy does it: two real
twin processes (``sim_engine_argv(pd_role=…)`` + ``pd_engine_env``), the prefill answer's
``kv_transfer_params`` handed to the decode engine, the KV read over the side channel; plus the
failure paths (unreachable prefill engine, bad params) and the prefill side's abort timeout on
in-process twins."""

from __future__ import annotations

import json
import re
import subprocess
import time

import httpx
import pytest
import zmq

from common.chatml import render_chat
from engine_twin.kv_cache import block_hashes, external_hash, none_hash
from engine_twin.kv_events import decode_batch
from engine_twin.launch import pd_engine_env, sim_engine_argv, wait_ready
from engine_twin.tokenizer import BuiltinTokenizer
from tests.integration.engine_twin.conftest import free_port

MODEL = "pd-model"
MESSAGES = [{"role": "user", "content": "a long document for the prefill engine to read, block after block " * 6}]
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
PARAM_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
              "remote_host", "remote_port", "tp_size"}
PROMPT_TOKENS = BuiltinTokenizer().encode(render_chat(MESSAGES), add_special_tokens=False)


def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not exported"
    return float(found.group(1))


class Twin:
    """One twin process in a P/D role."""

    def __init__(self, role: str, **launch):
        self.port = free_port()
        self.side_port = free_port()
        argv = sim_engine_argv(self.port, [MODEL], pd_role=role, time_scale=1.0, **launch)
        self.proc = subprocess.Popen(argv, env=pd_engine_env(self.side_port), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> Twin:
        wait_ready(self.url, timeout=30, process=self.proc)
        return self

    def state(self) -> dict:
        return httpx.get(f"{self.url}/sim/state").json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def events_sub():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    yield sub, port
    sub.close(linger=0)
    ctx.term()


@pytest.fixture
def pd_pair(events_sub):
    _, sub_port = events_sub
    twins = [Twin("prefill"), Twin("decode", kv_events_endpoint=f"tcp://127.0.0.1:{sub_port}")]
    try:
        yield [t.ready() for t in twins]
    finally:
        for t in twins:
            t.stop()


def stored_hashes(sub, want: set[int], timeout=5.0) -> set[int]:
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not want <= seen:
        if sub.poll(50):
            _, events, _ = decode_batch(sub.recv_multipart()[-1])
            for e in events:
                if e["type"] == "BlockStored":
                    seen.update(e["block_hashes"])
    return seen


def test_prefill_then_decode_by_hand_like_vllms_toy_proxy(pd_pair, events_sub):
    prefill, decode = pd_pair
    sub, _ = events_sub
    # a connecting PUB may lose its first messages before the pipe is up: send until events flow
    warm = {"model": MODEL, "max_tokens": 1}
    assert until(lambda: httpx.post(f"{decode.url}/v1/completions",
                                    json={**warm, "prompt": f"warm-up {time.monotonic()} " * 10}).status_code == 200
                 and sub.poll(50))
    while sub.poll(200):
        sub.recv_multipart()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12}
    p = httpx.post(f"{prefill.url}/v1/chat/completions",
                   json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}, timeout=30)
    assert p.status_code == 200, p.text
    answer = p.json()
    n = len(PROMPT_TOKENS)
    blocks = -(-n // 16)
    assert answer["usage"]["prompt_tokens"] == n and answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert set(params) == PARAM_KEYS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == prefill.state()["kv_transfer"]["engine_id"]
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", prefill.side_port, 1)
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == blocks
    held = prefill.state()["kv_transfer"]
    assert (held["held_requests"], held["held_blocks"]) == (1, blocks)

    d = httpx.post(f"{decode.url}/v1/chat/completions", json={**body, "kv_transfer_params": params}, timeout=30)
    assert d.status_code == 200, d.text
    out = d.json()
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["message"]["content"]
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 12
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # vLLM's decode side
    assert out["kv_transfer_params"] is None

    # the notification freed the prefill engine's held blocks
    assert until(lambda: prefill.state()["kv_transfer"]["held_requests"] == 0, 5)
    assert prefill.state()["kv_usage"] == 0.0
    # the decode engine stored the loaded blocks (KV events) and serves the prompt from its cache
    root = none_hash("0")
    full = {external_hash(h) for h in block_hashes(PROMPT_TOKENS, 16, root)[: (n - 1) // 16]}
    assert full <= stored_hashes(sub, full)
    again = httpx.post(f"{decode.url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    text = httpx.get(f"{decode.url}/metrics").text
    assert metric(text, "vllm:nixl_xfer_time_seconds_count") == 1.0
    assert metric(text, "vllm:nixl_bytes_transferred_sum") == blocks * 16 * 131_072
    assert metric(text, "vllm:nixl_num_failed_transfers_total") == 0.0
    prefill_text = httpx.get(f"{prefill.url}/metrics").text
    assert metric(prefill_text, "vllm:generation_tokens_total") == 1


def test_a_streamed_decode_answer_is_complete(pd_pair):
    prefill, decode = pd_pair
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}
    params = httpx.post(f"{prefill.url}/v1/chat/completions",
                        json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}).json()["kv_transfer_params"]
    with httpx.stream("POST", f"{decode.url}/v1/chat/completions", timeout=30,
                      json={**body, "stream": True, "stream_options": {"include_usage": True},
                            "kv_transfer_params": params}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT_TOKENS)
    assert until(lambda: prefill.state()["kv_transfer"]["held_requests"] == 0, 5)


# ---- in-process twins: failure paths and the abort timeout ---------------------------------------------
def nixl(role="kv_both", **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **extra})


def pd_sim(make_sim, role="kv_both", **overrides):
    extra = {k: overrides.pop(k) for k in ("kv_load_failure_policy",) if k in overrides}
    return make_sim(kv_transfer_config=nixl(role, **extra), nixl_side_channel_host="127.0.0.1",
                    nixl_side_channel_port=free_port(), block_size=16, served_model_name=[MODEL], **overrides)


def dead_params(blocks=3) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": "gone", "remote_request_id": "req-0-0", "remote_host": "127.0.0.1",
            "remote_port": free_port(), "tp_size": 1}


def test_an_unreachable_prefill_engine_fails_the_request_under_vllms_default_policy(make_sim):
    decode = pd_sim(make_sim, "kv_consumer")
    r = httpx.post(f"{decode.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "kv_transfer_params": dead_params()})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    text = httpx.get(f"{decode.url}/metrics").text
    assert metric(text, "vllm:nixl_num_failed_transfers_total") == 1.0
    assert decode.state()["kv_usage"] == 0.0 and decode.state()["waiting"] == 0


def test_an_unreachable_prefill_engine_is_recomputed_locally_under_the_recompute_policy(make_sim):
    decode = pd_sim(make_sim, "kv_consumer", kv_load_failure_policy="recompute")
    r = httpx.post(f"{decode.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "kv_transfer_params": dead_params()})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_streamed_decode_whose_load_fails_ends_with_vllms_in_stream_error(make_sim):
    decode = pd_sim(make_sim, "kv_consumer")
    with httpx.stream("POST", f"{decode.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True,
                            "kv_transfer_params": dead_params()}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["error"]["code"] == 500 and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True, "remote_block_ids": [[0, 1]]},  # no engine id, host, port
    {"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "x", "remote_request_id": "r",
     "remote_host": "127.0.0.1", "remote_port": 1},
    {"do_remote_prefill": True, "remote_block_ids": "zero", "remote_engine_id": "x", "remote_request_id": "r",
     "remote_host": "127.0.0.1", "remote_port": 1},
])
def test_bad_kv_transfer_params_compute_the_prompt_locally_as_vllm_logs_it(make_sim, params):
    decode = pd_sim(make_sim, "kv_consumer")
    r = httpx.post(f"{decode.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "kv_transfer_params": params})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_kv_transfer_params_that_are_not_an_object_are_a_400(make_sim):
    decode = pd_sim(make_sim)
    r = httpx.post(f"{decode.url}/v1/completions", json={"model": MODEL, "prompt": "x", "kv_transfer_params": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def expired(caplog) -> list[str]:
    """Request ids whose held blocks the twin freed at ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (its warning, as vLLM's)."""
    return [m.group(1) for r in caplog.records
            if (m := re.match(r"Releasing expired KV blocks for request (\S+) ", r.getMessage()))]


def test_the_prefill_side_frees_unread_blocks_after_the_abort_timeout(make_sim, caplog):
    """Held when it finished (the answer's block ids come from the held request), freed by the timer
    (its warning): nothing here depends on how soon after the answer the state is read."""
    prefill = pd_sim(make_sim, "kv_producer", nixl_abort_request_timeout_s=0.3)
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "x " * 100, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    params = r.json()["kv_transfer_params"]
    assert params["remote_block_ids"] and params["remote_request_id"]
    assert until(lambda: prefill.state()["kv_transfer"]["held_requests"] == 0, 60)
    assert prefill.state()["kv_usage"] == 0.0
    assert until(lambda: expired(caplog) == [params["remote_request_id"]], 60)


def test_a_prefill_request_that_stops_instead_of_being_length_capped_frees_its_blocks(make_sim):
    prefill = pd_sim(make_sim, "kv_producer")
    r = httpx.post(f"{prefill.url}/v1/completions",  # no max_tokens: finish "stop", as vLLM gives no params
                   json={"model": MODEL, "prompt": "x " * 100, "kv_transfer_params": PREFILL_PARAMS})
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["kv_transfer_params"] is None
    assert prefill.state()["kv_transfer"]["held_requests"] == 0


def test_without_a_connector_kv_transfer_params_are_ignored(make_sim):
    plain = make_sim(served_model_name=[MODEL])
    r = httpx.post(f"{plain.url}/v1/completions",
                   json={"model": MODEL, "prompt": "x " * 100, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
    assert plain.state()["kv_transfer"] is None and plain.state()["kv_usage"] == 0.0


def test_a_streamed_prefill_request_gets_no_params_and_its_blocks_wait_for_the_timeout(make_sim, caplog):
    """vLLM puts ``kv_transfer_params`` only in the non-streamed answer; the blocks are held all the
    same, until the timer frees them (its warning names the request)."""
    prefill = pd_sim(make_sim, "kv_producer", nixl_abort_request_timeout_s=0.3)
    with httpx.stream("POST", f"{prefill.url}/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x " * 100, "max_tokens": 1, "stream": True,
                            "kv_transfer_params": PREFILL_PARAMS}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and all("kv_transfer_params" not in line for line in lines)
    assert until(lambda: len(expired(caplog)) == 1, 60)
    assert prefill.state()["kv_transfer"]["held_requests"] == 0 and prefill.state()["kv_usage"] == 0.0


def test_side_channel_answers_bad_requests_in_json(pd_pair):
    prefill, _ = pd_pair
    side = f"http://127.0.0.1:{prefill.side_port}"
    meta = httpx.get(side + "/nixl/meta")
    assert meta.status_code == 200 and meta.json()["engine_id"] == prefill.state()["kv_transfer"]["engine_id"]
    bad = httpx.post(side + "/nixl/notif", content=b"not json")
    assert bad.status_code == 400 and "notif_msg" in bad.json()["error"]
    unknown = httpx.post(side + "/nixl/notif", json={"notif_msg": "no-such-request:1"})
    assert unknown.status_code == 200 and unknown.json() == {"released": False}
    assert httpx.get(side + "/nowhere").status_code == 404
    assert httpx.get(side + "/nixl/notif").status_code == 405
    huge = httpx.post(side + "/nixl/notif", content=b"x" * (1 << 20))
    assert huge.status_code == 413 and "error" in huge.json()
