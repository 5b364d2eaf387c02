"""The ground layer below every service: what the gateway, workers, processor, router and
engine twin share.

- :mod:`common.contracts` — the wire contracts, one module each (queue messages and names, the
  router's ``/admin/state``, OpenAI's error envelope);
- :mod:`common.logging` — the one log set-up (JSON lines or text);
- :mod:`common.tracing` — OpenTelemetry set-up and W3C ``traceparent`` helpers;
- :mod:`common.json_types` — how error messages name a JSON value's type;
- :mod:`common.chatml` — the ChatML prompt rendering the router and the engine twin share;
- :mod:`common.executable` — how to start another ``backfill`` command as a subprocess.

It imports no other package of this repository; every service may import it.
"""
