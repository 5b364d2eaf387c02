"""Fixtures of the deploy/ tests: every Kustomize overlay rendered once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
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
    (only those: the test process' own environment stays out); a list or dict field's value is
    JSON, as pydantic-settings reads it from the environment."""
    import json
    import typing

    def value(name: str, raw: str):
        field = settings_class.model_fields.get(name)
        complex_ = field is not None and typing.get_origin(field.annotation) in (list, dict)
        return json.loads(raw) if complex_ and isinstance(raw, str) else raw

    return settings_class(**{(name := k.removeprefix(prefix).lower()): value(name, v) for k, v in env.items()
                             if k.startswith(prefix)})


#: variables of the test process that must not leak into settings built from a deploy environment
FOREIGN_ENV = {"DATABASE_URL", "REDIS_URL", "PUBSUB_EMULATOR_HOST"}
#: the stores' URLs, Secrets the operator creates (absent from the production overlay)
STORE_FALLBACK = {"DATABASE_URL": "postgresql://u:p@db/backfill", "REDIS_URL": "redis://redis:6379/0"}


def settings_under_env(build: Callable[[], Any], env: dict[str, str], monkeypatch) -> Any:
    """``build()`` (a settings class or ``router.settings.build_settings``) run with exactly ``env``
    as its ``BACKFILL_*`` / store variables (the test process' own are removed meanwhile), so
    aliases and environment-only parsing apply as in the service."""
    with monkeypatch.context() as patch:
        for key in list(os.environ):
            if key.startswith("BACKFILL_") or key in FOREIGN_ENV:
                patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        return build()
