"""The operator's command line with the admin key (``--admin-key`` / ``BACKFILL_ADMIN_KEY``, checked
by the gateway as the dashboard checks it): every tenant's batches and files, ``tenants list``,
``batches show`` of another tenant's batch, and the paging line under every list."""

from __future__ import annotations

import json
import secrets

import pytest
from click.testing import CliRunner

from backfill.cli import main

ADMIN_KEY = "admin-" + secrets.token_hex(8)
LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}\n')


@pytest.fixture
def gateway_settings(gateway_settings):
    """The conftest's settings with the dashboard's admin key set."""
    return gateway_settings.model_copy(update={"admin_key": ADMIN_KEY})


@pytest.fixture
def run(gateway, monkeypatch, tmp_path):
    """``backfill ARGS`` against the test gateway as tenant ``default`` (no stack, no admin key set)."""
    for name in ("BACKFILL_ADMIN_KEY", "BACKFILL_API_KEY", "BACKFILL_BASE_URL", "OPENAI_API_KEY",
                 "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)

    def invoke(*args: str, key: str | None = gateway.api_key):
        auth = ["--api-key", key] if key else []
        return CliRunner().invoke(main, [*args, "--base-url", gateway.base_url + "/v1", *auth,
                                         "--data-dir", str(tmp_path)], catch_exceptions=False)

    return invoke


def _batches(gateway, tenant: str, count: int) -> list[str]:
    client = gateway.client(tenant)
    ids = []
    for _ in range(count):
        uploaded = client.files.create(file=("in.jsonl", LINE), purpose="batch")
        ids.append(client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    return ids


def test_all_tenants_batches_page_with_a_hint_and_a_total(gateway, run):
    mine, theirs = _batches(gateway, "default", 2), _batches(gateway, "acme", 3)
    first = run("batches", "list", "--all-tenants", "--limit", "2", "--admin-key", ADMIN_KEY)
    assert first.exit_code == 0, first.output
    lines = first.output.splitlines()
    assert lines[0].split()[:3] == ["ID", "TENANT", "STATUS"] and len(lines) == 4
    first_ids = [line.split()[0] for line in lines[1:3]]
    hint = lines[-1]
    assert hint.startswith("2 of 5 shown; --after ") and hint.endswith(" for more"), hint
    cursor = hint.split("--after ")[1].split()[0]
    rest = run("batches", "list", "--all-tenants", "--after", cursor, "--json", "--admin-key", ADMIN_KEY)
    listed = json.loads(rest.output)
    assert {row["id"] for row in listed} | set(first_ids) == set(mine + theirs)
    # newest first: created_at is whole seconds, so batches of one second may come in either order
    created = {batch_id: gateway.client("acme" if batch_id in theirs else "default").batches.retrieve(batch_id).created_at
               for batch_id in mine + theirs}
    assert min(created[i] for i in first_ids) >= max(created[row["id"]] for row in listed)
    tenants = sorted([line.split()[1] for line in lines[1:3]] + [row["tenant_name"] for row in listed])
    assert tenants == ["acme", "acme", "acme", "default", "default"]
    acme = run("batches", "list", "--all-tenants", "--tenant", "acme", "--admin-key", ADMIN_KEY)
    assert acme.output.splitlines()[-1] == "all 3 shown"
    own = run("batches", "list", "--limit", "1")  # the tenant's own list says there is more too
    assert own.output.splitlines()[-1] == f"1 shown; --after {mine[-1]} for more"


def test_show_another_tenants_batch_with_the_admin_key(gateway, run):
    (theirs,) = _batches(gateway, "acme", 1)
    refused = run("batches", "show", theirs)
    assert refused.exit_code == 1 and "404" in refused.output
    shown = run("batches", "show", theirs, "--admin-key", ADMIN_KEY)
    assert shown.exit_code == 0, shown.output
    assert f"id:                 {theirs}" in shown.output and "tenant:             acme" in shown.output
    as_json = json.loads(run("batches", "show", theirs, "--json", "--admin-key", ADMIN_KEY).output)
    assert as_json["id"] == theirs and as_json["tenant_name"] == "acme" and as_json["object"] == "batch"


def test_all_tenants_files_and_tenants_list(gateway, run, monkeypatch):
    _batches(gateway, "acme", 1)
    _batches(gateway, "zeta", 2)
    monkeypatch.setenv("BACKFILL_ADMIN_KEY", ADMIN_KEY)  # the dashboard's variable
    files = run("files", "list", "--all-tenants", "--limit", "2")
    assert files.exit_code == 0, files.output
    assert files.output.splitlines()[-1].startswith("2 of 3 shown; --after file-")
    tenants = run("tenants", "list", key=None)  # the admin key alone is enough
    assert tenants.exit_code == 0, tenants.output
    rows = [line.split() for line in tenants.output.splitlines()]
    assert rows[0][:2] == ["TENANT", "ACTIVE"] and [row[0] for row in rows[1:-1]] == ["acme", "default", "zeta"]
    assert rows[-1] == ["all", "3", "shown"]
    paged = run("tenants", "list", "--limit", "1", "--after", "acme", key=None)
    assert paged.output.splitlines()[-1] == "1 of 3 shown; --after default for more"


def test_an_admin_key_without_all_tenants_is_never_silently_the_own_tenant(gateway, run, monkeypatch):
    """``--admin-key`` on the command line without ``--all-tenants`` is refused (it read as "every
    tenant" but listed the API key's tenant only); from ``BACKFILL_ADMIN_KEY`` the own list comes
    with a note saying whose it is."""
    _batches(gateway, "acme", 1)
    (mine,) = _batches(gateway, "default", 1)
    for what in ("batches", "files"):
        refused = run(what, "list", "--admin-key", ADMIN_KEY)
        assert refused.exit_code == 2 and "--all-tenants" in refused.output, refused.output
    monkeypatch.setenv("BACKFILL_ADMIN_KEY", ADMIN_KEY)
    own = run("batches", "list")
    assert own.exit_code == 0, own.output
    assert "the API key's tenant's batches only" in own.output and mine in own.output
    assert sum(line.startswith("batch_") for line in own.output.splitlines()) == 1  # not acme's


def test_a_wrong_or_missing_admin_key_is_refused(gateway, run):
    missing = run("batches", "list", "--all-tenants")
    assert missing.exit_code == 2 and "--admin-key" in missing.output
    wrong = run("tenants", "list", "--admin-key", "nope", key=None)
    assert wrong.exit_code == 1 and "401" in wrong.output and "Incorrect admin key" in wrong.output
    tenant_key = run("tenants", "list", "--admin-key", gateway.api_key)
    assert tenant_key.exit_code == 1 and "403" in tenant_key.output


def test_a_refused_submit_deletes_its_upload_and_names_it(gateway, run, tmp_path):
    batch_file = tmp_path / "in.jsonl"
    batch_file.write_bytes(LINE)
    refused = run("submit", str(batch_file), "--endpoint", "/v1/no-such-endpoint")
    assert refused.exit_code == 1, refused.output
    file_id = refused.output.split(" as ")[1].split(";")[0]
    assert file_id.startswith("file-") and f"so {file_id} was deleted" in refused.output
    assert file_id not in {f.id for f in gateway.client().files.list()}


def test_submit_windows_are_judged_as_the_api_judges_them(gateway, run, tmp_path):
    """``--window`` is the API's ``completion_window``: OpenAI's ``24h`` or our documented
    extension, a duration of 1 minute to 30 days (README "Differences from OpenAI"), so ``99h`` is
    a 99-hour deadline; what the API refuses (``31d``, ``99x``) the command refuses in its words,
    with exit status 1 and its upload deleted."""
    batch_file = tmp_path / "in.jsonl"
    batch_file.write_bytes(LINE)
    accepted = run("submit", str(batch_file), "--window", "99h")
    assert accepted.exit_code == 0, accepted.output
    batch = json.loads(accepted.output[accepted.output.index("{"):])
    assert batch["completion_window"] == "99h" and batch["expires_at"] - batch["created_at"] == 99 * 3600
    before = {f.id for f in gateway.client().files.list()}
    for window, words in (("31d", "between 1 minute and 30 days"), ("99x", "must be '24h' or a duration")):
        refused = run("submit", str(batch_file), "--window", window)
        assert refused.exit_code == 1 and words in refused.output, refused.output
    assert {f.id for f in gateway.client().files.list()} == before


def test_downloads_are_private_whatever_the_umask(gateway, run, tmp_path):
    """A tenant's bytes written by ``files download`` (and ``batches download`` / ``submit --wait``,
    the same writer) are 0600 under umask 0000, also over a file that was 0644."""
    import os
    import stat

    uploaded = gateway.client().files.create(file=("in.jsonl", LINE), purpose="batch")
    fresh, existing = tmp_path / "fresh.jsonl", tmp_path / "existing.jsonl"
    existing.write_bytes(b"old")
    existing.chmod(0o644)
    umask = os.umask(0)
    try:
        for target in (fresh, existing):
            done = run("files", "download", uploaded.id, "-o", str(target))
            assert done.exit_code == 0, done.output
            assert target.read_bytes() == LINE and stat.S_IMODE(target.stat().st_mode) == 0o600
        # batches download / submit --wait: a folder they make is 0700 too
        from types import SimpleNamespace

        from backfill.batches import download_results

        batch = SimpleNamespace(id="batch_x", output_file_id=uploaded.id, error_file_id=None)
        [written] = download_results(gateway.client(), batch, tmp_path / "results" / "deep")
        assert stat.S_IMODE(written.stat().st_mode) == 0o600
        assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "results").stat().st_mode) == 0o700
        tmp_path.chmod(0o755)
        download_results(gateway.client(), batch, tmp_path)  # an existing folder is left as it is
        assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
    finally:
        os.umask(umask)
