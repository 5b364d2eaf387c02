"""YAML config: round trip, building, clamping, and errors for bad configs."""

import math

import pytest
from scheduling_helpers import InMemoryPrefixIndex, endpoints, prompt, request, scheduler_from

from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import build_scheduler, dump_config, load_config, parse_config
from router.scheduling.errors import ConfigError, NoCandidatesError
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from router.scheduling.registry import builtin_factories


def test_default_config_round_trips_and_builds():
    config = load_config(DEFAULT_CONFIG_PATH)
    again = parse_config(dump_config(config))
    assert again == config
    scheduler = build_scheduler(again)
    assert list(scheduler.profiles) == ["default", "round-robin"]
    default = scheduler.profiles["default"]
    assert [f.name for f in default.filters] == [
        "spare-capacity-filter", "session-affinity-filter", "prefix-cache-affinity-filter"]
    assert [(s.name, w) for s, w in default.scorers] == [
        ("token-load-scorer", 2.0), ("queue-scorer", 2.0), ("no-hit-lru-scorer", 1.0)]
    assert default.picker.name == "max-score-picker"
    assert [p.name for p in default.producers] == ["approx-prefix-cache-producer"]
    assert scheduler.profiles["round-robin"].producers == []


def test_missing_producer_and_picker_are_created_with_defaults():
    scheduler, handle = scheduler_from("""
plugins:
- type: prefix-cache-scorer
schedulingProfiles:
- name: only
  plugins:
  - pluginRef: prefix-cache-scorer
""")
    profile = scheduler.profiles["only"]
    assert isinstance(handle.plugins["approx-prefix-cache-producer"], ApproxPrefixCacheProducer)
    assert profile.producers == [handle.plugins["approx-prefix-cache-producer"]]
    assert profile.picker.plugin_type == "max-score-picker"
    assert [s for s, _ in profile.scorers][0].name == "prefix-cache-scorer"


def test_named_instances_and_precise_producer_from_an_injected_index():
    scheduler, handle = scheduler_from("""
plugins:
- type: precise-prefix-cache-producer
  name: kv
  parameters: {tierWeights: {GPU: 1.0, CPU: 0.5}}
- type: prefix-cache-scorer
  name: precise
  parameters: {prefixMatchInfoProducerName: kv}
- type: weighted-random-picker
  name: pick
schedulingProfiles:
- name: p
  plugins: [{pluginRef: precise, weight: 2}, {pluginRef: pick}]
""", prefix_index=InMemoryPrefixIndex())
    profile = scheduler.profiles["p"]
    assert [p.name for p in profile.producers] == ["kv"]
    assert handle.plugins["kv"].params.tier_weights == {"gpu": 1.0, "cpu": 0.5}


class OutOfRangeScorer:
    plugin_type = "out-of-range"

    def __init__(self, name):
        self.name = name

    def score(self, state, req, eps):
        return [-1.0, 0.5, 2.0, math.nan]


def test_scores_are_clamped_to_unit_interval_before_weighting():
    factories = builtin_factories() | {"out-of-range": lambda name, raw, handle: OutOfRangeScorer(name)}
    config = parse_config("""
plugins: [{type: out-of-range}]
schedulingProfiles: [{name: p, plugins: [{pluginRef: out-of-range, weight: 2}]}]
""")
    scheduler = build_scheduler(config, PluginHandle(), factories)
    result = scheduler.schedule(request(), endpoints(4))
    assert result.scores["out-of-range"] == [0.0, 0.5, 1.0, 0.0]
    assert result.totals == [0.0, 1.0, 2.0, 0.0]
    assert result.endpoint.name == "http://e2"
    assert result.breakdown()["total"]["http://e1"] == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("plugins: [", "not valid YAML"),
        ("- just a list", "must be a YAML mapping"),
        ("plugins: []\nschedulingProfiles: []", "no schedulingProfiles"),
        ("plugins: [{type: queue-scorer}]\nschedulingProfile: []", "schedulingProfile"),
        ("plugins: [{type: fancy-scorer}]\nschedulingProfiles: [{name: p, plugins: []}]", "unknown type 'fancy-scorer'"),
        ("plugins: [{type: token-load-scorer, parameters: {queueThreshold: 5}}]\n"
         "schedulingProfiles: [{name: p, plugins: []}]", "queueThreshold"),
        ("plugins: [{type: token-load-scorer, parameters: {queueThresholdTokens: 0}}]\n"
         "schedulingProfiles: [{name: p, plugins: []}]", "queueThresholdTokens"),
        ("plugins: [{type: queue-scorer}, {type: queue-scorer}]\nschedulingProfiles: [{name: p, plugins: []}]",
         "used twice"),
        ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: p, plugins: [{pluginRef: kv}]}]",
         "'kv' is not a declared plugin"),
        ("plugins: [{type: max-score-picker}]\n"
         "schedulingProfiles: [{name: p, plugins: [{pluginRef: max-score-picker, weight: 2}]}]", "takes no weight"),
        ("plugins: [{type: max-score-picker}, {type: random-picker}]\n"
         "schedulingProfiles: [{name: p, plugins: [{pluginRef: max-score-picker}, {pluginRef: random-picker}]}]",
         "two pickers"),
        ("plugins: [{type: queue-scorer}]\n"
         "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer, weight: -1}]}]", "weight"),
        ("plugins: [{type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: nope}}]\n"
         "schedulingProfiles: [{name: p, plugins: []}]", "'nope', which is not declared"),
        ("plugins: [{type: precise-prefix-cache-producer}]\nschedulingProfiles: [{name: p, plugins: []}]",
         "needs a prefix index"),
        ("plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoints: 2}}]\n"
         "schedulingProfiles: [{name: p, plugins: []}]", "maxNumOfEndpoints"),
    ],
)
def test_bad_configs_raise_config_error_naming_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        build_scheduler(parse_config(text))


def test_an_empty_pool_raises_no_candidates():
    scheduler = build_scheduler(load_config(DEFAULT_CONFIG_PATH))
    with pytest.raises(NoCandidatesError):
        scheduler.schedule(request(prompt(1, 64)), [])


def test_weights_default_to_one():
    scheduler, _ = scheduler_from("""
plugins: [{type: queue-scorer}]
schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer}]}]
""")
    assert scheduler.profiles["p"].scorers[0][1] == 1.0
