"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against a real gateway.

Logs in, opens every page (a run of an unknown shape too), searches text, labels episodes from the review
queue with the keyboard (and finds the reward rows in SQL), promotes a version and sees the gateway serve it,
logs out (a copy of the cookie stops working too) and is throttled after failed logins. The engine is the scripted upstream in
its vLLM mode (it serves vLLM's runtime LoRA API), so policy versions route as with vLLM without its start-up
cost; the gateway, the database and the browser are the real ones. Screenshots of every step go to
`tests/artifacts/dashboard-<database>/` (git-ignored), printed at the end.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from tests.conftest import query
from tests.support.dashboard import seed_policy_runs, seed_unusual_run
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.scripted_upstream import ScriptedUpstream

# Chromium through every page, twice: `make test-fast` leaves it out.
pytestmark = pytest.mark.slow

MakeGateway = Callable[..., GatewayServer]
ADMIN = "adm-browser"
CLIENT = "sk-browser"
CHROMIUM = Path("/usr/bin/chromium")
# No network on CI machines: nothing Chromium would fetch on its own, and no QUIC probing.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@contextlib.contextmanager
def chromium() -> Iterator[BrowserContext]:
    """A headless Chromium (the system's, never a downloaded one) with a fresh profile.

    Playwright's synchronous API keeps an event loop running in this thread while it is open, so a test
    starts it after its gateway and reads SQL from another thread (`sql`)."""
    if not CHROMIUM.exists():
        pytest.fail("Chromium is not installed (Debian's `chromium` package; .ci/run installs it)")
    profile = tempfile.mkdtemp(prefix="kaizen-chromium-")
    try:
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                profile,
                executable_path=str(CHROMIUM),
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": 1400, "height": 900},
            )
            context.set_default_timeout(20_000)
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def sql(url: str, text: str, **params: Any) -> list[dict[str, Any]]:
    """`query` from a thread of its own (this one's event loop belongs to Playwright)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(query, url, text, **params).result()


class Steps:
    """Screenshots of each step, numbered, in one directory per test."""

    def __init__(self, page: Page, directory: Path) -> None:
        self.page = page
        self.directory = directory
        self.count = 0
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)

    def shot(self, name: str) -> None:
        self.count += 1
        self.page.screenshot(path=str(self.directory / f"{self.count:02d}-{name}.png"), full_page=True)


def _served_by(gw: GatewayServer, model: str) -> str:
    client = OpenAI(base_url=gw.url + "/v1", api_key=CLIENT, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": f"hello at {time.monotonic()}"}]
    )
    return raw.headers["x-kaizen-model"]


def _follow(page: Page, selector: str) -> None:
    """Click a link or submit button and wait until the page it leads to has loaded.

    Reading the page straight after a click can still see the old one, or a document half replaced.
    """
    before = page.url
    page.click(selector)
    page.wait_for_url(lambda url: url != before)


def _gateway(
    make_gateway: MakeGateway, upstream: ScriptedUpstream, url: str, tmp_path: Path
) -> GatewayServer:
    adapters = tmp_path / "adapters" / "bot"
    for version in range(3):
        (adapters / str(version)).mkdir(parents=True)
    seed_policy_runs(url, "bot", versions=3, adapter_root=str(adapters))
    return make_gateway(
        url,
        engine="vllm",
        vllm_url=upstream.url,
        api_keys=[CLIENT],
        admin_key=ADMIN,
        policy_refresh_s=0.2,
        # Small enough to see within a few episodes: SQLite's text search window, the failed-login limit.
        dashboard_search_episodes=2,
        dashboard_login_failures=3,
    )


def test_browse_label_and_promote_in_chromium(
    make_gateway: MakeGateway,
    upstream: ScriptedUpstream,
    database_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    started = time.monotonic()
    gw = _gateway(make_gateway, upstream, database_url, tmp_path)
    wait_until(lambda: _served_by(gw, "bot") == "bot@0", "version 0 to serve the policy")
    for _ in range(3):
        _served_by(gw, "bot")
    gw.flush()
    unusual = seed_unusual_run(database_url, "bot")
    episodes = [
        r["id"] for r in query(database_url, "SELECT id FROM episodes ORDER BY created_at DESC, id DESC")
    ]
    shots = ARTIFACTS / f"dashboard-{request.node.callspec.id}"
    with chromium() as browser:
        _walk_through(browser, gw, database_url, episodes, shots, unusual)
    print(f"\nscreenshots: {shots} ({time.monotonic() - started:.1f} s)")


def _walk_through(
    browser: BrowserContext,
    gw: GatewayServer,
    database_url: str,
    episodes: list[str],
    shots: Path,
    unusual_run: int,
) -> None:
    """Every page, a run of another shape, a text search, the review queue by keyboard, a promotion and a
    rollback, logging out (everywhere) and a throttled login."""
    page = browser.new_page()
    dialogs: list[str] = []

    def accept(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    steps = Steps(page, shots)

    # Login is required: the overview sends the browser to the login form, which sends it back.
    page.goto(gw.url + "/dashboard/runs")
    expect(page).to_have_url(f"{gw.url}/dashboard/login?next=%2Fdashboard%2Fruns")
    steps.shot("login")
    page.fill("#login-key", "not-the-key")
    page.press("#login-key", "Enter")
    expect(page.locator("#flash")).to_contain_text("Unknown or revoked key")
    page.fill("#login-key", ADMIN)
    page.press("#login-key", "Enter")
    expect(page).to_have_url(gw.url + "/dashboard/runs")
    expect(page.locator("#run-list")).to_contain_text("collapse guard stopped the run")
    steps.shot("runs")
    assert page.context.cookies()[0]["httpOnly"] is True

    # Every page loads.
    page.click("nav >> text=Overview")
    expect(page.locator("#totals")).to_contain_text("calls")
    expect(page.locator("#reward-charts svg.chart")).to_have_count(1)
    # A few minutes of data: the overview opens on the hour that holds it, not on a day.
    expect(page.locator("select[name=window]")).to_have_value("1h")
    steps.shot("overview")
    page.click("nav >> text=Episodes")
    expect(page.locator("#episode-list tbody tr")).to_have_count(len(episodes))
    steps.shot("episodes")
    page.click("nav >> text=Policies")
    page.click("#policy-list >> text=bot")
    expect(page.locator("#active-version")).to_have_text("v0")
    steps.shot("policy")
    page.click("nav >> text=Judge")
    expect(page.locator("#judge-groups")).to_contain_text("judge timed out")
    steps.shot("judge")
    page.click("nav >> text=Training runs")
    page.click("#run-list tbody tr >> nth=-1 >> a")
    expect(page.locator("#gate-decision")).to_have_text("promote")
    steps.shot("run")
    # A run of a shape the dashboard has never seen (another training mode, new counters) renders them all.
    page.goto(f"{gw.url}/dashboard/runs/{unusual_run}")
    expect(page.locator("#run-numbers")).to_contain_text("examples")
    expect(page.locator("#run-data")).to_contain_text("resampled.rare_successes")
    expect(page.locator("svg.chart")).to_have_count(2)  # loss and learning_rate per step
    expect(page.locator("svg.chart").nth(1)).to_contain_text("learning_rate: 0.00002 at 1")  # not 2e-05
    expect(page.locator("#run-no-log")).to_contain_text("No log was kept for this run")
    steps.shot("run-of-another-mode")

    # Text search for the oldest episode. SQLite reads 2 episodes per request here and says how far it got;
    # "search older episodes" goes on. PostgreSQL finds it at once through its trigram index.
    oldest = sql(database_url, "SELECT request FROM calls WHERE episode_id = :e", e=episodes[-1])[0]
    request = json.loads(oldest["request"]) if isinstance(oldest["request"], str) else oldest["request"]
    page.goto(gw.url + "/dashboard/episodes")
    page.fill('#episode-filters input[name="q"]', request["messages"][-1]["content"])
    _follow(page, '#episode-filters button[type="submit"]')
    target = page.locator(f'#episode-list tr[data-episode="{episodes[-1]}"]')
    for _ in range(len(episodes)):
        if target.count():
            break
        expect(page.locator("#search-window")).to_contain_text("2 episodes per request")
        steps.shot("search-window")
        _follow(page, "#next-page")
    expect(target).to_have_count(1)
    steps.shot("search-found")

    # The review queue, by keyboard: the newest unrewarded episode first; u = thumbs up, j = next,
    # s = score (Enter saves), k = back.
    page.click("nav >> text=Review queue")
    expect(page.locator("#episode-id")).to_have_text(episodes[0])
    page.keyboard.press("u")
    expect(page.locator("#flash")).to_contain_text("Saved")
    steps.shot("labelled")
    up = sql(
        database_url,
        "SELECT source, name, value, key_id FROM rewards WHERE episode_id = :e AND name = 'dashboard'",
        e=episodes[0],
    )
    assert [(r["source"], r["value"], r["key_id"]) for r in up] == [("feedback", 1.0, "admin-key")]
    page.keyboard.press("j")
    expect(page.locator("#episode-id")).to_have_text(episodes[1])
    page.keyboard.press("s")
    page.keyboard.type("0.5")
    page.keyboard.press("Enter")
    expect(page.locator("#flash")).to_contain_text("Saved")
    scored = sql(database_url, "SELECT value FROM rewards WHERE episode_id = :e", e=episodes[1])
    assert [r["value"] for r in scored] == [0.5]
    page.keyboard.press("c")
    page.keyboard.type("the reply is fine")
    page.keyboard.press("Escape")
    page.click(".label-call >> nth=0")
    page.keyboard.press("d")

    def labels() -> int:
        return len(sql(database_url, "SELECT id FROM rewards WHERE episode_id = :e", e=episodes[1]))

    wait_until(lambda: labels() == 2, "the label of the call to be stored")
    on_call = sql(
        database_url,
        "SELECT value, comment, call_id FROM rewards WHERE episode_id = :e ORDER BY id",
        e=episodes[1],
    )
    assert (on_call[-1]["value"], on_call[-1]["comment"]) == (0.0, "the reply is fine")
    assert on_call[-1]["call_id"] is not None
    page.keyboard.press("k")
    expect(page.locator("#episode-id")).to_have_text(episodes[0])
    page.reload()
    expect(page.locator("#rewards")).to_contain_text("dashboard")
    steps.shot("trajectory")

    # Promotion through the dashboard, confirmed, and served by the gateway on the next call.
    page.goto(gw.url + "/dashboard/policies/bot")
    page.click('#versions tr[data-version="2"] button.promote')
    expect(page.locator("#active-version")).to_have_text("v2")
    assert dialogs and "Promote bot to version 2" in dialogs[-1]
    steps.shot("promoted")
    wait_until(lambda: _served_by(gw, "bot") == "bot@2", "the gateway to serve the promoted version")
    audit = sql(database_url, "SELECT actor, action, details FROM audit ORDER BY id")
    assert [(a["actor"], a["action"]) for a in audit] == [("admin-key", "policy.promote")]
    page.click("#rollback")
    expect(page.locator("#active-version")).to_have_text("v0")
    wait_until(lambda: _served_by(gw, "bot") == "bot@0", "the gateway to serve the rolled-back version")

    # Logging out ends the session in this browser, and on the server: a copy of the cookie is refused too.
    copied = {c["name"]: c["value"] for c in page.context.cookies()}
    assert httpx.get(gw.url + "/dashboard", cookies=copied).status_code == 200
    page.click("#logout")
    expect(page).to_have_url(gw.url + "/dashboard/login")
    page.goto(gw.url + "/dashboard/episodes")
    expect(page).to_have_url(f"{gw.url}/dashboard/login?next=%2Fdashboard%2Fepisodes")
    assert httpx.get(gw.url + "/dashboard", cookies={}).status_code == 303
    assert httpx.get(gw.url + "/dashboard", cookies=copied).status_code == 303

    # Three wrong keys from this address, and the login form refuses even the right one for a while.
    for _ in range(3):
        page.fill("#login-key", "a-wrong-guess")
        page.press("#login-key", "Enter")
        expect(page.locator("#flash")).to_contain_text("Unknown or revoked key")
        page.evaluate("document.getElementById('flash').textContent = ''")
    page.fill("#login-key", ADMIN)
    page.press("#login-key", "Enter")
    expect(page.locator("#flash")).to_contain_text("Too many failed logins")
    steps.shot("login-throttled")
    page.close()
