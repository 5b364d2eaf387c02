"""Who may use the dashboard: the holder of the admin key (``BACKFILL_ADMIN_KEY``), never a tenant.

The key is entered once on ``/admin/login``, which sets the cookie :data:`COOKIE` (HttpOnly,
SameSite=Strict, Path=/admin) holding a signed session token; or it is sent on each request as
``Authorization: Bearer KEY``. Tokens are stateless: ``ISSUED.HMAC-SHA256(admin key, "session:ISSUED")``
(hex), valid for ``admin_session_seconds`` and on every gateway replica, and void as soon as the admin
key changes. Forms that change something carry :func:`csrf_token` (an HMAC of the session token),
checked on top of SameSite; a Bearer request needs none (a browser never adds that header by itself).
Keys and tokens are compared as UTF-8 bytes with :func:`hmac.compare_digest` (so a cookie or form
field with non-ASCII characters is a wrong credential, never a ``TypeError``).

Errors (``AdminError`` and its subclasses, all :class:`~batch_gateway.errors.GatewayError`)::

    AdminError
    ├── AdminDisabledError   503 no admin key configured
    ├── AdminLoginRequired   401 no credential, a wrong key, an expired session
    └── AdminForbiddenError  403 a tenant's API key, or a form without its CSRF token
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from fastapi import Request

from batch_gateway.errors import GatewayError
from batch_gateway.settings import GatewaySettings
from batch_gateway.store import queries

COOKIE = "backfill_admin"
CSRF_FIELD = "csrf_token"


class AdminError(GatewayError):
    """Root of the dashboard's access errors."""

    type = "invalid_request_error"


class AdminDisabledError(AdminError):
    """503: the gateway runs without an admin key, so the dashboard is closed."""

    status = 503
    code = "admin_disabled"


class AdminLoginRequired(AdminError):
    """401: no admin credential, a wrong one, or an expired session."""

    status = 401
    code = "invalid_admin_key"


class AdminForbiddenError(AdminError):
    """403: a tenant's API key (tenants never see the dashboard), or a missing CSRF token."""

    status = 403
    code = "admin_key_required"


DISABLED = ("The admin dashboard is off: start the gateway with an admin key "
            "(backfill up --admin-key KEY, or BACKFILL_ADMIN_KEY).")
TENANT_KEY = ("This is a tenant's API key; the admin dashboard accepts only the admin key "
              "(BACKFILL_ADMIN_KEY).")
WRONG_KEY = "Incorrect admin key."
NO_CREDENTIAL = "Log in with the admin key, or send it as Authorization: Bearer KEY."


def _sign(admin_key: str, message: str) -> str:
    return hmac.new(admin_key.encode(), message.encode(), hashlib.sha256).hexdigest()


def session_token(admin_key: str, issued: int | None = None) -> str:
    """A session token issued at Unix second ``issued`` (default now)."""
    issued = int(time.time()) if issued is None else issued
    return f"{issued}.{_sign(admin_key, f'session:{issued}')}"


def session_valid(admin_key: str, token: str, max_age_seconds: int, now: float | None = None) -> bool:
    """Whether ``token`` was signed with ``admin_key`` less than ``max_age_seconds`` ago."""
    issued, _, signature = token.partition(".")
    if not (issued.isascii() and issued.isdigit()):
        return False
    now = time.time() if now is None else now
    if not 0 <= now - int(issued) < max_age_seconds:
        return False
    return _same(signature, _sign(admin_key, f"session:{issued}"))


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of two secrets, compared as UTF-8 bytes (``hmac.compare_digest``
    refuses ``str`` with non-ASCII characters)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


def csrf_token(admin_key: str, token: str) -> str:
    """The CSRF token of the session ``token`` (forms send it as ``csrf_token``)."""
    return _sign(admin_key, f"csrf:{token}")


@dataclass(frozen=True)
class Admin:
    """An authenticated dashboard user: ``via`` ``"cookie"`` or ``"bearer"``; ``csrf`` is the token
    forms must carry (None for Bearer requests, which need none)."""

    via: str
    csrf: str | None


def check_key(settings: GatewaySettings, key: str, session_factory) -> None:
    """Accept ``key`` if it is the admin key; raise :class:`AdminForbiddenError` for a tenant's key
    and :class:`AdminLoginRequired` for anything else."""
    if settings.admin_key is not None and _same(key, settings.admin_key):
        return
    with session_factory() as session:
        if queries.tenant_for_key(session, key) is not None:
            raise AdminForbiddenError(TENANT_KEY)
    raise AdminLoginRequired(WRONG_KEY)


def enabled(settings: GatewaySettings) -> str:
    """The admin key; raises :class:`AdminDisabledError` when none is configured."""
    if not settings.admin_key:
        raise AdminDisabledError(DISABLED)
    return settings.admin_key


def require_admin(request: Request) -> Admin:
    """FastAPI dependency: the request's admin credential (Bearer header first, then the session
    cookie). Raises :class:`AdminDisabledError`, :class:`AdminLoginRequired` or
    :class:`AdminForbiddenError`."""
    settings: GatewaySettings = request.app.state.settings
    admin_key = enabled(settings)
    header = request.headers.get("authorization")
    if header:
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AdminLoginRequired(NO_CREDENTIAL)
        check_key(settings, key.strip(), request.app.state.sessionmaker)
        admin = Admin(via="bearer", csrf=None)
    else:
        token = request.cookies.get(COOKIE)
        if not (token and session_valid(admin_key, token, settings.admin_session_seconds)):
            raise AdminLoginRequired(NO_CREDENTIAL)
        admin = Admin(via="cookie", csrf=csrf_token(admin_key, token))
    request.state.admin = admin  # error pages of this request keep the navigation
    return admin


def check_csrf(admin: Admin, submitted: str | None) -> None:
    """Refuse (403) a cookie-authenticated form whose ``csrf_token`` is missing or wrong."""
    if admin.csrf is None:
        return
    if not submitted or not _same(submitted, admin.csrf):
        raise AdminForbiddenError("The form's CSRF token is missing or wrong; reload the page and try again.",
                                  code="csrf_failed")
