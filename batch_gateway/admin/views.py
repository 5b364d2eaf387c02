"""The dashboard's pages, fragments (for live refresh) and JSON, all under ``/admin``.

Pages: ``/admin`` (jobs), ``/admin/jobs/{id}``, ``/admin/lanes``, ``/admin/fleet``,
``/admin/responses`` (background responses), ``/admin/tenants``, ``/admin/login``. ``/admin/fragments/…`` answer the part of a page that the
page's script re-reads every few seconds; ``/admin/api/jobs`` and ``/admin/api/state`` answer JSON.
Every route needs the admin key (:mod:`batch_gateway.admin.auth`).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

import orjson
import redis
from fastapi import APIRouter, Depends, FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates

import batch_gateway.admin.auth as auth
from batch_gateway.admin.auth import Admin, AdminError, require_admin
from batch_gateway.admin.charts import line_chart
from batch_gateway.admin.health import HealthSampler, freshness, health_bounds, health_urls
from batch_gateway.admin.router_sampler import RouterSampler, rates
from batch_gateway.api.files import content_disposition
from batch_gateway.deps import SessionDep
from batch_gateway.store import queries
from batch_gateway.store.queries import responses as response_queries
from batch_gateway.store.states import (
    ACTIVE_BATCH_STATUSES,
    CANCELLABLE_STATUSES,
    OPEN_REQUEST_STATES,
    TERMINAL_BATCH_STATUSES,
    TERMINAL_REQUEST_STATES,
    BatchStatus,
    ResponseStatus,
)
from common.contracts.queue import LANE_PRIORITIES, running_counts, running_key
from common.contracts.router_state import GATE_REASON_TEXT, SATURATION_THRESHOLD

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
STATIC = {"admin.css": "text/css", "admin.js": "text/javascript"}

BATCH_STATUSES = (*ACTIVE_BATCH_STATUSES, *TERMINAL_BATCH_STATUSES)
REQUEST_STATES = (*OPEN_REQUEST_STATES, *TERMINAL_REQUEST_STATES)
"""A batch request's states (``batch_gateway.store.models.BatchRequest``): ``pending`` (in Postgres, not
yet fed), ``queued`` (handed to the processors' queue, no result yet), then a terminal one."""
ENDED_AT = {status: f"{status}_at" for status in TERMINAL_BATCH_STATUSES}
"""The ``*_at`` column holding when a batch in each terminal status ended."""
MAX_BIGINT = 2**63 - 1
MAX_INTEGER = 2**31 - 1
"""Largest PostgreSQL ``bigint`` / ``integer``: a larger cursor matches nothing it could name."""
PAGE_SIZE = 50
REFRESH_MS = 2000
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; form-action 'self'; frame-ancestors 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}

AdminDep = Annotated[Admin, Depends(require_admin)]


class AdminBadRequest(AdminError):
    """400: a filter or cursor the dashboard cannot read."""

    status = 400


class AdminNotFound(AdminError):
    """404: no such batch or file (of any tenant)."""

    status = 404
    code = "not_found"


NOTICES = ("cancel_requested", "cancel_refused")
"""What the job page may say after its cancel form: ``?notice=…``."""


def _body_error(body: bytes | None) -> tuple[str | None, str | None]:
    """``(code, message)`` of an error response body: OpenAI's ``{"error": {"code", "message"}}``
    or vLLM's flat ``{"message", "code"}``; ``(None, None)`` when it is neither (or not JSON)."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(parsed, dict):
        return None, None
    inner = parsed.get("error")
    error: dict[Any, Any] = inner if isinstance(inner, dict) else parsed
    code, message = error.get("code"), error.get("message")
    return (str(code) if code not in (None, "") else None,
            message if isinstance(message, str) else None)


def request_view(row) -> dict[str, Any]:
    """One row of the job page's request outcomes (a row of :func:`queries.admin_request_page`),
    its ``error_code`` / ``error_message`` taken from the response body when the request failed with
    an HTTP error (the row's own fields are set only when no response came)."""
    view = row._asdict()
    body = view.pop("error_body")
    if body is not None and view["error_message"] is None:
        code, message = _body_error(body)
        view["error_code"] = view["error_code"] or code
        view["error_message"] = message
    return view


# --- formatting ------------------------------------------------------------------------------


def fmt_time(value: float | int | None) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS`` UTC (``—`` for None)."""
    if value is None:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value))


def fmt_in(value: float | None, now: float) -> str:
    """How far ``value`` (Unix s) is from ``now``: ``in 3m 20s`` / ``5m ago``."""
    if value is None:
        return "—"
    later, seconds = value > now, int(abs(value - now))  # a reading of this instant is "0s ago"
    text = (f"{seconds}s" if seconds < 60 else f"{seconds // 60}m {seconds % 60:02d}s" if seconds < 3600
            else f"{seconds // 3600}h {seconds % 3600 // 60:02d}m")
    return f"in {text}" if later else f"{text} ago"


def fmt_pct(value: float | None) -> str:
    """A fraction 0..1 as a whole percentage (``80%``; ``—`` for None)."""
    return "—" if value is None else f"{100 * value:.0f}%"


templates.env.filters["time"] = fmt_time
templates.env.globals["pct"] = fmt_pct
templates.env.globals["fmt_in"] = fmt_in
templates.env.globals["cancel_refusal"] = queries.terminal_cancel_refusal
templates.env.globals["state_meaning"] = {
    "pending": "in Postgres, not yet fed to the processors",
    "queued": "handed to the processors: waiting in a lane or running at an engine (no result yet)",
    "succeeded": "answered 2xx", "failed": "answered with an error, or none came",
    "cancelled": "ended by the batch's cancel without running", "expired": "ended by the deadline without running"}
"""What each request state means, shown on the job page (the states of
:class:`batch_gateway.store.states.RequestState`)."""


def estimated_finish(total: int, done: int, in_progress_at: int | None, now: float) -> float | None:
    """When the batch will have every request done (Unix s) at its rate so far:
    ``now + (total - done) × (now - in_progress_at) / done``; None before the first result, when
    everything is done, or before the batch started."""
    if in_progress_at is None or done <= 0 or done >= total or now <= in_progress_at:
        return None
    return now + (total - done) * (now - in_progress_at) / done


def unix_seconds(moment: dt.datetime) -> int:
    """``moment`` in whole Unix seconds, rounded to the nearest as the batch's own ``*_at`` fields
    are (``extract(epoch from now())::bigint`` rounds, :data:`batch_gateway.store.models.EPOCH_NOW`),
    so the timeline and the summary name the same second."""
    return math.floor(moment.timestamp() + 0.5)


def job_view(batch, tenant: str, now: float, unrun: dict[str, int] | None = None) -> dict[str, Any]:
    """What the job list and the job page show of one batch (counts from the batch row);
    ``ended`` says it is in a terminal status and ``ended_at`` (Unix s) when it got there.

    ``unrun`` (:func:`queries.ended_unrun_counts`) holds the batch's requests that ended without
    running (``cancelled``, ``expired``): the batch row, like the API's ``request_counts``
    (``request_counts`` = ``{total, completed, failed}``, kept as ``api_counts``), counts them as
    failed; the dashboard shows them apart, in a neutral colour, and ``failed`` is the rest.
    ``percent`` is the share of requests that ran to a result (the whole bar only for
    ``completed``); a batch that failed validation has no requests and shows no bar
    (``percent`` None)."""
    unrun = unrun or {}
    cancelled, expired = unrun.get("cancelled", 0), unrun.get("expired", 0)
    total = batch.request_total
    failed = max(0, batch.request_failed - cancelled - expired)
    done = batch.request_completed + batch.request_failed
    ran = batch.request_completed + failed
    if batch.status == BatchStatus.COMPLETED:
        percent: int | None = 100
    elif batch.status == BatchStatus.FAILED and not total:
        percent = None  # failed validation: nothing ran, no progress to show
    else:
        percent = 100 * ran // total if total else 0
    eta = estimated_finish(total, done, batch.in_progress_at, now) if batch.status == BatchStatus.IN_PROGRESS else None
    return {"id": batch.id, "tenant": tenant, "model": batch.model, "endpoint": batch.endpoint,
            "status": batch.status, "total": total, "completed": batch.request_completed,
            "failed": failed, "cancelled": cancelled, "expired": expired, "done": done, "ran": ran,
            "percent": percent,
            "api_counts": {"total": total, "completed": batch.request_completed, "failed": batch.request_failed},
            "created_at": batch.created_at, "in_progress_at": batch.in_progress_at,
            "expires_at": batch.expires_at, "eta": eta, "active": batch.status in ACTIVE_BATCH_STATUSES,
            "ended": batch.status in ENDED_AT,
            "ended_at": getattr(batch, ENDED_AT[batch.status]) if batch.status in ENDED_AT else None,
            "cancellable": batch.status in CANCELLABLE_STATUSES}


def _render(request: Request, name: str, admin: Admin | None, status_code: int = 200,
            **context) -> HTMLResponse:
    context.update(admin=admin, now=time.time(), refresh_ms=REFRESH_MS, csrf_field=auth.CSRF_FIELD)
    return templates.TemplateResponse(request, name, context, status_code=status_code,
                                      headers=SECURITY_HEADERS)


# --- jobs ------------------------------------------------------------------------------------


def _number(text: str, largest: int) -> int | None:
    """``text`` as a non-negative integer up to ``largest`` (ASCII digits only), else None."""
    if not (text.isascii() and text.isdigit()) or int(text) > largest:
        return None
    return int(text)


def _bad_cursor(after: str) -> AdminBadRequest:
    return AdminBadRequest(f"Invalid cursor {after[:80]!r}; use the link the page gives.", param="after")


def _cursor(after: str | None) -> queries.BatchCursor | None:
    """The job list's cursor ``CREATED_AT~BATCH_ID``; raises :class:`AdminBadRequest` (400) for
    anything else, including a number beyond ``bigint`` and a NUL byte."""
    if after is None:
        return None
    created, _, batch_id = after.partition("~")
    number = _number(created, MAX_BIGINT)
    if number is None or not batch_id or not queries.can_exist(batch_id):
        raise _bad_cursor(after)
    return number, batch_id


def _line_cursor(after: str | None) -> int | None:
    """The request list's cursor: the input line number of the last request shown (400 otherwise)."""
    if after is None:
        return None
    number = _number(after, MAX_INTEGER)
    if number is None:
        raise _bad_cursor(after)
    return number


def _text_param(value: str | None, param: str) -> str | None:
    """``value`` unless it holds a NUL byte, which no stored text can (400, never a database error)."""
    if value is not None and not queries.can_exist(value):
        raise AdminBadRequest(f"Invalid value for '{param}': it contains a NUL byte.", param=param)
    return value


UNRUN_STATUSES = (BatchStatus.CANCELLING, BatchStatus.CANCELLED, BatchStatus.EXPIRED)
"""Batches whose requests may have ended without running (their cancelled / expired requests are
counted for the job list)."""


def search_terms(q: str | None) -> tuple[str | None, dict[str, str]]:
    """The job list's search box: ``key=value`` words are metadata pairs the batch must hold, one
    other word is a batch id or the start of one, e.g. ``batch_4f team=nlp``. Raises
    :class:`AdminBadRequest` (400) for two id words or an empty key."""
    id_prefix, metadata = None, {}
    for word in (_text_param(q, "q") or "").split():
        key, sep, value = word.partition("=")
        if sep:
            if not key:
                raise AdminBadRequest(f"Invalid search {word[:80]!r}: a metadata key comes before '='.", param="q")
            metadata[key] = value
        elif id_prefix is not None:
            raise AdminBadRequest("Search for one batch id (or its start) and any key=value pairs.", param="q")
        else:
            id_prefix = word
    return id_prefix, metadata


def _jobs(session, status: str | None, tenant: str | None, after: str | None, limit: int,
          q: str | None = None) -> dict:
    """A page of the job list with its filters and ``total``: how many batches match them."""
    if status is not None and status not in BATCH_STATUSES:
        raise AdminBadRequest(f"Unknown status '{status[:40]}'; one of: {', '.join(BATCH_STATUSES)}.",
                              param="status")
    id_prefix, metadata = search_terms(q)
    tenant_id = None
    if tenant is not None and _text_param(tenant, "tenant"):
        found = queries.tenant_by_name(session, tenant)
        if found is None:
            return {"jobs": [], "next": None, "status": status, "tenant": tenant, "q": q, "total": 0}
        tenant_id = found.id
    where = queries.BatchFilter(status=status, tenant_id=tenant_id, id_prefix=id_prefix, metadata=metadata)
    rows, more = queries.admin_list_batches(session, limit=limit, after=_cursor(after), where=where)
    unrun = queries.ended_unrun_counts(session, [b.id for b, _ in rows if b.status in UNRUN_STATUSES])
    now = time.time()
    jobs = [job_view(batch, name, now, unrun.get(batch.id)) for batch, name in rows]
    last = rows[-1][0] if rows else None
    return {"jobs": jobs, "next": f"{last.created_at}~{last.id}" if more and last else None,
            "status": status, "tenant": tenant, "q": q, "total": queries.admin_count_batches(session, where)}


def _query(**params) -> str:
    return urlencode({k: v for k, v in params.items() if v not in (None, "")})


Status = Annotated[str | None, Query(max_length=32)]
Search = Annotated[str | None, Query(max_length=1000)]
TenantName = Annotated[str | None, Query(max_length=256)]
After = Annotated[str | None, Query(max_length=200)]
Limit = Annotated[int, Query(ge=1, le=200)]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the Redis client (``app.state.admin_redis``) and, with an admin key, start the health
    sampler (``app.state.admin_health``) and, with ``BACKFILL_ROUTER_URL`` too, the router sampler
    (``app.state.admin_sampler``; each None otherwise); close them at shutdown."""
    settings = app.state.settings
    app.state.admin_redis = redis.Redis.from_url(settings.redis_url, socket_timeout=2.0,
                                                 socket_connect_timeout=2.0)
    sampler = health = None
    if settings.admin_key and settings.router_url:
        sampler = RouterSampler(settings.router_url, settings.router_poll_seconds, settings.router_history)
        sampler.start()
    if settings.admin_key:
        health = HealthSampler(health_urls(settings), Path(settings.data_dir), settings.health_poll_seconds)
        health.start()
    app.state.admin_sampler, app.state.admin_health = sampler, health
    try:
        yield
    finally:
        for running in (sampler, health):
            if running is not None:
                await running.stop()
        app.state.admin_redis.close()


router = APIRouter(prefix="/admin", include_in_schema=False, lifespan=_lifespan)
"""The ``/admin`` routes, named handlers; the lifespan opens the Redis client and the router sampler."""


@router.get("/static/{name}")
def static(name: str) -> Response:
    """A file of the dashboard's static assets (404 for a name not shipped)."""
    if name not in STATIC:
        raise AdminNotFound("No such file.")
    return Response((HERE / "static" / name).read_bytes(), media_type=STATIC[name],
                    headers={"cache-control": "max-age=300"})


# --- routes: login ---------------------------------------------------------------------------


@router.get("/login")
def login_page(request: Request, next: Annotated[str, Query(max_length=500)] = "/admin") -> HTMLResponse:
    """The admin key form."""
    auth.enabled(request.app.state.settings)
    return _render(request, "login.html", None, next=_safe_next(next), error=None)


@router.post("/login")
def login(request: Request, key: Annotated[str, Form(max_length=512)] = "",
          next: Annotated[str, Form(max_length=500)] = "/admin") -> Response:
    """Check the admin key; set the session cookie and go to ``next`` (a safe local path), or show
    the form again with the refusal."""
    settings = request.app.state.settings
    admin_key = auth.enabled(settings)
    try:
        auth.check_key(settings, key, request.app.state.sessionmaker)
    except (auth.AdminLoginRequired, auth.AdminForbiddenError) as exc:
        log.info("admin login refused", extra={"action": "admin_login_refused", "reason": exc.code})
        return _render(request, "login.html", None, status_code=exc.status, next=_safe_next(next),
                       error=exc.message)
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(auth.COOKIE, auth.session_token(admin_key), max_age=settings.admin_session_seconds,
                        path="/admin", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    log.info("admin login", extra={"action": "admin_login"})
    return response


@router.post("/logout")
def logout(admin: AdminDep, csrf_token: Annotated[str | None, Form()] = None) -> Response:
    """Clear the session cookie; back to the login form."""
    auth.check_csrf(admin, csrf_token)
    response = RedirectResponse("/admin/login", status_code=303)
    response.delete_cookie(auth.COOKIE, path="/admin")
    return response


# --- routes: jobs ----------------------------------------------------------------------------


@router.get("")
def jobs_page(request: Request, admin: AdminDep, session: SessionDep, status: Status = None,
              tenant: TenantName = None, after: After = None, limit: Limit = PAGE_SIZE,
              q: Search = None) -> HTMLResponse:
    """The jobs list: every tenant's batches, searchable by id and metadata, with a total."""
    page = _jobs(session, status or None, tenant or None, after, limit, q or None)
    filters = {"status": status, "tenant": tenant, "q": q}
    return _render(request, "jobs.html", admin, nav="jobs", statuses=BATCH_STATUSES,
                   tenants=queries.tenant_names(session), **page,
                   fragment=f"/admin/fragments/jobs?{_query(**filters, after=after, limit=limit)}",
                   next_url=(f"/admin?{_query(**filters, after=page['next'], limit=limit)}"
                             if page["next"] else None),
                   first_url=f"/admin?{_query(**filters, limit=limit)}" if after else None)


@router.get("/jobs")
def jobs_alias(request: Request) -> RedirectResponse:
    """``/admin/jobs`` (where a job's page lives below) is the job list at ``/admin``; the
    query string is kept."""
    query = request.url.query
    return RedirectResponse("/admin" + (f"?{query}" if query else ""), status_code=307)


@router.get("/fragments/jobs")
def jobs_fragment(request: Request, admin: AdminDep, session: SessionDep, status: Status = None,
                  tenant: TenantName = None, after: After = None, limit: Limit = PAGE_SIZE,
                  q: Search = None) -> HTMLResponse:
    """The jobs list's table, for the page's live refresh."""
    return _render(request, "_job_rows.html", admin, **_jobs(session, status or None, tenant or None,
                                                             after, limit, q or None))


@router.get("/api/jobs")
def jobs_json(admin: AdminDep, session: SessionDep, status: Status = None, tenant: TenantName = None,
              after: After = None, limit: Limit = PAGE_SIZE, q: Search = None) -> dict:
    """``{"data": [job, …], "next": cursor | null, "total": n}``: a page of every tenant's
    batches, newest first (``q``: :func:`search_terms`); ``next`` goes back as ``after``, ``total``
    counts every batch the filters match."""
    page = _jobs(session, status or None, tenant or None, after, limit, q or None)
    return {"data": page["jobs"], "next": page["next"], "total": page["total"]}


def running_requests(client: redis.Redis, pool: str, batch_id: str) -> int | None:
    """Requests of ``batch_id`` the processors have in flight at the router now (their reports in
    :func:`~common.contracts.queue.running_key`, :mod:`async_processor.running`); None when Redis
    cannot be read."""
    try:
        fields = client.hgetall(running_key(pool))
    except redis.RedisError:
        return None
    return running_counts(fields, time.time()).get(batch_id, 0)


def _job(session, batch_id: str, running: int | None) -> dict:
    """The job page's batch (:func:`job_view` and its detail), timeline and request counts; 404 when
    no tenant has ``batch_id``. ``running`` (:func:`running_requests`; None: unknown) of the
    ``queued`` requests are in flight at the router; ``open_states`` has ``pending``, ``waiting``
    (queued, not in flight: in a lane or held by a processor), ``running`` and ``queued`` (both)."""
    row = queries.admin_get_batch(session, batch_id)
    if row is None:
        raise AdminNotFound(f"No such Batch object: {batch_id[:100]}", param="batch_id")
    batch, tenant = row
    states = queries.request_state_counts(session, batch_id)
    job = job_view(batch, tenant, time.time(), {s: n for s, n in states.items() if s in ("cancelled", "expired")})
    job.update(errors=(batch.errors or []), input_file_id=batch.input_file_id,
               output_file_id=batch.output_file_id, error_file_id=batch.error_file_id,
               completion_window=batch.completion_window, metadata=batch.metadata_ or {},
               usage={"input": batch.usage_input_tokens, "cached": batch.usage_cached_tokens,
                      "output": batch.usage_output_tokens})
    timeline = [{"type": e.type, "at": unix_seconds(e.created_at), "payload": e.payload}
                for e in queries.batch_events(session, batch_id)]
    open_states: dict[str, int | None] = {state: states.get(state, 0) for state in OPEN_REQUEST_STATES}
    queued = states.get("queued", 0)
    in_flight = None if running is None else min(running, queued)  # a report may lag a result by a second
    open_states.update(running=in_flight, waiting=None if in_flight is None else queued - in_flight)
    return {"job": job, "timeline": timeline, "states": states, "open_states": open_states}


def _job_of(request: Request, session, batch_id: str) -> dict:
    """:func:`_job` with the processors' running count from the dashboard's Redis."""
    settings = request.app.state.settings
    return _job(session, batch_id, running_requests(request.app.state.admin_redis, settings.queue_pool, batch_id))


def _requests(session, batch_id: str, state: str | None, after: str | None) -> tuple[list[dict], Any]:
    """A page of the job page's request table and the last row's line when more follow (else None)."""
    if state is not None and state not in REQUEST_STATES:
        raise AdminBadRequest(f"Unknown request state '{state[:40]}'.", param="state")
    rows, more = queries.admin_request_page(session, batch_id, limit=PAGE_SIZE, after=_line_cursor(after),
                                            state=state)
    return [request_view(r) for r in rows], rows[-1].line if more else None


@router.get("/jobs/{batch_id}")
def job_page(request: Request, batch_id: str, admin: AdminDep, session: SessionDep,
             state: Status = None, after: After = None,
             notice: Annotated[str | None, Query(max_length=32)] = None) -> HTMLResponse:
    """One batch: its summary, requests by state, timeline and requests."""
    detail = _job_of(request, session, batch_id)
    requests, last = _requests(session, batch_id, state, after)
    base = f"/admin/jobs/{batch_id}"
    notice = notice if notice in NOTICES else None
    return _render(request, "job.html", admin, nav="jobs", **detail, requests=requests,
                   request_states=REQUEST_STATES, state=state, notice=notice,
                   fragment=f"/admin/fragments/jobs/{batch_id}?{_query(notice=notice)}".rstrip("?"),
                   rows_fragment=f"/admin/fragments/jobs/{batch_id}/requests?{_query(state=state, after=after)}".rstrip("?"),
                   next_url=f"{base}?{_query(state=state, after=last)}" if last is not None else None,
                   first_url=f"{base}?{_query(state=state)}" if after else None)


@router.get("/fragments/jobs/{batch_id}/requests")
def requests_fragment(request: Request, batch_id: str, admin: AdminDep, session: SessionDep,
                      state: Status = None, after: After = None) -> HTMLResponse:
    """The job page's request table rows (the same page of them), re-read by the page's script."""
    if queries.admin_get_batch(session, batch_id) is None:
        raise AdminNotFound(f"No such Batch object: {batch_id[:100]}", param="batch_id")
    requests, _ = _requests(session, batch_id, state, after)
    return _render(request, "_request_rows.html", admin, requests=requests, state=state)


@router.get("/fragments/jobs/{batch_id}")
def job_fragment(request: Request, batch_id: str, admin: AdminDep, session: SessionDep,
                 notice: Annotated[str | None, Query(max_length=32)] = None) -> HTMLResponse:
    """One batch's live parts, for the page's refresh."""
    return _render(request, "_job_summary.html", admin, **_job_of(request, session, batch_id),
                   notice=notice if notice in NOTICES else None)


@router.post("/jobs/{batch_id}/cancel")
def cancel(request: Request, batch_id: str, admin: AdminDep, session: SessionDep,
           csrf_token: Annotated[str | None, Form()] = None) -> Response:
    """Cancel through the API's own path and rule (:func:`queries.request_cancel`,
    :data:`queries.CANCEL_RULE`; the outbox hands the cancel task to the worker), then back to the
    job page with ``notice=cancel_requested``; a batch that had already ended (cancelled
    included) goes back with ``notice=cancel_refused`` (the API answers 409 "Cannot cancel a
    batch with status '…'." there)."""
    auth.check_csrf(admin, csrf_token)
    row = queries.admin_get_batch(session, batch_id)
    if row is None:
        raise AdminNotFound(f"No such Batch object: {batch_id[:100]}", param="batch_id")
    outcome = queries.request_cancel(session, row[0].tenant_id, batch_id)
    assert outcome is not None  # the batch was just read
    session.commit()
    request.app.state.outbox.wake()  # the cancel task goes out off the request, as the API's
    moved, refusal = outcome.batch, outcome.refusal
    log.info("batch cancel refused" if refusal else "batch cancel",
             extra={"action": "batch_cancel_refused" if refusal else "batch_cancel", "batch_id": batch_id,
                    "tenant": row[1], "status": moved.status, "by": "admin"})
    notice = "cancel_refused" if refusal else "cancel_requested"
    return RedirectResponse(f"/admin/jobs/{batch_id}?notice={notice}", status_code=303)


@router.get("/files/{file_id}")
def file_download(request: Request, file_id: str, admin: AdminDep, session: SessionDep) -> StreamingResponse:
    """A batch's input, output or error file, streamed as stored."""
    row = queries.get_any_file(session, file_id)
    chunks = None
    if row is not None:
        try:
            chunks = request.app.state.store.read(row.storage_key)
        except FileNotFoundError:
            chunks = None
    if row is None or chunks is None:
        raise AdminNotFound(f"No such File object: {file_id[:100]}", param="file_id")
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"content-disposition": content_disposition(row.filename)})


# --- routes: lanes and fleet -----------------------------------------------------------------


def _live_page(request: Request, admin: Admin, name: str, build: Callable[[Request], dict]) -> HTMLResponse:
    """``/admin/NAME``: the page, its live part from ``build(request)``."""
    return _render(request, f"{name}.html", admin, nav=name, fragment=f"/admin/fragments/{name}", **build(request))


@router.get("/lanes", name="admin_lanes")
def lanes_page(request: Request, admin: AdminDep) -> HTMLResponse:
    """The Lanes page: the gate, each engine's gate and each objective's queues and counts."""
    return _live_page(request, admin, "lanes", _lanes)


@router.get("/fragments/lanes", name="admin_lanes_fragment")
def lanes_fragment(request: Request, admin: AdminDep) -> HTMLResponse:
    """The Lanes page's live part."""
    return _render(request, "_lanes.html", admin, **_lanes(request))


@router.get("/fleet", name="admin_fleet")
def fleet_page(request: Request, admin: AdminDep) -> HTMLResponse:
    """The Fleet page: each engine's saturation, slots and KV use from the router's state."""
    return _live_page(request, admin, "fleet", _fleet)


@router.get("/fragments/fleet", name="admin_fleet_fragment")
def fleet_fragment(request: Request, admin: AdminDep) -> HTMLResponse:
    """The Fleet page's live part."""
    return _render(request, "_fleet.html", admin, **_fleet(request))


@router.get("/api/state")
def state_json(request: Request, admin: AdminDep) -> dict:
    """``{"queues": [lane depth, …], "queues_error", "router": state | null, "router_error",
    "sampled_at"}``."""
    settings = request.app.state.settings
    queues, queues_error = queue_depths(request.app.state.admin_redis, settings.queue_pool,
                                        settings.queue_consumer_group)
    sampler = request.app.state.admin_sampler
    latest = sampler.latest if sampler else None
    return {"queues": queues, "queues_error": queues_error,
            "router": latest.state.model_dump() if latest else None,
            "router_error": _router_problem(request.app.state.settings, sampler),
            "sampled_at": latest.at if latest else None}


# --- routes: health ---------------------------------------------------------------------------


def _health(request: Request) -> dict:
    """Every service's row of the health view (:meth:`HealthSampler.rows`; empty without one)."""
    health: HealthSampler | None = request.app.state.admin_health
    now = time.time()
    return {"services": health.rows(now, gateway_at=now) if health else [], "bounds": health_bounds(health)}


@router.get("/health", name="admin_health")
def health_page(request: Request, admin: AdminDep) -> HTMLResponse:
    """The Health page: every service's last answer and its age."""
    return _live_page(request, admin, "health", _health)


@router.get("/fragments/health", name="admin_health_fragment")
def health_fragment(request: Request, admin: AdminDep) -> HTMLResponse:
    """The Health page's live part."""
    return _render(request, "_health.html", admin, **_health(request))


# --- routes: background responses ------------------------------------------------------------


def _responses(session, status: str | None, after: str | None) -> dict:
    """A page of background responses over every tenant, newest first (status filter, ``after`` cursor)."""
    if status is not None and status not in set(ResponseStatus):
        raise AdminBadRequest(f"Unknown status {status[:40]!r}.")
    rows, more = response_queries.admin_list_responses(session, status=status or None, limit=PAGE_SIZE,
                                                       after=_text_param(after, "after"))
    views = [{"id": row.id, "status": row.status, "tenant": row.tenant, "model": row.model,
              "created": fmt_time(row.created_at), "started": fmt_time(row.in_progress_at),
              "ended": fmt_time(row.finished_at), "error": (row.error or {}).get("code") or ""} for row in rows]
    return {"responses": views, "more": more, "last": rows[-1].id if rows else None}


@router.get("/responses")
def responses_page(request: Request, admin: AdminDep, session: SessionDep, status: Status = None,
                   after: After = None) -> HTMLResponse:
    """Background responses of every tenant, newest first, by status."""
    page = _responses(session, status, after)
    return _render(request, "responses.html", admin, nav="responses", responses=page["responses"],
                   statuses=list(ResponseStatus), status=status,
                   next_url=f"/admin/responses?{_query(status=status, after=page['last'])}" if page["more"] else None,
                   first_url=f"/admin/responses?{_query(status=status)}".rstrip("?") if after else None)


@router.get("/api/responses")
def responses_json(admin: AdminDep, session: SessionDep, status: Status = None, after: After = None) -> dict:
    """The background responses page as JSON (``data``, ``has_more``)."""
    page = _responses(session, status, after)
    return {"data": page["responses"], "has_more": page["more"]}


# --- routes: tenants -------------------------------------------------------------------------


def _tenants(request: Request, session, after: str | None) -> dict:
    """A page of tenants by name after ``after``: reserved tokens against the limit, active batches,
    open requests per state."""
    settings = request.app.state.settings
    rows, more = queries.tenant_usage(session, limit=PAGE_SIZE, after=_text_param(after, "after"))
    open_requests = queries.open_requests_by_tenant(session, [row.id for row in rows])
    tenants: list[dict[str, Any]] = []
    for row in rows:
        limit = row.enqueued_token_limit or settings.default_enqueued_token_limit
        tenants.append({"name": row.name, "reserved": int(row.reserved_tokens), "limit": limit,
                        "percent": min(100.0, 100 * int(row.reserved_tokens) / limit) if limit else 0,
                        "active_batches": row.active_batches,
                        **{state: open_requests.get(row.id, {}).get(state, 0)
                           for state in queries.OPEN_REQUEST_STATES}})
    return {"tenants": tenants, "more": more, "last": rows[-1].name if rows else None}


@router.get("/tenants")
def tenants_page(request: Request, admin: AdminDep, session: SessionDep, after: After = None) -> HTMLResponse:
    """Tenants with their quotas and active work."""
    page = _tenants(request, session, after)
    return _render(request, "tenants.html", admin, nav="tenants", tenants=page["tenants"],
                   fragment=f"/admin/fragments/tenants?{_query(after=after)}".rstrip("?"),
                   next_url=f"/admin/tenants?{_query(after=page['last'])}" if page["more"] else None,
                   first_url="/admin/tenants" if after else None)


@router.get("/fragments/tenants")
def tenants_fragment(request: Request, admin: AdminDep, session: SessionDep,
                     after: After = None) -> HTMLResponse:
    """The tenants table, for the page's live refresh."""
    return _render(request, "_tenants.html", admin, tenants=_tenants(request, session, after)["tenants"])


def _safe_next(target: str) -> str:
    """``target`` when it is a path of the dashboard, else ``/admin`` (no open redirect)."""
    if target.startswith("/admin") and not target.startswith("//") and "\\" not in target:
        return target
    return "/admin"


def queue_depths(client: redis.Redis, pool: str, group: str) -> tuple[list[dict], str | None]:
    """Per lane (highest priority first): ``{"lane", "priority", "stream", "length", "pending",
    "dead"}`` as the queue port reports them
    (:meth:`~async_processor.backends.redis_producer.RedisLaneProducer.lane_depths`: messages not yet
    acknowledged, delivered to a processor now, dead-lettered); and an error text when Redis cannot
    be read."""
    from async_processor.backends.redis_producer import RedisLaneProducer
    from async_processor.errors import BackendError

    lanes = sorted(LANE_PRIORITIES.items(), key=lambda item: -item[1])
    try:
        depths = RedisLaneProducer(client, pool=pool).lane_depths([lane for lane, _ in lanes], group)
    except BackendError as exc:
        return [], f"Redis cannot be read ({type(exc.__cause__ or exc).__name__})"
    return [{"lane": depth.lane, "priority": priority, "stream": depth.queue, "length": depth.length,
             "pending": depth.pending, "dead": depth.dead} for depth, (_, priority) in zip(depths, lanes)], None


def _router_problem(settings, sampler: RouterSampler | None) -> str | None:
    if sampler is None:
        return "No router is configured (set BACKFILL_ROUTER_URL)."
    if sampler.latest is None and sampler.last_error is None:
        return "Waiting for the first reading of the router's state."
    if not sampler.reachable:
        return f"{sampler.last_error or 'The router cannot be read'} at {sampler.url}."
    latest = sampler.latest
    if latest is not None and freshness(latest.at, sampler.stale_after_s, time.time()) == "unknown":
        return f"The router has not answered at {sampler.url} for longer than its refresh."
    return None


def _router_context(request: Request) -> dict:
    """The router's samples, the latest state and when it was read; ``router_live`` says whether
    that reading is within its refresh (:func:`~batch_gateway.admin.health.freshness`): when not,
    the pages show the gate and the engines as unknown, with the reading's age."""
    sampler: RouterSampler | None = request.app.state.admin_sampler
    samples = list(sampler.samples) if sampler else []
    latest = samples[-1] if samples else None
    live = sampler is not None and latest is not None and sampler.reachable and \
        freshness(latest.at, sampler.stale_after_s, time.time()) == "live"
    return {"sampler": sampler, "samples": samples, "latest": latest.state if latest else None,
            "sampled_at": latest.at if latest else None, "router_live": live,
            "router_error": _router_problem(request.app.state.settings, sampler)}


def refusals(band) -> dict[str, dict[str, int]]:
    """A band's router counters as the router splits them (labels spelled as its metrics spell
    them): ``refused``, backpressure the caller re-sends (``refused_total``,
    ``backfill_router_refused_total``), and ``shed``, work truly dropped (``shed_total``,
    ``backfill_router_shed_total``); reasons never counted are left out."""
    if band is None:
        return {"refused": {}, "shed": {}}
    return {"refused": {r: n for r, n in band.refused_total.items() if n},
            "shed": {r: n for r, n in band.shed_total.items() if n}}


def _lanes(request: Request) -> dict:
    settings = request.app.state.settings
    context = _router_context(request)
    queues, queues_error = queue_depths(request.app.state.admin_redis, settings.queue_pool,
                                        settings.queue_consumer_group)
    samples, latest = context["samples"], context["latest"]
    per_objective = rates(samples)
    bands = {band.objective: band for band in latest.bands} if latest else {}

    def rate(objective: str) -> float | None:
        """The latest sample's rate, when it followed an earlier sample of the same router."""
        points = per_objective.get(objective)
        return points[-1][1] if points and latest and points[-1][0] == latest.time else None

    lanes = []
    for queue in queues:
        band = bands.pop(queue["lane"], None)
        lanes.append({**queue, "band": band, "rate": rate(queue["lane"]), **refusals(band)})
    lanes += [{"lane": name, "priority": band.priority, "stream": None, "length": None, "pending": None,
               "dead": None, "band": band, "rate": rate(name), **refusals(band)}
              for name, band in bands.items()]  # objectives the router knows with no stream (flex)
    lanes.sort(key=lambda lane: -lane["priority"])  # flex (OpenAI's service_tier) between async and batch
    now = time.time()
    saturation = {"least saturated engine (gate)": [(s.state.time, s.state.gate_saturation) for s in samples],
                  "pool mean": [(s.state.time, s.state.pool_saturation) for s in samples]}
    charts = [
        line_chart(saturation, title="Fleet saturation", now=now, threshold=SATURATION_THRESHOLD,
                   y_max=max([1.2] + [v for values in saturation.values() for _, v in values])),
        line_chart(per_objective, title="Dispatch rate per objective", unit="requests/s", now=now,
                   width=1280, height=240),  # drawn full width
    ]
    return {**context, "lanes": lanes, "queues_error": queues_error, "charts": charts,
            "threshold": SATURATION_THRESHOLD, "pool": settings.queue_pool, "gate_reasons": GATE_REASON_TEXT}


def _fleet(request: Request) -> dict:
    context = _router_context(request)
    samples = context["samples"]
    series: dict[str, list[tuple[float, float]]] = {}
    kv: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        for endpoint in sample.state.endpoints:
            if endpoint.saturation is not None:  # None while unhealthy: a gap, not a zero
                series.setdefault(endpoint.name, []).append((sample.state.time, endpoint.saturation))
            kv.setdefault(endpoint.name, []).append((sample.state.time, 100 * endpoint.kv_cache_usage_perc))
    now = time.time()
    charts = [line_chart(series, title="Saturation per engine", now=now, threshold=SATURATION_THRESHOLD,
                         y_max=max([1.2] + [v for values in series.values() for _, v in values])),
              line_chart(kv, title="KV-cache use per engine", unit="%", now=now, y_max=100)]
    return {**context, "charts": charts, "threshold": SATURATION_THRESHOLD}
