"""Who may set a request's flow-control identity: the trust decision for the fairness id and objective.

The fairness id (``x-llm-d-inference-fairness-id``) picks the tenant a request is counted against
(its per-tenant quota and fair share) and the objective (``x-llm-d-inference-objective``) picks its
priority band. A caller that could set them freely could spread a flood over random tenants (no
quota ever binds) or pass as another tenant. So the router takes them only from:

* **trusted callers**: a request carrying ``x-backfill-router-token`` equal to the router's
  ``trusted_token`` (``BACKFILL_ROUTER_TRUSTED_TOKEN``; compared in constant time with
  :func:`hmac.compare_digest`). The async processor sends it (``BACKFILL_PROCESSOR_ROUTER_TOKEN``);
  ``backfill up`` generates one token and gives it to both; the deploy overlays read it from a
  Secret. Its headers are honoured as they come.
* **everyone else**: the objective header is ignored (the request goes to the default objective's
  band, ``interactive``) and the fairness id is the tenant of the request's API key in the router's
  key → tenant map (``api_keys``, ``Authorization: Bearer KEY``) when it has one, else
  ``anonymous``. One fairness id for every unidentified caller is deliberate: they share one
  per-tenant quota, so a flood from them cannot starve identified tenants, and there is no header
  or address to vary to escape it (a client address would be one value behind a proxy or many for
  an attacker with a subnet). An identity header such a caller sent anyway is ignored and counted
  (``backfill_router_untrusted_headers_total{header}``).

With no ``trusted_token`` configured, no caller is trusted: every request is an untrusted one.

The token header itself is never forwarded to engines (``router.proxy.FORWARDED_HEADERS``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from router.parsing import FAIRNESS_ID_HEADER, LEGACY_FAIRNESS_ID_HEADER, LEGACY_OBJECTIVE_HEADER, OBJECTIVE_HEADER

#: The shared-secret header a trusted caller (the async processor) sends.
TOKEN_HEADER = "x-backfill-router-token"
#: Fairness id of an untrusted caller without a known API key.
ANONYMOUS_TENANT = "anonymous"
#: The identity headers an untrusted caller may not set (lower case).
IDENTITY_HEADERS = (OBJECTIVE_HEADER, LEGACY_OBJECTIVE_HEADER, FAIRNESS_ID_HEADER, LEGACY_FAIRNESS_ID_HEADER)


@dataclass(frozen=True, slots=True)
class Identity:
    """The outcome of :meth:`HeaderTrust.identify`.

    Attributes:
        trusted: the caller presented the trusted token (its headers stand).
        objective: the objective to use: the caller's when trusted, else None (the default band).
        fairness_id: the fairness id to use: the caller's when trusted (None when it sent none),
            else its API key's tenant or :data:`ANONYMOUS_TENANT`.
        ignored: the identity headers the caller sent that were ignored (lower-case names).
    """

    trusted: bool
    objective: str | None
    fairness_id: str | None
    ignored: tuple[str, ...] = ()


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read an API-key → tenant map: a YAML (or JSON) mapping ``{key: tenant}`` of strings.

    Raises:
        ValueError: not a mapping of non-empty strings to non-empty strings.
        OSError: the file cannot be read.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise ValueError(f"api keys file {path} is not YAML/JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                             for k, v in data.items()):
        raise ValueError(f"api keys file {path} must map each key (a string) to its tenant (a string): "
                         f"{json.dumps(data)[:200] if isinstance(data, (dict, list)) else type(data).__name__}")
    return dict(data)


class HeaderTrust:
    """The trust decision (module docstring: the rules).

    Args:
        trusted_token: the shared secret of trusted callers; None or empty: nobody is trusted.
        api_keys: API key → tenant (the fairness id of an untrusted caller presenting that key).
    """

    def __init__(self, trusted_token: str | None = None, api_keys: Mapping[str, str] | None = None) -> None:
        self._token = trusted_token.encode() if trusted_token else None
        self._api_keys = dict(api_keys or {})

    def is_trusted(self, headers: Mapping[str, str]) -> bool:
        """The request carries the trusted token (constant-time comparison)."""
        if self._token is None:
            return False
        presented = headers.get(TOKEN_HEADER)
        if not presented:
            return False
        return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self._token)

    def tenant_of(self, headers: Mapping[str, str]) -> str:
        """The API key's tenant (``Authorization: Bearer KEY`` in the map), else ``anonymous``."""
        auth = headers.get("authorization") or ""
        scheme, _, key = auth.partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return self._api_keys.get(key.strip(), ANONYMOUS_TENANT)
        return ANONYMOUS_TENANT

    def identify(self, headers: Mapping[str, str], objective: str | None, fairness_id: str | None) -> Identity:
        """Decide the request's objective and fairness id.

        Args:
            headers: the request headers (case-insensitive lookup, e.g. aiohttp's ``CIMultiDict``,
                or a dict with lower-case names).
            objective, fairness_id: what :func:`router.parsing.parse_request` read from them.

        Returns:
            The :class:`Identity`; never raises.
        """
        if self.is_trusted(headers):
            return Identity(True, objective, fairness_id)
        ignored = tuple(name for name in IDENTITY_HEADERS if (headers.get(name) or "").strip())
        return Identity(False, None, self.tenant_of(headers), ignored)
