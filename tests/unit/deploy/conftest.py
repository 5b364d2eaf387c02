"""Fixtures of the deploy/ tests: every Kustomize overlay rendered once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deploy_render import render

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if (p / "kustomization.yaml").exists())


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Overlay name -> its rendered objects, plus ``base``."""
    out = {name: render(DEPLOY / "k8s" / "overlays" / name) for name in OVERLAYS}
    out["base"] = render(DEPLOY / "k8s" / "base")
    return out


def settings_from(settings_class, prefix: str, env: dict[str, str]):
    """``settings_class`` built from the ``prefix``-ed variables of ``env`` passed as field values
    (only those: the test process' own environment stays out)."""
    return settings_class(**{k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)})
