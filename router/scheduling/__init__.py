"""The router's scheduling framework: where a request goes, as pure code (no I/O).

Filters → weighted scorers → picker, configured from YAML in llm-d's shape; plugins keep llm-d's
names and parameters. See ``router/scheduling/README.md`` for the plugins and
``default-config.yaml`` for the default profile. Entry points:

* :func:`~router.scheduling.config.load_config` / :func:`~router.scheduling.config.build_scheduler`
* :class:`~router.scheduling.scheduler.Scheduler` (``schedule`` → ``pre_request`` →
  ``response_complete``)
* :func:`~router.scheduling.saturation.fleet_saturation` and
  :func:`~router.scheduling.saturation.gate_saturation` for flow control's per-engine gate
  (:func:`~router.scheduling.saturation.pool_saturation`: the mean, for display).
"""

from pathlib import Path

#: The shipped default config (spare-capacity filter, prefix-cache affinity filter, token-load 2,
#: queue 2, no-hit-lru 1, max-score picker, plus a ``round-robin`` baseline profile).
DEFAULT_CONFIG_PATH = Path(__file__).with_name("default-config.yaml")
#: The shipped prefill/decode config (``pd-profile-handler`` over a load-aware ``decode`` profile and
#: a prefix-aware ``prefill`` profile); the router's default when prefill engines are given.
PD_CONFIG_PATH = Path(__file__).with_name("pd-config.yaml")
