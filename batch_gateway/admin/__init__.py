"""The admin dashboard at ``/admin``: jobs, one job, lanes, fleet and tenants, for the holder of
the admin key (``BACKFILL_ADMIN_KEY``; see :mod:`.auth`).

Server-rendered Jinja2 pages with one small script (``static/admin.js``) that re-reads the live part
of a page every 2 s and asks before a cancel; charts are inline SVG drawn on the server
(:mod:`.charts`) from the router's state, sampled into a ring buffer (:mod:`.router_sampler`). Lists
are keyset-paginated; every query lives in :mod:`batch_gateway.store.queries`.

:func:`install` adds the routes (whose lifespan starts the sampler) and the handler that answers the
dashboard's errors: JSON in OpenAI's envelope under ``/admin/api`` and ``/admin/fragments``, an HTML
page elsewhere, and a redirect to the login page when a browser has no session.
"""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from batch_gateway.admin.auth import AdminError, AdminLoginRequired
from batch_gateway.errors import error_body

__all__ = ["install"]


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith(("/admin/api", "/admin/fragments"))


async def _admin_error(request: Request, exc: AdminError) -> Response:
    if _wants_json(request):
        return JSONResponse(error_body(exc), status_code=exc.status)
    if isinstance(exc, AdminLoginRequired) and request.method == "GET" and "authorization" not in request.headers:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/admin/login?next={quote(target, safe='')}", status_code=303)
    from batch_gateway.admin.views import _render

    return _render(request, "error.html", getattr(request.state, "admin", None), status_code=exc.status, error=exc)


def install(app: FastAPI) -> None:
    """Mount the dashboard on ``app`` (the gateway): routes under ``/admin`` and their error handler."""
    from batch_gateway.admin.views import router

    app.include_router(router)
    app.add_exception_handler(AdminError, _admin_error)  # type: ignore[arg-type]  # Starlette types handlers as taking any Exception
