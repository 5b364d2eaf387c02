"""Router flow control (llm-d's model): when a request may run.

``FlowControlConfig`` (config.py) → ``FlowControlCore`` (core.py, pure: bands, flows, EDF, limits,
TTL, quotas, saturation gating, eviction) → ``FlowController`` (controller.py, asyncio facade the
router's director calls). Drops raise ``RequestDropped`` (errors.py) with the contract's reason, status and
Retry-After.
"""

from router.flow_control.config import BandConfig, FlowControlConfig, TurnPriorityConfig
from router.flow_control.controller import Admission, FlowController
from router.flow_control.core import FlowControlCore, FlowItem, StepResult, Ticket, TicketState, retry_after_for
from router.flow_control.errors import DROPPED_REASON_HEADER, ConfigError, DropReason, FlowControlError, RequestDropped

__all__ = [
    "DROPPED_REASON_HEADER",
    "Admission",
    "BandConfig",
    "ConfigError",
    "DropReason",
    "FlowControlConfig",
    "FlowControlCore",
    "FlowControlError",
    "FlowController",
    "FlowItem",
    "RequestDropped",
    "StepResult",
    "Ticket",
    "TicketState",
    "TurnPriorityConfig",
    "retry_after_for",
]
