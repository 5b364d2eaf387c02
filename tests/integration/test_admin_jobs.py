"""The dashboard's job list, job page and cancel against real Postgres: keyset pages that cover
every batch once in (created_at, id) order, status and tenant filters, the job page's timeline,
validation errors with line numbers and file links, a cancel through the API's own path
(``cancelling`` then ``cancelled``), the tenants page's quota and in-flight counts, and the query
plans with 10,000 batches (index scans, no sequential scan of ``batches``)."""

from __future__ import annotations

import datetime as dt
import re

import httpx
import orjson
import pytest
from sqlalchemy import event, insert, text

from batch_gateway.store import queries
from batch_gateway.store.models import Batch, BatchRequest, File
from common.contracts.queue import ErrorCode, error_result
from tests.integration.test_lifecycle import StandInProcessor, _line, _submit
from workers import lifecycle

ADMIN_KEY = "admin-jobs-" + "x" * 24
STATUSES = ("in_progress", "completed", "failed", "cancelled", "validating")
BASE_TIME = 1_790_000_000


@pytest.fixture
def gateway_settings(gateway_settings):
    return gateway_settings.model_copy(update={"admin_key": ADMIN_KEY})


def _admin(gateway) -> httpx.Client:
    return httpx.Client(base_url=gateway.base_url, timeout=30, headers={"authorization": f"Bearer {ADMIN_KEY}"})


def seed_batches(session, count: int, tenants=("acme", "globex", "initech"), with_requests: int = 0,
                 statuses: tuple[str, ...] = STATUSES, ended_with_requests: int = 0) -> list[dict]:
    """Insert ``count`` batches spread over ``tenants`` and ``statuses`` (in turn), three per
    created_at second (ties broken by id); the first ``with_requests`` in-progress ones get 200
    requests, a quarter of them queued, a quarter pending (not yet fed) and the rest succeeded, and
    the first ``ended_with_requests`` completed ones 200 succeeded requests. Ended batches ended at
    their creation second. Returns the rows inserted."""
    ids = {name: queries.ensure_tenant(session, name).id for name in tenants}
    first = next(iter(ids.values()))
    session.execute(insert(File).values(id="file-seed", tenant_id=first, bytes=1, filename="seed.jsonl",
                                        purpose="batch", storage_key="seed"))
    deadline = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    rows = []
    for i in range(count):
        tenant = tenants[i % len(tenants)]
        rows.append({"id": f"batch_{(i * 7919) % count:06d}", "tenant_id": ids[tenant], "endpoint": "/v1/chat/completions",
                     "input_file_id": "file-seed", "completion_window": "24h", "window_seconds": 86400,
                     "status": statuses[i % len(statuses)], "created_at": BASE_TIME + i // 3,
                     "in_progress_at": BASE_TIME + i // 3, "expires_at": BASE_TIME + 86400,
                     "deadline": deadline, "model": "m", "request_total": 200,
                     "request_completed": i % 200, "enqueued_tokens": 1000, "_tenant": tenant,
                     **({f"{statuses[i % len(statuses)]}_at": BASE_TIME + i // 3}
                        if statuses[i % len(statuses)] in ("completed", "failed", "cancelled", "expired") else {})})
    for status in set(statuses):  # one insert per status: the rows of one executemany share their keys
        session.execute(insert(Batch), [{k: v for k, v in row.items() if k != "_tenant"}
                                        for row in rows if row["status"] == status])
    running = [row for row in rows if row["status"] == "in_progress"][:with_requests]
    ended = [row for row in rows if row["status"] == "completed"][:ended_with_requests]
    requests = [{"batch_id": row["id"], "custom_id": f"r{j}", "line": j + 1, "byte_offset": j, "byte_length": 1,
                 "prefix_key": b"", "est_tokens": 1,
                 "state": ("queued", "pending", "succeeded", "succeeded")[j % 4]
                 if row["status"] == "in_progress" else "succeeded"}
                for row in running + ended for j in range(200)]
    if requests:
        session.execute(insert(BatchRequest), requests)
    session.commit()
    return rows


def _order(rows):
    return [row["id"] for row in sorted(rows, key=lambda r: (r["created_at"], r["id"]), reverse=True)]


def _walk(admin, **params) -> list[str]:
    seen, after = [], None
    while True:
        page = admin.get("/admin/api/jobs", params={**params, **({"after": after} if after else {})}).json()
        seen += [job["id"] for job in page["data"]]
        if page["next"] is None:
            return seen
        assert len(page["data"]) == params["limit"]
        after = page["next"]


def test_keyset_pages_cover_every_batch_once_newest_first_with_filters(gateway):
    with gateway.session() as session:
        rows = seed_batches(session, 50)
    admin = _admin(gateway)
    assert _walk(admin, limit=7) == _order(rows)
    assert _walk(admin, limit=7, status="failed") == _order([r for r in rows if r["status"] == "failed"])
    assert _walk(admin, limit=4, tenant="globex") == _order([r for r in rows if r["_tenant"] == "globex"])
    both = [r for r in rows if r["_tenant"] == "acme" and r["status"] == "in_progress"]
    assert both and _walk(admin, limit=3, tenant="acme", status="in_progress") == _order(both)
    assert admin.get("/admin/api/jobs", params={"tenant": "nobody"}).json() == {"data": [], "next": None, "total": 0}

    job = admin.get("/admin/api/jobs", params={"limit": 1}).json()["data"][0]
    source = next(r for r in rows if r["id"] == job["id"])
    assert (job["tenant"], job["status"], job["completed"], job["total"]) == \
        (source["_tenant"], source["status"], source["request_completed"], 200)
    assert job["percent"] == 100 * source["request_completed"] // 200

    page = admin.get("/admin", params={"status": "failed", "limit": 5})
    assert page.status_code == 200
    shown = re.findall(r'<tr data-batch="([^"]+)"', page.text)
    assert shown == _order([r for r in rows if r["status"] == "failed"])[:5]
    assert 'rel="next"' in page.text and "/admin/fragments/jobs?status=failed" in page.text
    fragment = admin.get("/admin/fragments/jobs", params={"status": "failed", "limit": 5})
    assert re.findall(r'<tr data-batch="([^"]+)"', fragment.text) == shown and "<html" not in fragment.text

    bad = admin.get("/admin/api/jobs", params={"status": "bogus"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
    assert admin.get("/admin/api/jobs", params={"after": "not-a-cursor"}).status_code == 400
    assert admin.get("/admin", params={"after": "x~"}).status_code == 400


def test_job_page_shows_validation_errors_with_line_numbers_and_file_links(gateway):
    client = gateway.client()
    good = _line("ok")
    lines = [good, b"{not json", good.replace(b'"ok"', b'"ok2"'), orjson.dumps({"custom_id": "u", "method": "POST",
             "url": "/v1/other", "body": {"model": "m"}})]
    uploaded = client.files.create(file=("bad.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = gateway.wait_status(batch.id, ("failed",))
    expected_lines = sorted(e.line for e in failed.errors.data)
    assert expected_lines  # the batch failed on numbered lines

    admin = _admin(gateway)
    page = admin.get(f"/admin/jobs/{batch.id}")
    assert page.status_code == 200
    table = page.text.split("<h2>Errors</h2>")[1].split("</table>")[0]
    assert [int(n) for n in re.findall(r'<tr><td class="num">(\d+)</td>', table)] == \
        [e.line for e in failed.errors.data]
    assert "invalid_json_line" in table
    assert "batch.created" in page.text and "batch.failed" in page.text  # the timeline
    assert f'href="/admin/files/{uploaded.id}"' in page.text
    download = admin.get(f"/admin/files/{uploaded.id}")
    assert download.status_code == 200 and download.content == b"\n".join(lines) + b"\n"
    assert "Cancel batch" not in page.text  # an ended batch offers no cancel
    missing = admin.get("/admin/jobs/batch_nope")
    assert missing.status_code == 404 and "No such Batch object" in missing.text
    assert 'href="/admin/lanes"' in missing.text  # the error page keeps the navigation
    assert admin.get("/admin/fragments/jobs/batch_nope").json()["error"]["code"] == "not_found"
    assert admin.get("/admin/files/file-nope").status_code == 404
    assert admin.post("/admin/jobs/batch_nope/cancel").status_code == 404
    alias = admin.get("/admin/jobs?status=failed", follow_redirects=False)
    assert alias.status_code == 307 and alias.headers["location"] == "/admin?status=failed"


def test_cancel_from_the_dashboard_goes_cancelling_then_cancelled(gateway):
    ctx = gateway.celery.backfill
    ctx.settings.feed_window = 2
    client, batch = _submit(gateway, [_line(f"c{i}") for i in range(4)])
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == 2
    held = proc.take()
    proc.ok(held[0])
    assert lifecycle.collect(ctx) == 1

    browser = gateway.http(tenant=None)
    login = browser.post("/admin/login", data={"key": ADMIN_KEY, "next": f"/admin/jobs/{batch.id}"})
    assert login.status_code == 303
    page = browser.get(login.headers["location"])
    assert "Cancel batch" in page.text and "data-confirm" in page.text
    assert re.search(r'aria-valuenow="25"', page.text)  # 1 of 4 done
    csrf = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text).group(1)
    assert browser.post(f"/admin/jobs/{batch.id}/cancel").status_code == 403  # no CSRF token: refused
    assert client.batches.retrieve(batch.id).status == "in_progress"

    done = browser.post(f"/admin/jobs/{batch.id}/cancel", data={"csrf_token": csrf})
    assert done.status_code == 303 and done.headers["location"].endswith("?notice=cancel_requested")
    assert client.batches.retrieve(batch.id).status == "cancelling"  # the API sees the same batch
    shown = browser.get(done.headers["location"]).text
    assert 'id="job-status">cancelling<' in shown and "now <strong>cancelling</strong>" in shown
    assert "Cancel batch" not in shown
    live = re.search(r'id="job-live" data-refresh="([^"]+)"', shown).group(1)
    assert live == f"/admin/fragments/jobs/{batch.id}?notice=cancel_requested"  # the banner is live too

    proc.answer(held[1], error_result(held[1].id, ErrorCode.CANCELLED, "batch cancelled", held[1].metadata))
    assert lifecycle.collect(ctx) == 1
    assert lifecycle.finalize_due(ctx) == [batch.id]
    fragment = browser.get(live).text
    assert 'id="job-status">cancelled<' in fragment
    assert "now <strong>cancelling</strong>" not in fragment and "the batch is <strong>cancelled</strong>" in fragment
    timeline = re.findall(r'<span class="event">([^<]+)</span>', fragment)
    assert timeline.index("batch.cancelling") < timeline.index("batch.cancelled")
    assert client.batches.retrieve(batch.id).status == "cancelled"
    outcomes = browser.get(f"/admin/jobs/{batch.id}", params={"state": "cancelled"}).text
    assert sorted(re.findall(r'<td class="mono">(c\d)</td>', outcomes)) == ["c1", "c2", "c3"]
    # the API's one rule: a batch that ended, cancelled included, is refused with OpenAI's 409 message
    again = browser.post(f"/admin/jobs/{batch.id}/cancel", data={"csrf_token": csrf})
    assert again.status_code == 303 and again.headers["location"].endswith("?notice=cancel_refused")
    refused = browser.get(again.headers["location"]).text
    assert "Cannot cancel a batch with status &#39;cancelled&#39;." in refused or \
        "Cannot cancel a batch with status 'cancelled'." in refused


def test_tenants_page_shows_quota_use_and_queued_and_pending_requests_live(gateway):
    with gateway.session() as session:
        rows = seed_batches(session, 30, with_requests=2)
    admin = _admin(gateway)
    page = admin.get("/admin/tenants").text
    assert "running" not in page.lower()  # no request is ever in a state called running
    fed = [r for r in rows if r["status"] == "in_progress"][:2]
    assert {r["_tenant"] for r in fed} != {"acme", "globex", "initech"}  # some tenant has nothing open
    for name in ("acme", "globex", "initech"):
        mine = [r for r in rows if r["_tenant"] == name]
        active = [r for r in mine if r["status"] in ("in_progress", "validating")]
        open_ = sum(50 for r in fed if r["_tenant"] == name)  # 50 queued and 50 pending of each
        row = re.search(rf'<tr data-tenant="{name}">(.*?)</tr>', page, re.S).group(1)
        assert f"{1000 * len(active):,} / " in row
        assert re.search(r'<td class="num">(\d+)</td>', row).group(1) == str(len(active))
        assert f'requests-queued">{open_}<' in row and f'requests-pending">{open_}<' in row
    live = re.search(r'<tbody id="tenant-rows" data-refresh="([^"]+)"', page).group(1)
    fragment = admin.get(live).text
    assert "<html" not in fragment
    assert re.findall(r'<tr data-tenant="([^"]+)">', fragment) == ["acme", "default", "globex", "initech"]


def _plans(session, call) -> list[str]:
    """EXPLAIN of every SELECT that ``call(session)`` runs (the real statements, captured)."""
    seen = []
    connection = session.connection()

    def capture(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    event.listen(connection, "before_cursor_execute", capture)
    try:
        call(session)
    finally:
        event.remove(connection, "before_cursor_execute", capture)
    raw = connection.connection.driver_connection
    plans = []
    for statement, parameters in seen:
        with raw.cursor() as cursor:
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
    return plans


def test_with_10000_batches_a_page_is_an_index_scan(gateway):
    with gateway.session() as session:
        # a realistic history: 1 batch in 100 still running, most ended, ended batches' requests kept
        history = ("completed",) * 60 + ("failed",) * 20 + ("cancelled",) * 10 + ("expired",) * 9 + ("in_progress",)
        rows = seed_batches(session, 10_000, with_requests=40, statuses=history, ended_with_requests=400)
        session.execute(text("ANALYZE"))
        session.commit()
        acme = queries.tenant_by_name(session, "acme").id
        middle = sorted(rows, key=lambda r: (r["created_at"], r["id"]))[5000]
        keyset_indexes = ("ix_batches_created_at_id", "ix_batches_status_created_at_id",
                          "ix_batches_tenant_id_created_at_id")
        for filters in ({}, {"status": "failed"}, {"status": "in_progress"}, {"tenant_id": acme},
                        {"status": "completed", "tenant_id": acme}):
            for after in (None, (middle["created_at"], middle["id"])):
                [plan] = _plans(session, lambda s: queries.admin_list_batches(s, limit=51, after=after, **filters))  # noqa: B023 - called at once
                # batches are reached through a keyset index (in order, stopping after the page, or
                # for a rare status just its matching rows), never by reading the table
                assert "Seq Scan on batches" not in plan, plan
                used = re.findall(r"Index Scan(?: Backward)? using (\w+) on batches|Bitmap Index Scan on (\w+)", plan)
                assert used and all(any(name in keyset_indexes for name in pair) for pair in used), plan
        [plan] = _plans(session, lambda s: queries.open_requests_by_tenant(s, [acme]))
        assert "Seq Scan on batch_requests" not in plan and "ix_batch_requests_batch_id_state" in plan, plan
        assert "Seq Scan on batches" not in plan, plan
    page = _admin(gateway).get("/admin", params={"limit": 50})
    assert page.status_code == 200 and len(re.findall(r"<tr data-batch=", page.text)) == 50


ERROR_400 = {"error": {"message": "Missing required parameter: 'messages'.", "type": "invalid_request_error",
                       "param": "messages", "code": "missing_required_parameter"}}


def test_job_page_lists_requests_in_input_order_with_http_error_messages(gateway):
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("in_progress",))
        requests = [{"batch_id": row["id"], "custom_id": f"req-{line}", "line": line, "byte_offset": line,
                     "byte_length": 1, "prefix_key": b"", "est_tokens": 1, "state": "pending"}
                    for line in range(1, 76)]  # custom_id as text sorts req-1, req-10, req-11, …
        requests[8].update(state="failed", status_code=400, response_body=orjson.dumps(ERROR_400))
        requests[9].update(state="failed", status_code=500, response_body=b'{"object": "error", '
                           b'"message": "engine overloaded", "type": "InternalServerError", "code": 500}')
        requests[10].update(state="failed", status_code=502, response_body=b"<html>bad gateway</html>")
        session.execute(insert(BatchRequest), requests)
        session.commit()
    admin = _admin(gateway)
    page = admin.get(f"/admin/jobs/{row['id']}").text
    lines = [int(n) for n in re.findall(r'<tr><td class="num">(\d+)</td><td class="mono">req-', page)]
    assert lines == list(range(1, 51))
    rows = {r[1]: r for r in re.findall(r'<tr><td class="num">(\d+)</td><td class="mono">(req-\d+)</td>(.*?)</tr>',
                                         page, re.S) for r in [r]}
    assert "Missing required parameter: &#39;messages&#39;." in rows["req-9"][2]
    assert "missing_required_parameter" in rows["req-9"][2]
    assert "engine overloaded" in rows["req-10"][2]  # vLLM's flat error body
    assert ">502<" in rows["req-11"][2]  # not JSON: the status alone
    after = re.search(r'href="([^"]+)" rel="next"', page).group(1).replace("&amp;", "&")
    assert after.endswith("after=50")
    rest = admin.get(after).text
    assert [int(n) for n in re.findall(r'<tr><td class="num">(\d+)</td><td class="mono">req-', rest)] == \
        list(range(51, 76))
    options = re.findall(r'<option value="(\w+)"', page)
    assert "running" not in options and {"pending", "queued", "failed"} <= set(options)
    assert admin.get(f"/admin/jobs/{row['id']}", params={"state": "running"}).status_code == 400


def test_an_ended_batch_shows_when_it_ended_and_refuses_a_cancel(gateway):
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("completed",))
    browser = gateway.http(tenant=None)
    assert browser.post("/admin/login", data={"key": ADMIN_KEY}).status_code == 303
    listing = browser.get("/admin").text
    cell = re.search(rf'<tr data-batch="{row["id"]}">(.*?)</tr>', listing, re.S).group(1)
    assert "ended" in cell and " in " not in cell  # no deadline "in 23h 54m" for a finished batch
    page = browser.get(f"/admin/jobs/{row['id']}").text
    ended = re.search(r'id="job-ended">([^<]+)<', page).group(1)
    assert ended.startswith("2026-09-21") and "ago" in ended  # BASE_TIME, in the past
    csrf = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page).group(1)
    refused = browser.post(f"/admin/jobs/{row['id']}/cancel", data={"csrf_token": csrf})
    assert refused.status_code == 303 and refused.headers["location"].endswith("?notice=cancel_refused")
    shown = browser.get(refused.headers["location"]).text
    assert "Cannot cancel a batch with status &#39;completed&#39;." in shown and "Cancel requested" not in shown
    assert 'id="job-status">completed<' in shown


def test_bad_cursors_and_filters_are_400s_never_500s(gateway):
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("in_progress",))
    admin = _admin(gateway)
    for path, params in [("/admin/api/jobs", {"after": "99999999999999999999999999~batch_abc"}),
                         ("/admin/api/jobs", {"after": "\u0661\u0662~batch_abc"}),  # Arabic-Indic digits
                         ("/admin/api/jobs", {"after": "12~batch\x00"}),
                         ("/admin/api/jobs", {"tenant": "acme\x00"}),
                         (f"/admin/jobs/{row['id']}", {"after": "\x00"}),
                         (f"/admin/jobs/{row['id']}", {"after": "99999999999"}),
                         (f"/admin/jobs/{row['id']}", {"after": "req-1"}),
                         ("/admin/tenants", {"after": "\x00"}),
                         ("/admin/fragments/tenants", {"after": "a\x00"})]:
        answer = admin.get(path, params=params)
        assert answer.status_code == 400, (path, params, answer.status_code, answer.text[:300])
    error = admin.get("/admin/api/jobs", params={"after": "9" * 26 + "~batch_abc"}).json()["error"]
    assert error["param"] == "after" and error["type"] == "invalid_request_error"
    assert admin.get("/admin/api/jobs", params={"after": "1~batch_abc"}).json() == {"data": [], "next": None, "total": 1}
    assert admin.get("/admin/jobs/batch%00x").status_code == 404


def _seed_requests(session, batch_id: str, states: dict[str, int]) -> None:
    """Give ``batch_id`` requests in ``states`` (``{state: count}``), lines in that order."""
    rows, line = [], 0
    for state, count in states.items():
        for _ in range(count):
            line += 1
            rows.append({"batch_id": batch_id, "custom_id": f"r{line}", "line": line, "byte_offset": line,
                         "byte_length": 1, "prefix_key": b"", "est_tokens": 1, "state": state})
    session.execute(insert(BatchRequest), rows)


def _cell(html: str, element_id: str) -> str:
    """The text of the element with ``element_id`` (tags dropped, spaces collapsed)."""
    inner = re.search(rf'<(\w+)[^>]*id="{element_id}"[^>]*>(.*?)</\1>', html, re.S).group(2)
    return " ".join(re.sub(r"<[^>]+>", " ", inner).split())


def test_a_cancelled_batch_shows_cancelled_requests_apart_with_the_api_counts(gateway):
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("cancelled",))
        session.execute(text("UPDATE batches SET request_completed = 52, request_failed = 148 WHERE id = :id"),
                        {"id": row["id"]})
        _seed_requests(session, row["id"], {"succeeded": 52, "cancelled": 148})
        session.commit()
    admin = _admin(gateway)
    page = admin.get(f"/admin/jobs/{row['id']}").text
    assert _cell(page, "job-counts") == "52 ok · 0 failed · 148 cancelled / 200 total"
    # what GET /v1/batches/{id} answers: the API counts requests ended without a result as failed
    assert _cell(page, "api-counts") == "total 200 · completed 52 · failed 148"
    assert 'aria-valuenow="26"' in page and '<rect class="bad" x="26.00" width="0.00"' in page
    assert '<rect class="unrun" x="26.00" width="74.00"' in page  # grey, not red
    listing = admin.get("/admin", params={"status": "cancelled"}).text
    cell = re.search(rf'<tr data-batch="{row["id"]}">(.*?)</tr>', listing, re.S).group(1)
    assert "148<span class=\"muted\"> cancelled" in cell and "0<span class=\"muted\"> failed" in cell
    assert admin.get("/admin/api/jobs").json()["data"][0]["api_counts"] == {"total": 200, "completed": 52,
                                                                           "failed": 148}


def test_search_by_id_and_metadata_with_a_total_and_the_job_page_shows_metadata_and_window(gateway):
    with gateway.session() as session:
        rows = seed_batches(session, 9)
        for i, row in enumerate(rows):
            session.execute(text("UPDATE batches SET metadata = CAST(:m AS jsonb), completion_window = '2h' "
                                 "WHERE id = :id"),
                            {"id": row["id"], "m": orjson.dumps({"team": "nlp" if i % 3 == 0 else "vision",
                                                                  "run": str(i)}).decode()})
        session.commit()
    admin = _admin(gateway)
    nlp = admin.get("/admin/api/jobs", params={"q": "team=nlp", "limit": 2}).json()
    assert nlp["total"] == 3 and len(nlp["data"]) == 2 and nlp["next"]
    assert _walk(admin, q="team=nlp", limit=2) == _order([r for i, r in enumerate(rows) if i % 3 == 0])
    both = admin.get("/admin/api/jobs", params={"q": "team=nlp run=3"}).json()
    assert [job["id"] for job in both["data"]] == [rows[3]["id"]] and both["total"] == 1
    target = rows[4]["id"]
    by_id = admin.get("/admin/api/jobs", params={"q": target}).json()
    assert [job["id"] for job in by_id["data"]] == [target] and by_id["total"] == 1
    prefix = admin.get("/admin/api/jobs", params={"q": "batch_00000"}).json()  # batch_000000 … batch_000008
    assert prefix["total"] == 9
    assert admin.get("/admin/api/jobs", params={"q": "batch_%"}).json()["total"] == 0  # LIKE's % is literal
    assert admin.get("/admin/api/jobs", params={"q": "a b"}).status_code == 400
    assert admin.get("/admin/api/jobs", params={"q": "=x"}).status_code == 400

    listing = admin.get("/admin", params={"q": "team=vision"}).text
    assert _cell(listing, "job-total") == "6 batches match, showing 6"
    assert 'name="q" id="q" value="team=vision"' in listing
    assert "q=team%3Dvision" in listing  # the live fragment keeps the search
    assert _cell(admin.get("/admin").text, "job-total") == "9 batches, showing 9"

    page = admin.get(f"/admin/jobs/{target}").text
    assert _cell(page, "job-window") == "2h"
    assert _cell(page, "job-metadata") == "run=4 team=vision"
    assert 'href="/admin?q=team%3Dvision"' in page


def test_job_page_counts_requests_by_their_states_and_its_request_table_refreshes(gateway):
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("in_progress",))
        _seed_requests(session, row["id"], {"succeeded": 3, "queued": 38, "pending": 159})
        session.commit()
    admin = _admin(gateway)
    page = admin.get(f"/admin/jobs/{row['id']}").text
    assert _cell(page, "job-open") == ("159 pending (in Postgres, not yet fed) · 38 queued, waiting (in a lane or "
                                       "held by a processor) · 0 running (sent to the router, no answer yet)")
    # two processors report 12 of them in flight; a third's report is older than the age the page
    # trusts (it stopped or froze) and another batch's requests are not this one's
    import time as clock

    import redis as redis_client

    from common.contracts.queue import RUNNING_REPORT_MAX_AGE_S, running_key, running_report

    store = redis_client.Redis.from_url(gateway.settings.redis_url)
    now = clock.time()
    store.hset(running_key(gateway.settings.queue_pool), mapping={
        "p1": running_report(now, {row["id"]: 5, "batch_other": 9}), "p2": running_report(now, {row["id"]: 7}),
        "p3": running_report(now - RUNNING_REPORT_MAX_AGE_S - 1, {row["id"]: 20})})
    try:
        page = admin.get(f"/admin/jobs/{row['id']}").text
        assert (_cell(page, "job-waiting"), _cell(page, "job-running")) == ("26", "12")
        live = admin.get(f"/admin/fragments/jobs/{row['id']}").text  # the refreshed summary says the same
        assert (_cell(live, "job-waiting"), _cell(live, "job-running")) == ("26", "12")
    finally:
        store.delete(running_key(gateway.settings.queue_pool))
    assert "queued 38" in _cell(page, "job-states") and "pending 159" in _cell(page, "job-states")
    live = re.search(r'<tbody id="request-rows" data-refresh="([^"]+)"', page).group(1).replace("&amp;", "&")
    assert live == f"/admin/fragments/jobs/{row['id']}/requests"
    before = admin.get(live).text
    assert "<html" not in before and before.count("s-queued") == 38  # lines 4-41 of the first 50
    with gateway.session() as session:
        session.execute(text("UPDATE batch_requests SET state = 'succeeded' WHERE batch_id = :id AND line = 4"),
                        {"id": row["id"]})
        session.commit()
    after = admin.get(live).text
    assert after.count("s-queued") == 37 and after.count("s-succeeded") == 4
    filtered = admin.get(f"/admin/jobs/{row['id']}", params={"state": "queued"}).text
    assert re.search(r'data-refresh="([^"]+)"', filtered.split('id="request-rows"')[1]).group(1) == \
        f"/admin/fragments/jobs/{row['id']}/requests?state=queued"
    assert admin.get(f"/admin/fragments/jobs/{row['id']}/requests", params={"state": "bogus"}).status_code == 400
    assert admin.get("/admin/fragments/jobs/batch_nope/requests").status_code == 404


def test_the_timeline_names_the_same_second_as_the_summary(gateway):
    """The batch's ``created_at`` is ``now()`` rounded to the second; its ``batch.created`` event,
    written in the same transaction, shows the same second (truncating it was 1 s off)."""
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("in_progress",))
        created = dt.datetime.fromtimestamp(BASE_TIME - 0.4, dt.UTC)  # rounds to BASE_TIME
        session.execute(text("INSERT INTO events (batch_id, tenant_id, type, created_at) "
                             "SELECT id, tenant_id, 'batch.created', :at FROM batches WHERE id = :id"),
                        {"id": row["id"], "at": created})
        session.commit()
    page = _admin(gateway).get(f"/admin/jobs/{row['id']}").text
    summary = re.search(r"<dt>Created</dt><dd>([^<]+)</dd>", page).group(1)
    when = re.search(r'<span class="when">([^<]+)</span> <span class="event">batch.created</span>', page).group(1)
    assert summary == when == "2026-09-21 14:13:20"


def test_a_batch_that_failed_validation_shows_no_progress_bar(gateway):
    with gateway.session() as session:
        [row] = seed_batches(session, 1, statuses=("failed",))
        session.execute(text("UPDATE batches SET request_total = 0, request_completed = 0 WHERE id = :id"),
                        {"id": row["id"]})
        session.commit()
    admin = _admin(gateway)
    page = admin.get(f"/admin/jobs/{row['id']}").text
    assert 'role="progressbar"' not in page and "no-progress" in page
    listing = admin.get("/admin").text
    cell = re.search(rf'<tr data-batch="{row["id"]}">(.*?)</tr>', listing, re.S).group(1)
    assert 'role="progressbar"' not in cell and "%</span>" not in cell
    assert admin.get("/admin/api/jobs").json()["data"][0]["percent"] is None
