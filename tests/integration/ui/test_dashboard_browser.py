"""The dashboard in Debian's Chromium (driven by Playwright) against `agentflow serve`
with a real run in it: an RTPO run the split trainer trains while the run's page is open,
so its curves grow live; its episodes' trees hold the re-rolled branches.

Screenshots of each page go to `$AGENTFLOW_UI_SCREENSHOTS` (the README's come from
there), else to the test's temporary directory.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect
from sqlalchemy import select

from agentflow.config import Settings
from agentflow.db.blobs import blob_store_for
from agentflow.db.models import Turn
from agentflow.db.packing import unpack_floats
from agentflow.db.runs import RunStore
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.types import TurnRecord
from envs.browser.chromium import chromium_executable
from tests.e2e.test_rtpo_run import _config as rtpo_config
from tests.integration.test_gateway_crash import gateway_process
from tests.integration.test_serve import _free_port

pytestmark = pytest.mark.integration

KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEPS = 3
TIMEOUT_MS = 60_000


def _config(tmp_path: Path) -> dict[str, Any]:
    """The RTPO e2e test's small run (each episode re-rolled from its later turns, so its
    tree forks), for STEPS steps by disk sync."""
    document = rtpo_config(tmp_path)
    document["name"] = "dashboard-rtpo"
    document["trainer"].update(steps=STEPS, checkpoint_every=STEPS)
    document["weights"] = {"sync": "disk", "dir": str(tmp_path / "weights")}
    return document


def _shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("AGENTFLOW_UI_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=chromium_executable(headless=True)
        )
        try:
            yield launched
        finally:
            await launched.close()


async def _signed_in(browser: Browser, url: str) -> Page:
    page = await browser.new_page(viewport={"width": 1280, "height": 860})
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    first = await page.goto(f"{url}/ui")
    assert first is not None and first.status == 401  # the sign-in form
    await page.fill("#key", KEY)
    await page.click("button[type=submit]")
    await expect(page.locator("main[data-page=runs]")).to_be_visible()
    page.errors = errors  # type: ignore[attr-defined]
    return page


async def _tree_facts(database_url: str, episode_id: uuid.UUID) -> dict[str, Any]:
    """What the database holds of one episode's tree."""
    engine = create_engine(database_url)
    try:
        async with session_factory(engine)() as session:
            rows = (
                await session.execute(
                    select(Turn.id, Turn.parent_id, Turn.kind, Turn.logprobs, Turn.created_at)
                    .where(Turn.episode_id == episode_id)
                    .order_by(Turn.depth, Turn.created_at)
                )
            ).all()
    finally:
        await engine.dispose()
    children = Counter(row.parent_id for row in rows if row.parent_id is not None)
    policy = next(row for row in rows if row.kind == "policy")
    return {
        "turns": len(rows),
        "forks": {parent: n for parent, n in children.items() if n > 1},
        "policy_turn": policy.id,
        "logprobs": unpack_floats(policy.logprobs),
    }


async def _branched_episode(url: str, run_id: str, database_url: str) -> uuid.UUID:
    page = httpx.get(
        f"{url}/v1/runs/{run_id}/episodes",
        params={"status": "completed", "limit": 50},
        headers=AUTH,
    ).json()
    for item in page["items"]:
        episode = uuid.UUID(item["id"])
        if (await _tree_facts(database_url, episode))["forks"]:
            return episode
    raise AssertionError("no completed episode of the RTPO run has a re-rolled branch")


async def test_the_dashboard_shows_a_real_run(
    pg_database: str, browser: Browser, tmp_path: Path
) -> None:
    # On PostgreSQL, the production database: the dashboard reads through the API, whose
    # queries run on both databases in their own tests (test_train_dashboard.py serves the
    # embedded run's SQLite), so a second minute of gateway, trainer and browser adds none.
    database_url = pg_database
    document = _config(tmp_path)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(document))
    shots = _shots(tmp_path)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    with gateway_process(database_url, tmp_path, port, log=log, AGENTFLOW_API_KEY=KEY):
        env_name = f"web-form-{uuid.uuid4().hex[:6]}"
        registered = httpx.post(
            f"{url}/v1/envs",
            json={"name": env_name, "kind": "http", "spec": {"url": "http://127.0.0.1:9"}},
            headers=AUTH,
        )
        assert registered.status_code == 201, registered.text
        created = httpx.post(f"{url}/v1/runs", json=document, headers=AUTH, timeout=60)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        page = await _signed_in(browser, url)

        # The run's page, open before the trainer starts: its curves fill in as it trains.
        await page.goto(f"{url}/ui#/runs/{run_id}")
        reward_points = page.locator("figure[data-chart=reward] circle.point")
        await expect(page.locator("figure[data-chart=reward]")).to_be_visible()
        assert await reward_points.count() == 0
        trainer = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", "trainer", str(config)]
            + ["--gateway", url, "--run", run_id, "--api-key", KEY],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            output, _ = trainer.communicate(timeout=300)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        assert trainer.returncode == 0, output.decode()[-3000:]
        await expect(reward_points).to_have_count(STEPS)  # the page polled; never reloaded
        await expect(page.locator("figure[data-chart=staleness] .series")).to_have_count(2)
        await expect(page.locator("figure[data-chart=throughput] circle.point")).to_have_count(
            STEPS
        )
        await expect(page.locator("[data-fact=weight-version]")).to_have_text(str(STEPS))
        await page.screenshot(path=shots / "dashboard-run.png", full_page=True)

        # The runs page lists it, with the version its engines serve.
        await page.goto(f"{url}/ui#/runs")
        listed = page.locator(f"table.runs tr[data-run-id='{run_id}']")
        await expect(listed).to_contain_text("dashboard-rtpo")
        await expect(listed.locator("td.num")).to_have_text(str(STEPS))
        await expect(listed).to_contain_text("rtpo")
        await page.screenshot(path=shots / "dashboard-runs.png")

        # Engines and envs, while the run still plays.
        await page.goto(f"{url}/ui#/engines")
        row = page.locator(f"table.engines tr[data-run-id='{run_id}']")
        await expect(row).to_be_visible()
        await expect(row.locator("td").nth(1)).to_have_text("LocalEngine")
        await expect(row.locator("td.kv")).to_contain_text("tokens")
        await expect(row.locator("td.batch")).to_contain_text("/ 32")
        await page.screenshot(path=shots / "dashboard-engines.png")
        await page.goto(f"{url}/ui#/envs")
        env_row = page.locator("table.envs tr", has_text=env_name)
        await expect(env_row).to_contain_text("http")
        builtin = page.locator("table.builtin-envs tr", has_text="agentflow/vault-v0")
        await expect(builtin.locator("td.live")).to_have_text(re.compile(r"^\d+$"))
        await page.screenshot(path=shots / "dashboard-envs.png")

        stopped = httpx.post(f"{url}/v1/runs/{run_id}/stop", headers=AUTH, timeout=60)
        assert stopped.status_code == 200, stopped.text

        # Episodes: paged, and filtered through the form.
        listing = httpx.get(f"{url}/v1/runs/{run_id}/episodes", headers=AUTH).json()
        completed = httpx.get(
            f"{url}/v1/runs/{run_id}/episodes", params={"status": "completed"}, headers=AUTH
        ).json()
        await page.goto(f"{url}/ui#/runs/{run_id}/episodes")
        await expect(page.locator(".pager .range")).to_contain_text(f"of {listing['total']}")
        await expect(page.locator("table.episodes tbody tr")).to_have_count(
            min(50, listing["total"])
        )
        await page.select_option("select[name=status]", "completed")
        await page.click(".filters button[type=submit]")
        await expect(page.locator(".pager .range")).to_contain_text(f"of {completed['total']}")
        statuses = await page.locator("table.episodes tbody .badge").all_text_contents()
        assert statuses and set(statuses) == {"completed"}
        await page.screenshot(path=shots / "dashboard-episodes.png")

        # One episode's tree: every turn, each fork's branches, a token's log-prob.
        episode = await _branched_episode(url, run_id, database_url)
        facts = await _tree_facts(database_url, episode)
        await page.goto(f"{url}/ui#/episodes/{episode}")
        await expect(page.locator("article.turn")).to_have_count(facts["turns"])
        forks = page.locator(".branches")
        await expect(forks).to_have_count(len(facts["forks"]))
        for parent, count in facts["forks"].items():
            fork = page.locator(f".branches[data-parent='{parent}']")
            await expect(fork.locator(":scope > .branch")).to_have_count(count)
        token = page.locator(f"article[data-turn-id='{facts['policy_turn']}'] .tok").first
        await token.hover()
        logprob = facts["logprobs"][0]
        await expect(page.locator("#tip")).to_contain_text(f"log-prob {logprob:.4f}")
        assert float(await token.get_attribute("data-logprob") or "nan") == pytest.approx(
            logprob, abs=1e-6
        )
        await page.screenshot(path=shots / "dashboard-episode.png", full_page=True)
        assert page.errors == []  # type: ignore[attr-defined]


async def test_a_computer_use_episode_shows_its_screenshots(
    sqlite_database: str, browser: Browser, tmp_path: Path
) -> None:
    """An env turn's screenshot (a real one, taken by Chromium) is shown in the tree."""
    shot_page = await browser.new_page(viewport={"width": 320, "height": 200})
    await shot_page.set_content("<button style='font-size:40px'>Submit</button>")
    png = await shot_page.screenshot()
    await shot_page.close()
    engine = create_engine(sqlite_database)
    try:
        turns = TurnTree(
            session_factory(engine),
            blob_store=blob_store_for(Settings(database_url=sqlite_database)),
        )
        episode = await turns.create_episode(env_ref="agentflow/miniwob-click-button")
        prompt = await turns.add_turn(
            episode, None, TurnRecord(kind="prompt", token_ids=(67,), text="C", images=(png,))
        )
        action = await turns.add_turn(
            episode,
            prompt,
            TurnRecord(kind="policy", token_ids=(99,), logprobs=(-0.1,), weight_versions=(0,)),
        )
        await turns.add_turn(
            episode, action, TurnRecord(kind="env", token_ids=(100,), reward=1.0, images=(png,))
        )
        await turns.complete_episode(episode, "completed", 1.0)
    finally:
        await engine.dispose()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_process(sqlite_database, tmp_path, port, AGENTFLOW_API_KEY=KEY):
        page = await _signed_in(browser, url)
        await page.goto(f"{url}/ui#/episodes/{episode}")
        shots = page.locator("img.shot")
        await expect(shots).to_have_count(2)
        for index in range(2):
            width = await shots.nth(index).evaluate("img => img.complete && img.naturalWidth")
            assert width == 320  # the stored PNG itself, loaded with the session cookie
        await page.screenshot(path=_shots(tmp_path) / "dashboard-screenshots.png", full_page=True)


class _OtherSite(http.server.BaseHTTPRequestHandler):
    """Another origin's page that posts to the dashboard, as a cross-site request forgery
    would: a form the browser submits with the dashboard's cookie."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = (
            f'<form id="f" method="post" action="{self.target}"></form>'
            '<script>document.getElementById("f").submit()</script>'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        """Quiet: the test reads the gateway's log, not this server's."""


async def test_the_run_page_controls_a_run_and_refuses_another_sites_requests(
    sqlite_database: str, browser: Browser, tmp_path: Path
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    run = {
        "name": "dashboard-controls",
        "model": {"init": {"layers": 1, "hidden": 32, "heads": 2, "max_context": 256}},
        "envs": [{"id": "agentflow/guess-number-v0", "max_concurrency": 4}],
        "agent": {"max_turns": 2, "max_new_tokens": 4},
        "rollout": {"group_size": 2, "max_concurrency": 4},
    }
    with gateway_process(sqlite_database, tmp_path, port, log=log, AGENTFLOW_API_KEY=KEY):
        created = httpx.post(f"{url}/v1/runs", json=run, headers=AUTH, timeout=60)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        try:
            await _control_from_the_page(browser, url, run_id, sqlite_database, tmp_path)
        finally:  # never left live in the session's database, for a later gateway to resume
            httpx.post(f"{url}/v1/runs/{run_id}/stop", headers=AUTH, timeout=60)
    logged = log.read_text()
    for action in ("pause", "resume", "env mix revision 2", "stop"):
        assert re.search(rf"{action} by dashboard from 127\.0\.0\.1 at \d{{4}}-", logged), action


async def _control_from_the_page(
    browser: Browser, url: str, run_id: str, sqlite_database: str, tmp_path: Path
) -> None:

    def stored() -> dict[str, Any]:
        return dict(httpx.get(f"{url}/v1/runs/{run_id}", headers=AUTH, timeout=30).json())

    page = await _signed_in(browser, url)
    await page.goto(f"{url}/ui#/runs/{run_id}")
    badge = page.locator("h1 .badge")
    await expect(badge).to_have_text("running")

    # Pause and resume from the page.
    await page.click("button[data-action=pause]")
    await expect(badge).to_have_text("paused")
    assert stored()["status"] == "paused"
    await page.click("button[data-action=resume]")
    await expect(badge).to_have_text("running")

    # The mix: add the vault env, then weigh guess-the-number 3 to 1.
    await page.fill("input[aria-label='env id to add']", "agentflow/vault-v0")
    await page.click("button[data-action=apply-mix]")
    await expect(page.locator(".mix h2")).to_have_text("Env mix (revision 1)")
    await expect(page.locator(".mix tr[data-env='agentflow/vault-v0']")).to_be_visible()
    await page.fill("input[aria-label='weight of agentflow/guess-number-v0']", "3")
    await page.click("button[data-action=apply-mix]")
    await expect(page.locator(".mix h2")).to_have_text("Env mix (revision 2)")
    mix = stored()
    assert {e["id"]: e["weight"] for e in mix["envs"]} == {
        "agentflow/guess-number-v0": 3.0,
        "agentflow/vault-v0": 1.0,
    }
    assert mix["env_revisions"][-1]["changed_by"] == "dashboard from 127.0.0.1"
    # A bad weight is refused naming the field; the mix stays as it was.
    await page.fill("input[aria-label='weight of agentflow/vault-v0']", "0")
    await page.click("button[data-action=apply-mix]")
    await expect(page.locator("p.error[role=alert]")).to_contain_text("weight")
    assert stored()["env_revision"] == 2

    # Another site's page (another port: the same site to the browser, so its cookie
    # goes along) submits a form to pause the run: refused, the run plays on.
    _OtherSite.target = f"{url}/ui/api/runs/{run_id}/pause"
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtherSite)
    serving = threading.Thread(target=other.serve_forever, daemon=True)
    serving.start()
    answers: list[int] = []
    page.on("response", lambda r: answers.append(r.status) if r.url == _OtherSite.target else None)
    try:
        await page.goto(f"http://127.0.0.1:{other.server_address[1]}/")
        await expect(page.locator("body")).to_contain_text("dashboard's own page")
    finally:
        other.shutdown()
        other.server_close()
    assert answers == [403]
    assert stored()["status"] == "running"
    await page.goto(f"{url}/ui#/runs/{run_id}")
    await expect(badge).to_have_text("running")

    # Each env's curves, with the mix's revisions marked (steps recorded as a trainer
    # would, at versions past the one the revisions took effect at).
    engine = create_engine(sqlite_database)
    try:
        runs = RunStore(session_factory(engine))
        for version in (1, 2, 3):
            await runs.record_version(uuid.UUID(run_id), version, "", {})
            figures = {
                "reward": 0.5,
                "env/agentflow/guess-number-v0/reward": version / 10,
                "env/agentflow/vault-v0/reward": version / 5,
                "env/agentflow/guess-number-v0/episodes": 12.0,
                "env/agentflow/vault-v0/episodes": 4.0,
                "env/agentflow/guess-number-v0/staleness": 0.5,
                "env/agentflow/vault-v0/staleness": 0.25 * version,
            }
            await runs.record_metrics(uuid.UUID(run_id), version, figures, step=version)
    finally:
        await engine.dispose()
    env_reward = page.locator("figure[data-chart=env-reward]")
    await expect(env_reward.locator(".series")).to_have_count(2)
    await expect(env_reward.locator(".series circle.point")).to_have_count(6)
    await expect(env_reward.locator(".mark")).to_have_count(2)  # revisions 1 and 2
    await expect(env_reward.locator(".legend")).to_contain_text("agentflow/vault-v0")
    await page.screenshot(path=_shots(tmp_path) / "dashboard-controls.png", full_page=True)

    # Stop, asked twice.
    await page.click("button[data-action=ask-stop]")
    await page.click("button[data-action=stop]")
    await expect(badge).to_have_text("stopped")
    assert page.errors == []  # type: ignore[attr-defined]
