"""One line from a pydantic ``ValidationError``, for usage errors and config errors."""

from __future__ import annotations

from pydantic import ValidationError


def describe(exc: ValidationError, whole: str = "settings") -> str:
    """``"loc.path: message; other.loc: message"``, every error of ``exc``; an error about the
    whole model (no location) is named ``whole``."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in exc.errors())
