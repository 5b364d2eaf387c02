"""Settings of ``backfill router`` (env prefix ``BACKFILL_ROUTER_``), built by :func:`build_settings`.

Every field can come from the environment (``BACKFILL_ROUTER_PORT=8100``) or from the command line
(``--port 8100``); the command line wins. Defaults and their sources:

* ``scrape_interval_s`` 0.05 s — llm-d's EPP refreshes endpoint metrics every 50 ms
  (``--refresh-metrics-interval``), so its 200 ms staleness bound (``max_metrics_age_s``) leaves
  room for three missed scrapes.
* ``health_interval_s`` 1 s, ``unhealthy_after`` 2 failures — a dead engine leaves the candidate
  set within about 2 s even with no traffic; a failed connection while proxying marks it at once.
* ``make_room`` on — on an engine whose batch is bound by its sequence slots and scheduled first
  come first served (vLLM's default; even with ``--scheduling-policy priority`` a running request
  is never preempted for a waiting one), the slot reserve alone cannot keep interactive work from
  waiting: when interactive load takes the reserved slots, the next interactive request waits for
  a whole batch request to finish (``bench mixed``: interactive TTFT p99 55 ms alone, 787 ms
  with the batch backlog). Evicting the newest sheddable request there costs only that request's
  work so far, and the async processor re-sends it (it holds an ``evicted`` 429 like a
  ``rejected-saturated`` one). Turn it off when sheddable work must never be aborted once started.
* ``port`` 8100 — beside the gateway's 8000 and the simulated engines' 8001+ on one host.
* ``responses_ttl_s`` 30 days — OpenAI keeps stored responses 30 days by default (its "conversation
  state" guide), and clients resume agent sessions days later with ``previous_response_id``. Each
  record holds its conversation so far (``common/contracts/responses.py``), so a Redis short of
  memory should run ``maxmemory-policy volatile-ttl`` (every record has a TTL) or lower this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

#: The shipped scheduling config (approximate prefix + load scorers) used when none is given.
DEFAULT_SCHEDULING_CONFIG = Path(__file__).parent / "scheduling" / "default-config.yaml"
#: The shipped prefill/decode config, used instead when prefill engines are given and no config is.
PD_SCHEDULING_CONFIG = Path(__file__).parent / "scheduling" / "pd-config.yaml"


class RouterSettings(BaseSettings):
    """Everything the router process needs.

    Attributes:
        host, port: where the proxy listens.
        engines: static engine base URLs (``http://10.0.0.7:8000``), the endpoint pool's first source;
            in ``BACKFILL_ROUTER_ENGINES`` separated by spaces or commas. Role ``both``.
        prefill_engines, decode_engines: static engines of role ``prefill`` / ``decode`` (prefill/
            decode disaggregation; ``BACKFILL_ROUTER_PREFILL_ENGINES``, ``…_DECODE_ENGINES``, as
            ``engines``). A URL in two of the three lists is an error.
        engine_selector: Kubernetes label selector of engine pods (second source; needs the
            ``kubernetes`` package and in-cluster or kubeconfig credentials).
        engine_namespace: namespace watched by the selector (default: the pod's own).
        engine_port: port of the engines found by the selector.
        config: scheduling YAML (llm-d ``EndpointPickerConfig`` shape); None: the shipped
            ``pd-config.yaml`` when prefill engines are given, else ``default-config.yaml``.
        profile: scheduling profile to run (default: the config's first).
        tokenizer: ``estimate`` (4 bytes per token), ``hf`` (``tokenizer_path`` tokenizer.json) or
            ``engine`` (an engine's ``/tokenize``).
        tokenizer_path: tokenizer.json for the ``hf`` backend.
        kv_events_bind: ZMQ address the KV-event subscriber binds (``tcp://0.0.0.0:5557``); engines
            publish to it. None: no KV-event index (``precise-prefix-cache-producer`` unusable).
        index_max_blocks: cap of the KV-event index, in our 64-token blocks.
        flow_control: path of a flow-control YAML (bands, limits); None: the built-in defaults.
        flow_control_enabled: False sends every request straight to scheduling (a pure router).
        engine_priority: add vLLM's ``priority`` field (engines run ``--scheduling-policy
            priority`` to honour it; vLLM's v1 engine ignores it under the default ``fcfs``, the
            old v0 engine refused a non-zero one there). ``backfill up`` turns it on in every
            launch mode (``--no-engine-priority`` to turn it off).
        scrape_interval_s, health_interval_s, unhealthy_after, max_metrics_age_s: see the module doc.
        queue_threshold, kv_threshold: saturation detector thresholds (llm-d defaults 5 and 0.8).
        slot_reserve_fraction, min_slot_reserve: the slot reserve for non-sheddable work, a
            fraction of each engine's sequence slots and the fewest slots (defaults 0.1 and 1:
            ``router/scheduling/saturation.py`` gives the reasoning). Both 0: no reserve.
        make_room: a non-sheddable request bound for an engine with no free slot evicts the newest
            sheddable request this router runs there (``Director.make_room``; module doc: why on).
        working_set_cap: the most of an engine's GPU KV, a fraction 0..1, that idle sessions' working
            set holds back from sheddable work (default 0.5; ``router/runtime.py`` gives the rule and
            its reasoning; 1.0: the whole working set, the rule before the cap).
        evict_on_wait, reserve_from_arrivals, batch_prefill_share, batch_prefill_window_s,
            max_num_batched_tokens: the engine-level interactive protection, each off by default (measured in
            docs/benchmarks.md "isolation"): evict-and-resume when an interactive request would wait
            on an engine (``Director.make_room``), the slot reserve sized by Little's law from the
            measured interactive arrivals, and the bound of batch prompt tokens in prefill per engine
            as a share of the engines' ``max_num_batched_tokens``
            (``router/scheduling/saturation.py``, ``router/pool/state.py``).
        max_num_seqs: every engine's sequence slots (vLLM's ``--max-num-seqs``), when the fleet
            shares one; None (default): what each engine states (``backfill:engine_config_info`` in
            its ``/metrics``, vLLM's ``/server_info``), else learned from its scrapes
            (``router/pool/slots.py``).
        connect_timeout_s: connecting to an engine, seconds.
        request_timeout_s: base of a proxied request's timeout, seconds (0 = none): the whole request
            when it names no ``max_tokens``, the longest silence of a stream.
        request_timeout_per_token_s: added to ``request_timeout_s`` per output token a non-streamed
            request asks for (``max_tokens`` × ``n``); 0.25 s is 2.5-25x a loaded engine's 10-100 ms
            per token, so only a stalled engine trips it.
        max_body_bytes: largest request body accepted, bytes (413 past it).
        trusted_token: the shared secret of trusted callers (the async processor's
            ``BACKFILL_PROCESSOR_ROUTER_TOKEN``), sent in ``x-backfill-router-token``; only their
            fairness id and objective headers are honoured (``router/trust.py``). None (default):
            no caller is trusted. ``backfill up`` generates one.
        api_keys: YAML/JSON file mapping API key → tenant: an untrusted caller's fairness id is
            its ``Authorization: Bearer`` key's tenant (else ``anonymous``). None: no map.
        state_redis_url: redis-py URL of the Redis holding the Responses API state, shared by every
            router replica (``router/responses/``). None (default): ``store`` is not honoured (answers
            say ``store: false``) and every ``previous_response_id`` is unknown (OpenAI's 400
            ``previous_response_not_found``).
        responses_ttl_s: seconds a stored response is kept (module doc: why 30 days).
        log_level: Python logging level name.
        kv_events_connect, kv_events_port, kv_events_replay_port_offset, kv_events_replay_timeout_s,
            replicas: router high availability (the block at the end of the fields).
    """

    model_config = SettingsConfigDict(env_prefix="BACKFILL_ROUTER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    engines: Annotated[list[str], NoDecode] = Field(default_factory=list)  # "URL URL" or "URL,URL" in the env
    prefill_engines: Annotated[list[str], NoDecode] = Field(default_factory=list)
    decode_engines: Annotated[list[str], NoDecode] = Field(default_factory=list)
    engine_selector: str | None = None
    engine_namespace: str | None = None
    engine_port: int = Field(8000, ge=1, le=65535)
    config: Path | None = None
    profile: str | None = None
    tokenizer: Literal["estimate", "hf", "engine"] = "estimate"
    tokenizer_path: Path | None = None
    kv_events_bind: str | None = None
    index_max_blocks: int = Field(4_000_000, ge=1)
    flow_control: Path | None = None
    flow_control_enabled: bool = True
    engine_priority: bool = False
    scrape_interval_s: float = Field(0.05, gt=0)
    health_interval_s: float = Field(1.0, gt=0)
    unhealthy_after: int = Field(2, ge=1)
    max_metrics_age_s: float = Field(0.2, gt=0)
    queue_threshold: float = Field(5, gt=0)
    kv_threshold: float = Field(0.8, gt=0)
    slot_reserve_fraction: float = Field(0.1, ge=0, le=1)
    working_set_cap: float = Field(0.5, ge=0, le=1)
    min_slot_reserve: int = Field(1, ge=0)
    make_room: bool = True
    evict_on_wait: bool = False
    reserve_from_arrivals: bool = False
    batch_prefill_share: float | None = Field(None, gt=0, le=1)
    batch_prefill_window_s: float = Field(0.25, gt=0)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    connect_timeout_s: float = Field(2.0, gt=0)
    request_timeout_s: float = Field(600.0, ge=0)
    request_timeout_per_token_s: float = Field(0.25, ge=0)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    trusted_token: SecretStr | None = None
    api_keys: Path | None = None
    log_level: str = "INFO"
    # Responses API state (router/responses/)
    state_redis_url: str | None = None
    responses_ttl_s: int = Field(30 * 24 * 3600, ge=1)

    # ---- router high availability: KV events from every engine, replica count -------
    # kv_events_connect: ``ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`` per engine whose
    #   bound PUB socket this router connects to (every replica connects to every engine); in the
    #   env separated by spaces. kv_events_port: PUB port of discovered engine pods without the
    #   ``backfill.io/kv-events-port`` annotation (None: such pods send no events).
    #   kv_events_replay_port_offset: replay socket at PUB port + this when not named (the fleet's
    #   5557/5558; 0: engines have none). kv_events_replay_timeout_s: a replay taking longer counts
    #   as unavailable. replicas: router replicas sharing the tenants' limits (each enforces
    #   ceil(limit / replicas): router/replicas.py).
    kv_events_connect: Annotated[list[str], NoDecode] = Field(default_factory=list)
    kv_events_port: int | None = Field(None, ge=1, le=65535)
    kv_events_replay_port_offset: int = Field(1, ge=0, le=1000)
    kv_events_replay_timeout_s: float = Field(2.0, gt=0)
    replicas: int = Field(1, ge=1)

    @field_validator("kv_events_connect", mode="before")
    @classmethod
    def _split_specs(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split()
        return value

    @field_validator("kv_events_connect")
    @classmethod
    def _specs(cls, value: list[str]) -> list[str]:
        from router.kv_index.subscriber import parse_connect_spec

        for spec in value:
            parse_connect_spec(spec)  # raises ValueError with the reason
        return value

    @property
    def kv_events(self) -> bool:
        """True when the router builds the KV-event index (a bind address, connect specs, or
        discovered engines' KV-event port)."""
        return bool(self.kv_events_bind or self.kv_events_connect
                    or (self.engine_selector and self.kv_events_port is not None))

    @field_validator("state_redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"state_redis_url must be a redis-py URL (redis://, rediss:// or unix://): {value!r}")
        return value

    @model_validator(mode="after")
    def _connected_engines_are_known(self) -> RouterSettings:
        """Without discovery, every ``--kv-events-connect`` names an ``--engine`` (a typo would feed an
        index no endpoint reads)."""
        if self.all_engines and not self.engine_selector:
            from router.kv_index.subscriber import parse_connect_spec

            known = set(self.all_engines)
            unknown = [s.endpoint for s in map(parse_connect_spec, self.kv_events_connect) if s.endpoint not in known]
            if unknown:
                raise ValueError(f"--kv-events-connect names engines that no --engine gives: {', '.join(unknown)}")
        return self

    @model_validator(mode="after")
    def _one_role_per_engine(self) -> RouterSettings:
        seen: dict[str, str] = {}
        for flag, urls in (("--engine", self.engines), ("--prefill-engine", self.prefill_engines),
                           ("--decode-engine", self.decode_engines)):
            for url in urls:
                if url in seen and seen[url] != flag:
                    raise ValueError(f"engine {url} is given as {seen[url]} and as {flag}: one role per engine")
                seen[url] = flag
        return self

    @property
    def all_engines(self) -> list[str]:
        """Every static engine URL (``engines``, then prefill, then decode ones), each once."""
        return list(dict.fromkeys([*self.engines, *self.prefill_engines, *self.decode_engines]))

    @property
    def engine_roles(self) -> dict[str, str]:
        """Static engine URL → role, for the engines that are not ``both``."""
        return {**{u: "prefill" for u in self.prefill_engines}, **{u: "decode" for u in self.decode_engines}}

    @field_validator("engines", "prefill_engines", "decode_engines", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        return value

    @field_validator("engines", "prefill_engines", "decode_engines")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        out = []
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://: {url!r}")
            out.append(url.rstrip("/"))
        return out

    @property
    def scheduling_config(self) -> Path:
        """The scheduling YAML in force: ``config``, else the P/D one when prefill engines are given,
        else the default."""
        if self.config is not None:
            return self.config
        return PD_SCHEDULING_CONFIG if self.prefill_engines else DEFAULT_SCHEDULING_CONFIG


def build_settings(**overrides: Any) -> RouterSettings:
    """Settings from the environment, with non-None ``overrides`` (command-line values) on top.

    Raises:
        pydantic.ValidationError: a value is out of range or malformed.
    """
    return RouterSettings(**{k: v for k, v in overrides.items() if v is not None})
