"""FastAPI dependency aliases: ``SessionDep``, ``TenantDep``, ``SettingsDep``, ``StoreDep``.

The tenant comes from the ``Authorization: Bearer`` credential only; every query takes it
explicitly. The credential is checked in a session of its own that is closed before the handler
runs, so no database connection is held while a handler streams bytes (an upload, a download);
``SessionDep``'s session takes a connection only at its first query.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from batch_gateway.errors import AuthenticationError, InvalidRequestError
from batch_gateway.settings import GatewaySettings
from batch_gateway.store import queries
from batch_gateway.store.files import FileStore
from batch_gateway.store.models import Tenant

NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
QUERY_KEY_NAMES = ("api_key", "api-key", "key", "access_token")


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


def _settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


def _store(request: Request) -> FileStore:
    return request.app.state.store


def bearer_key(request: Request) -> str:
    """The API key from ``Authorization: Bearer KEY``. Keys in the query string are refused.

    Raises :class:`AuthenticationError` (401) when missing or malformed and
    :class:`InvalidRequestError` (400) when a key is put in the URL.
    """
    if any(name in request.query_params for name in QUERY_KEY_NAMES):
        raise InvalidRequestError(
            "API keys are not accepted in the URL; send them in the Authorization header.",
            code="invalid_api_key",
        )
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if not header or scheme.lower() != "bearer" or not key:
        raise AuthenticationError(NO_KEY, code=None if not header else "invalid_api_key")
    return key


def _tenant(request: Request) -> Tenant:
    key = bearer_key(request)
    with request.app.state.sessionmaker() as session:  # returned to the pool before the handler runs
        tenant = queries.tenant_for_key(session, key)
    if tenant is None:
        shown = key[:6] + "*" * 4 + key[-4:] if len(key) > 12 else "*" * 4
        raise AuthenticationError(f"Incorrect API key provided: {shown}.")
    return tenant


SessionDep = Annotated[Session, Depends(_session)]
SettingsDep = Annotated[GatewaySettings, Depends(_settings)]
StoreDep = Annotated[FileStore, Depends(_store)]
TenantDep = Annotated[Tenant, Depends(_tenant)]
