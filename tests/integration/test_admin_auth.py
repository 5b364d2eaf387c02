"""Who gets into the admin dashboard: the admin key through the login page (a signed, HttpOnly,
SameSite=Strict cookie) or as a Bearer token; never a tenant's API key, a wrong key or nobody; and
nobody at all when no admin key is configured. Forms that change something need their CSRF token."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from batch_gateway.admin import auth
from batch_gateway.app import create_app
from batch_gateway.store import queries
from batch_gateway.store.db import make_engine, make_sessionmaker

ADMIN_KEY = "admin-" + "k" * 32


def _tenant_key(settings, tenant: str = "acme") -> str:
    engine = make_engine(settings.database_url, pool_size=1)
    with make_sessionmaker(engine)() as session:
        key = queries.add_api_key(session, tenant)
        session.commit()
    engine.dispose()
    return key


@pytest.fixture
def client(gateway_settings):
    settings = gateway_settings.model_copy(update={"admin_key": ADMIN_KEY})
    with TestClient(create_app(settings), follow_redirects=False) as test_client:
        test_client.settings = settings
        yield test_client


def _login(client, key: str, next_: str = "/admin"):
    return client.post("/admin/login", data={"key": key, "next": next_})


def test_login_with_the_admin_key_sets_a_strict_httponly_cookie_and_opens_every_page(client):
    page = client.get("/admin/lanes")
    assert page.status_code == 303 and page.headers["location"].startswith("/admin/login?next=%2Fadmin%2Flanes")
    assert "Admin key" in client.get("/admin/login").text

    answer = _login(client, ADMIN_KEY, "/admin/lanes")
    assert answer.status_code == 303 and answer.headers["location"] == "/admin/lanes"
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{auth.COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Path=/admin" in cookie
    for path in ("/admin", "/admin/lanes", "/admin/fleet", "/admin/tenants", "/admin/api/jobs"):
        response = client.get(path)
        assert response.status_code == 200, (path, response.text[:300])
    assert "frame-ancestors 'none'" in client.get("/admin").headers["content-security-policy"]


def test_bearer_admin_key_works_without_a_session(client):
    response = client.get("/admin/api/jobs", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200 and response.json() == {"data": [], "next": None, "total": 0}
    assert client.get("/admin", headers={"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200


def test_tenant_key_is_refused_with_a_clear_403(client):
    tenant_key = _tenant_key(client.settings)
    by_bearer = client.get("/admin/api/jobs", headers={"authorization": f"Bearer {tenant_key}"})
    assert by_bearer.status_code == 403
    error = by_bearer.json()["error"]
    assert error["code"] == "admin_key_required" and "tenant" in error["message"]
    assert client.get("/admin", headers={"authorization": f"Bearer {tenant_key}"}).status_code == 403

    by_login = _login(client, tenant_key)
    assert by_login.status_code == 403 and "accepts only the admin key" in by_login.text
    assert "set-cookie" not in by_login.headers
    assert client.get("/admin").status_code == 303  # still logged out
    # the gateway's own default key is a tenant key too
    assert _login(client, client.settings.api_key).status_code == 403


def test_wrong_key_missing_key_and_forged_cookie_are_refused(client):
    assert _login(client, "nope").status_code == 401
    assert client.get("/admin/api/jobs").status_code == 401
    assert client.get("/admin/api/jobs", headers={"authorization": "Bearer nope"}).json()["error"]["code"] \
        == "invalid_admin_key"
    assert client.get("/admin/api/jobs", headers={"authorization": "Basic abc"}).status_code == 401
    forged = auth.session_token("another-key")
    client.cookies.set(auth.COOKIE, forged, path="/admin")
    assert client.get("/admin/api/jobs").status_code == 401
    expired = auth.session_token(ADMIN_KEY, issued=1)
    assert not auth.session_valid(ADMIN_KEY, expired, 3600)
    client.cookies.set(auth.COOKIE, expired, path="/admin")
    assert client.get("/admin/api/jobs").status_code == 401


def test_login_never_redirects_off_the_dashboard(client):
    for target in ("https://evil.example/", "//evil.example/admin", "/v1/files"):
        answer = _login(client, ADMIN_KEY, target)
        assert answer.status_code == 303 and answer.headers["location"] == "/admin"


def test_forms_need_their_csrf_token_with_a_cookie_session(client):
    _login(client, ADMIN_KEY)
    assert client.post("/admin/logout").status_code == 403
    wrong = client.post("/admin/logout", data={"csrf_token": "0" * 64})
    assert wrong.status_code == 403 and "CSRF token" in wrong.text
    token = client.cookies.get(auth.COOKIE)
    page = client.get("/admin")
    assert auth.csrf_token(ADMIN_KEY, token) in page.text  # the logout form carries it
    out = client.post("/admin/logout", data={"csrf_token": auth.csrf_token(ADMIN_KEY, token)})
    assert out.status_code == 303 and out.headers["location"] == "/admin/login"
    assert client.get("/admin/api/jobs").status_code == 401


def test_without_an_admin_key_the_dashboard_is_closed(gateway_settings):
    assert gateway_settings.admin_key is None
    with TestClient(create_app(gateway_settings), follow_redirects=False) as client:
        for path in ("/admin", "/admin/login", "/admin/api/jobs"):
            response = client.get(path, headers={"authorization": "Bearer anything"})
            assert response.status_code == 503, path
        error = client.get("/admin/api/jobs").json()["error"]
        assert error["code"] == "admin_disabled" and "--admin-key" in error["message"]
        assert "BACKFILL_ADMIN_KEY" in client.get("/admin").text
        assert client.post("/admin/login", data={"key": "x"}).status_code == 503


def test_non_ascii_cookies_keys_and_csrf_tokens_are_refused_not_500s(client):
    for cookie in (b"backfill_admin=1796020000.\xc3\xa9", b"backfill_admin=\xd9\xa1\xd9\xa2.abc",
                   b"backfill_admin=" + b"9" * 40 + b".abc"):
        answer = client.get("/admin/api/jobs", headers={b"cookie": cookie})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_admin_key", cookie
    assert client.get("/admin/api/jobs", headers={b"authorization": b"Bearer \xc3\xa9t\xc3\xa9"}).status_code == 401
    assert _login(client, "clé").status_code == 401
    _login(client, ADMIN_KEY)
    refused = client.post("/admin/logout", data={"csrf_token": "é" * 64})
    assert refused.status_code == 403 and "CSRF token" in refused.text
    cancel = client.post("/admin/jobs/batch_abc/cancel", data={"csrf_token": "\u0661" * 64})
    assert cancel.status_code == 403 and "CSRF token" in cancel.text
    assert client.get("/admin/api/jobs").status_code == 200  # still logged in


def test_the_gateway_does_not_log_every_router_poll(gateway_settings):
    import logging

    create_app(gateway_settings)
    assert logging.getLogger("httpx").level == logging.WARNING  # set, whatever the root level: httpx logs each request at INFO
