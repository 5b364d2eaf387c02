"""Unit tests for lab.bench.batchfile: the seeded batch input generator."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import orjson
import pytest

from lab.bench.batchfile import write_batch_file
from workers.validation import validate_batch_file

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]


def read_chunks(path: Path, size: int = 1 << 16):
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_endpoint_validates_clean(tmp_path: Path, endpoint: str) -> None:
    path = tmp_path / "b.jsonl"
    written = write_batch_file(path, lines=120, target_bytes=240_000, endpoint=endpoint, model="mx")
    report = validate_batch_file(read_chunks(path), endpoint=endpoint)
    assert report.errors == []
    assert len(report.requests) == 120
    assert report.model == "mx"
    assert report.bytes_read == written == path.stat().st_size == 240_000
    assert report.est_tokens > 240_000 // 4 * 0.8  # the padding is prompt text


def test_lines_are_lf_terminated_with_sequential_ids(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    write_batch_file(path, lines=50, target_bytes=100_000)
    data = path.read_bytes()
    assert data.endswith(b"}\n") and b"\r" not in data
    lines = data.splitlines()
    assert [orjson.loads(line)["custom_id"] for line in lines] == [f"request-{n}" for n in range(1, 51)]
    sizes = [len(line) + 1 for line in lines]
    assert max(sizes) - min(sizes) <= 1  # the budget is spread evenly


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_batch_file(a, lines=40, target_bytes=80_000, seed=7)
    write_batch_file(b, lines=40, target_bytes=80_000, seed=7)
    write_batch_file(c, lines=40, target_bytes=80_000, seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_shared_prefixes_bound_distinct_prefix_keys(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    write_batch_file(path, lines=400, target_bytes=600_000, shared_prefixes=6)
    keys = {r.prefix_key for r in validate_batch_file(read_chunks(path), endpoint=ENDPOINTS[0]).requests}
    assert len(keys) == 6
    write_batch_file(path, lines=50, target_bytes=60_000, shared_prefixes=1)
    keys = {r.prefix_key for r in validate_batch_file(read_chunks(path), endpoint=ENDPOINTS[0]).requests}
    assert len(keys) == 1


def test_target_below_unpadded_size_writes_unpadded_lines(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    written = write_batch_file(path, lines=5, target_bytes=10)
    assert written == path.stat().st_size > 10
    assert len(validate_batch_file([path.read_bytes()], endpoint=ENDPOINTS[0]).requests) == 5


def test_file_is_streamed_not_built_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    tracemalloc.start()
    try:
        written = write_batch_file(path, lines=2_000, target_bytes=24_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert written == 24_000_000
    assert peak < 8 << 20  # ~1 MiB filler pool + ~1 MiB write buffer, not the 24 MB file


def test_fixed_max_tokens_changes_only_the_limit(tmp_path: Path) -> None:
    drawn, fixed = tmp_path / "drawn.jsonl", tmp_path / "fixed.jsonl"
    write_batch_file(drawn, lines=30, target_bytes=10)
    write_batch_file(fixed, lines=30, target_bytes=10, max_tokens=7)
    drawn_lines = [orjson.loads(line) for line in drawn.read_bytes().splitlines()]
    fixed_lines = [orjson.loads(line) for line in fixed.read_bytes().splitlines()]
    assert {line["body"]["max_tokens"] for line in fixed_lines} == {7}
    assert len({line["body"]["max_tokens"] for line in drawn_lines}) > 1
    for a, b in zip(drawn_lines, fixed_lines, strict=True):
        a["body"].pop("max_tokens"), b["body"].pop("max_tokens")
        assert a == b


@pytest.mark.parametrize("kwargs", [{"lines": 0}, {"lines": 1, "shared_prefixes": 0},
                                    {"lines": 1, "max_tokens": 0}])
def test_bad_arguments_raise(tmp_path: Path, kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        write_batch_file(tmp_path / "x", target_bytes=100, **kwargs)
