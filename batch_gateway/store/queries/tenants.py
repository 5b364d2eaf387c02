"""Queries on ``tenants`` and ``api_keys``: credentials, quotas, webhook endpoints.

None commits: the caller owns the transaction."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    EPOCH_NOW,
    ApiKey,
    Tenant,
)
from batch_gateway.store.queries._shared import new_id, rowcount

KEY_PREFIX = "sk-bf-"


def hash_key(key: str) -> str:
    """SHA-256 hex of an API key: keys carry 256 random bits, so a fast hash is the standard
    choice (as for GitHub tokens); the plain key is never stored."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    """The tenant owning the unrevoked key ``key``, or None."""
    return session.execute(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()


def ensure_tenant(session: Session, name: str) -> Tenant:
    """The tenant called ``name``, created if missing (safe under concurrent calls)."""
    session.execute(
        pg_insert(Tenant).values(id=new_id("tenant_"), name=name).on_conflict_do_nothing(
            index_elements=[Tenant.name]
        )
    )
    return session.execute(select(Tenant).where(Tenant.name == name)).scalar_one()


def add_api_key(session: Session, tenant_name: str, key: str | None = None) -> str:
    """Register ``key`` (or a new random one) for tenant ``tenant_name``; returns the key.

    Adding a key that already exists for the same tenant is a no-op; for another tenant it raises
    ``ValueError``.
    """
    tenant = ensure_tenant(session, tenant_name)
    key = key or KEY_PREFIX + secrets.token_urlsafe(32)
    session.execute(
        pg_insert(ApiKey)
        .values(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:12])
        .on_conflict_do_nothing(index_elements=[ApiKey.key_hash])
    )
    owner = session.execute(select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(key))).scalar_one()
    if owner != tenant.id:
        raise ValueError("that key already belongs to another tenant")
    return key


KEY_ID_PREFIX = "key_"


def key_id(row_id: int) -> str:
    """The id ``backfill keys list`` shows for the ``api_keys`` row ``row_id`` (``key_17``), which
    :func:`revoke_api_key` accepts in place of the key itself."""
    return f"{KEY_ID_PREFIX}{row_id}"


def shown_prefix(prefix: str) -> str:
    """What ``backfill keys list`` shows of a key whose stored prefix (its first 12 characters) is
    ``prefix``: the prefix, or half of it for a key shorter than 12 characters (stored whole, so
    it is never shown whole)."""
    return prefix if len(prefix) >= 12 else prefix[: len(prefix) // 2]


def list_api_keys(session: Session, tenant_name: str | None = None) -> list:
    """Rows ``(key id, tenant name, key prefix, created_at, revoked_at)``, oldest first; the key id
    is :func:`key_id`'s."""
    stmt = (select(ApiKey.id, Tenant.name, ApiKey.prefix, ApiKey.created_at, ApiKey.revoked_at)
            .join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.id))
    if tenant_name is not None:
        stmt = stmt.where(Tenant.name == tenant_name)
    return [(key_id(row_id), *rest) for row_id, *rest in session.execute(stmt).all()]


class AmbiguousKeyPrefix(ValueError):
    """A prefix given to :func:`revoke_api_key` matches several active keys.

    Attributes:
        ids: their ids (``key_17``), oldest first.
    """

    def __init__(self, prefix: str, ids: list[str]) -> None:
        super().__init__(f"{prefix!r} is the start of {len(ids)} active keys ({', '.join(ids)}): give the id")
        self.ids = ids


def revoke_api_key(session: Session, key: str, *, by_prefix: bool = False) -> bool:
    """Revoke ``key``: the key itself, or else its id as :func:`list_api_keys` shows it
    (``key_17``), or else (``by_prefix``) the prefix ``backfill keys list`` shows of it
    (:func:`shown_prefix`, or longer; a trailing ``…`` as printed is ignored); returns whether an
    active key was revoked. A whole key wins over an id, an id over a prefix.

    Raises:
        AmbiguousKeyPrefix: ``by_prefix`` and the prefix starts more than one active key (nothing
            revoked).
    """
    matches = [ApiKey.key_hash == hash_key(key)]
    row_id = key.removeprefix(KEY_ID_PREFIX)
    if key.startswith(KEY_ID_PREFIX) and row_id.isdigit():
        matches.append(ApiKey.id == int(row_id))
    for match in matches:
        result = session.execute(update(ApiKey).where(match, ApiKey.revoked_at.is_(None))
                                 .values(revoked_at=EPOCH_NOW))
        if rowcount(result) > 0:
            return True
    start = key.rstrip("…").strip()
    if not by_prefix or not start:
        return False
    candidates = session.execute(
        select(ApiKey.id, ApiKey.prefix).where(ApiKey.revoked_at.is_(None),
                                               ApiKey.prefix.startswith(start[:12], autoescape=True))
        .order_by(ApiKey.id)).all()
    found = [row_id for row_id, prefix in candidates
             if len(start) >= len(shown_prefix(prefix)) and prefix.startswith(start[:12])]
    if len(found) > 1:
        raise AmbiguousKeyPrefix(start, [key_id(i) for i in found])
    if not found:
        return False
    session.execute(update(ApiKey).where(ApiKey.id == found[0]).values(revoked_at=EPOCH_NOW))
    return True


def lock_tenant(session: Session, tenant_id: str) -> Tenant:
    """The tenant row, locked until the transaction ends (serialises quota checks)."""
    return session.execute(select(Tenant).where(Tenant.id == tenant_id).with_for_update()).scalar_one()


def set_webhook(session: Session, tenant_name: str, url: str | None, secret: str | None) -> Tenant:
    """Set (or with ``url`` None, clear) the tenant's webhook endpoint and signing secret."""
    tenant = ensure_tenant(session, tenant_name)
    session.execute(update(Tenant).where(Tenant.id == tenant.id).values(webhook_url=url, webhook_secret=secret))
    return tenant


def tenant_by_name(session: Session, name: str) -> Tenant | None:
    """The tenant called ``name``, or None."""
    return session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()


def tenant_names(session: Session, limit: int = 500) -> list[str]:
    """Tenant names in alphabetical order (at most ``limit``), for the dashboard's filter."""
    return list(session.execute(select(Tenant.name).order_by(Tenant.name).limit(limit)).scalars())


def set_enqueued_token_limit(session: Session, tenant_name: str, limit: int | None) -> Tenant:
    """Set the tenant's enqueued-token quota (tokens; None = the deployment's default), creating
    the tenant if new."""
    tenant = ensure_tenant(session, tenant_name)
    session.execute(update(Tenant).where(Tenant.id == tenant.id).values(enqueued_token_limit=limit))
    return tenant


def set_queued_response_limit(session: Session, tenant_name: str, limit: int | None) -> Tenant:
    """Set the tenant's cap on background responses ``queued`` at once (None = the deployment's
    default, ``BACKFILL_GATEWAY_MAX_QUEUED_BACKGROUND_RESPONSES``), creating the tenant if new."""
    tenant = ensure_tenant(session, tenant_name)
    session.execute(update(Tenant).where(Tenant.id == tenant.id).values(queued_response_limit=limit))
    return tenant
