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
    "gateway 5xx ratio": {"backfill_gateway_http_requests_total"},
    "gateway latency": {"backfill_gateway_http_request_duration_seconds"},
}
#: samples that count a user's mistake (a bad file, a bad request): metric -> (label, predicate on its value)
USER_ERROR_SAMPLES = {
    "backfill_gateway_http_requests_total": ("status", lambda v: v == "4xx"),
    "backfill_gateway_http_request_duration_seconds_bucket": ("status", lambda v: v == "4xx"),
    "backfill_gateway_http_request_duration_seconds_count": ("status", lambda v: v == "4xx"),
    "backfill_processor_router_request_duration_seconds_bucket": ("status", lambda v: v == "4xx"),
    "backfill_router_requests_total": ("code", lambda v: v.startswith("4")),
    "backfill_worker_batches_validated_total": ("status", lambda v: v == "failed"),
    "backfill_processor_results_total": ("error_code", lambda v: v == "INVALID_REQUEST"),
    "backfill_processor_shed_total": ("reason", lambda v: v == "invalid"),
}
#: a value of each label above that is a user's mistake, to test matchers against
USER_ERROR_VALUES = {"status": ("4xx", "failed"), "code": ("400", "404", "422", "429"),
                     "error_code": ("INVALID_REQUEST",), "reason": ("invalid",)}


def contract_text() -> str:
    readme = (DEPLOY / "README.md").read_text()
    contract = readme[readme.index("## Metrics contract"):]
    return contract[:contract.find("\n## ", 1)]


def documented_series() -> set[str]:
    return set(NAME.findall(contract_text())) | set(NAME.findall((REPO / "docs" / "observability.md").read_text()))


def contract_list(heading: str) -> set[str]:
    """The series of the bullet list after the contract's bold ``heading`` paragraph."""
    section = contract_text().split(f"**{heading}**", 1)[1].split("\n**", 1)[0]
    return {NAME.match(line[2:])[1] for line in section.splitlines() if line.startswith("- `")}


GLOBAL_GAUGES = contract_list("Global gauges")
ABSENT_UNTIL_FIRST_EVENT = contract_list("Absent until the first event")
#: labels that keep one replica's series apart (ServiceMonitor targets carry both)
REPLICA_LABELS = {"pod", "instance"}
ARITHMETIC = {"+", "-", "*", "/", "%", "^", "atan2"}
COMPARISON = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">": lambda a, b: a > b,
              "<": lambda a, b: a < b, ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}


def children(node) -> list:
    """The sub-expressions of a parsed PromQL node (operands, arguments, aggregation parameter)."""
    out = [getattr(node, attr, None) for attr in ("expr", "lhs", "rhs", "vector_selector", "param")]
    return [child for child in out + list(getattr(node, "args", None) or []) if child is not None]


def walk(node):
    """``node`` and every node below it."""
    yield node
    for child in children(node):
        yield from walk(child)


def selectors(expr: str) -> set[str]:
    """Metric names of every vector selector in a PromQL expression (raises on a parse error)."""
    names: set[str] = set()
    for node in walk(promql_parser.parse(expr)):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)
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
    with pytest.raises(Exception):  # noqa: B017 - the parser's error type is not part of its API
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
    """Router and engine series of the contract exist in router/ and engine_twin/ (the simulator
    reproduces vLLM's names); counters are registered without their _total suffix."""
    source = "\n".join(p.read_text() for d in ("router", "engine_twin") for p in (REPO / d).rglob("*.py"))
    names = documented_series() - set(NAME.findall((REPO / "docs" / "observability.md").read_text()))
    assert names  # the router's and the engines' series
    for name in sorted(names - {"up"}):
        assert f'"{name.removesuffix("_total")}"' in source, name


def sums_over_replicas(expr: str, gauges: set[str]) -> list[str]:
    """``sum`` aggregations in ``expr`` that add up replicas' copies of one of ``gauges``: a gauge
    reached with no aggregation in between, and no replica label kept (``by (pod)``)."""
    out = []

    def direct(node) -> set[str]:
        if isinstance(node, promql_parser.VectorSelector):
            return {node.name} & gauges
        if isinstance(node, promql_parser.AggregateExpr):
            return set()
        return set().union(*(direct(child) for child in children(node)))

    for node in walk(promql_parser.parse(expr)):
        if isinstance(node, promql_parser.AggregateExpr) and str(node.op) == "sum":
            modifier = node.modifier
            keeps_replica = modifier is not None and modifier.type == promql_parser.AggModifierType.By \
                and REPLICA_LABELS & set(modifier.labels)
            found = direct(node.expr)
            if found and not keeps_replica:
                out.append(f"{node}: sums {sorted(found)}")
    return out


def absent_reads(expr: str, series: set[str], *, panel: bool) -> list[str]:
    """Places in ``expr`` where one of ``series`` (no sample before its first event) missing would
    change the answer, because it is not read as 0 by an ``or`` fallback: anywhere in a panel (it
    would say "No data"); in an alert, an operand of vector arithmetic, the right of a vector
    comparison or of ``and``, the left of a comparison other than ``>`` (0 > x never holds for
    rates), and the operand of a comparison with a number that 0 satisfies (``== 0``)."""

    def unguarded(node) -> set[str]:
        if isinstance(node, promql_parser.BinaryExpr) and str(node.op) == "or":
            return set()
        if isinstance(node, promql_parser.VectorSelector):
            return {node.name} & series
        return set().union(*(unguarded(child) for child in children(node)))

    root = promql_parser.parse(expr)
    if panel:
        return [f"{expr}: {sorted(unguarded(root))}"] if unguarded(root) else []
    out = []
    for node in walk(root):
        if not isinstance(node, promql_parser.BinaryExpr):
            continue
        op, lhs, rhs = str(node.op), node.lhs, node.rhs
        numbers = [isinstance(side, promql_parser.NumberLiteral) for side in (lhs, rhs)]
        must = []
        if op in ARITHMETIC and not any(numbers):
            must = [lhs, rhs]
        elif op == "and":
            must = [rhs]
        elif op in COMPARISON and not any(numbers):
            must = [rhs] if op == ">" else [lhs, rhs]
        elif op in COMPARISON and numbers[1] and COMPARISON[op](0, rhs.val):
            must = [lhs]
        for side in must:
            if unguarded(side):
                out.append(f"{side} (in {op}): {sorted(unguarded(side))} read without a fallback")
    return out


def test_contract_lists_global_gauges_and_late_series():
    documented = documented_series()
    assert {"backfill_gateway_batches", "backfill_router_pool_saturation"} <= GLOBAL_GAUGES <= documented
    assert {"backfill_router_shed_total", "backfill_router_dispatched_total"} <= ABSENT_UNTIL_FIRST_EVENT <= documented


def test_the_checks_find_the_reviewed_mistakes():
    """The expressions shipped before the review fail; their fixed forms pass."""
    assert sums_over_replicas('sum(backfill_gateway_batches{status="in_progress"}) > 0', GLOBAL_GAUGES)
    assert sums_over_replicas("sum by (status) (backfill_gateway_batches)", GLOBAL_GAUGES)
    assert not sums_over_replicas("max by (status) (backfill_gateway_batches)", GLOBAL_GAUGES)
    assert not sums_over_replicas("sum by (pod) (backfill_router_endpoint_healthy)", GLOBAL_GAUGES)
    assert not sums_over_replicas("sum(max by (endpoint) (backfill_router_endpoint_healthy))", GLOBAL_GAUGES)
    late = ABSENT_UNTIL_FIRST_EVENT
    shed = "sum by (band, reason) (rate(backfill_router_shed_total[5m]))"
    assert absent_reads(shed, late, panel=True)
    assert not absent_reads(shed + " or vector(0)", late, panel=True)
    ratio = ("sum(rate(backfill_router_shed_total[5m])) / (sum(rate(backfill_router_shed_total[5m]))"
             " + sum(rate(backfill_router_dispatched_total[5m]))) > 0.01")
    assert absent_reads(ratio, late, panel=False)
    assert not absent_reads("sum(rate(backfill_router_shed_total[5m])) > 0", late, panel=False)
    assert absent_reads("sum(rate(backfill_router_shed_total[5m])) == 0", late, panel=False)


def test_no_alert_or_panel_sums_replicas_of_a_global_gauge():
    exprs = [rule["expr"] for rule in alert_rules()] + [grafana_to_promql(e) for e in dashboard_exprs()]
    assert [problem for expr in exprs for problem in sums_over_replicas(expr, GLOBAL_GAUGES)] == []


def test_series_absent_until_their_first_event_read_as_zero():
    problems = [p for rule in alert_rules() for p in absent_reads(rule["expr"], ABSENT_UNTIL_FIRST_EVENT, panel=False)]
    problems += [p for e in dashboard_exprs()
                 for p in absent_reads(grafana_to_promql(e), ABSENT_UNTIL_FIRST_EVENT, panel=True)]
    assert problems == []


def test_no_healthy_engine_counts_a_router_that_found_no_engine():
    """A router with an empty pool has no backfill_router_endpoint_healthy series at all; the alert
    reads it as 0 healthy through a per-router fallback on a series every router has."""
    rule = next(r for r in alert_rules() if r["alert"] == "BackfillNoHealthyEngine")
    root = promql_parser.parse(rule["expr"])
    assert str(root.op) == "==" and root.rhs.val == 0
    guard = root.lhs.expr if isinstance(root.lhs, promql_parser.ParenExpr) else root.lhs
    assert str(guard.op) == "or"
    assert selectors(str(guard.rhs)) == {"backfill_router_pool_saturation"}
    assert set(guard.rhs.rhs.modifier.labels) == {"pod"} == set(guard.lhs.modifier.labels)


def matches(matcher, value: str) -> bool:
    """Whether one PromQL label matcher selects ``value`` (regular expressions are anchored)."""
    op = str(matcher.op)
    if op.endswith("NotEqual"):
        return value != matcher.value
    if op.endswith("NotRe"):
        return re.fullmatch(matcher.value, value) is None
    if op.endswith("Re"):
        return re.fullmatch(matcher.value, value) is not None
    return value == matcher.value


def user_error_reads(expr: str) -> list[str]:
    """Selectors in ``expr`` that can read a sample of :data:`USER_ERROR_SAMPLES` anywhere but in
    the denominator (right of ``/``) of a ratio."""
    out = []

    def visit(node, denominator: bool) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name in USER_ERROR_SAMPLES and not denominator:
            label, is_error = USER_ERROR_SAMPLES[node.name]
            wanted = [m for m in node.matchers.matchers if m.name == label]
            if any(is_error(v) and all(matches(m, v) for m in wanted) for v in USER_ERROR_VALUES[label]):
                out.append(str(node))
        if isinstance(node, promql_parser.BinaryExpr) and str(node.op) == "/":
            visit(node.lhs, denominator)
            visit(node.rhs, True)
            return
        for child in children(node):
            visit(child, denominator)

    visit(promql_parser.parse(expr), False)
    return out


def test_user_error_check_finds_what_would_page_on_a_bad_file():
    assert user_error_reads('sum(rate(backfill_gateway_http_requests_total{status=~"4xx|5xx"}[5m])) > 1')
    assert user_error_reads("sum(rate(backfill_gateway_http_requests_total[5m])) > 100")
    assert user_error_reads('increase(backfill_worker_batches_validated_total{status="failed"}[1h]) > 0')
    assert user_error_reads('rate(backfill_processor_results_total{error_code!="none"}[5m]) > 0')
    assert user_error_reads('rate(backfill_router_requests_total{code=~"4.."}[5m]) > 0')
    assert not user_error_reads('sum(rate(backfill_gateway_http_requests_total{status="5xx"}[5m])) / '
                                'sum(rate(backfill_gateway_http_requests_total[5m])) > 0.05')
    assert not user_error_reads('rate(backfill_gateway_http_request_duration_seconds_bucket{status!="4xx"}[5m])')
    assert not user_error_reads('rate(backfill_router_requests_total{code=~"5.."}[5m]) > 0')


def test_a_users_bad_file_pages_no_one():
    """Critical (paging) rules never read 4xx answers, validation failures or invalid lines, except
    as the denominator of a ratio; rules that do read them are warnings."""
    paging = [rule for rule in alert_rules() if rule["labels"]["severity"] == "critical"]
    assert paging
    assert {rule["alert"]: user_error_reads(rule["expr"]) for rule in paging} == {r["alert"]: [] for r in paging}


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of the Markdown headings in ``text`` (lower case, spaces to '-', punctuation
    other than '-' and '_' dropped)."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_paging_and_gateway_alert_links_its_runbook():
    anchors = {"docs/observability.md": heading_anchors((REPO / "docs" / "observability.md").read_text()),
               "deploy/README.md": heading_anchors((DEPLOY / "README.md").read_text())}
    rules = [r for r in alert_rules() if r["labels"]["severity"] == "critical" or "Gateway" in r["alert"]]
    assert {"BackfillGatewayErrors", "BackfillGatewaySlow"} <= {r["alert"] for r in rules}
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path in anchors and anchor in anchors[path], f"{rule['alert']}: runbook_url {url!r}"
        assert rule["alert"].lower() in anchor, f"{rule['alert']}: {url} is another alert's runbook"


def test_dashboard_shows_the_gateway_the_lanes_and_tenants():
    used = {base_name(n) for e in dashboard_exprs() for n in selectors(grafana_to_promql(e))}
    assert {"backfill_gateway_http_requests_total", "backfill_gateway_http_request_duration_seconds",
            "backfill_gateway_lane_backlog_messages", "backfill_gateway_lane_oldest_age_seconds",
            "backfill_worker_tenant_tokens_total"} <= used
    quantiles = [e for e in dashboard_exprs() if "backfill_gateway_http_request_duration_seconds_bucket" in e]
    assert {q for e in quantiles for q in re.findall(r"histogram_quantile\((0\.\d+)", e)} == {"0.5", "0.95", "0.99"}


ROUTER_REASON_SERIES = ("backfill_router_refused_total", "backfill_router_shed_total")


def reasons_read(expr: str) -> dict[str, set[str]]:
    """For each of the router's two reason-labelled series, the reasons (as labels) its selectors
    in ``expr`` can read: ``backfill_router_refused_total`` carries the backpressure reasons,
    ``backfill_router_shed_total`` the others (each reason in exactly one)."""
    from common.contracts.router_state import BACKPRESSURE_REASONS, SHED_REASONS

    labels = {"backfill_router_refused_total": set(BACKPRESSURE_REASONS),
              "backfill_router_shed_total": set(SHED_REASONS)}
    read: dict[str, set[str]] = {name: set() for name in ROUTER_REASON_SERIES}
    for node in walk(promql_parser.parse(expr)):
        if isinstance(node, promql_parser.VectorSelector) and node.name in labels:
            wanted = [m for m in node.matchers.matchers if m.name == "reason"]
            read[node.name] |= {label for label in labels[node.name] if all(matches(m, label) for m in wanted)}
    return read


def test_backpressure_and_shedding_are_read_from_their_own_series():
    """``BackfillShedRateHigh`` and the shed panel read ``backfill_router_shed_total`` whole (work
    truly dropped), never the backpressure the processor re-sends (``backfill_router_refused_total``,
    a panel of its own); the interactive alert reads both but a tenant's own quota; no expression
    picks reasons of these series by a regular expression or in llm-d's header spelling."""
    from common.contracts.router_state import BACKPRESSURE_REASONS, SHED_REASONS

    shed_only = {"backfill_router_refused_total": set(), "backfill_router_shed_total": set(SHED_REASONS)}
    [rule] = [r for r in alert_rules() if r["alert"] == "BackfillShedRateHigh"]
    assert reasons_read(rule["expr"]) == shed_only
    [shed_panel] = [e for e in dashboard_exprs() if "backfill_router_shed_total" in e]
    assert reasons_read(grafana_to_promql(shed_panel)) == shed_only
    [refused_panel] = [e for e in dashboard_exprs() if "backfill_router_refused_total" in e]
    assert reasons_read(grafana_to_promql(refused_panel)) == {
        "backfill_router_refused_total": set(BACKPRESSURE_REASONS), "backfill_router_shed_total": set()}
    [interactive] = [r for r in alert_rules() if r["alert"] == "BackfillInteractiveShed"]
    assert reasons_read(interactive["expr"]) == {
        "backfill_router_refused_total": set(BACKPRESSURE_REASONS) - {"rejected_quota"},
        "backfill_router_shed_total": set(SHED_REASONS)}
    exprs = [r["expr"] for r in alert_rules()] + [grafana_to_promql(e) for e in dashboard_exprs()]
    for expr in exprs:
        for node in walk(promql_parser.parse(expr)):
            if isinstance(node, promql_parser.VectorSelector) and node.name in ROUTER_REASON_SERIES:
                assert not [m for m in node.matchers.matchers if m.name == "reason" and str(m.op).endswith("Re")], expr
    assert not [e for e in exprs if re.search(r'"rejected-', e)]
