"""Settings of one simulated vLLM engine: one typed object, built by :func:`build_settings`.

Field names follow vLLM's command-line flags (``--served-model-name`` → ``served_model_name``) so a
launch line moves between the simulator and a real engine. Environment variables with the prefix
``BACKFILL_ENGINE_SIM_`` fill fields the caller leaves out (``BACKFILL_ENGINE_SIM_BLOCK_SIZE=64``).

Defaults of the scheduler follow vLLM (``vllm/config/scheduler.py``, ``EngineArgs``):

* ``max_num_batched_tokens = 8192``: vLLM's default for its OpenAI server on GPUs of 70 GiB or
  more other than the A100 (``EngineArgs`` batch defaults; 2048 on smaller GPUs).
* ``max_num_partial_prefills = 1``, ``max_long_partial_prefills = 1``,
  ``long_prefill_token_threshold = 0`` (no per-request cap); with ``max_num_partial_prefills > 1``
  and no threshold given, the threshold becomes 4 % of ``max_model_len``, as vLLM sets it.
* ``num_gpu_blocks = 8192`` (131k tokens at block size 16): smaller than an H100 would hold for an
  8B model (about 30k blocks) so that evictions happen in fleet benchmarks at modest load.

The step-time constants (``model_params`` … ``nvme_gb_s``) describe Llama-3.1-8B in bf16 on one
H100 SXM; :mod:`engine_twin.step_model` states the model and the source of every number.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class KVEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config`` JSON (``vllm/config/kv_events.py``), same keys and defaults.

    ``endpoint``: ``tcp://*:5557`` binds, ``tcp://host:port`` connects (see ``kv_events.py``).
    ``topic``: vLLM's default is the empty topic; the fleet uses ``kv@<host>:<port>@<model>``.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        """True when events are enabled and the publisher is ZMQ (the only one vLLM ships)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


NIXL_CONNECTOR = "NixlConnector"
"""The one KV connector the twin simulates (vLLM's ``NixlConnector``, prefill/decode disaggregation)."""


def _env_number(name: str, default: str, kind: type = float) -> Any:
    """A number from vLLM's environment variable ``name`` (``vllm/envs.py``), ``default`` when unset."""
    raw = os.environ.get(name, default)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


class KVTransferConfig(BaseModel):
    """vLLM's ``--kv-transfer-config`` JSON (``vllm/config/kv_transfer.py``), same keys and defaults.

    The twin simulates ``NixlConnector`` only (prefill/decode disaggregation, ``engine_twin/core.py``
    and ``engine_twin/pd.py``); any other connector is refused at startup with a clear error, as is a
    connector without a role or a role vLLM does not know. ``engine_id`` defaults to a fresh UUID, as
    vLLM's ``__post_init__``. ``kv_load_failure_policy``: vLLM's, ``"fail"`` (its default: a request
    whose KV load failed finishes with an error) or ``"recompute"`` (the request computes its prompt
    locally). Unknown keys are kept, as newer vLLM versions add some."""

    model_config = {"extra": "allow"}

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str | None = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"

    @model_validator(mode="after")
    def _role_with_connector(self) -> KVTransferConfig:
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("Please specify kv_role when kv_connector is set, supported roles are "
                             "('kv_producer', 'kv_consumer', 'kv_both')")
        if self.kv_connector is not None and self.kv_connector != NIXL_CONNECTOR:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not simulated: the engine twin simulates "
                             f"{NIXL_CONNECTOR!r} only (prefill/decode disaggregation)")
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        return self

    @property
    def is_nixl(self) -> bool:
        """True when the NIXL connector is on (any role)."""
        return self.kv_connector == NIXL_CONNECTOR


class EngineSimSettings(BaseSettings):
    """Everything one simulated engine needs. Units are in the field names (``_ms``, ``_s``)."""

    model_config = SettingsConfigDict(env_prefix="BACKFILL_ENGINE_SIM_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = Field(default_factory=lambda: ["sim-model"])
    tokenizer: str | None = None
    block_size: int = Field(16, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_model_len: int = Field(16384, ge=16)
    num_gpu_blocks: int = Field(8192, ge=1)
    cpu_offload_blocks: int = Field(0, ge=0)
    disk_offload_blocks: int = Field(0, ge=0)
    hash_seed: str | None = None
    kv_events_config: KVEventsConfig = Field(default_factory=KVEventsConfig)
    kv_events_layout: Literal["map", "array"] = "map"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    enable_prompt_tokens_details: bool = False
    max_logprobs: int = 20

    max_num_partial_prefills: int = Field(1, ge=1)
    max_long_partial_prefills: int = Field(1, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0)
    kv_transfer_config: KVTransferConfig | None = None
    retention_priority_threshold: int | None = None
    """Requests whose vLLM ``priority`` is at least this get the lowest KV retention (None: off)."""
    background_priority_threshold: int | None = None
    """Requests whose vLLM ``priority`` is at least this are *background* (batch, async): their prefill
    chunks share at most ``max_background_prefill_tokens`` of a step and wait while a foreground
    prefill is pending (``engine_twin/core.py``). None: off, as vLLM (a twin extension, no vLLM flag)."""
    max_background_prefill_tokens: int = Field(512, ge=1)
    """Prefill tokens all background requests together get per step (tokens, at most the step's
    budget in effect), when ``background_priority_threshold`` is set. Default 512: the knee of the
    engine-level frontier (docs/benchmarks.md "isolation"): a step carrying 512 background prefill
    tokens lasts about 8.2 + 16.4 ms on the default step model, so a foreground request arriving
    during it waits at most that long, while one engine still prefills ≥ 19,000 background tokens/s."""

    time_scale: float = Field(1.0, ge=0.0)
    model_params: float = Field(8.03e9, gt=0.0)
    model_dtype_bytes: float = Field(2.0, gt=0.0)
    num_hidden_layers: int = Field(32, ge=1)
    num_attention_heads: int = Field(32, ge=1)
    num_key_value_heads: int = Field(8, ge=1)
    head_dim: int = Field(128, ge=1)
    hbm_bandwidth_gb_s: float = Field(3350.0, gt=0.0)
    mbu: float = Field(0.77, gt=0.0, le=1.0)
    peak_tflops: float = Field(989.0, gt=0.0)
    mfu: float = Field(0.5, gt=0.0, le=1.0)
    step_overhead_ms: float = Field(2.0, ge=0.0)
    pcie_gb_s: float = Field(25.0, gt=0.0)
    nvme_gb_s: float = Field(5.0, gt=0.0)

    kv_transfer_bandwidth_gb_s: float = Field(50.0, gt=0.0)
    """Gigabytes/s of the link between a prefill and a decode engine, for the KV transfer time of
    ``NixlConnector`` (a twin extension; vLLM has no such flag). Default 50 GB/s: one 400 Gb/s RDMA
    NIC per GPU (NVIDIA ConnectX-7 NDR InfiniBand, eight per DGX H100, NVIDIA DGX H100 datasheet),
    the path NIXL's UCX backend takes between nodes. Within one node NVLink 4 carries 450 GB/s per
    direction per H100 (NVIDIA H100 datasheet: 900 GB/s bidirectional)."""
    nixl_side_channel_host: str = Field(default_factory=lambda: os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST",
                                                                               "localhost"))
    """vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (default ``localhost``, ``vllm/envs.py``): where the
    twin's side channel listens and the ``remote_host`` its prefill answers name."""
    nixl_side_channel_port: int = Field(default_factory=lambda: _env_number("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600",
                                                                            int), ge=1, le=65535)
    """vLLM's ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (default 5600; plus ``data_parallel_rank``, as vLLM)."""
    nixl_abort_request_timeout_s: float = Field(
        default_factory=lambda: _env_number("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480"), gt=0.0)
    """vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (default 480 s, ``vllm/envs.py``): a prefill engine
    frees the blocks of a finished request no decode engine has read after this long."""
    default_max_tokens: int = Field(16, ge=1)
    embedding_dim: int = Field(1024, ge=1)
    failure_rate: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = 0
    engine_index: str = "0"
    data_parallel_rank: int = 0
    plugin_metrics: bool = True
    """Export the series backfill's vLLM plugin adds to ``/metrics`` (``backfill:engine_config_info``
    with ``max_num_seqs``, ``num_gpu_blocks``, ``block_size``): the twin stands in for vLLM with the
    plugin (what ``deploy/`` runs), whose rules it carries. False: ``/metrics`` as vLLM alone
    exports it (no ``max_num_seqs`` anywhere), the router's slot-learning fallback."""

    @field_validator("kv_events_config", "kv_transfer_config", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value.split()
        return value

    @model_validator(mode="after")
    def _sizes_are_consistent(self) -> EngineSimSettings:
        needed = -(-self.max_model_len // self.block_size)
        if self.num_gpu_blocks < needed:
            raise ValueError(
                f"num_gpu_blocks={self.num_gpu_blocks} cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens ({needed} blocks of {self.block_size}); vLLM refuses "
                "to start in this case too"
            )
        if not self.served_model_name:
            raise ValueError("served_model_name needs at least one name")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's SchedulerConfig refuses it too
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or "
                             f"equal to max_num_seqs ({self.max_num_seqs})")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills={self.max_long_partial_prefills} must be less than or "
                             f"equal to max_num_partial_prefills={self.max_num_partial_prefills}")
        if self.max_num_partial_prefills > 1 and self.long_prefill_token_threshold == 0:
            self.long_prefill_token_threshold = int(self.max_model_len * 0.04)  # vLLM's SchedulerConfig
        return self

    @property
    def model(self) -> str:
        """The first served name: vLLM reports it in ``model_name`` metric labels."""
        return self.served_model_name[0]

    @property
    def nixl(self) -> bool:
        """True when ``--kv-transfer-config`` turns vLLM's NixlConnector on (prefill/decode roles)."""
        return self.kv_transfer_config is not None and self.kv_transfer_config.is_nixl

    @property
    def side_channel_port(self) -> int:
        """The side channel's port: ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + ``data_parallel_rank``, as vLLM."""
        return self.nixl_side_channel_port + self.data_parallel_rank

    def seconds(self, ms: float) -> float:
        """Scale a model duration in milliseconds to wall-clock seconds (``time_scale`` applied)."""
        return ms * self.time_scale / 1000.0


def build_settings(**overrides: Any) -> EngineSimSettings:
    """Build the settings from keyword overrides (``None`` values are dropped) plus the environment.

    Raises ``pydantic.ValidationError`` on bad values (negative sizes, a GPU pool too small for
    ``max_model_len``, malformed ``kv_events_config`` JSON).
    """
    return EngineSimSettings(**{k: v for k, v in overrides.items() if v is not None})
