"""Plugin roles (typed Protocols), the handle factories receive, and the precise-prefix index port.

A plugin instance is any object with a ``name`` (its instance name in the config) and a
``plugin_type`` (its registered type, llm-d's name); the roles it plays are the Protocols below that
it implements — one object may play several (``no-hit-lru-scorer`` is a Scorer and a PreRequest).
The roles follow llm-d's ``pkg/epp/framework/interface/scheduling/plugins.go`` and
``interface/requestcontrol``:

==================  =========================================================================
role                runs
==================  =========================================================================
DataProducer        before the profile, once per decision: computes data (prefix matches)
                    into the CycleState for filters and scorers
Filter              in the profile: keeps a subset of the candidates
Scorer              in the profile: one score per candidate; the scheduler clamps it to
                    [0, 1] and multiplies it by the profile's weight for that scorer
Picker              in the profile: picks one endpoint from the scored candidates
PreRequest          after the decision, when the router commits to forwarding: learn from it
ResponseComplete    when the engine's response has finished (usage known)
ProfileHandler      instead of one profile, per decision: runs the profiles it was bound to
                    and combines their picks (prefill/decode disaggregation)
==================  =========================================================================

The scheduler (:mod:`router.scheduling.scheduler`) knows the roles only, never a concrete plugin:
which plugin plays a role is the config's word (the registry maps llm-d type names to factories).

Endpoints are passed as sequences and scorers answer with a list aligned to them (index i scores
``endpoints[i]``): cheaper than a dict per scorer on the hot path.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from router.scheduling.types import CycleState, Endpoint, LLMRequest

if TYPE_CHECKING:
    from router.scheduling.types import PDDecision, SchedulingResult

#: Cache tier names as in vLLM's KV events ``medium`` field, lower-cased.
TIER_GPU = "gpu"
TIER_CPU = "cpu"
TIER_DISK = "disk"


@runtime_checkable
class Plugin(Protocol):
    """Every plugin: ``name`` is the instance name (config ``name``, defaulting to the type),
    ``plugin_type`` the registered type (``queue-scorer``…)."""

    name: str
    plugin_type: str


@runtime_checkable
class DataProducer(Protocol):
    """Computes per-decision data into ``state`` before filters and scorers run."""

    def produce(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None: ...


@runtime_checkable
class Filter(Protocol):
    """Returns the candidates to keep (a subset of ``endpoints``, order kept). Returning an empty
    list makes the decision fail with :class:`~router.scheduling.errors.NoCandidatesError`."""

    def filter(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """Returns one score per endpoint, aligned with ``endpoints``. Scores are meant to lie in
    [0, 1] (higher is better); the scheduler clamps whatever comes back (NaN counts as 0)."""

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Picks one of ``endpoints`` given their weighted total scores (aligned lists, non-empty)."""

    def pick(self, state: CycleState, endpoints: Sequence[Endpoint], totals: Sequence[float]) -> Endpoint: ...


@runtime_checkable
class PreRequest(Protocol):
    """Learns from a decision the router has committed to (called just before forwarding)."""

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None: ...


@runtime_checkable
class ResponseComplete(Protocol):
    """Learns from a finished response: ``cached_tokens`` is the engine's
    ``usage.prompt_tokens_details.cached_tokens`` (tokens), None when the engine did not report it."""

    def response_complete(self, request: LLMRequest, endpoint: Endpoint, cached_tokens: int | None) -> None: ...


@runtime_checkable
class ProfileHandler(Protocol):
    """Decides with several profiles instead of one (llm-d's ``ProfileHandler``; the built-in one
    is ``pd-profile-handler``, :mod:`router.scheduling.plugins.disagg`). Bound to the scheduler's
    profiles when the scheduler is built (:func:`router.scheduling.config.build_scheduler`).

    Attributes:
        name: its instance name in the config.
        decode_profile: the name of the profile whose pick answers the client (the scheduler's
            default profile).
    """

    name: str
    decode_profile: str

    def bind(self, profiles: Mapping[str, Any]) -> None:
        """Resolve the profiles it runs among ``profiles`` (name → the scheduler's
        ``SchedulerProfile``). Raises :class:`~router.scheduling.errors.ConfigError` when one is
        missing or unusable."""
        ...

    def decide(self, request: LLMRequest, endpoints: Sequence[Endpoint],
               exclude_prefill: Sequence[str] = ()) -> PDDecision:
        """The decode pick and, when the request is disaggregated, a prefill pick not in
        ``exclude_prefill``. Raises :class:`~router.scheduling.errors.NoCandidatesError` when there
        is no decode candidate."""
        ...

    def prefill(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                exclude: Sequence[str] = ()) -> SchedulingResult | None:
        """The prefill profile's pick among ``endpoints`` not in ``exclude``; None without one."""
        ...


class PrefixIndex(Protocol):
    """The precise prefix index (fed by the engines' KV events; built by :mod:`router.kv_index`, not here).

    Keys are :mod:`router.scheduling.hashing` block keys of the prompt, block 0 first.
    """

    def longest_prefix(self, model: str, block_keys: Sequence[int]) -> Mapping[str, tuple[int, str]]:
        """For each endpoint holding block 0: (consecutive blocks from block 0 it holds, the tier
        the run is served from — the slowest tier along the run: ``"gpu"``, ``"cpu"`` or
        ``"disk"``). Endpoints holding nothing are absent."""
        ...


@dataclass(slots=True)
class PluginHandle:
    """What a factory may use besides its parameters (llm-d's ``plugins.Handle``).

    Attributes:
        rng: the random source for every random choice (ties, weighted picks, exploration);
            inject a seeded ``random.Random`` for reproducible decisions.
        clock: seconds on a monotonic clock (TTLs, metric ages); injectable for tests.
        prefix_index: the precise prefix index, required by ``precise-prefix-cache-producer``.
        saturation: one endpoint's saturation now (≥ 0; < 1.0: room for sheddable work), the
            router's detector with its thresholds and scrape-lag credit (``RouterRuntime.
            scheduling_saturation``); None: ``spare-capacity-filter`` uses
            :func:`router.scheduling.saturation.endpoint_saturation` with llm-d's thresholds, the
            credit on, on ``clock``.
        plugins: instances built so far, by instance name (a plugin may look up one declared
            before it).
    """

    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    prefix_index: PrefixIndex | None = None
    saturation: Callable[[Endpoint], float] | None = None
    plugins: dict[str, object] = field(default_factory=dict)
