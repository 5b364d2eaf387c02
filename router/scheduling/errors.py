"""Errors of the scheduling framework: one root, one subclass per cause.

::

    SchedulingError                  root; never raised itself
    ├── ConfigError                  bad YAML / unknown plugin type / bad parameters / bad profile
    └── NoCandidatesError            the pool (after filters) is empty: nothing to route to

The router maps ``NoCandidatesError`` to 503 (no engine available); ``ConfigError`` only happens at
start-up, when the configuration is loaded.
"""

from __future__ import annotations


class SchedulingError(Exception):
    """Root of every error raised by ``router.scheduling``."""


class ConfigError(SchedulingError):
    """The scheduling configuration is invalid; the message names the plugin or profile at fault."""


class NoCandidatesError(SchedulingError):
    """No endpoint to pick from: the pool is empty, or the profile's filters removed every endpoint."""
