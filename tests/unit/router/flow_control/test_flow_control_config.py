"""Flow-control config: defaults, YAML loading, and clear errors."""

from __future__ import annotations

import pytest

from router.flow_control import ConfigError, FlowControlConfig


def test_defaults_are_the_documented_bands():
    cfg = FlowControlConfig()
    rows = [(b.objective, b.priority, b.sheddable, b.bypass_saturation, b.max_in_flight, b.ttl_s) for b in cfg.bands]
    # the processor's sheddable work never queues in the router; a flex client waits up to 600 s
    assert rows == [("interactive", 100, False, True, 64, 30.0), ("async", 10, True, False, None, 0.0),
                    ("flex", 0, True, False, None, 600.0), ("batch", -10, True, False, None, 0.0)]
    assert cfg.default_objective == "interactive" and cfg.eviction is False and cfg.poll_interval_s == 0.01
    assert cfg.band("unknown").objective == "interactive" and cfg.band(None).objective == "interactive"
    assert FlowControlConfig.from_yaml("") == cfg


def test_yaml_round_trip_and_overrides():
    cfg = FlowControlConfig.from_yaml("""
default_objective: batch
eviction: true
poll_interval_s: 0.05
bands:
- {objective: interactive, priority: 5, bypass_saturation: true, max_in_flight: 8}
- {objective: batch, priority: -1, ttl_s: 120, max_queued_bytes: 1000, tenant_max_in_flight: 3,
   tenant_max_queued: 10, sheddable: true}
""")
    assert cfg.band("nope").objective == "batch" and cfg.band("batch").tenant_max_in_flight == 3
    assert cfg.band("batch").max_queued_requests == 10_000  # unspecified fields keep their defaults
    assert FlowControlConfig.from_mapping(cfg.model_dump()) == cfg


@pytest.mark.parametrize("text, fragment", [
    ("bands: [{objective: a, priority: 1}, {objective: a, priority: 2}]\ndefault_objective: a", "duplicate band objective"),
    ("bands: [{objective: a, priority: 1}, {objective: b, priority: 1}]\ndefault_objective: a", "duplicate band priority"),
    ("bands: [{objective: a, priority: 1}]", "default_objective 'interactive'"),
    ("bands: [{objective: a, priority: 1, bypass_saturation: true}]\ndefault_objective: a", "max_in_flight"),
    ("bands: [{objective: a, priority: 1, max_queued_bytes: -1}]\ndefault_objective: a", "max_queued_bytes"),
    ("bands: [{objective: a, priority: 1, colour: red}]\ndefault_objective: a", "colour"),
    ("bands: []", "bands"),
    ("poll_interval_s: 0", "poll_interval_s"),
    ("- just a list", "must be a mapping"),
    ("bands: [", "not valid YAML"),
])
def test_invalid_configs_raise_config_error_naming_the_fault(text, fragment):
    with pytest.raises(ConfigError) as exc:
        FlowControlConfig.from_yaml(text)
    assert fragment in str(exc.value)
    assert isinstance(exc.value, ValueError)
