"""How error messages name a JSON value's type, the way OpenAI's do ("expected a string, but got
an integer instead")."""

from __future__ import annotations

from typing import Any


def json_type_name(value: Any) -> str:
    """``"null"``, ``"a boolean"``, ``"an integer"``, ``"a number"``, ``"a string"``, ``"an array"``
    or ``"an object"`` for a value parsed from JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
