"""Settings of one simulated vLLM engine: one typed object, built by :func:`build_settings`.

Field names follow vLLM's command-line flags (``--served-model-name`` → ``served_model_name``) so a
launch line moves between the simulator and a real engine. Environment variables with the prefix
``BACKFILL_ENGINE_SIM_`` fill fields the caller leaves out (``BACKFILL_ENGINE_SIM_BLOCK_SIZE=64``).

Default latency numbers and where they come from:

* ``prefill_tokens_per_s = 16_000``: llm-d's calibration of about 16k prefill tokens/s for a 32B
  model on two H100s (quoted in docs/engine-simulator.md and the vLLM-engine contract).
* ``prefill_overhead_ms = 30`` and ``itl_ms = 12`` and ``itl_load_factor = 2.0``: the
  "8B-class model on H100, balanced" latency profile published with llm-d's inference simulator
  (``prefill-overhead: 30ms``, ``inter-token-latency: 12ms``, ``time-factor-under-load: 2.0``).
* ``cpu_load_ms_per_block = 0.08``: one 16-token block of an 8B Llama (32 layers x 8 KV heads x 128
  dims x K,V x 2 bytes = 128 KiB/token, 2 MiB/block) over PCIe Gen4 at about 25 GB/s effective.
  About 12x cheaper than recomputing the block at 16k tokens/s (1 ms).
* ``disk_load_ms_per_block = 0.4``: the same 2 MiB block from a local NVMe SSD at about 5 GB/s.
* ``max_num_batched_tokens = 8192``: vLLM's default for its OpenAI server on GPUs of 70 GiB or
  more other than the A100 (``EngineArgs`` batch defaults; 2048 on smaller GPUs), matching the
  H100 latency profile above. Queued prefills within this budget count as running, as vLLM would
  schedule them in its next step (see :mod:`engine_twin.scheduler`).
* ``num_gpu_blocks = 8192`` (131k tokens at block size 16): smaller than an H100 would hold for an
  8B model (about 30k blocks) so that evictions happen in fleet benchmarks at modest load.
"""

from __future__ import annotations

import json
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

    time_scale: float = Field(1.0, ge=0.0)
    prefill_overhead_ms: float = Field(30.0, ge=0.0)
    prefill_tokens_per_s: float = Field(16_000.0, gt=0.0)
    itl_ms: float = Field(12.0, ge=0.0)
    itl_load_factor: float = Field(2.0, ge=1.0)
    cpu_load_ms_per_block: float = Field(0.08, ge=0.0)
    disk_load_ms_per_block: float = Field(0.4, ge=0.0)

    default_max_tokens: int = Field(16, ge=1)
    embedding_dim: int = Field(1024, ge=1)
    failure_rate: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = 0
    engine_index: str = "0"
    data_parallel_rank: int = 0

    @field_validator("kv_events_config", mode="before")
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
    def _gpu_pool_holds_one_request(self) -> EngineSimSettings:
        needed = -(-self.max_model_len // self.block_size)
        if self.num_gpu_blocks < needed:
            raise ValueError(
                f"num_gpu_blocks={self.num_gpu_blocks} cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens ({needed} blocks of {self.block_size}); vLLM refuses "
                "to start in this case too"
            )
        if not self.served_model_name:
            raise ValueError("served_model_name needs at least one name")
        return self

    @property
    def model(self) -> str:
        """The first served name: vLLM reports it in ``model_name`` metric labels."""
        return self.served_model_name[0]

    def seconds(self, ms: float) -> float:
        """Scale a model duration in milliseconds to wall-clock seconds (``time_scale`` applied)."""
        return ms * self.time_scale / 1000.0


def build_settings(**overrides: Any) -> EngineSimSettings:
    """Build the settings from keyword overrides (``None`` values are dropped) plus the environment.

    Raises ``pydantic.ValidationError`` on bad values (negative sizes, a GPU pool too small for
    ``max_model_len``, malformed ``kv_events_config`` JSON).
    """
    return EngineSimSettings(**{k: v for k, v in overrides.items() if v is not None})
