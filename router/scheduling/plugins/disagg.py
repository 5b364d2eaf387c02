"""Prefill/decode disaggregation: the role filters and the P/D profile handler (llm-d's names).

* ``prefill-filter`` keeps the endpoints that may run a disaggregated prefill (role ``prefill`` or
  ``both``); ``decode-filter`` those that may decode (``decode`` or ``both``). llm-d's filters
  (``pkg/plugins/filter/pd_role.go``) are ``by-label`` filters over the pod label
  ``llm-d.ai/role``; here the role is :attr:`Endpoint.role`, which the pool fills from the same
  label or from ``--prefill-engine`` / ``--decode-engine`` / ``--engine``.
* ``pd-profile-handler`` decides per request, as llm-d's (``pkg/plugins/profile/pd_profile_handler.go``,
  the version with ``threshold`` and ``hashBlockSize``; later split into ``prefix-based-pd-decider``
  with ``nonCachedTokens``): run the **decode** profile first; then, when the prompt's uncached
  part on the chosen decode endpoint — prompt tokens minus the tokens that endpoint is known to hold
  from block 0 (the prefix producer's match) — is at least ``threshold`` tokens, run the **prefill**
  profile (over the endpoints other than the decode pick) and disaggregate; else the decode
  endpoint does it all. ``threshold`` 0 disaggregates every request (llm-d's meaning of 0).
  :meth:`PDProfileHandler.decide` does no I/O and is usable without HTTP (the simulator calls it
  through :meth:`router.scheduling.scheduler.Scheduler.decide`).
* ``prefill-header-handler`` is accepted so llm-d configs load: in llm-d it writes the prefill pod's
  address into ``x-prefiller-host-port`` for the routing sidecar in front of the decode pod; this
  router runs both legs itself (``router/director.py``), so it does nothing here.

Differences from llm-d: ``threshold`` counts tokens (llm-d's ``pd-profile-handler`` counted prompt
characters, its ``prefix-based-pd-decider`` counts tokens as 4 characters each); the prefill profile
never picks the decode endpoint (a ``both`` endpoint chosen for decode is not also its own prefill).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from router.scheduling.errors import ConfigError, NoCandidatesError
from router.scheduling.interfaces import DataProducer, PluginHandle, PreRequest, ResponseComplete
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.plugins.prefix import APPROX_PRODUCER_TYPE
from router.scheduling.types import (
    CycleState,
    Endpoint,
    LLMRequest,
    PDDecision,
    PrefixMatchInfo,
    SchedulingResult,
    prefix_match_key,
)

if TYPE_CHECKING:
    from router.scheduling.scheduler import SchedulerProfile

PREFILL_FILTER_TYPE = "prefill-filter"
DECODE_FILTER_TYPE = "decode-filter"
PD_PROFILE_HANDLER_TYPE = "pd-profile-handler"
PREFILL_HEADER_HANDLER_TYPE = "prefill-header-handler"


class PDReason(enum.StrEnum):
    """Why a request was or was not disaggregated (doubles as the ``reason`` metric label)."""

    DISAGGREGATED = "disaggregated"
    BELOW_THRESHOLD = "below_threshold"  # the uncached prompt on the decode pick is shorter than threshold
    NO_PREFILL_ENDPOINT = "no_prefill_endpoint"  # the prefill profile had no candidate
    NOT_GENERATION = "not_generation"  # embeddings and other paths that do not decode (director)
    PREFILL_FAILED = "prefill_failed"  # disaggregated, but no prefill engine answered: fallback (director)


class RoleFilter:
    """Keeps the endpoints whose role allows ``prefill`` (``prefill-filter``) or ``decode``
    (``decode-filter``). Never raises; an empty result fails the profile
    (:class:`NoCandidatesError`), as a by-label filter leaving no pod does in llm-d."""

    def __init__(self, name: str, plugin_type: str) -> None:
        self.name = name
        self.plugin_type = plugin_type
        self._prefill = plugin_type == PREFILL_FILTER_TYPE

    def filter(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints of the filter's role, order kept."""
        if self._prefill:
            return [ep for ep in endpoints if ep.can_prefill]
        return [ep for ep in endpoints if ep.can_decode]


class _NoParams(PluginParams):
    pass


def build_prefill_filter(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> RoleFilter:
    """``prefill-filter`` (no parameters)."""
    parse_params(_NoParams, name, raw)
    return RoleFilter(name, PREFILL_FILTER_TYPE)


def build_decode_filter(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> RoleFilter:
    """``decode-filter`` (no parameters)."""
    parse_params(_NoParams, name, raw)
    return RoleFilter(name, DECODE_FILTER_TYPE)


class PrefillHeaderHandler:
    """``prefill-header-handler``: accepted for llm-d config compatibility; plays no role here
    (module docstring). Reference it in no profile."""

    plugin_type = PREFILL_HEADER_HANDLER_TYPE

    def __init__(self, name: str) -> None:
        self.name = name


class _PrefillHeaderParams(PluginParams):
    prefill_profile: str = "prefill"  # llm-d's parameter; unused here


def build_prefill_header_handler(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> PrefillHeaderHandler:
    """``prefill-header-handler`` (llm-d's ``prefillProfile`` parameter accepted, unused)."""
    parse_params(_PrefillHeaderParams, name, raw)
    return PrefillHeaderHandler(name)


class PDProfileHandlerParams(PluginParams):
    """Parameters of ``pd-profile-handler`` (llm-d's names).

    Attributes:
        threshold: uncached prompt tokens on the decode pick at or above which the request is
            disaggregated, ≥ 0 (0: always). Default 0 as llm-d's; the shipped ``pd-config.yaml``
            sets its own value and says where it comes from.
        decode_profile, prefill_profile: the profiles' names (llm-d's defaults ``decode``, ``prefill``).
        prefix_plugin_name: the prefix producer whose matches give the cached part
            (default ``approx-prefix-cache-producer``, created when not declared).
        hash_block_size: llm-d's tokens per matched block; here the producer's ``blockSizeTokens``
            is used, and a value given must equal it (a mismatch is a ConfigError).
        primary_port: llm-d's data-parallel port rewrite; only 0 (off) is supported.
    """

    threshold: int = Field(0, ge=0)
    decode_profile: str = "decode"
    prefill_profile: str = "prefill"
    prefix_plugin_name: str = APPROX_PRODUCER_TYPE
    hash_block_size: int | None = Field(None, gt=0)
    primary_port: int = Field(0, ge=0, le=0)


class PDProfileHandler:
    """``pd-profile-handler`` (module docstring). :meth:`bind` (called by
    :func:`router.scheduling.config.build_scheduler`) checks the profiles and the producer."""

    plugin_type = PD_PROFILE_HANDLER_TYPE

    def __init__(self, name: str, params: PDProfileHandlerParams, handle: PluginHandle) -> None:
        self.name = name
        self.params = params
        self.threshold = params.threshold
        self.decode_profile = params.decode_profile
        self.prefill_profile = params.prefill_profile
        self._handle = handle
        self._producer: DataProducer | None = None
        self._profiles: Mapping[str, SchedulerProfile] = {}
        if params.prefix_plugin_name == APPROX_PRODUCER_TYPE:
            self.requires = {params.prefix_plugin_name: APPROX_PRODUCER_TYPE}
        else:
            self.requires = {params.prefix_plugin_name: ""}  # must be declared: build_scheduler says so

    def bind(self, profiles: Mapping[str, SchedulerProfile]) -> None:
        """Resolve the profiles and the prefix producer.

        Raises:
            ConfigError: a profile is missing, the two are the same, the producer is not a data
                producer, or ``hashBlockSize`` differs from its block size.
        """
        for role, profile in (("decodeProfile", self.decode_profile), ("prefillProfile", self.prefill_profile)):
            if profile not in profiles:
                raise ConfigError(f"plugin {self.name!r}: {role} {profile!r} is not a profile "
                                  f"(profiles: {', '.join(profiles)})")
        if self.decode_profile == self.prefill_profile:
            raise ConfigError(f"plugin {self.name!r}: decodeProfile and prefillProfile are both {self.decode_profile!r}")
        producer = self._handle.plugins.get(self.params.prefix_plugin_name)
        if not isinstance(producer, DataProducer):
            raise ConfigError(f"plugin {self.name!r}: prefixPluginName {self.params.prefix_plugin_name!r} "
                              "is not a prefix producer")
        block = getattr(producer, "block_size_tokens", None)
        if self.params.hash_block_size is not None and block is not None and self.params.hash_block_size != block:
            raise ConfigError(f"plugin {self.name!r}: hashBlockSize {self.params.hash_block_size} differs from "
                              f"{self.params.prefix_plugin_name!r}'s blockSizeTokens {block}")
        self._producer = producer
        self._profiles = profiles
        # the decode pick holds the prompt's blocks once the request ran there (received from the
        # prefill engine, or computed): the producer learns from it even when the decode profile
        # (load-aware) does not run it
        decode = profiles[self.decode_profile]
        if isinstance(producer, PreRequest) and producer not in decode.pre_request_hooks:
            decode.pre_request_hooks.append(producer)
        if isinstance(producer, ResponseComplete) and producer not in decode.response_hooks:
            decode.response_hooks.append(producer)

    def uncached_tokens(self, request: LLMRequest, endpoint: Endpoint, state: CycleState | None = None) -> int:
        """Prompt tokens ``endpoint`` would compute for ``request``: prompt tokens minus the
        tokens of the blocks it holds from block 0 (the producer's match, read from ``state``
        when a profile's producer already wrote it, else asked now for ``endpoint`` alone)."""
        key = prefix_match_key(self.params.prefix_plugin_name)
        info = state.read(key) if state is not None else None
        if not isinstance(info, PrefixMatchInfo):
            assert self._producer is not None, "bind() first"
            scratch = CycleState()
            self._producer.produce(scratch, request, [endpoint])
            info = scratch.read(key)
        if not isinstance(info, PrefixMatchInfo):
            return request.prompt_tokens
        return info.uncached_tokens(endpoint.name, request.prompt_tokens)

    def decide(self, request: LLMRequest, endpoints: Sequence[Endpoint],
               exclude_prefill: Sequence[str] = ()) -> PDDecision:
        """Decode pick, then prefill pick when the uncached prompt there is ≥ ``threshold``.

        Args:
            request: the request.
            endpoints: every candidate (the profiles' role filters narrow them).
            exclude_prefill: endpoint names the prefill profile must not pick (besides the decode pick).

        Raises:
            NoCandidatesError: the decode profile has no candidate (llm-d: "failed to find
                available decode workers").
        """
        decode = self._profiles[self.decode_profile].run(request, endpoints)
        uncached = self.uncached_tokens(request, decode.endpoint, decode.state)
        if uncached < self.threshold:
            return PDDecision(decode, None, PDReason.BELOW_THRESHOLD.value, uncached)
        prefill = self.prefill(request, endpoints, (decode.endpoint.name, *exclude_prefill))
        if prefill is None:
            return PDDecision(decode, None, PDReason.NO_PREFILL_ENDPOINT.value, uncached)
        return PDDecision(decode, prefill, PDReason.DISAGGREGATED.value, uncached)

    def prefill(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                exclude: Sequence[str] = ()) -> SchedulingResult | None:
        """The prefill profile's pick among ``endpoints`` not in ``exclude``; None when it has none."""
        skip = set(exclude)
        candidates = [ep for ep in endpoints if ep.name not in skip]
        if not candidates:
            return None
        try:
            return self._profiles[self.prefill_profile].run(request, candidates)
        except NoCandidatesError:
            return None


def build_pd_profile_handler(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> PDProfileHandler:
    """``pd-profile-handler`` from its parameters (:class:`PDProfileHandlerParams`)."""
    return PDProfileHandler(name, parse_params(PDProfileHandlerParams, name, raw), handle)
