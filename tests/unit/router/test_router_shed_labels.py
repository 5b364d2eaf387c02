"""The router's ``backfill_router_shed_total`` labels its reasons with underscores, as the
processor's series do (STYLE.md 8): ``rejected_saturated``, never llm-d's header spelling."""

from __future__ import annotations

from common.contracts.router_state import BACKPRESSURE_REASONS, RouterState
from router.flow_control.errors import DropReason
from router.metrics import RouterMetrics


def test_every_drop_reason_is_labelled_with_underscores():
    metrics = RouterMetrics(lambda: RouterState(pool_saturation=0.0, time=0.0))
    for reason in DropReason:
        metrics.shed("batch", reason.value)
    text = metrics.render().decode()
    shed = [line for line in text.splitlines() if line.startswith("backfill_router_shed_total{")]
    assert len(shed) == len(DropReason) and not [line for line in shed if 'reason="rejected-' in line]
    assert 'backfill_router_shed_total{band="batch",reason="rejected_saturated"} 1.0' in shed
    assert {f'reason="{r}"' for r in BACKPRESSURE_REASONS} <= {line.split(",")[1].split("}")[0] for line in shed}
