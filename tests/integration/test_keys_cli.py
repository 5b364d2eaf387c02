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


def test_keys_revoke_accepts_the_prefix_keys_list_prints(database_url, monkeypatch, tmp_path) -> None:
    """The KEY column as printed (``sk-bf-AbCdEf…``, copied with its ellipsis) revokes that key; a
    short key by the half shown; a prefix that starts two active keys is refused, naming their ids,
    and revokes nothing."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    runner = CliRunner()

    def cli(*args: str):
        return runner.invoke(main, [*args, "--data-dir", str(tmp_path)])

    doomed = cli("keys", "create", "--tenant", "prefixes").output.strip()
    kept = cli("keys", "create", "--tenant", "prefixes").output.strip()
    from batch_gateway.store import queries
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    engine = make_engine(sqlalchemy_url(database_url), pool_size=1)
    with make_sessionmaker(engine)() as session:
        for key in ("sk-twin-prefix-one", "sk-twin-prefix-two", "sk-shrt9"):
            queries.add_api_key(session, "prefixes", key)
        session.commit()
    table = cli("keys", "list", "--tenant", "prefixes").output
    printed = next(word for word in table.split() if word.endswith("…") and doomed.startswith(word[:-1]))

    revoked = cli("keys", "revoke", printed)
    assert revoked.exit_code == 0, revoked.output
    short = cli("keys", "revoke", "sk-s…")  # what keys list prints of sk-shrt9
    assert short.exit_code == 0, short.output
    twins = cli("keys", "revoke", "sk-twin-pref")
    assert twins.exit_code == 1 and "2 active keys" in twins.output and "give the id" in twins.output
    too_short = cli("keys", "revoke", kept[:5])  # shorter than what keys list prints: no match
    assert too_short.exit_code == 1 and "no such active key" in too_short.output
    with make_sessionmaker(engine)() as session:
        assert queries.tenant_for_key(session, doomed) is None and queries.tenant_for_key(session, "sk-shrt9") is None
        assert queries.tenant_for_key(session, kept) is not None
        assert queries.tenant_for_key(session, "sk-twin-prefix-one") is not None
        assert queries.tenant_for_key(session, "sk-twin-prefix-two") is not None
    engine.dispose()
