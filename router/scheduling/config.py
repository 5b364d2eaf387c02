"""Declarative scheduling config: YAML in llm-d's ``EndpointPickerConfig`` shape → a Scheduler.

::

    plugins:                        # plugin instances
    - type: prefix-cache-scorer     # registered type (router/scheduling/registry.py)
      name: prefix                  # instance name; defaults to the type
      parameters: {...}             # the type's parameters (camelCase, as llm-d)
    schedulingProfiles:             # the first profile is the default
    - name: default
      plugins:
      - pluginRef: prefix           # an instance name
        weight: 3                   # scorers only; default 1

Building (:func:`build_scheduler`) follows llm-d's conventions: a role is inferred from what the
instance implements (producer, filter, scorer, picker); a profile without a picker gets a
``max-score-picker``; a consumer of prefix matches whose producer is not declared gets one created
with default parameters when the producer's name is its type (``approx-prefix-cache-producer``),
and the producers a profile's plugins read run first in that profile. ``apiVersion`` and ``kind``
are accepted and kept, not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from common.validation import describe
from router.scheduling.errors import ConfigError
from router.scheduling.interfaces import DataProducer, Filter, Picker, PluginHandle, ProfileHandler, Scorer
from router.scheduling.plugins.pickers import MAX_SCORE_PICKER_TYPE
from router.scheduling.registry import PluginFactory, builtin_factories
from router.scheduling.scheduler import Scheduler, SchedulerProfile


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PluginSpec(_Model):
    """One plugin instance: ``type``, optional ``name`` (defaults to the type), ``parameters``."""

    type: str
    name: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def instance_name(self) -> str:
        """The instance name (``name`` or, when absent, ``type``)."""
        return self.name or self.type


class ProfilePluginRef(_Model):
    """A plugin used by a profile: ``pluginRef`` (instance name), ``weight`` (scorers only)."""

    plugin_ref: str
    weight: float | None = Field(None, ge=0.0)


class ProfileSpec(_Model):
    """A scheduling profile: ``name`` and its plugin references."""

    name: str
    plugins: list[ProfilePluginRef]


class SchedulerConfig(_Model):
    """The whole file (llm-d ``EndpointPickerConfig``)."""

    api_version: str | None = None
    kind: str | None = None
    plugins: list[PluginSpec] = Field(default_factory=list)
    scheduling_profiles: list[ProfileSpec] = Field(default_factory=list)


def parse_config(text: str) -> SchedulerConfig:
    """Parse YAML text into a :class:`SchedulerConfig`.

    Raises:
        ConfigError: not YAML, not a mapping, or not the expected shape (message says where).
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"scheduling config is not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError("scheduling config must be a YAML mapping with 'plugins' and 'schedulingProfiles'")
    try:
        return SchedulerConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"scheduling config: {describe(exc, 'config')}") from None


def load_config(path: str | Path) -> SchedulerConfig:
    """Read and parse the YAML file at ``path`` (see :func:`parse_config`; OSError if unreadable)."""
    return parse_config(Path(path).read_text())


def dump_config(config: SchedulerConfig) -> str:
    """The config as YAML with llm-d's camelCase keys; ``parse_config(dump_config(c)) == c``."""
    data = config.model_dump(by_alias=True, exclude_none=True)
    text: str = yaml.safe_dump(data, sort_keys=False)
    return text


def build_scheduler(
    config: SchedulerConfig,
    handle: PluginHandle | None = None,
    factories: Mapping[str, PluginFactory] | None = None,
) -> Scheduler:
    """Instantiate the config's plugins and profiles.

    Args:
        config: the parsed config.
        handle: shared dependencies (rng, clock, precise prefix index); a fresh default when None.
        factories: type name → factory; :func:`builtin_factories` when None.

    Raises:
        ConfigError: unknown type, duplicate instance name, bad parameters, unknown ``pluginRef``,
            weight on a non-scorer, two pickers in a profile, a plugin playing no role, no profile,
            or a missing producer that cannot be created.
    """
    handle = handle or PluginHandle()
    factories = builtin_factories() if factories is None else factories
    plugins = handle.plugins

    def create(type_name: str, name: str, params: Mapping[str, Any] | None) -> object:
        factory = factories.get(type_name)
        if factory is None:
            raise ConfigError(f"plugin {name!r}: unknown type {type_name!r}; known: {', '.join(sorted(factories))}")
        if name in plugins:
            raise ConfigError(f"plugin name {name!r} is used twice")
        instance = factory(name, params, handle)
        plugins[name] = instance
        return instance

    for spec in config.plugins:
        create(spec.type, spec.instance_name, spec.parameters)
    for instance in list(plugins.values()):
        for dep_name, dep_type in getattr(instance, "requires", {}).items():
            if dep_name not in plugins:
                if dep_name != dep_type:
                    raise ConfigError(f"plugin {instance.name!r} refers to {dep_name!r}, which is not declared")  # type: ignore[attr-defined]
                create(dep_type, dep_name, None)

    if not config.scheduling_profiles:
        raise ConfigError("scheduling config has no schedulingProfiles")
    profiles: dict[str, SchedulerProfile] = {}
    for profile_spec in config.scheduling_profiles:
        if profile_spec.name in profiles:
            raise ConfigError(f"profile name {profile_spec.name!r} is used twice")
        profiles[profile_spec.name] = _build_profile(profile_spec, plugins, create)
    handlers = [p for p in plugins.values() if isinstance(p, ProfileHandler)]
    if len(handlers) > 1:
        raise ConfigError(f"two profile handlers ({handlers[0].name!r} and {handlers[1].name!r})")
    for handler in handlers:
        handler.bind(profiles)
    return Scheduler(profiles, handlers[0] if handlers else None)


def _build_profile(spec: ProfileSpec, plugins: dict[str, object], create: Any) -> SchedulerProfile:
    wanted_producers: set[str] = set()
    filters: list[Filter] = []
    scorers: list[tuple[Scorer, float]] = []
    picker: Picker | None = None
    where = f"profile {spec.name!r}"
    for ref in spec.plugins:
        instance = plugins.get(ref.plugin_ref)
        if instance is None:
            raise ConfigError(f"{where}: pluginRef {ref.plugin_ref!r} is not a declared plugin")
        roles = 0
        if isinstance(instance, DataProducer):
            wanted_producers.add(ref.plugin_ref)
            roles += 1
        if isinstance(instance, Filter):
            filters.append(instance)
            roles += 1
        if isinstance(instance, Scorer):
            scorers.append((instance, 1.0 if ref.weight is None else ref.weight))
            roles += 1
        elif ref.weight is not None:
            raise ConfigError(f"{where}: {ref.plugin_ref!r} is not a scorer and takes no weight")
        if isinstance(instance, Picker):
            if picker is not None:
                raise ConfigError(f"{where}: two pickers ({picker.name!r} and {ref.plugin_ref!r})")  # type: ignore[attr-defined]
            picker = instance
            roles += 1
        if roles == 0:
            raise ConfigError(f"{where}: {ref.plugin_ref!r} plays no scheduling role"
                              + (" (a profile handler is declared in plugins only)"
                                 if isinstance(instance, ProfileHandler) else ""))
        wanted_producers.update(getattr(instance, "requires", {}))
    if picker is None:
        existing = plugins.get(MAX_SCORE_PICKER_TYPE)
        picker = existing if isinstance(existing, Picker) else create(MAX_SCORE_PICKER_TYPE, f"{spec.name}/{MAX_SCORE_PICKER_TYPE}", None)
    producers = [p for name, p in plugins.items() if name in wanted_producers]  # declaration order
    return SchedulerProfile(spec.name, producers, filters, scorers, picker)  # type: ignore[arg-type]
