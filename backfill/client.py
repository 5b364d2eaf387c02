"""How a client command reaches a gateway: the ``--data-dir`` / ``--base-url`` / ``--api-key``
options, the ``openai`` client they make, and clear errors instead of tracebacks.

The gateway URL and API key are, in this order: ``--base-url`` / ``--api-key`` (or
``BACKFILL_BASE_URL`` / ``BACKFILL_API_KEY``); the stack recorded in ``DATA_DIR/stack.json`` by
``backfill up`` (:mod:`backfill.stack_file`); ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``. Without
any of them the command fails, naming what it looked for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

DEFAULT_DATA_DIR = Path(".data")
"""``backfill up``'s default ``--data-dir`` (client commands look for its ``stack.json`` there)."""


def data_dir_option(help_text: str = "Data directory of the `backfill up` stack to talk to (its stack.json)."):
    """``--data-dir`` with ``backfill up``'s default and environment variable."""
    return click.option("--data-dir", type=click.Path(path_type=Path), default=DEFAULT_DATA_DIR, show_default=True,
                        envvar="BACKFILL_DATA_DIR", help=help_text)


def gateway_options(func: Callable) -> Callable:
    """``--data-dir``, ``--base-url`` and ``--api-key`` (see the module docstring for the order)."""
    func = click.option("--api-key", envvar="BACKFILL_API_KEY",
                        help="API key (default: the stack's, else OPENAI_API_KEY).")(func)
    func = click.option("--base-url", envvar="BACKFILL_BASE_URL",
                        help="Gateway URL ending in /v1 (default: the stack's, else OPENAI_BASE_URL).")(func)
    return data_dir_option()(func)


def with_gateway(func: Callable) -> Callable:
    """:func:`gateway_options`, resolved by :func:`find_gateway` into one ``gateway`` argument."""
    import functools

    @functools.wraps(func)
    def wrapper(*args, data_dir: Path, base_url: str | None, api_key: str | None, **kwargs):
        return func(*args, gateway=find_gateway(data_dir, base_url, api_key), **kwargs)

    return gateway_options(wrapper)


@dataclass
class Gateway:
    """Where the gateway is and the key to use."""

    base_url: str
    api_key: str

    def client(self, max_retries: int = 2):
        """The ``openai`` client of this gateway."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=max_retries)


def find_gateway(data_dir: Path, base_url: str | None, api_key: str | None, *, need_key: bool = True) -> Gateway:
    """Resolve the gateway URL and key (module docstring). Raises ``click.ClickException`` when one
    of them is found nowhere (the key only when ``need_key``; else it may be ""), with the reason the
    stack file gave."""
    from backfill.stack_file import NoStack, load_stack

    stack: dict[str, Any] = {}
    reason = ""
    if not (base_url and api_key):
        try:
            stack = load_stack(data_dir)
        except NoStack as exc:
            reason = str(exc)
    url = base_url or stack.get("gateway_url") or os.environ.get("OPENAI_BASE_URL")
    key = api_key or stack.get("api_key") or os.environ.get("OPENAI_API_KEY")
    if not url:
        raise click.ClickException(f"no gateway to talk to: {reason}; or give --base-url")
    if not key and need_key:
        raise click.ClickException(f"no API key for {url}: {reason or 'none given'}; give --api-key")
    return Gateway(base_url=url.rstrip("/"), api_key=key or "")


ADMIN_KEY_OPTION = click.option("--admin-key", envvar="BACKFILL_ADMIN_KEY",
                                help="The gateway's admin key (the dashboard's, BACKFILL_ADMIN_KEY): every tenant.")


def own_tenant_only(what: str, all_tenants: bool, admin_key: str | None) -> None:
    """Make plain that a list without ``--all-tenants`` is the API key's tenant's only, when an
    admin key is at hand: ``--admin-key`` given on the command line is refused (``click.UsageError``:
    add ``--all-tenants`` or drop it); one from ``BACKFILL_ADMIN_KEY`` gets a note on standard
    error. ``what``: ``batches`` or ``files``."""
    if all_tenants or not admin_key:
        return
    source = click.get_current_context().get_parameter_source("admin_key")
    if source is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(f"--admin-key lists every tenant's {what} only with --all-tenants; without it the "
                               f"list is the API key's own tenant's: add --all-tenants, or drop --admin-key")
    click.echo(f"the API key's tenant's {what} only (BACKFILL_ADMIN_KEY is set: --all-tenants lists every "
               f"tenant's)", err=True)


@dataclass
class Operator:
    """The gateway's operator JSON over every tenant (``/admin/api/operator``), authenticated with
    the admin key as the dashboard is."""

    base_url: str
    """The gateway's API URL (ending in ``/v1``), as :class:`Gateway` has it."""
    admin_key: str

    @classmethod
    def of(cls, gateway: Gateway, admin_key: str | None, flag: str) -> Operator:
        """The operator view of ``gateway``; raises ``click.UsageError`` naming ``flag`` without a key."""
        if not admin_key:
            raise click.UsageError(f"{flag} needs the admin key: --admin-key or BACKFILL_ADMIN_KEY")
        return cls(gateway.base_url, admin_key)

    def get(self, path: str, **params: Any) -> dict:
        """``GET /admin/api/operator{path}`` with ``params`` (None ones left out); the JSON answer.
        Raises ``click.ClickException`` with the gateway's error message or the connection error."""
        import httpx

        root = self.base_url.removesuffix("/v1")
        try:
            response = httpx.get(f"{root}/admin/api/operator{path}", timeout=30,
                                 params={k: v for k, v in params.items() if v is not None},
                                 headers={"authorization": f"Bearer {self.admin_key}"})
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach the gateway at {root}: {exc}") from None
        if response.status_code != 200:
            try:
                error = response.json().get("error", {})
            except ValueError:
                error = {"message": response.text[:200]}
            raise click.ClickException(f"{root} answered {response.status_code}: {error.get('message')}")
        return response.json()


@contextlib.contextmanager
def api_errors(base_url: str) -> Iterator[None]:
    """Turn the ``openai`` client's errors into ``click.ClickException`` (exit status 1, no
    traceback): a connection error names ``base_url``; an API error gives its status and message."""
    import openai

    try:
        yield
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        raise click.ClickException(f"cannot reach the gateway at {base_url}: {cause}") from None
    except openai.APIStatusError as exc:
        raise click.ClickException(f"{base_url} answered {exc.status_code}: {_message(exc)}") from None
    except openai.APIError as exc:
        raise click.ClickException(f"{base_url}: {exc}") from None


def _message(exc) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body) if isinstance(body, dict) else {}
    if isinstance(error, dict) and error.get("message"):
        code = error.get("code")
        return f"{error['message']}" + (f" ({code})" if code else "")
    return str(exc.message)
