"""``backfill up``'s ready check counts only its own gateway: a stack whose port was taken by
another process (after the free-port check, before its gateway bound) must not report ready
because the other process answers ``/health``."""

from __future__ import annotations

import http.server
import threading

import click
import pytest

from backfill.up import free_port, run_stack


class _Impostor(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_up_is_not_ready_when_another_process_answers_on_its_port(database_url, stores, monkeypatch, tmp_path):
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("REDIS_URL", stores.redis_url)
    port = free_port()
    impostor = http.server.HTTPServer(("127.0.0.1", port), _Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    # the port is free when checked and taken before the gateway binds it
    monkeypatch.setattr("backfill.up._check_port_free", lambda host, port: None)
    try:
        with pytest.raises(click.ClickException) as raised:
            with run_stack(tmp_path / "data", "127.0.0.1", port, "sk-ready-test", engines=0):
                pass
    finally:
        impostor.shutdown()
        impostor.server_close()
    message = raised.value.message
    assert "gateway exited during start-up" in message, message
    assert f"port {port} answers but is held by" in message
    assert not (tmp_path / "data" / "stack.json").exists()
