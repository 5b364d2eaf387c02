"""The router counts backpressure and shedding apart, in one label spelling: every drop reason goes
to ``backfill_router_refused_total`` (refused at once, re-sent by the caller) or to
``backfill_router_shed_total`` (work dropped after it waited or ran), never both, labelled with
underscores as the processor's series are (STYLE.md 8): ``rejected_saturated``, never llm-d's
header spelling. ``/admin/state`` splits and spells them the same way."""

from __future__ import annotations

from common.contracts.router_state import BACKPRESSURE_REASONS, SHED_REASONS, RouterState
from router.flow_control.config import FlowControlConfig
from router.flow_control.core import FlowControlCore
from router.flow_control.errors import DropReason
from router.metrics import RouterMetrics


def _series(text: str, name: str) -> dict[str, float]:
    """``{reason: value}`` of ``name``'s samples of band ``batch`` in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + '{band="batch",reason="'):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].removesuffix('"}')] = float(value)
    return out


def test_each_drop_reason_is_counted_as_refused_or_shed_with_underscores():
    metrics = RouterMetrics(lambda: RouterState(pool_saturation=0.0, time=0.0))
    for reason in DropReason:
        metrics.shed("batch", reason.value)
    metrics.shed("batch", DropReason.SATURATED.value)
    text = metrics.render().decode()
    refused, shed = _series(text, "backfill_router_refused_total"), _series(text, "backfill_router_shed_total")
    assert refused == {"rejected_saturated": 2.0, "rejected_capacity": 1.0, "rejected_quota": 1.0}
    assert shed == {"rejected_ttl_expired": 1.0, "evicted": 1.0, "rejected_context_cancelled": 1.0}
    assert set(refused) == set(BACKPRESSURE_REASONS) and set(shed) == set(SHED_REASONS)
    assert len(DropReason) == len(BACKPRESSURE_REASONS) + len(SHED_REASONS)


def test_the_admin_state_splits_and_spells_them_as_the_metrics_do():
    core = FlowControlCore(FlowControlConfig.from_mapping(None))
    [batch] = [band for band in core.stats(0.0)["bands"] if band["objective"] == "batch"]
    assert set(batch["refused_total"]) == set(BACKPRESSURE_REASONS)
    assert set(batch["shed_total"]) == set(SHED_REASONS)
