"""``backfill processor`` (the pump) and ``backfill enqueue`` (put one request on a lane, optionally
wait for its result). Options override ``BACKFILL_PROCESSOR_*`` settings
(:mod:`async_processor.settings`)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
import time

import click
import msgspec
import orjson

from async_processor.settings import build_settings
from common.contracts.queue import LANE_PRIORITIES, RequestMessage, ResultMessage

_BACKENDS = click.Choice(["redis", "pubsub", "memory"])


@click.command("processor")
@click.option("--backend", type=_BACKENDS, help="queue transport (default: redis)")
@click.option("--redis-url", help="redis-py URL (default: REDIS_URL, else redis://127.0.0.1:6379/0)")
@click.option("--router-url", help="where requests are POSTed: router, llm-d gateway or one engine")
@click.option("--pool", help="pool name in stream/topic names (default: default)")
@click.option("--lanes", help="comma-separated lanes to read (default: interactive,async,batch)")
@click.option("--concurrency", type=int, help="requests in flight at most (default 64)")
@click.option("--tenant-limit", type=int, help="requests in flight per tenant (default 0 = no limit)")
@click.option("--saturation-gate/--no-saturation-gate", default=None,
              help="gate lanes below interactive on the router's /admin/state (fails closed)")
@click.option("--lease", "lease_s", type=float, help="lease in seconds (default 30)")
@click.option("--max-deliveries", type=int, help="dead-letter after this many deliveries (default 5)")
@click.option("--max-error-attempts", type=int, help="attempts of a request answered 500/502/504/408 or not at "
              "all before its last answer is final (default 5; 429/503 retry until the deadline)")
@click.option("--buffer", "buffer_size", type=int, help="messages held in memory per lane (default 1024)")
@click.option("--reserve", "reserved", multiple=True, metavar="LANE=SLOTS",
              help="slots of --concurrency only LANE and higher lanes may use (repeatable; replaces the "
              "default interactive=8 async=4)")
@click.option("--tenant-weight", "weights", multiple=True, metavar="TENANT=WEIGHT",
              help="a tenant's weight in its lane's fair share (repeatable; default 1)")
@click.option("--deadline-at-risk", "deadline_at_risk_s", type=float,
              help="seconds to a deadline below which work goes before fair shares (default 300; 0: never)")
@click.option("--grace", "grace_s", type=float, help="seconds in-flight work may finish on SIGTERM (default 20)")
@click.option("--backoff-base", "backoff_base_s", type=float, help="retry backoff base in seconds (default 2)")
@click.option("--pubsub-project", help="Pub/Sub project (default backfill-local)")
@click.option("--pubsub-emulator-host", help="host:port of a Pub/Sub emulator (default PUBSUB_EMULATOR_HOST)")
@click.option("--metrics-port", type=int, help="serve /metrics and /health on this port (default: "
              "BACKFILL_PROCESSOR_METRICS_PORT or BACKFILL_METRICS_PORT, else none); /health answers 503 "
              "while the processor cannot consume (receive failing, or none completed within "
              "BACKFILL_PROCESSOR_HEALTH_STALL_S, default 30 s)")
@click.option("--log-level", default="INFO", show_default=True)
def processor_command(lanes: str | None, log_level: str, reserved: tuple[str, ...], weights: tuple[str, ...],
                      **options) -> None:
    """Pump queued requests to the router and publish their results (SIGTERM: drain and exit 0)."""
    import uvloop

    from async_processor.metrics import ProcessorMetrics, start_metrics_server
    from async_processor.processor import run_processor
    from common.logging import configure_logging

    configure_logging(log_level)
    settings = build_settings(lanes=lanes.split(",") if lanes else None,
                              reserved_slots=_numbers(reserved, int, "--reserve") if reserved else None,
                              tenant_weights=_numbers(weights, float, "--tenant-weight") if weights else None,
                              **options)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        logging.getLogger("async_processor").info(
            "processor started", extra={"action": "started", "backend": settings.backend,
                                        "router_url": settings.router_url, "lanes": settings.lanes})
        metrics = ProcessorMetrics()
        server = (await start_metrics_server(metrics, settings.metrics_port, settings.metrics_host)
                  if settings.metrics_port else None)
        try:
            processor = await run_processor(settings, stop, metrics=metrics)
        finally:
            if server is not None:
                await server.cleanup()
        logging.getLogger("async_processor").info("processor stopped",
                                                  extra={"action": "stopped", "counts": dict(processor.counts)})

    uvloop.run(main())


def _numbers(pairs: tuple[str, ...], kind: type[int] | type[float], option: str) -> dict:
    """``KEY=NUMBER`` pairs as a dict; ``click.BadParameter`` naming ``option`` on a bad one."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            out[key] = kind(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise click.BadParameter(f"expected KEY={kind.__name__.upper()}, got {pair!r}", param_hint=option)
    return out


def _metadata(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--metadata")
        out[key] = value
    return out


def result_json(result: ResultMessage) -> str:
    """``result`` as one JSON object, its ``payload`` (the engine's answer) as the JSON it holds
    rather than a string of it (kept a string when it is not JSON)."""
    fields = msgspec.to_builtins(result)
    try:
        fields["payload"] = orjson.loads(result.payload)
    except orjson.JSONDecodeError:
        pass
    return orjson.dumps(fields).decode()


@click.command("enqueue")
@click.option("--backend", type=click.Choice(["redis", "pubsub"]), help="queue transport (default: redis)")
@click.option("--redis-url", help="redis-py URL (default: REDIS_URL, else redis://127.0.0.1:6379/0)")
@click.option("--pool", help="pool name (default: default)")
@click.option("--lane", type=click.Choice(list(LANE_PRIORITIES)), default="batch", show_default=True)
@click.option("--payload", required=True, help="the OpenAI request body, as JSON")
@click.option("--endpoint", default="/v1/chat/completions", show_default=True)
@click.option("--id", "request_id", help="request id (default: a random one)")
@click.option("--deadline-in", type=click.FloatRange(min=0, min_open=True), default=3600.0, show_default=True,
              help="seconds from now (> 0)")
@click.option("--tenant", default="", help="metadata.tenant (fairness id)")
@click.option("--metadata", multiple=True, help="extra metadata KEY=VALUE (repeatable)")
@click.option("--result-queue", default="", help="result stream/topic (default: the shared one, or a private "
                                                  "stream with --wait on Redis)")
@click.option("--wait/--no-wait", default=False, help="wait for the result and print it as JSON")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="seconds to wait with --wait")
@click.option("--pubsub-project", help="Pub/Sub project (default backfill-local)")
@click.option("--pubsub-emulator-host", help="host:port of a Pub/Sub emulator (default PUBSUB_EMULATOR_HOST)")
def enqueue_command(lane: str, payload: str, endpoint: str, request_id: str | None, deadline_in: float,
                    tenant: str, metadata: tuple[str, ...], result_queue: str, wait: bool, timeout: float,
                    **options) -> None:
    """Put one request on a lane; print its transport id, or with --wait its result JSON
    (exit status 1 if no result came within --timeout, 3 if the result is an error: a non-2xx
    answer or an error code)."""
    from async_processor.backends import make_backend

    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--payload") from None
    if not isinstance(body, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--payload")
    settings = build_settings(lanes=[lane], **options)
    request_id = request_id or f"req-{secrets.token_hex(8)}"
    private = wait and not result_queue and settings.backend == "redis"
    if private:
        from async_processor.backends.redis_streams import private_result_stream

        result_queue = private_result_stream(settings.result_stream, request_id)
    meta = {"objective": lane, **({"tenant": tenant} if tenant else {}), **_metadata(metadata)}
    message = RequestMessage(id=request_id, created=int(time.time()), deadline=int(time.time() + deadline_in),
                             payload=body, endpoint=endpoint, metadata=meta, result_queue_name=result_queue)

    async def main() -> int:
        backend = make_backend(settings)
        await backend.start()
        try:
            reader = backend.result_reader(result_queue) if wait else None
            transport_id = await backend.publish_request(lane, message)
            if reader is None:
                click.echo(orjson.dumps({"id": request_id, "transport_id": transport_id}).decode())
                return 0
            try:
                until = time.monotonic() + timeout
                while time.monotonic() < until:
                    for result in await reader.read(min(1.0, max(0.01, until - time.monotonic()))):
                        if result.id == request_id:
                            click.echo(result_json(result))
                            return 0 if result.ok else 3
                click.echo(f"no result for {request_id} within {timeout} s", err=True)
                return 1
            finally:
                await reader.close()
                if private:
                    from async_processor.backends.redis_streams import RedisStreamsBackend

                    if isinstance(backend, RedisStreamsBackend):
                        await backend.client.delete(result_queue)
        finally:
            await backend.close()

    sys.exit(asyncio.run(main()))
