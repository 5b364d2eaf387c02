"""``backfill router``: serve the router (flags override ``BACKFILL_ROUTER_*`` settings)."""

from __future__ import annotations

import asyncio
import logging

import click
from pydantic import ValidationError

from common.validation import describe
from router.settings import build_settings


@click.command("router")
@click.option("--host", default=None, help="address to listen on (default 127.0.0.1)")
@click.option("--port", type=int, default=None, help="port to listen on (default 8100)")
@click.option("--engine", "engines", multiple=True,
              help="engine base URL, e.g. http://127.0.0.1:8001 (repeat); role both (prefill and decode)")
@click.option("--prefill-engine", "prefill_engines", multiple=True,
              help="prefill engine base URL (repeat): computes prompts and hands their KV to a decode engine "
                   "(vLLM --kv-transfer-config NixlConnector); enables prefill/decode disaggregation")
@click.option("--decode-engine", "decode_engines", multiple=True,
              help="decode engine base URL (repeat): generates, with the KV a prefill engine computed")
@click.option("--engine-selector", default=None, help="Kubernetes label selector of engine pods (discovery)")
@click.option("--engine-namespace", default=None, help="namespace of the engine pods (default: the router's)")
@click.option("--engine-port", type=int, default=None, help="engine port on discovered pods (default 8000)")
@click.option("--config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="scheduling YAML (default: router/scheduling/default-config.yaml, or pd-config.yaml when "
                   "--prefill-engine is given)")
@click.option("--profile", default=None, help="scheduling profile to run (default: the config's first)")
@click.option("--tokenizer", type=click.Choice(["estimate", "hf", "engine"]), default=None,
              help="prompt tokenizer backend (default estimate)")
@click.option("--tokenizer-path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="tokenizer.json for --tokenizer hf")
@click.option("--kv-events-bind", default=None,
              help="ZMQ address to bind for the engines' KV events, e.g. tcp://0.0.0.0:5557 (precise prefix routing)")
@click.option("--flow-control", "flow_control", type=click.Path(exists=True, dir_okay=False), default=None,
              help="flow-control YAML (bands, limits, quotas)")
@click.option("--no-flow-control", "no_flow_control", is_flag=True, help="route every request at once")
@click.option("--engine-priority/--no-engine-priority", default=None,
              help="send vLLM's priority field (engines run --scheduling-policy priority)")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
              help="every engine's sequence slots (vLLM --max-num-seqs) for the slot reserve "
                   "(default: what each engine states, else learned from its metrics; router/pool/slots.py)")
@click.option("--api-keys", "api_keys", type=click.Path(exists=True, dir_okay=False), default=None,
              help="YAML/JSON file mapping API key -> tenant: the fairness id of callers without the trusted "
                   "token (default: every such caller is tenant 'anonymous')")
@click.option("--make-room/--no-make-room", "make_room", default=None,
              help="evict the newest sheddable request on an engine with no free slot for an interactive one "
                   "(default on)")
@click.option("--evict-on-wait/--no-evict-on-wait", "evict_on_wait", default=None,
              help="also evict the newest batch request in prefill on an engine an interactive request would "
                   "wait on (default off)")
@click.option("--batch-prefill-share", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="bound batch prompt tokens in prefill per engine to this share of --max-num-batched-tokens "
                   "(default: no bound)")
@click.option("--state-redis-url", default=None,
              help="Redis URL for the Responses API state shared by every replica (store, previous_response_id)")
@click.option("--responses-ttl-s", type=click.IntRange(min=1), default=None,
              help="seconds a stored response is kept (default 30 days, as OpenAI)")
@click.option("--log-level", default=None, help="logging level (default INFO)")
# ---- router high availability: every replica subscribes to every engine's KV events ----
@click.option("--kv-events-connect", "kv_events_connect", multiple=True, metavar="ENGINE_URL=tcp://HOST:PORT",
              help="connect to an engine's bound KV-event publisher (repeat); ENGINE_URL is its base URL as "
                   "--engine names it; ',tcp://HOST:PORT' after it names the replay socket (default: PORT + "
                   "--kv-events-replay-port-offset)")
@click.option("--kv-events-port", type=click.IntRange(1, 65535), default=None,
              help="KV-event PUB port of engines found by --engine-selector (a pod's backfill.io/kv-events-port "
                   "annotation wins); enables their KV events")
@click.option("--kv-events-replay-port-offset", type=click.IntRange(0, 1000), default=None,
              help="replay socket = PUB port + this where not named (default 1; 0: engines have none)")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="router replicas behind one Service: per-tenant limits are divided by it (default 1)")
def router_command(engines: tuple[str, ...], prefill_engines: tuple[str, ...], decode_engines: tuple[str, ...],
                   no_flow_control: bool, kv_events_connect: tuple[str, ...], **options) -> None:
    """Serve the prefix-cache-aware router with flow control in front of the engines."""
    import uvloop
    from aiohttp import web

    from common.logging import configure_logging
    from router.app import create_app

    overrides = dict(options)
    if engines:
        overrides["engines"] = list(engines)
    if prefill_engines:
        overrides["prefill_engines"] = list(prefill_engines)
    if decode_engines:
        overrides["decode_engines"] = list(decode_engines)
    if kv_events_connect:
        overrides["kv_events_connect"] = list(kv_events_connect)
    if no_flow_control:
        overrides["flow_control_enabled"] = False
    try:
        settings = build_settings(**overrides)
    except ValidationError as exc:
        raise click.UsageError(describe(exc)) from None
    if not settings.all_engines and not settings.engine_selector:
        raise click.UsageError("give at least one --engine (or --prefill-engine / --decode-engine) URL or an "
                               "--engine-selector")
    if settings.prefill_engines and not settings.engine_selector and not (settings.engines or settings.decode_engines):
        raise click.UsageError("--prefill-engine needs a --decode-engine or --engine to decode on")
    if settings.engine_selector:
        from router.pool import KubernetesSource

        try:
            KubernetesSource.load_credentials()
        except RuntimeError as exc:
            raise click.UsageError(str(exc)) from None
    configure_logging(settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine /tokenize call otherwise
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    def ready(_banner: str) -> None:  # run_app calls it once the socket listens
        roles = settings.engine_roles
        listed = ",".join(f"{u}({roles[u]})" if u in roles else u for u in settings.all_engines)
        click.echo(f"router ready on http://{settings.host}:{settings.port} engines={listed}", err=True)

    web.run_app(create_app(settings), host=settings.host, port=settings.port, access_log=None, print=ready,
                handler_cancellation=True, shutdown_timeout=5.0)


def router_argv(port: int, engines: list[str], *, host: str = "127.0.0.1", config: str | None = None,
                profile: str | None = None, tokenizer: str | None = None, kv_events_bind: str | None = None,
                flow_control: str | None = None, no_flow_control: bool = False, engine_priority: bool = False,
                kv_events_connect: dict[str, str] | None = None, replicas: int | None = None,
                extra: list[str] | tuple[str, ...] = (), prefill_engines: list[str] | tuple[str, ...] = (),
                decode_engines: list[str] | tuple[str, ...] = ()) -> list[str]:
    """argv of ``backfill router …`` for ``subprocess.Popen`` (``backfill up``, tests, benchmarks).

    ``kv_events_connect``: ``{engine URL: "tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]"}``, one
    ``--kv-events-connect`` each; ``replicas``: ``--replicas``; ``prefill_engines`` /
    ``decode_engines``: one ``--prefill-engine`` / ``--decode-engine`` each (``engines`` are role both).

    Raises:
        ValueError: no engine URL.
    """
    from common.executable import backfill_executable

    if not engines and not prefill_engines and not decode_engines:
        raise ValueError("router_argv needs at least one engine URL")
    argv = [*backfill_executable(), "router", "--host", host, "--port", str(port)]
    for flag, urls in (("--engine", engines), ("--prefill-engine", prefill_engines),
                       ("--decode-engine", decode_engines)):
        for url in urls:
            argv += [flag, url]
    for flag, value in (("--config", config), ("--profile", profile), ("--tokenizer", tokenizer),
                        ("--kv-events-bind", kv_events_bind), ("--flow-control", flow_control)):
        if value is not None:
            argv += [flag, str(value)]
    for url, address in (kv_events_connect or {}).items():
        argv += ["--kv-events-connect", f"{url}={address}"]
    if replicas is not None:
        argv += ["--replicas", str(replicas)]
    if no_flow_control:
        argv.append("--no-flow-control")
    if engine_priority:
        argv.append("--engine-priority")
    return argv + list(extra)
