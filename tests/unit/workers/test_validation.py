"""Unit tests for workers.validation: the streaming batch input validator."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from common.contracts.openai_request import ROUTED_ENDPOINTS
from lab.bench.batchfile import write_batch_file
from workers.validation import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    MAX_N,
    PREFIX_KEY_BYTES,
    LineError,
    ValidationReport,
    loads_line,
    prompt_bytes,
    validate_batch_file,
)

CHAT = "/v1/chat/completions"
SHARED_BATCHES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "batches"
INVALID_JSON = "This line is not parseable as valid JSON."

# name -> (endpoint, request lines), from ../shared/data/batches/README.md
REAL_FILES = {
    "vllm-openai-example-batch.jsonl": (CHAT, 2),
    "vllm-readme-embeddings.jsonl": ("/v1/embeddings", 2),
    "litellm-batch-small.jsonl": (CHAT, 3),
    "aibrix-sample-job-input.jsonl": (CHAT, 3),
    "azure-global-batch-chat.jsonl": (CHAT, 3),
    "openai-cookbook-batch-movies.jsonl": (CHAT, 5),
}


def req(custom_id: str = "r1", **over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    line.update(over)
    return line


def jsonl(*lines: dict[str, Any] | bytes, end: bytes = b"\n") -> bytes:
    return end.join(x if isinstance(x, bytes) else orjson.dumps(x) for x in lines) + end


def chunked(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def run(data: bytes, chunk: int | None = None, endpoint: str = CHAT, **kw: Any) -> ValidationReport:
    chunks = [data] if chunk is None else chunked(data, chunk)
    return validate_batch_file(chunks, endpoint=endpoint, **kw)


def only_error(report: ValidationReport) -> LineError:
    assert len(report.errors) == 1, report.errors
    assert report.requests == []
    return report.errors[0]


def assert_slices_back(data: bytes, report: ValidationReport) -> None:
    """Every request's (offset, length) slices exactly its JSON text out of the file."""
    text_lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    for r in report.requests:
        raw = data[r.offset : r.offset + r.length]
        assert not raw.endswith(b"\r") and b"\n" not in raw
        assert raw == text_lines[r.line - 1].removesuffix(b"\r")
        assert orjson.loads(raw)["custom_id"] == r.custom_id


# --- real files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_batches() -> Path:
    if not SHARED_BATCHES.is_dir():
        pytest.fail(f"shared batch files not found at {SHARED_BATCHES} (expected ../shared beside the repo)")
    return SHARED_BATCHES


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_real_file_validates(shared_batches: Path, name: str) -> None:
    endpoint, count = REAL_FILES[name]
    path = shared_batches / name
    assert path.is_file(), f"missing shared batch file {path}"
    data = path.read_bytes()
    for chunk in (None, 1, 7, 4096):
        report = run(data, chunk, endpoint=endpoint)
        assert report.errors == []
        assert len(report.requests) == count
        assert report.bytes_read == len(data)
        assert report.model == orjson.loads(data.split(b"\n", 1)[0])["body"]["model"]
        assert report.est_tokens == sum(r.est_tokens for r in report.requests) > 0
        assert [r.line for r in report.requests] == list(range(1, count + 1))
        assert_slices_back(data, report)


def test_real_file_quirks_are_present(shared_batches: Path) -> None:
    # The two quirks the validator must accept are really in the data.
    assert (shared_batches / "litellm-batch-small.jsonl").read_bytes().endswith(b"}\n\n")
    assert not (shared_batches / "aibrix-sample-job-input.jsonl").read_bytes().endswith(b"\n")


# --- framing: BOM, CRLF, blank lines, chunk boundaries -------------------------------------------


def test_bom_is_skipped_and_offsets_start_after_it() -> None:
    data = b"\xef\xbb\xbf" + jsonl(req("a"), req("b"))
    report = run(data)
    assert report.errors == []
    assert [r.offset for r in report.requests] == [3, 3 + len(orjson.dumps(req("a"))) + 1]
    assert_slices_back(data, report)


def test_crlf_lengths_exclude_terminator() -> None:
    data = jsonl(req("a"), req("b"), end=b"\r\n")
    report = run(data)
    assert report.errors == []
    assert [r.length for r in report.requests] == [len(orjson.dumps(req("a")))] * 2
    assert report.requests[1].offset == report.requests[0].length + 2
    assert_slices_back(data, report)


def test_crlf_split_across_chunks() -> None:
    first = orjson.dumps(req("a")) + b"\r"
    second = b"\n" + orjson.dumps(req("b")) + b"\r\n"
    split = validate_batch_file([first, second], endpoint=CHAT)
    whole = run(first + second)
    assert split == whole
    assert split.errors == [] and split.requests[0].length == len(first) - 1


def test_multibyte_char_split_across_chunks() -> None:
    line = req("a", body={"model": "m", "messages": [{"role": "user", "content": "café 🚀 naïve"}]})
    data = jsonl(line)
    cut = data.index("🚀".encode()) + 2  # inside the 4-byte emoji
    split = validate_batch_file([data[:cut], data[cut:]], endpoint=CHAT)
    assert split == run(data)
    assert split.errors == []
    assert split.requests[0].prefix_key == "café 🚀 naïve".encode()


def test_blank_lines_are_skipped_but_counted() -> None:
    data = b"\n   \n" + orjson.dumps(req("a")) + b"\n\t\r\n\n" + orjson.dumps(req("b"))  # no final newline
    report = run(data)
    assert report.errors == []
    assert [r.line for r in report.requests] == [3, 6]
    assert_slices_back(data, report)


def test_chunk_size_does_not_change_the_report() -> None:
    emoji = {"model": "m", "messages": [{"role": "system", "content": "Ω" * 200}, {"role": "user", "content": "😀"}]}
    data = (
        b"\xef\xbb\xbf"
        + jsonl(req("a", body=emoji), end=b"\r\n")
        + b"\r\n  \n"
        + jsonl(req("b"), b"{not json", req("a"), req("c", method="GET"))
        + b"\n"
        + orjson.dumps(req("d"))
    )
    reference = run(data)
    assert [e.code for e in reference.errors] == ["invalid_json_line", "duplicate_custom_id", "invalid_request"]
    for size in (1, 2, 3, 5, 64, 1 << 20):
        assert run(data, size) == reference, size
    clean = b"\xef\xbb\xbf" + jsonl(req("a", body=emoji), req("b"), end=b"\r\n") + b"\n" + orjson.dumps(req("c"))
    clean_reference = run(clean)
    assert clean_reference.errors == [] and len(clean_reference.requests) == 3
    for size in (1, 2, 3, 5, 64, 1 << 20):
        assert run(clean, size) == clean_reference, size
    assert_slices_back(clean, clean_reference)


def test_bytes_like_chunks_are_accepted() -> None:
    data = jsonl(req("a"), req("b"))
    report = validate_batch_file([bytearray(data[:10]), memoryview(data[10:])], endpoint=CHAT)
    assert report == run(data)


# --- each error code ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "code", "param"),
    [
        ({k: v for k, v in req("x").items() if k != "custom_id"}, "invalid_request", "custom_id"),
        (req(123), "invalid_request", "custom_id"),  # type: ignore[arg-type]
        (req(None), "invalid_request", "custom_id"),  # type: ignore[arg-type]
        ({k: v for k, v in req("x").items() if k != "method"}, "invalid_request", "method"),
        (req("x", method="GET"), "invalid_request", "method"),
        (req("x", method="post"), "invalid_request", "method"),
        ({k: v for k, v in req("x").items() if k != "url"}, "invalid_request", "url"),
        (req("x", url="/v1/completions"), "url_mismatch", "url"),
        (req("x", url="https://evil/v1/chat/completions"), "url_mismatch", "url"),
        (req("x", url=["/v1/chat/completions"]), "url_mismatch", "url"),
        ({k: v for k, v in req("x").items() if k != "body"}, "invalid_request", "body"),
        (req("x", body=[1]), "invalid_request", "body"),
        (req("x", body={"messages": []}), "invalid_request", "body.model"),
        (req("x", body={"model": 5, "messages": []}), "invalid_request", "body.model"),
        (req("x", body={"model": "m", "messages": [], "stream": True}), "invalid_request", "body.stream"),
        (req("x", body={"model": "other", "messages": []}), "model_mismatch", "body.model"),
    ],
)
def test_error_code_line_and_param(bad: dict[str, Any], code: str, param: str) -> None:
    data = jsonl(req("first"), b"", bad)  # the bad request is on line 3
    error = only_error(run(data))
    assert (error.code, error.line, error.param) == (code, 3, param)
    assert error.message


def test_stream_false_is_fine() -> None:
    report = run(jsonl(req("a", body={"model": "m", "messages": [], "stream": False})))
    assert report.errors == [] and len(report.requests) == 1


def test_invalid_json_line_uses_openai_wording() -> None:
    error = only_error(run(jsonl(req("a")) + b'{"custom_id": "b",\n'))
    assert error == LineError("invalid_json_line", INVALID_JSON, 2, None)


def test_duplicate_custom_id() -> None:
    report = run(jsonl(req("a"), req("b"), req("a")))
    error = only_error(report)
    assert (error.code, error.line, error.param) == ("duplicate_custom_id", 3, "custom_id")
    assert "'a'" in error.message


def test_model_mismatch_names_the_model_and_keeps_the_first() -> None:
    report = run(jsonl(req("a"), req("b", body={"model": "n", "messages": []})))
    assert only_error(report).line == 2
    assert "'n'" in report.errors[0].message
    assert report.model == "m"


def test_errors_are_in_line_order_and_capped() -> None:
    data = jsonl(*[b"nope"] * 10, req("a"))
    report = run(data, max_errors=3)
    assert [(e.code, e.line) for e in report.errors] == [("invalid_json_line", n) for n in (1, 2, 3)]
    assert report.requests == []
    uncapped = run(data)
    assert [e.line for e in uncapped.errors] == list(range(1, 11))


def test_too_many_tasks_is_one_error_and_stops() -> None:
    data = jsonl(*(req(f"r{i}") for i in range(10)))
    report = run(data, chunk=50, max_requests=3)
    error = only_error(report)
    assert (error.code, error.line, error.param) == ("too_many_tasks", 4, None)
    assert report.bytes_read < len(data)  # stopped reading
    assert run(jsonl(*(req(f"r{i}") for i in range(3))), max_requests=3).errors == []


def test_too_many_tasks_counts_requests_not_blank_lines() -> None:
    data = jsonl(req("a"), b"", b"", req("b"))
    assert run(data, max_requests=2).errors == []


@pytest.mark.parametrize("data", [b"", b"\n", b"\n  \n\r\n\t\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n"])
def test_empty_file(data: bytes) -> None:
    for chunk in (None, 1):
        report = run(data, chunk)
        assert report.errors == [LineError("empty_file", report.errors[0].message, None, None)]
        assert report.requests == [] and report.model is None and report.bytes_read == len(data)


def test_one_error_per_line_and_requests_dropped_on_error() -> None:
    report = run(jsonl(req("a"), req("b", method="GET", url="/x"), req("c")))
    assert [(e.line, e.param) for e in report.errors] == [(2, "method")]
    assert report.requests == []


# --- bad-input class 5 and other hostile lines -----------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        b'{"custom_id": "x", "n": ' + b"9" * 5000 + b"}",
        b'{"custom_id": "x", "n": 1' + b"0" * 400 + b".5}",
        b'{"custom_id": "x", "n": NaN}',
        b'{"custom_id": "x", "n": Infinity}',
        b'{"custom_id": "x", "n": -Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"custom_id": "\xff\xfe"}',
        b'{"custom_id": "\xed\xa0\x80"}',  # an encoded surrogate
        b"[]",
        b'"a string"',
        b"42",
        b"null",
        b"true",
        b"{} {}",
        b"\x00",
    ],
)
def test_hostile_line_is_invalid_json_line(line: bytes) -> None:
    start = time.process_time()  # this process's CPU time: what other processes do does not count
    data = jsonl(req("a"), line, req("b"))
    for chunk in (None, 977):
        error = only_error(run(data, chunk))
        assert error == LineError("invalid_json_line", INVALID_JSON, 2, None)
    assert time.process_time() - start < 2


def test_deep_but_parseable_body_is_fine_on_any_endpoint() -> None:
    # 1,000 levels: orjson reads up to 1,024 but serialises only 254, so the prompt helper must cope.
    deep = b"[" * 1000 + b'"x"' + b"]" * 1000
    for endpoint in (CHAT, "/v1/images/generations"):
        line = (
            b'{"custom_id": "a", "method": "POST", "url": "' + endpoint.encode() + b'", "body": {"model": "m", '
            b'"messages": [{"role": "user", "content": ' + deep + b'}], "x": ' + deep + b"}}"
        )
        report = run(jsonl(line), endpoint=endpoint, served_endpoints=(endpoint,))  # the prompt helper
        assert report.errors == [] and len(report.requests) == 1


def test_line_longer_than_max_line_bytes_is_invalid_request() -> None:
    long_line = orjson.dumps(req("long", body={"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}))
    last = long_line.replace(b'"long"', b'"last"')
    data = jsonl(req("a"), long_line, req("b"), end=b"\r\n") + last  # also as a last line, no newline
    for chunk in (None, 1, 100, 4096):
        report = run(data, chunk, max_line_bytes=1000)
        got = [(e.code, e.line, e.param) for e in report.errors]
        assert got == [("invalid_request", 2, None), ("invalid_request", 4, None)]
        assert f"{len(long_line):,} bytes" in report.errors[0].message
    exact = run(data, 100, max_line_bytes=len(long_line))  # the limit itself is allowed, CR excluded
    assert exact.errors == [] and len(exact.requests) == 4


def test_huge_line_is_counted_not_buffered() -> None:
    chunk = b"x" * (1 << 20)
    total = 64

    def chunks() -> Iterator[bytes]:
        yield orjson.dumps(req("a")) + b"\n"
        for _ in range(total):  # a 64 MiB line, the same chunk object each time
            yield chunk
        yield b"\n" + orjson.dumps(req("b")) + b"\n"

    tracemalloc.start()
    try:
        report = validate_batch_file(chunks(), endpoint=CHAT, max_line_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert only_error(report).line == 2
    assert f"{total << 20:,} bytes" in report.errors[0].message
    assert peak < 8 << 20  # O(max_line_bytes), not O(line)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        validate_batch_file([b""], endpoint=CHAT, max_requests=0)


# --- prompt text, prefix key, token estimate --------------------------------------------------------


def test_prompt_text_per_endpoint() -> None:
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "sys"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "u"}},
                    {"type": "text", "text": "b"},
                ],
            },
        ],
    }
    assert prompt_bytes(CHAT, chat) == (b"sys\na\nb", 7)
    assert prompt_bytes("/v1/completions", {"prompt": "p"}) == (b"p", 1)
    assert prompt_bytes("/v1/completions", {"prompt": ["p", "q"]}) == (b"p\nq", 3)
    assert prompt_bytes("/v1/embeddings", {"input": "é"}) == ("é".encode(), 2)
    assert prompt_bytes("/v1/embeddings", {"input": [1, 2, 3]}) == (b"", 12)
    assert prompt_bytes("/v1/embeddings", {"input": [[1, 2], [3]]}) == (b"", 12)
    assert prompt_bytes("/v1/responses", {"instructions": "i", "input": "q"}) == (b"i\nq", 3)
    responses = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}]}
    assert prompt_bytes("/v1/responses", responses) == (b"q", 1)
    other = {"model": "m", "prompt": "x"}
    assert prompt_bytes("/v1/images/generations", other) == (orjson.dumps(other), len(orjson.dumps(other)))
    assert prompt_bytes(CHAT, {"messages": "not a list"}) == (b"", 0)


def test_prefix_key_and_est_tokens() -> None:
    text = "s" * 300
    line = req("a", body={"model": "m", "messages": [{"role": "user", "content": text}]})
    tokens = req("b", url="/v1/embeddings", body={"model": "m", "input": [7] * 10})
    chat = run(jsonl(line)).requests[0]
    assert chat.prefix_key == b"s" * PREFIX_KEY_BYTES
    assert chat.est_tokens == 75  # ceil(300 / 4)
    odd = run(jsonl(req("c", body={"model": "m", "messages": [{"role": "user", "content": "abcde"}]})))
    assert odd.requests[0].est_tokens == 2 and odd.est_tokens == 2  # ceil(5 / 4)
    emb = run(jsonl(tokens), endpoint="/v1/embeddings").requests[0]
    assert (emb.prefix_key, emb.est_tokens) == (b"", 10)


# --- generated files ----------------------------------------------------------------------------


def test_generated_file_validates_clean(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    written = write_batch_file(path, lines=300, target_bytes=600_000, seed=3, shared_prefixes=5)
    data = path.read_bytes()
    assert written == len(data)
    report = run(data, 65536)
    assert report.errors == []
    assert report.bytes_read == written
    assert [r.custom_id for r in report.requests] == [f"request-{n}" for n in range(1, 301)]
    assert report.model == "sim-model"
    assert 1 < len({r.prefix_key for r in report.requests}) <= 5
    assert_slices_back(data, report)


# --- bounds on what one line may ask for -----------------------------------------------------------


def body(**over: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **over}


@pytest.mark.parametrize(
    ("over", "param", "message"),
    [
        ({"n": 1_000_000, "max_tokens": 5}, "body.n",
         "Invalid 'n': integer above maximum value. Expected a value <= 128, but got 1000000 instead."),
        ({"n": 129}, "body.n",
         "Invalid 'n': integer above maximum value. Expected a value <= 128, but got 129 instead."),
        ({"n": 0}, "body.n",
         "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 instead."),
        ({"n": "2"}, "body.n", "Invalid type for 'n': expected an integer, but got a string instead."),
        ({"max_tokens": 0}, "body.max_tokens",
         "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead."),
        ({"max_tokens": -1}, "body.max_tokens",
         "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got -1 instead."),
        ({"max_completion_tokens": 0}, "body.max_completion_tokens",
         "Invalid 'max_completion_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead."),
        ({"max_tokens": 2.5}, "body.max_tokens",
         "Invalid type for 'max_tokens': expected an integer, but got a number instead."),
        ({"max_tokens": True}, "body.max_tokens",
         "Invalid type for 'max_tokens': expected an integer, but got a boolean instead."),
        ({"n": 128, "max_tokens": 8193}, "body.max_tokens",
         "Invalid 'max_tokens': n × max_tokens is 1,048,704 tokens, over the limit of 1,048,576 output tokens "
         "per request; lower 'n' or 'max_tokens'."),
        ({"max_completion_tokens": DEFAULT_MAX_OUTPUT_TOKENS + 1}, "body.max_completion_tokens", None),
    ],
)
def test_n_and_output_token_limits_out_of_bounds_fail_their_line(over: dict, param: str, message: str | None) -> None:
    error = only_error(run(jsonl(req("a"), req("b", body=body(**over)), req("c"))))
    assert (error.code, error.line, error.param) == ("invalid_request", 2, param)
    if message is not None:
        assert error.message == message


def test_output_limits_within_bounds_pass() -> None:
    lines = [req("a", body=body(n=MAX_N, max_tokens=DEFAULT_MAX_OUTPUT_TOKENS // MAX_N)),
             req("b", body=body(n=None, max_tokens=None)), req("c", body=body(max_completion_tokens=1)),
             req("d", url="/v1/responses", body={"model": "m", "input": "q", "max_output_tokens": 4096})]
    assert run(jsonl(*lines[:3])).errors == []
    assert run(jsonl(lines[3]), endpoint="/v1/responses").errors == []


def test_the_output_bound_follows_max_output_tokens() -> None:
    line = req("a", body=body(n=4, max_tokens=100))
    assert run(jsonl(line), max_output_tokens=400).errors == []
    assert only_error(run(jsonl(line), max_output_tokens=399)).param == "body.max_tokens"


def test_an_empty_custom_id_fails_its_line() -> None:
    error = only_error(run(jsonl(req("a"), req(""))))
    assert error == LineError("invalid_request", "Invalid 'custom_id': empty string. Expected a string with "
                              "minimum length 1, but got an empty string instead.", 2, "custom_id")


# --- lone surrogate escapes -----------------------------------------------------------------------


def test_a_lone_surrogate_in_a_prompt_runs_with_the_replacement_character() -> None:
    text = b'"\\ud83d alone, a pair \\ud83d\\ude00, a low one \\udc00, an escaped backslash \\\\ud83d"'
    line = (b'{"custom_id": "s", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", '
            b'"messages": [{"role": "user", "content": ' + text + b"}]}}")
    data = jsonl(req("a"), line, req("b"))
    for chunk in (None, 7):
        report = run(data, chunk)
        assert report.errors == []
        assert [r.custom_id for r in report.requests] == ["a", "s", "b"]
    parsed = loads_line(data.split(b"\n")[1])
    assert parsed["body"]["messages"][0]["content"] == \
        "\ufffd alone, a pair \U0001f600, a low one \ufffd, an escaped backslash \\ud83d"
    assert report.requests[1].prefix_key.decode().startswith("\ufffd alone")


def test_a_lone_surrogate_in_a_custom_id_fails_its_line() -> None:
    line = b'{"custom_id": "x\\ud800", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}'
    error = only_error(run(jsonl(req("a"), line)))
    assert (error.code, error.line, error.param) == ("invalid_request", 2, "custom_id")
    real = "x\ufffd"  # a real U+FFFD in a custom_id, with a lone surrogate elsewhere: runs
    other = orjson.dumps(req(real)).replace(b'"hi"', b'"\\udfff"')
    assert [r.custom_id for r in run(jsonl(other)).requests] == [real]


def test_loads_line_refuses_what_is_not_json_after_the_replacement() -> None:
    with pytest.raises(orjson.JSONDecodeError):
        loads_line(b'{"a": "\\ud800", NaN}')
    with pytest.raises(orjson.JSONDecodeError):
        loads_line(b'{"a": "\\u00"}')


def test_an_endpoint_no_engine_serves_fails_the_batch_at_once() -> None:
    data = jsonl(req(url="/v1/moderations", body={"model": "m", "input": "hi"}))
    report = validate_batch_file([data], endpoint="/v1/moderations")
    assert not report.ok and report.requests == [] and report.bytes_read == 0  # the file is not read
    assert [(e.code, e.line, e.param) for e in report.errors] == [("invalid_request", None, "endpoint")]
    assert "'/v1/moderations'" in report.errors[0].message and "'/v1/chat/completions'" in report.errors[0].message
    assert validate_batch_file([data], endpoint="/v1/moderations",
                               served_endpoints=("/v1/moderations",)).ok


def test_the_served_endpoints_are_the_ones_the_router_routes() -> None:
    from router.app import INFERENCE_PATHS

    assert set(ROUTED_ENDPOINTS) == set(INFERENCE_PATHS)
