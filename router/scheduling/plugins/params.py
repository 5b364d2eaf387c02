"""Typed plugin parameters: YAML ``parameters`` maps validated into pydantic models.

Parameter keys in YAML are llm-d's camelCase (``queueThresholdTokens``); the models use snake_case
fields with a camelCase alias. Unknown keys are an error (a typo must not silently fall back to a
default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from common.validation import describe
from router.scheduling.errors import ConfigError


class PluginParams(BaseModel):
    """Base of every plugin's parameter model: camelCase keys, unknown keys rejected, frozen."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


P = TypeVar("P", bound=PluginParams)


def parse_params(model: type[P], plugin_name: str, raw: Mapping[str, Any] | None) -> P:
    """Validate ``raw`` (the YAML ``parameters`` map, or None) into ``model``.

    Raises:
        ConfigError: naming the plugin instance and every bad or unknown key.
    """
    try:
        return model.model_validate(dict(raw or {}))
    except ValidationError as exc:
        raise ConfigError(f"plugin {plugin_name!r}: bad parameters: {describe(exc, '(parameters)')}") from None
