"""The plugin's settings, read from the environment (vLLM's engine-core process inherits it).

``BACKFILL_BACKGROUND_PRIORITY_THRESHOLD`` (int): a request whose vLLM ``priority`` is at least this
is *background*; unset, every rule is off and the scheduler is vLLM's own. backfill's router sends
vLLM priority −100 for interactive, −10 for async and 10 for batch work (``router/parsing.py``
``engine_priority``), and its engines use −10 (``engine_twin/launch.py``
``BACKGROUND_PRIORITY_THRESHOLD``), so async and batch are background.

``BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS`` (int ≥ 0, default 512): the prefill tokens all background
requests together may take in one step; the engine twin's ``--max-background-prefill-tokens``, same
meaning and default (``engine_twin/core.py``, item 4).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

THRESHOLD_ENV = "BACKFILL_BACKGROUND_PRIORITY_THRESHOLD"
MAX_PREFILL_ENV = "BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS"
DEFAULT_MAX_BACKGROUND_PREFILL_TOKENS = 512
"""The engine twin's default for ``--max-background-prefill-tokens``."""


@dataclass(frozen=True)
class BackfillConfig:
    """``background_priority_threshold``: None = rules off. ``max_background_prefill_tokens``: tokens
    per step, all background prefill chunks together."""

    background_priority_threshold: int | None = None
    max_background_prefill_tokens: int = DEFAULT_MAX_BACKGROUND_PREFILL_TOKENS

    def is_background(self, priority: int) -> bool:
        """Whether a request of vLLM ``priority`` is background (always False when the rules are off)."""
        threshold = self.background_priority_threshold
        return threshold is not None and priority >= threshold


def _int_env(environ: dict[str, str] | os._Environ[str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def load_config(environ: dict[str, str] | os._Environ[str] | None = None) -> BackfillConfig:
    """The settings from ``environ`` (default ``os.environ``).

    Raises ValueError naming the variable when a value is not an integer, or when
    ``BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS`` is negative."""
    env = os.environ if environ is None else environ
    threshold = _int_env(env, THRESHOLD_ENV)
    tokens = _int_env(env, MAX_PREFILL_ENV)
    if tokens is None:
        tokens = DEFAULT_MAX_BACKGROUND_PREFILL_TOKENS
    if tokens < 0:
        raise ValueError(f"{MAX_PREFILL_ENV}={tokens} must be >= 0")
    return BackfillConfig(threshold, tokens)
