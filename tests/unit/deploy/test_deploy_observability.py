"""deploy/prometheus/alerts.yaml and deploy/grafana/backfill.json: every expression parses as PromQL
and uses only documented series (docs/observability.md + the contract in deploy/README.md), and
every documented router/engine series is registered in the code."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest
import yaml

from conftest import DEPLOY, REPO

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "backfill.json"
NAME = re.compile(r"`((?:backfill_|vllm:)[a-z0-9_:]+|up)`")
#: what the brief asks the alerts to cover, as the series each needs
REQUIRED_ALERT_SERIES = {
    "stuck batches": {"backfill_gateway_batches", "backfill_worker_requests_collected_total"},
    "shed rate": {"backfill_router_shed_total"},
    "saturation pinned": {"backfill_router_pool_saturation"},
    "dead letters": {"backfill_processor_shed_total"},
    "worker failures": {"backfill_worker_tasks_total"},
    "engine down": {"up"},
}


def documented_series() -> set[str]:
    readme = (DEPLOY / "README.md").read_text()
    contract = readme[readme.index("## Metrics contract"):]
    contract = contract[:contract.find("\n## ", 1)]
    return set(NAME.findall(contract)) | set(NAME.findall((REPO / "docs" / "observability.md").read_text()))


def selectors(expr: str) -> set[str]:
    """Metric names of every vector selector in a PromQL expression (raises on a parse error)."""
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)
        for attr in ("expr", "lhs", "rhs", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None:
                visit(child)
        for child in getattr(node, "args", None) or []:
            visit(child)
        param = getattr(node, "param", None)
        if param is not None:
            visit(param)

    visit(promql_parser.parse(expr))
    return names


def base_name(series: str) -> str:
    """The documented name of a histogram's sample series."""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    return [t["expr"] for p in panels for t in p["targets"]]


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")


def test_selector_extraction_sees_every_metric():
    expr = 'sum by (band) (rate(a_total{band="x"}[5m])) / (sum(rate(b_total[5m])) or vector(0)) and ' \
           'histogram_quantile(0.9, sum by (le) (rate(c_bucket[5m]))) and topk(3, d) and -e'
    assert selectors(expr) == {"a_total", "b_total", "c_bucket", "d", "e"}
    with pytest.raises(Exception):
        selectors("sum(rate(a[5m])")


def test_contract_lists_the_series_the_brief_names():
    names = documented_series()
    assert {"backfill_router_pool_saturation", "backfill_router_shed_total", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total", "up"} <= names


def test_every_alert_parses_and_uses_documented_series():
    documented, rules = documented_series(), alert_rules()
    assert len(rules) >= 6
    used: set[str] = set()
    for rule in rules:
        assert rule["alert"] and rule["expr"].strip() and rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        names = {base_name(n) for n in selectors(rule["expr"])}
        assert names <= documented, f"{rule['alert']}: undocumented {names - documented}"
        used |= names
    for topic, series in REQUIRED_ALERT_SERIES.items():
        assert series <= used, topic


def test_dashboard_panels_all_have_parsable_targets_on_documented_series():
    dashboard = json.loads(DASHBOARD.read_text())
    documented = documented_series()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert len(panels) >= 10
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            names = {base_name(n) for n in selectors(grafana_to_promql(target["expr"]))}
            assert names and names <= documented, f"{panel['title']}: undocumented {names - documented}"
    used = {base_name(n) for e in dashboard_exprs() for n in selectors(grafana_to_promql(e))}
    # saturation, throughput, lanes, shed, batch counts, engine KV use and prefix hit rate
    assert {"backfill_router_pool_saturation", "backfill_router_dispatched_total", "backfill_processor_held_requests",
            "backfill_router_shed_total", "backfill_gateway_batches", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} <= used
    assert [v["type"] for v in dashboard["templating"]["list"]] == ["datasource"]


def test_contract_names_are_registered_in_the_code():
    """Router and engine series of the contract exist in router/ (the simulator reproduces vLLM's
    names); counters are registered without their _total suffix."""
    source = "\n".join(p.read_text() for p in (REPO / "router").rglob("*.py"))
    names = documented_series() - set(NAME.findall((REPO / "docs" / "observability.md").read_text()))
    assert names  # the router's and the engines' series
    for name in sorted(names - {"up"}):
        assert f'"{name.removesuffix("_total")}"' in source, name
