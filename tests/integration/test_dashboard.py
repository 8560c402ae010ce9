"""The dashboard over real HTTP, on SQLite and PostgreSQL: who gets in, what the pages show, what labels and
policy actions write. The same flows in a real browser are in test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
from markupsafe import escape
from openai import OpenAI

from gateway.dashboard.pages import encode_cursor
from gateway.settings import async_database_url
from storage.dashboard import EpisodeCursor
from storage.database import Database
from storage.jobs import start_job_run
from storage.policies import get_policy
from tests.conftest import query
from tests.support.dashboard import csrf_token, login, seed_policy_runs, seed_unusual_run
from tests.support.gateway_server import GatewayServer
from tests.support.polling import wait_until
from tests.support.scripted_upstream import REFUSAL
from tests.support.training_children import RECORDS_ITS_RUN
from trainer.control.ruler import JudgeSettings
from trainer.control.scheduler import JobRunner, RunnerConfig

MakeGateway = Callable[..., GatewayServer]
ADMIN = "adm-dashboard-secret"
CLIENT = "sk-dashboard-client"
PAGES = ["/dashboard", "/dashboard/episodes", "/dashboard/policies", "/dashboard/runs", "/dashboard/judge"]


def _chat(gw: GatewayServer, text: str) -> str:
    """One captured call with the official SDK; its episode's id."""
    client = OpenAI(base_url=gw.url + "/v1", api_key=CLIENT, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="scripted-1", messages=[{"role": "user", "content": text}]
    )
    return raw.headers["x-episode-id"]


def test_nothing_is_shown_without_a_login(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    with httpx.Client(base_url=gw.url) as anonymous:
        for page in [*PAGES, "/dashboard/episodes/ep-x", "/dashboard/runs/1", "/dashboard/review"]:
            answer = anonymous.get(page)
            assert answer.status_code == 303, page
            assert answer.headers["location"].startswith("/dashboard/login?next=%2Fdashboard")
        login_page = anonymous.get("/dashboard/login")
        assert login_page.status_code == 200 and "csrf-token" not in login_page.text
        refused = anonymous.post("/dashboard/feedback", json={"episode_id": "x", "value": True})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "login_required"
        # A client key is not an admin key; a wrong key is nobody's.
        assert anonymous.post("/dashboard/session", json={"key": CLIENT}).status_code == 403
        assert anonymous.post("/dashboard/session", json={"key": "wrong"}).status_code == 401
        # A forged or altered cookie is no session.
        anonymous.cookies.set("kaizen_dashboard", "e30.AAAA", domain="127.0.0.1", path="/dashboard")
        assert anonymous.get("/dashboard").status_code == 303


def test_login_sets_a_safe_cookie_and_logout_ends_it(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    with httpx.Client(base_url=gw.url) as browser:
        answer = browser.post("/dashboard/session", json={"key": ADMIN, "next": "https://evil.example/"})
        assert answer.status_code == 200
        assert answer.json() == {"next": "/dashboard", "actor": "admin-key"}  # no open redirect
        cookie = answer.headers["set-cookie"].lower()
        for attribute in ("httponly", "samesite=strict", "path=/dashboard", "max-age="):
            assert attribute in cookie
        page = browser.get("/dashboard")
        assert page.status_code == 200
        assert ADMIN not in page.text  # no secret in pages
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
        token = csrf_token(page.text)
        # Writes need the CSRF token, and must come from the dashboard's own origin.
        assert browser.post("/dashboard/logout").json()["error"]["code"] == "csrf_failed"
        cross = browser.post(
            "/dashboard/logout", headers={"x-kaizen-csrf": token, "origin": "http://evil.example"}
        )
        assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_origin"
        # A form post (what a cross-site page can send without a preflight) never reaches a handler.
        form = browser.post("/dashboard/logout", content=b"a=b", headers={"content-type": "text/plain"})
        assert form.status_code == 415
        out = browser.post("/dashboard/logout", headers={"x-kaizen-csrf": token})
        assert out.status_code == 200
        assert browser.get("/dashboard").status_code == 303


def test_logout_ends_the_session_on_every_replica(make_gateway: MakeGateway, database_url: str) -> None:
    # Two replicas of one deployment: the same database and dashboard secret.
    shared = {"admin_key": ADMIN, "dashboard_secret": "one-secret-for-both", "policy_refresh_s": 0.2}
    first, second = make_gateway(database_url, **shared), make_gateway(database_url, **shared)
    browser = login(first.url, ADMIN)
    copied = browser.cookies["kaizen_dashboard"]  # what a stolen cookie would be

    def status(gateway: GatewayServer) -> int:
        return httpx.get(
            gateway.url + "/dashboard", headers={"cookie": f"kaizen_dashboard={copied}"}
        ).status_code

    assert status(first) == 200 and status(second) == 200
    assert browser.post("/dashboard/logout").status_code == 200
    assert status(first) == 303  # at once where the logout happened
    wait_until(lambda: status(second) == 303, "the other replica to refuse the logged-out cookie", 10)
    assert query(database_url, "SELECT count(*) AS n FROM dashboard_logouts")[0]["n"] == 1
    # Another login of the same key is a new session, untouched by that logout.
    assert login(second.url, ADMIN).get("/dashboard").status_code == 200


def test_failed_logins_are_throttled_per_client_address(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, admin_key=ADMIN, dashboard_login_failures=3, dashboard_login_window_s=2.0)
    guesser = httpx.Client(base_url=gw.url)
    for _ in range(3):
        assert guesser.post("/dashboard/session", json={"key": "guess"}).status_code == 401
    refused = guesser.post("/dashboard/session", json={"key": ADMIN})  # even the right key, for now
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "too_many_failed_logins"
    assert 1 <= int(refused.headers["retry-after"]) <= 2
    # Another address is not affected (the loopback network answers from 127.0.0.2 too).
    other = httpx.Client(base_url=gw.url, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    assert other.post("/dashboard/session", json={"key": ADMIN}).status_code == 200
    wait_until(
        lambda: guesser.post("/dashboard/session", json={"key": ADMIN}).status_code == 200,
        "the failures to leave the window",
        timeout_s=10,
        every_s=0.5,
    )
    guesser.close()
    other.close()


def test_guesses_at_the_admin_key_on_admin_routes_count_as_failed_logins(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    # The admin key opens /admin and /metrics as well as the dashboard: guesses there must meet the same
    # throttle, or a short admin key could be guessed at full speed beside a throttled login form.
    gw = make_gateway(
        f"sqlite:///{tmp_path / 'guess.db'}",
        admin_key=ADMIN,  # a key exists: /metrics wants one, on loopback too
        dashboard_login_failures=3,
        dashboard_login_window_s=2.0,
    )
    guesser = httpx.Client(base_url=gw.url)
    # A request that presents no key is no guess (a browser opening the URL, a scraper not set up yet).
    for _ in range(5):
        assert guesser.get("/admin/audit").status_code == 401
        assert guesser.get("/metrics").status_code == 401
    guesses = [
        guesser.get("/admin/audit", headers={"authorization": "Bearer guess-1"}),
        guesser.get("/metrics", headers={"authorization": "Bearer guess-2"}),
        guesser.get("/admin/policies", headers={"authorization": "Bearer guess-3"}),
    ]
    assert [g.status_code for g in guesses] == [401, 401, 401]
    for refused in (
        guesser.get("/admin/audit", headers={"authorization": f"Bearer {ADMIN}"}),  # even the right key
        guesser.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"}),
        guesser.post("/dashboard/session", json={"key": ADMIN}),
    ):
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_failed_logins"
        assert 1 <= int(refused.headers["retry-after"]) <= 2
    other = httpx.Client(base_url=gw.url, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    assert other.get("/admin/audit", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
    wait_until(
        lambda: guesser.get("/admin/audit", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200,
        "the failures to leave the window",
        timeout_s=10,
        every_s=0.5,
    )
    guesser.close()
    other.close()


def test_sessions_expire_and_end_when_the_key_is_revoked(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, admin_key=ADMIN, policy_refresh_s=0.2)
    with httpx.Client(base_url=gw.url) as admin:
        created = admin.post(
            "/admin/keys",
            json={"name": "ops", "scopes": ["admin"]},
            headers={"authorization": f"Bearer {ADMIN}"},
        ).json()
    operator = login(gw.url, created["secret"])
    assert operator.get("/dashboard").status_code == 200
    assert created["secret"] not in operator.get("/dashboard/policies").text
    httpx.post(f"{gw.url}/admin/keys/{created['id']}/revoke", headers={"authorization": f"Bearer {ADMIN}"})
    assert operator.get("/dashboard").status_code == 303
    # Expiry is the server's decision: a cookie past its time is refused (the signer's tests pin the rest).
    short = make_gateway(database_url, admin_key=ADMIN, dashboard_session_ttl_s=0.5)
    with httpx.Client(base_url=short.url) as browser:
        value = browser.post("/dashboard/session", json={"key": ADMIN}).cookies["kaizen_dashboard"]
    wait_until(
        lambda: (
            httpx.get(short.url + "/dashboard", headers={"cookie": f"kaizen_dashboard={value}"}).status_code
            == 303
        ),
        "the session to expire",
        timeout_s=10,
    )


def test_pages_show_traffic_episodes_runs_and_judge_groups(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy_runs(database_url, "bot", versions=3)
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    first = _chat(gw, "<script>alert(1)</script> what is the capital of France?")
    failed = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "scripted-1", "messages": [{"role": "user", "content": "#error 500"}]},
        headers={"authorization": f"Bearer {CLIENT}"},
    )
    assert failed.status_code == 502  # the engine's error, recorded as an error call
    tool = _chat(gw, "weather please #tool")
    gw.flush()
    browser = login(gw.url, ADMIN)
    overview = browser.get("/dashboard?window=1h")
    assert overview.status_code == 200
    totals = re.search(r'id="totals">(.*?)</section>', overview.text, re.S)
    assert totals is not None and "<b>3</b><span>calls</span>" in totals.group(1)
    assert "Live reward of bot by serving version" in overview.text
    episodes = browser.get("/dashboard/episodes")
    assert episodes.status_code == 200 and first in episodes.text and "capital of France" in episodes.text
    for page in (episodes.text, browser.get(f"/dashboard/episodes/{first}").text):
        assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # escaped
    trajectory = browser.get(f"/dashboard/episodes/{tool}")
    assert trajectory.status_code == 200
    assert "get_weather" in trajectory.text and "tool call" in trajectory.text
    assert browser.get("/dashboard/episodes/no-such-episode").status_code == 404
    policy = browser.get("/dashboard/policies/bot")
    assert policy.status_code == 200 and 'id="active-version">v0<' in policy.text
    assert 'id="owner">shared by every project<' in policy.text
    assert "<td>shared</td>" in browser.get("/dashboard/policies").text
    assert "judge_interval_s" in policy.text  # the stored configuration, and the one in effect
    runs = browser.get("/dashboard/runs?policy=bot")
    assert runs.status_code == 200 and "collapse guard stopped the run" in runs.text
    run_ids = [int(r["id"]) for r in query(database_url, "SELECT id FROM training_runs ORDER BY id")]
    run = browser.get(f"/dashboard/runs/{run_ids[0]}")
    assert run.status_code == 200 and 'id="gate-decision">promote<' in run.text
    assert "Loss per optimizer step" in run.text and "Collapse signals" in run.text
    judge = browser.get("/dashboard/judge")
    assert judge.status_code == 200 and "judge timed out" in judge.text and "$0.0012" in judge.text
    for page in PAGES:
        assert ADMIN not in browser.get(page).text
    assert browser.get("/dashboard/episodes?min_reward=abc").status_code == 400
    assert browser.get("/dashboard?window=9y").status_code == 400


def test_runs_of_unknown_shapes_render_their_metrics_generically(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy_runs(database_url, "bot", versions=2)
    run_id = seed_unusual_run(database_url, "bot")
    gw = make_gateway(database_url, admin_key=ADMIN)
    browser = login(gw.url, ADMIN)
    page = browser.get(f"/dashboard/runs/{run_id}")
    assert page.status_code == 200, page.text
    for shown in ("resampled.rare_successes", "examples", "sft", "learning_rate per optimizer step"):
        assert shown in page.text, shown
    assert "Loss per optimizer step" in page.text and 'id="gate-decision"' not in page.text
    assert "learning_rate: 0.00002 at 1" in page.text  # not 2e-05
    other = re.search(r'id="run-other">(.*?)</pre>', page.text, re.S)
    assert other is not None and "bootstrap" in other.group(1)
    assert "skipped" in page.text and "checked" in page.text  # a gate and collapse of another shape
    overview = browser.get("/dashboard?window=1h")  # its version changes read the runs' gates too
    assert overview.status_code == 200 and "gate promoted v1" in overview.text
    for listing in ("/dashboard/runs", "/dashboard/runs?policy=bot", "/dashboard/policies/bot"):
        answer = browser.get(listing)
        assert answer.status_code == 200, (listing, answer.text)
        assert f'href="/dashboard/runs/{run_id}"' in answer.text


def test_an_episode_shows_a_refused_reply(make_gateway: MakeGateway, database_url: str) -> None:
    """A refusal is the reply a labeller judges: the episode page shows it, marked as a refusal."""
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    refused = _chat(gw, "#refuse")
    gw.flush()
    page = login(gw.url, ADMIN).get(f"/dashboard/episodes/{refused}")
    assert page.status_code == 200
    shown = re.search(r'<pre class="content refusal">(.*?)</pre>', page.text, re.S)
    assert shown is not None and str(escape(REFUSAL)) in shown.group(1)


def test_episode_filters_and_keyset_pages(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    ids = [_chat(gw, f"question {n} about {'apples' if n % 2 else 'pears'}") for n in range(7)]
    gw.flush()
    browser = login(gw.url, ADMIN)
    for episode_id, value in ((ids[0], 0.9), (ids[1], 0.1)):
        stored = browser.post("/dashboard/feedback", json={"episode_id": episode_id, "value": value})
        assert stored.status_code == 200, stored.text

    def listed(params: dict[str, str]) -> list[str]:
        page = browser.get("/dashboard/episodes", params=params)
        assert page.status_code == 200, page.text
        return re.findall(r'<tr data-episode="([^"]+)">', page.text)

    assert listed({}) == list(reversed(ids))
    assert listed({"min_reward": "0.5"}) == [ids[0]]
    assert listed({"feedback": "yes"}) == [ids[1], ids[0]]
    assert len(listed({"rewarded": "no"})) == 5
    assert set(listed({"q": "APPLES"})) == {ids[n] for n in range(7) if n % 2}
    assert listed({"q": "100%_"}) == []  # LIKE wildcards are matched literally
    assert listed({"source": "traffic", "policy": "scripted-1"}) == list(reversed(ids))
    assert listed({"since": "2999-01-01"}) == []
    # A page ends with a cursor (the last row's time and id); the next page starts right after it.
    assert 'id="next-page"' not in browser.get("/dashboard/episodes").text  # 7 rows: one page
    rows = query(database_url, "SELECT id, created_at FROM episodes ORDER BY created_at DESC, id DESC")
    created = rows[2]["created_at"]
    created = datetime.fromisoformat(created) if isinstance(created, str) else created
    cursor = encode_cursor(EpisodeCursor(created.replace(tzinfo=created.tzinfo or UTC), rows[2]["id"]))
    assert listed({"after": cursor}) == [r["id"] for r in rows[3:]]


def test_labels_are_feedback_rows_from_the_logged_in_key(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    episode = _chat(gw, "rate me")
    gw.flush()
    call = query(database_url, "SELECT id FROM calls WHERE episode_id = :e", e=episode)[0]["id"]
    browser = login(gw.url, ADMIN)
    up = browser.post("/dashboard/feedback", json={"episode_id": episode, "value": True, "comment": "nice"})
    assert up.status_code == 200, up.text
    score = browser.post("/dashboard/feedback", json={"request_id": call, "value": 0.25})
    assert score.status_code == 200, score.text
    rows = query(
        database_url,
        "SELECT source, name, value, label, comment, call_id, episode_id, status, key_id FROM rewards ORDER BY id",
    )
    assert [(r["source"], r["name"], r["value"], r["label"], r["comment"]) for r in rows] == [
        ("feedback", "dashboard", 1.0, "thumbs_up", "nice"),
        ("feedback", "dashboard", 0.25, None, None),
    ]
    assert [(r["call_id"], r["episode_id"], r["status"], r["key_id"]) for r in rows] == [
        (None, episode, "linked", "admin-key"),
        (call, episode, "linked", "admin-key"),
    ]
    # The episode's reward is derived as for any feedback: the newest `feedback:dashboard` signal.
    assert query(database_url, "SELECT reward FROM episodes WHERE id = :e", e=episode)[0]["reward"] == 0.25
    bad = browser.post("/dashboard/feedback", json={"value": True})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_target"
    page = browser.get(f"/dashboard/episodes/{episode}").text
    assert page.count('data-name="dashboard"') == 2 and "nice" in page


def test_review_queue_goes_through_unrewarded_episodes_first(
    make_gateway: MakeGateway, database_url: str
) -> None:
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    ids = [_chat(gw, f"task {n}") for n in range(4)]  # ids[3] is the newest
    gw.flush()
    browser = login(gw.url, ADMIN)
    browser.post("/dashboard/feedback", json={"episode_id": ids[2], "value": True})

    def next_of(after: str | None, part: str) -> tuple[str, str] | None:
        answer = browser.get("/dashboard/review", params={"after": after, "part": part} if after else {})
        if answer.status_code == 200:
            assert 'id="queue-empty"' in answer.text
            return None
        assert answer.status_code == 303
        target = answer.headers["location"].split("/dashboard/episodes/")[1]
        episode_id, _, params = target.partition("?queue=")
        return episode_id, params

    order = []
    found = next_of(None, "unrewarded")
    while found is not None and len(order) < 10:
        order.append(found[0])
        found = next_of(*found)
    assert order == [ids[3], ids[1], ids[0], ids[2]]  # unrewarded newest first, then the rewarded one


def test_promote_rollback_and_pause_are_audited_as_the_logged_in_key(
    make_gateway: MakeGateway, database_url: str
) -> None:
    seed_policy_runs(database_url, "bot", versions=3)
    gw = make_gateway(database_url, admin_key=ADMIN)
    browser = login(gw.url, ADMIN)
    promoted = browser.post("/dashboard/policies/bot/promote", json={"version": 2})
    assert promoted.status_code == 200 and promoted.json()["active_version"] == 2
    assert browser.post("/dashboard/policies/bot/promote", json={"version": 9}).status_code == 404
    assert browser.post("/dashboard/policies/bot/rollback").json()["active_version"] == 0
    assert browser.post("/dashboard/policies/bot/pause").json()["schedule"]["paused"] is True
    assert 'id="schedule-state">paused<' in browser.get("/dashboard/policies/bot").text
    assert browser.post("/dashboard/policies/bot/resume").json()["schedule"]["paused"] is False
    audit = query(database_url, "SELECT actor, action FROM audit ORDER BY id")
    assert [(a["actor"], a["action"]) for a in audit] == [
        ("admin-key", "policy.promote"),
        ("admin-key", "policy.rollback"),
        ("admin-key", "policy.pause"),
        ("admin-key", "policy.resume"),
    ]
    overview = browser.get("/dashboard?window=1h&policy=bot").text
    assert "promoted v2" in overview and "rolled back from v2" in overview and "gate promoted v1" in overview


def test_the_dashboard_can_be_switched_off(make_gateway: MakeGateway, database_url: str) -> None:
    gw = make_gateway(database_url, admin_key=ADMIN, dashboard=False)
    assert httpx.get(gw.url + "/dashboard/login").status_code == 404
    assert httpx.post(gw.url + "/dashboard/login", json={"key": ADMIN}).status_code == 404


# A training child as the scheduler starts one: a line before it records its run (as the trainer's start-up
# does), a line per request as an unquieted client would log, its run's lines, and no candidate (exit 3).
TRAINING_CHILD = (
    RECORDS_ITS_RUN
    + """
print("starting", sys.argv[3], flush=True)
if sys.argv[3] == "broken":
    sys.exit(1)

asyncio.run(record())
for step in range(3):
    print(f"step {step} of", sys.argv[3], flush=True)
sys.exit(3)
"""
)


def test_a_run_page_shows_that_runs_own_log(make_gateway: MakeGateway, database_url: str) -> None:
    """The runs of a policy share its log file; each run's page shows the lines of that run only (those before
    the child recorded its run too), and a run from before runs had logs of their own says it has none."""
    seed_policy_runs(database_url, "bot", versions=2)
    gw = make_gateway(database_url, admin_key=ADMIN)

    async def train(name: str) -> int:
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                policy = await get_policy(session, "bot")
            assert policy is not None
            config = RunnerConfig(
                data_dir=gw.settings.data_dir,
                judge=JudgeSettings(model=""),
                database_url=database.url,
                train_command=[sys.executable, "-c", TRAINING_CHILD, database.url, str(policy.id), name],
                gate_url="http://127.0.0.1:9/v1",
            )
            info = await JobRunner(database, config).run("bot", "train")
            assert info is not None and info.status == "failed"
            return info.id
        finally:
            await database.dispose()

    runs = {name: asyncio.run(train(name)) for name in ("first", "second", "broken")}
    shared = (gw.settings.data_dir / "logs" / "train-bot.log").read_text()
    assert "step 2 of first" in shared and "step 2 of second" in shared  # the policy's log has them all
    browser = login(gw.url, ADMIN)
    for name, run_id in runs.items():
        page = browser.get(f"/dashboard/runs/{run_id}")
        assert page.status_code == 200, page.text
        log = re.search(r'id="run-log">(.*?)</pre>', page.text, re.S)
        assert log is not None, (name, page.text)
        assert f"starting {name}" in log.group(1)
        others = [other for other in runs if other != name]
        assert not any(
            f"of {other}" in log.group(1) or f"starting {other}" in log.group(1) for other in others
        )
    assert "step 2 of second" in browser.get(f"/dashboard/runs/{runs['second']}").text
    old = int(query(database_url, "SELECT min(id) AS id FROM training_runs")[0]["id"])
    page = browser.get(f"/dashboard/runs/{old}")
    assert page.status_code == 200 and 'id="run-log"' not in page.text
    assert "No log was kept for this run" in page.text

    async def running() -> int:  # a run whose child the scheduler has not seen yet
        database = Database(async_database_url(database_url))
        try:
            async with database.session() as session:
                policy = await get_policy(session, "bot")
                assert policy is not None
                run_id = await start_job_run(session, policy.id, "train", None, {})
                await session.commit()
                return run_id
        finally:
            await database.dispose()

    page = browser.get(f"/dashboard/runs/{asyncio.run(running())}")
    assert page.status_code == 200 and "No output yet" in page.text


def test_the_default_window_holds_a_short_burst_of_traffic(
    make_gateway: MakeGateway, database_url: str
) -> None:
    """A few minutes of traffic: the overview opens on the hour that holds it (a minute a point), not on a day
    where it would be a sliver at the right edge; a window picked explicitly stays picked."""
    gw = make_gateway(database_url, api_keys=[CLIENT], admin_key=ADMIN)
    for n in range(3):
        _chat(gw, f"question {n}")
    gw.flush()
    browser = login(gw.url, ADMIN)
    page = browser.get("/dashboard")
    assert page.status_code == 200
    assert '<option value="1h" selected>' in page.text
    assert "per 1 min" in page.text
    picked = browser.get("/dashboard?window=24h")
    assert '<option value="24h" selected>' in picked.text and "per 15 min" in picked.text
    assert "per 2 h" in browser.get("/dashboard?window=7d").text
    assert not re.search(r"\d[eE][+-]?\d", picked.text.split("<svg", 1)[-1])
