"""``backfill keys`` against a real database (``DATABASE_URL`` from the test fixture)."""

from __future__ import annotations

import json

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


def test_keys_revoke_accepts_the_id_keys_list_shows(database_url, monkeypatch, tmp_path) -> None:
    """Issue 26 item 1: the list printed a prefix that ``revoke`` refused; now it prints an id that
    ``revoke`` accepts, and the key stops authenticating."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    runner = CliRunner()
    kept = runner.invoke(main, ["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path)]).output.strip()
    doomed = runner.invoke(main, ["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path)]).output.strip()
    listed = runner.invoke(main, ["keys", "list", "--tenant", "acme", "--json", "--data-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    doomed_id = next(row["id"] for row in rows if doomed.startswith(row["key_prefix"]))
    table = runner.invoke(main, ["keys", "list", "--tenant", "acme", "--data-dir", str(tmp_path)]).output
    assert doomed_id in table.split()

    revoked = runner.invoke(main, ["keys", "revoke", doomed_id, "--data-dir", str(tmp_path)])
    assert revoked.exit_code == 0, revoked.output
    again = runner.invoke(main, ["keys", "revoke", doomed_id, "--data-dir", str(tmp_path)])
    assert again.exit_code != 0 and "no such active key" in again.output
    states = {row["id"]: row["state"]
              for row in json.loads(runner.invoke(main, ["keys", "list", "--json", "--data-dir", str(tmp_path)]).output)}
    assert states[doomed_id] == "revoked" and list(states.values()).count("active") == 1

    from batch_gateway.store import queries
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    engine = make_engine(sqlalchemy_url(database_url), pool_size=1)
    with make_sessionmaker(engine)() as session:
        assert queries.tenant_for_key(session, doomed) is None
        assert queries.tenant_for_key(session, kept) is not None
    engine.dispose()
