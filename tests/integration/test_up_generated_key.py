"""A stack started without ``--api-key`` makes a key active only while it runs: its stop revokes it,
and a start after a stack that died before its stop revokes the key that stack left behind. A key
given with ``--api-key`` stays."""

from __future__ import annotations

import httpx

from backfill.up import GENERATED_KEY_FILE, free_port, run_stack
from batch_gateway.store import queries
from batch_gateway.store.db import make_engine, make_sessionmaker


def _active_keys(database_url: str) -> set[str]:
    """Prefixes of the active keys of tenant ``default``."""
    engine = make_engine(database_url, pool_size=1)
    try:
        with make_sessionmaker(engine)() as session:
            return {prefix for _, _, prefix, _, revoked in queries.list_api_keys(session, "default") if not revoked}
    finally:
        engine.dispose()


def _answers(stack) -> int:
    return httpx.get(f"{stack.gateway_url}/files", headers={"authorization": f"Bearer {stack.api_key}"}).status_code


def test_each_run_s_key_lives_only_while_its_stack_runs(database_url, stores, monkeypatch, tmp_path):
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("REDIS_URL", stores.redis_url)
    data_dir = tmp_path / "data"
    with run_stack(data_dir, "127.0.0.1", free_port(), None, engines=0) as first:
        assert _answers(first) == 200 and _active_keys(database_url) == {first.api_key[:12]}
        assert (data_dir / GENERATED_KEY_FILE).stat().st_mode & 0o077 == 0
    assert _active_keys(database_url) == set() and not (data_dir / GENERATED_KEY_FILE).exists()

    # a stack that died before its stop leaves its key and its file: the next start revokes it
    left = queries.KEY_PREFIX + "left-by-a-killed-stack"
    engine = make_engine(database_url, pool_size=1)
    with make_sessionmaker(engine)() as session:
        queries.add_api_key(session, "default", left)
        session.commit()
    engine.dispose()
    (data_dir / GENERATED_KEY_FILE).write_text(left + "\n")
    with run_stack(data_dir, "127.0.0.1", free_port(), None, engines=0) as second:
        assert second.api_key != first.api_key and _answers(second) == 200
        assert _active_keys(database_url) == {second.api_key[:12]}
    assert _active_keys(database_url) == set()

    with run_stack(data_dir, "127.0.0.1", free_port(), "sk-given-by-the-user", engines=0) as given:
        assert _answers(given) == 200
    assert _active_keys(database_url) == {"sk-given-by-"}
