"""The admin dashboard in a real browser (Debian's Chromium, headless, driven by Playwright) against
``backfill up`` with a slowed simulated engine: log in, watch a running batch's progress bar advance
without reloading, open it, cancel it after confirming, and see ``cancelling`` then ``cancelled``
with the cancelled requests apart (not failed); a tenant's key is refused; with the router stopped
(SIGSTOP) the gate turns unknown and the health view says so; no page asks for something that
404s. Screenshots go to ``test-artifacts/`` (gitignored)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.conftest import backfill_up

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
ADMIN_KEY = "admin-browser-" + "b" * 24
SLOW = {"BACKFILL_ENGINE_SIM_TIME_SCALE": "4",  # 4 wall seconds per model second: ~2 s a request
        "BACKFILL_PROCESSOR_CONCURRENCY": "2",  # two requests at a time, so progress comes in steps
        # the dashboard reads the router and every service's /health each second (default 5 s)
        "BACKFILL_GATEWAY_ROUTER_POLL_SECONDS": "1", "BACKFILL_GATEWAY_HEALTH_POLL_SECONDS": "1"}
SERVICES = ("gateway", "router", "processor", "worker", "beat")
WAIT_MS = 60_000
"""Longest wait for something to show up on a page (a bound against hanging, not a speed check)."""


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium (.ci/run installs it with "
                    "apt-get install chromium chromium-driver; this machine could not)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, browser):
    with backfill_up(tmp_path_factory.mktemp("browser") / "data", "--engines", "1", "--admin-key", ADMIN_KEY,
                     env=SLOW) as up:
        yield up


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    yield tab
    context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def admin_url(stack) -> str:
    return stack.base_url.removesuffix("/v1") + "/admin"


def log_in(page, stack, key: str) -> None:
    page.goto(admin_url(stack))
    assert "/admin/login" in page.url  # no session: the login page
    page.fill("#key", key)
    page.click("button[type=submit]")


def test_ready_line_names_the_dashboard(stack):
    assert f" admin={admin_url(stack)} " in stack.ready_line


def test_a_tenant_key_is_refused(page, stack):
    log_in(page, stack, stack.api_key)  # the default tenant's API key
    alert = page.locator("[role=alert]")
    alert.wait_for()
    assert "accepts only the admin key" in alert.inner_text()
    shot(page, "tenant-key-refused")
    page.goto(admin_url(stack))
    assert "/admin/login" in page.url  # still no session


def test_log_in_watch_progress_open_the_batch_and_cancel_it(page, stack):
    client = stack.client()
    lines = [orjson.dumps({"custom_id": f"req-{i:03d}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "sim-model", "max_tokens": 40,
                                    "messages": [{"role": "user", "content": f"Tell me about number {i}."}]}})
             for i in range(40)]
    uploaded = client.files.create(file=("browser.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")

    log_in(page, stack, ADMIN_KEY)
    page.wait_for_url(admin_url(stack))
    row = f'tr[data-batch="{batch.id}"]'
    page.locator(row).wait_for()
    # the bar advances while the page stays loaded (live refresh): read it once progress began, then
    # wait for a later reading to be higher
    bar = f"{row} .progress"
    page.wait_for_function("([sel, n]) => { const el = document.querySelector(sel); "
                           "return el !== null && +el.dataset.done > n; }", arg=[bar, 0])
    first = int(page.locator(bar).get_attribute("data-done"))
    page.evaluate("window.__loaded_once = true")  # gone if the page were reloaded
    page.wait_for_function("([sel, n]) => +document.querySelector(sel).dataset.done > n", arg=[bar, first])
    second = int(page.locator(bar).get_attribute("data-done"))
    assert second > first and page.evaluate("window.__loaded_once === true")
    assert int(page.locator(bar).get_attribute("aria-valuenow")) == 100 * second // 40
    assert page.locator(f"{row} .status").inner_text() == "in_progress"
    shot(page, "jobs")

    page.click(f"{row} a")
    page.wait_for_url(f"**/admin/jobs/{batch.id}")
    assert page.locator("#job-status").inner_text() == "in_progress"
    assert "batch.in_progress" in page.locator(".timeline").inner_text()
    # the requests at the router are counted as running, apart from those still waiting: at most
    # the processor's 2 slots, refreshed without a reload
    page.wait_for_function("() => +document.querySelector('#job-running').textContent > 0")
    running = int(page.locator("#job-running").inner_text())
    assert 1 <= running <= 2 and int(page.locator("#job-waiting").inner_text()) >= 0
    shot(page, "job")

    dialogs = []
    page.once("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
    page.click("text=Cancel batch")
    page.wait_for_url("**?notice=*")
    assert dialogs and batch.id in dialogs[0]  # asked before cancelling
    assert "cancelling" in page.locator("#notice").inner_text()
    assert page.locator("#job-status").inner_text() == "cancelling"  # requests still run at the engine
    shot(page, "job-cancelling")
    page.wait_for_function("() => document.querySelector('#job-status').textContent === 'cancelled'")
    notice = page.locator("#notice").inner_text()  # the live refresh updated the banner too
    assert "cancelled" in notice and "cancelling" not in notice
    timeline = page.locator(".timeline").inner_text()
    assert timeline.index("batch.cancelling") < timeline.index("batch.cancelled")
    shot(page, "job-cancelled")
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.request_counts.completed >= second
    # the cancelled requests are shown as cancelled in grey, beside the API's own request_counts
    counts = page.locator("#job-counts").inner_text()
    assert f"{done.request_counts.completed} ok" in counts and " cancelled" in counts
    api = page.locator("#api-counts").inner_text()
    assert api == (f"total {done.request_counts.total} · completed {done.request_counts.completed} · "
                   f"failed {done.request_counts.failed}")
    assert page.locator(".summary .progress rect.unrun").get_attribute("width") != "0.00"


def test_lanes_fleet_and_tenants_pages_render(page, stack):
    log_in(page, stack, ADMIN_KEY)
    page.wait_for_url(admin_url(stack))
    for name in ("lanes", "fleet", "tenants"):
        page.click(f"header nav >> text={name.capitalize()}")
        page.wait_for_url(f"**/admin/{name}")
        assert page.locator("h1").inner_text() == name.capitalize()
        shot(page, name)
    assert "default" in page.locator("#tenants").inner_text()
    engines = stack.ready_line.split(" engines=")[1].split()[0].split(",")
    page.goto(admin_url(stack) + "/fleet")
    page.locator("#engines").wait_for()
    # the stack's router feeds the fleet page: every engine of the ready line shows up
    page.wait_for_function("(names) => names.every(n => document.querySelector(`tr[data-engine=\"${n}\"]`))",
                           arg=engines)
    assert page.locator("#router-error").count() == 0
    models = page.locator(f'tr[data-engine="{engines[0]}"] td').nth(1).inner_text()
    assert models not in ("", "—")  # the engine's served model(s), from the router's "models"
    shot(page, "fleet-engines")
    page.goto(admin_url(stack) + "/tenants")
    assert page.locator("#tenant-rows").get_attribute("data-refresh") == "/admin/fragments/tenants"



def test_a_stopped_router_turns_the_gate_unknown_and_the_health_view_says_so(page, stack):
    not_found: list[str] = []
    page.on("response", lambda response: not_found.append(response.url) if response.status == 404 else None)
    log_in(page, stack, ADMIN_KEY)
    page.wait_for_url(admin_url(stack))
    page.goto(admin_url(stack) + "/health")
    page.wait_for_function("(names) => names.every(n => document.querySelector(`tr[data-service=\"${n}\"] .status`)"
                           "?.textContent === 'up')", arg=list(SERVICES))
    shot(page, "health")
    page.goto(admin_url(stack) + "/lanes")
    gate = "document.querySelector('#gate-state')?.textContent.trim()"
    page.wait_for_function(f"() => ['open', 'closed'].includes({gate})")
    router = stack.child("router")
    router.suspend()  # SIGSTOP: its port stays open, nothing answers
    try:
        page.wait_for_function(f"() => {gate} === 'unknown'")  # the live refresh, no reload
        assert "ago" in page.locator("#router-error").inner_text()
        assert page.locator("#router-live").count() == 0
        shot(page, "lanes-router-stopped")
        page.goto(admin_url(stack) + "/health")
        page.wait_for_function("() => document.querySelector('tr[data-service=\"router\"] .status')"
                               ".textContent === 'unknown'")
        states = {name: page.locator(f'tr[data-service="{name}"] .status').inner_text() for name in SERVICES}
        assert states == {"gateway": "up", "router": "unknown", "processor": "up", "worker": "up", "beat": "up"}
        # "unknown" comes once the reading is older than its refresh, "no answer" once the probe has
        # timed out: wait for that too, however busy the machine is
        page.wait_for_function("() => document.querySelector('tr[data-service=\"router\"]')"
                               ".innerText.includes('no answer')")
        shot(page, "health-router-stopped")
        # and down once three refreshes (3 × (1 s poll + 2 s read bound)) passed without an answer
        page.wait_for_function("() => document.querySelector('tr[data-service=\"router\"] .status')"
                               ".textContent === 'down'")
        assert "not answered for 9 s" in page.locator("#health-rule").inner_text()
        shot(page, "health-router-down")
    finally:
        router.resume()
    page.goto(admin_url(stack) + "/lanes")
    page.wait_for_function(f"() => ['open', 'closed'].includes({gate})")  # live again once it answers
    assert not_found == []  # no favicon (or any other) 404
