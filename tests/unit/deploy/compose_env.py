"""The environment Docker Compose gives a service of deploy/compose.yaml: its ``environment``
(anchors and ``<<`` merges resolved by the YAML loader) with Compose's interpolation applied —
``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}`` / ``${VAR-default}`` and ``${VAR:?error}`` /
``${VAR?error}`` (the Compose Specification's "Interpolation" section)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

INTERPOLATION = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


class MissingVariable(ValueError):
    """A ``${VAR:?error}`` / ``${VAR?error}`` whose variable is unset (or empty, with the colon)."""


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """``value`` with every ``$…`` reference replaced from ``environ`` as Compose does; raises
    :class:`MissingVariable` for a required variable that is missing."""

    def substitute(match: re.Match) -> str:
        if match[0] == "$$":
            return "$"
        name, op, arg = match["name"] or match["bare"], match["op"] or "", match["arg"] or ""
        current = environ.get(name)
        missing = current is None or (op.startswith(":") and current == "")
        if op.endswith("?") and missing:
            raise MissingVariable(f"{name}: {arg}")
        if op.endswith("-") and missing:
            return arg
        return current or ""

    return INTERPOLATION.sub(substitute, value)


def service_environment(compose: dict[str, Any], service: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``service`` runs with, given the shell environment ``environ``."""
    environment = compose["services"][service].get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: interpolate(str(value), environ) for key, value in environment.items()}
