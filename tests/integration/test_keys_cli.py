"""``backfill keys`` against a real database (``DATABASE_URL`` from the test fixture)."""

from __future__ import annotations

from click.testing import CliRunner

from backfill.cli import main


def test_keys_list_never_shows_a_whole_key(database_url, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DATABASE_URL", database_url)
    runner = CliRunner()
    created = runner.invoke(main, ["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path)])
    assert created.exit_code == 0, created.output
    long_key = created.output.strip().split()[-1]
    from batch_gateway.store import queries
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    engine = make_engine(sqlalchemy_url(database_url), pool_size=1)
    with make_sessionmaker(engine)() as session:
        queries.add_api_key(session, "acme", "sk-short1")  # a user-chosen short key (backfill up --api-key)
        session.commit()
    engine.dispose()
    listed = runner.invoke(main, ["keys", "list", "--tenant", "acme", "--data-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert long_key[:12] + "…" in listed.output and long_key not in listed.output
    assert "sk-s…" in listed.output and "sk-short1" not in listed.output
