"""The header trust decision (router/trust.py): who may set the fairness id and the objective."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from router.settings import build_settings
from router.trust import ANONYMOUS_TENANT, TOKEN_HEADER, HeaderTrust, Identity, load_api_keys

SPOOF = {"x-llm-d-inference-fairness-id": "victim", "x-llm-d-inference-objective": "batch"}


def identify(trust: HeaderTrust, headers: dict[str, str]) -> Identity:
    h = CIMultiDict(headers)
    return trust.identify(h, h.get("x-llm-d-inference-objective"), h.get("x-llm-d-inference-fairness-id"))


def test_a_caller_with_the_token_keeps_its_fairness_id_and_objective():
    got = identify(HeaderTrust("s3cret"), {**SPOOF, "X-Backfill-Router-Token": "s3cret"})
    assert got == Identity(True, "batch", "victim")


def test_a_trusted_caller_without_a_fairness_id_has_none():
    assert identify(HeaderTrust("s3cret"), {TOKEN_HEADER: "s3cret"}) == Identity(True, None, None)


@pytest.mark.parametrize("token", [None, "", "s3cre", "s3cret ", "S3CRET", "s3cret\u00e9"])
def test_a_caller_without_the_token_is_anonymous_in_the_default_band(token):
    headers = dict(SPOOF) if token is None else {**SPOOF, TOKEN_HEADER: token}
    got = identify(HeaderTrust("s3cret"), headers)
    assert got == Identity(False, None, ANONYMOUS_TENANT,
                           ("x-llm-d-inference-objective", "x-llm-d-inference-fairness-id"))


def test_with_no_token_configured_nobody_is_trusted_not_even_an_empty_token():
    for trust in (HeaderTrust(), HeaderTrust("")):
        assert not identify(trust, {**SPOOF, TOKEN_HEADER: ""}).trusted
        assert identify(trust, SPOOF).fairness_id == ANONYMOUS_TENANT


def test_legacy_identity_headers_are_ignored_and_reported_too():
    got = identify(HeaderTrust("t"), {"x-gateway-inference-fairness-id": "v", "x-gateway-inference-objective": "b"})
    assert got.ignored == ("x-gateway-inference-objective", "x-gateway-inference-fairness-id")
    assert identify(HeaderTrust("t"), {}).ignored == ()


def test_an_untrusted_callers_tenant_comes_from_its_api_key():
    trust = HeaderTrust("t", {"sk-acme": "acme"})
    assert identify(trust, {**SPOOF, "Authorization": "Bearer sk-acme"}).fairness_id == "acme"
    assert identify(trust, {"authorization": "bearer  sk-acme "}).fairness_id == "acme"
    assert identify(trust, {"Authorization": "Bearer sk-other"}).fairness_id == ANONYMOUS_TENANT
    assert identify(trust, {"Authorization": "Basic sk-acme"}).fairness_id == ANONYMOUS_TENANT


def test_api_keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("sk-a: acme\nsk-b: beta\n")
    assert load_api_keys(path) == {"sk-a": "acme", "sk-b": "beta"}
    path.write_text('{"sk-a": "acme"}')
    assert load_api_keys(path) == {"sk-a": "acme"}
    path.write_text("")
    assert load_api_keys(path) == {}
    for bad in ("- sk-a\n", "sk-a: 3\n", "sk-a: ''\n", "[oops"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            load_api_keys(path)


def test_settings_read_the_token_from_the_environment_and_never_show_it(monkeypatch, tmp_path):
    monkeypatch.setenv("BACKFILL_ROUTER_TRUSTED_TOKEN", "s3cret")
    settings = build_settings()
    assert settings.trusted_token is not None and settings.trusted_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)
