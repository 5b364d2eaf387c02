"""Unit tests for the custom_id check of ``backfill bench end-to-end``."""

from __future__ import annotations

import orjson

from lab.bench.end_to_end import check_custom_ids


def _lines(*ids: str) -> list[bytes]:
    return [orjson.dumps({"custom_id": cid, "response": None, "error": None}) for cid in ids]


def test_each_id_once_has_no_problems() -> None:
    assert check_custom_ids(_lines("request-2", "request-1", "request-3") + [b""], 3) == (3, 3, [])


def test_missing_doubled_and_unknown_ids_are_named() -> None:
    lines, distinct, problems = check_custom_ids(_lines("request-1", "request-1", "request-9"), 3)
    assert (lines, distinct) == (3, 2)
    assert len(problems) == 3
    assert problems[0].startswith("2 missing") and "request-2" in problems[0]
    assert problems[1].startswith("1 more than once") and "request-1" in problems[1]
    assert problems[2].startswith("1 unknown") and "request-9" in problems[2]
