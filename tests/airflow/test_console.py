"""The operator console in the Airflow UI, in a real browser: Debian's headless Chromium, driven
by Selenium, logs into a real ``airflow standalone`` (its UI's login sets the session cookie),
opens the "sluice epochs" tab of a pipeline that ran, reads the epoch table and the plots, and
rolls the pipeline back through the page (preview, then confirmation). The ``sluice_rollback``
run the page starts is executed by the real scheduler; the table then equals the oracle from
the raw files. The cards, the plots and the tables are checked against ``/control``, ``/epochs``
and the store (issue 38 item 7: each card reads one source of truth).
Screenshots go to ``var/screenshots/``; ``docs/img/console.png`` (the README's) is a copy of
``console-epochs.png``."""

from __future__ import annotations

import json
import secrets
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

import httpx
import pytest

from include.generators.ysb import expected_window_counts
from sluice import protocol
from sluice.paths import project_root
from sluice.protocol.run import run_once
from sluice.spec import PipelineSpec
from sluice.store import EpochStore
from tests.airflow import standalone
from tests.pipelines import assert_matches_oracle, land, landed, make_pipeline

pytestmark = pytest.mark.browser

NAME = "console_ysb"
USER = "operator"
#: The second person: ``sluice_rollback`` waits for an approval (``[sluice] rollback_approval``).
REVIEWER = "reviewer"
SCREENSHOTS = project_root() / "var" / "screenshots"


@pytest.fixture(scope="module")
def ran(spark) -> Iterator[PipelineSpec]:
    """A pipeline that ran before the server starts: six files, three epochs in two groups."""
    spec = make_pipeline(NAME, **{"spark.mode": "in_process", "control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=6, seed=41, malformed_fraction=0.02)
    log = EpochStore()
    try:
        run_once(spec, log, spark, drain=True)
        assert [(e.epoch_id, e.state) for e in log.epochs(NAME)] == [(i, protocol.PUBLISHED) for i in range(3)]
    finally:
        log.close()
    yield spec


@dataclass
class Login:
    server: standalone.Server
    password: str
    token: str
    reviewer_token: str

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, timeout=30.0,
                            headers={"Authorization": f"Bearer {token or self.token}"})


@pytest.fixture(scope="module")
def server(ran, tmp_path_factory) -> Iterator[Login]:
    """``airflow standalone`` with a real login: the simple auth manager with one admin user
    and a password (not every request an admin, as the other real-Airflow tests have it)."""
    home = tmp_path_factory.mktemp("console") / "airflow"
    home.mkdir(parents=True)
    passwords = {user: secrets.token_urlsafe(12) for user in (USER, REVIEWER)}
    (home / "passwords.json").write_text(json.dumps(passwords))
    srv = standalone.start(home, extra_env={
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin,{REVIEWER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__SLUICE__ROLLBACK_APPROVAL": "True"})
    try:
        def token(user: str) -> str | None:
            try:
                with httpx.Client(base_url=srv.url, timeout=30.0) as c:
                    r = c.post("/auth/token", json={"username": user, "password": passwords[user]})
            except httpx.TransportError:
                return None
            return r.json()["access_token"] if r.status_code in (200, 201) else None

        first = standalone.wait_for(lambda: token(USER), 180, "a token from the api-server", server=srv)
        login = Login(srv, passwords[USER], first, token(REVIEWER) or "")
        with login.client() as client:
            standalone.wait_healthy(srv, client, timeout=180)
            for dag_id in (NAME, "sluice_rollback", "sluice_rollback_preview"):
                standalone.wait_for_dag(srv, client, dag_id, timeout=120)
        yield login
    finally:
        standalone.stop(srv)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_path, "Debian's chromium and chromium-driver (make test-full installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def open_tab(driver, url: str) -> None:
    """Open an Airflow UI page holding a sluice view, and switch into the view's frame once the
    console page has rendered."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.switch_to.default_content()
    driver.get(url)
    WebDriverWait(driver, 60).until(ec.frame_to_be_available_and_switch_to_it((By.CSS_SELECTOR, "iframe")))
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    ready = driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready")
    assert ready == "true", driver.find_element(By.ID, "error").text


def screenshot(driver, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    driver.switch_to.default_content()
    driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def marks(driver, plot: str, series: str) -> list[tuple[float, float]]:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f"svg#{plot} [data-series='{series}'][data-x]")
    return sorted((float(m.get_attribute("data-x")), float(m.get_attribute("data-y"))) for m in found)


def live_rows(driver) -> dict[int, dict[str, str]]:
    from selenium.webdriver.common.by import By

    rows = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, "table#epochs tr[data-live='true']"):
        cells = {c: tr.find_element(By.CSS_SELECTOR, f"td.{c}").text
                 for c in ("range", "state", "delta", "rows-input", "rows-output", "rows-rejected", "timings",
                           "validation")}
        rows[int(tr.get_attribute("data-epoch"))] = cells
    return rows


def group_rows(driver) -> dict[int, dict[str, str]]:
    from selenium.webdriver.common.by import By

    return {int(tr.get_attribute("data-group")): {c: tr.find_element(By.CSS_SELECTOR, f"td.{c}").text
                                                  for c in ("epochs", "state", "rows-output", "timings")}
            for tr in driver.find_elements(By.CSS_SELECTOR, "table#groups tr[data-live='true']")}


def card(driver, card_id: str) -> tuple[str, str]:
    """A card's value and its classes."""
    from selenium.webdriver.common.by import By

    found = driver.find_element(By.ID, card_id)
    return found.find_element(By.TAG_NAME, "b").text, found.get_attribute("class")


def check_cards_and_tables(driver, login: Login, spec: PipelineSpec, epochs: list) -> None:
    """The cards and the tables agree with ``/control``, ``/epochs`` and the store: one halted
    state, no Python ``None``, freshness from the last publish against the SLA, output rows of
    a shared commit once on its group, the group's timings once, validation counted per epoch."""
    from selenium.webdriver.common.by import By

    with login.client() as client:
        control = client.get(f"/sluice/pipelines/{NAME}/control").json()
        api_epochs = {e["epoch_id"]: e for e in client.get(f"/sluice/pipelines/{NAME}/epochs").json() if e["live"]}
    halted = control["halted"]
    assert card(driver, "now-halted")[0] == (halted or "no")
    assert (card(driver, "now-next")[0] == "halted") == bool(halted) == (control["next"]["mode"] == "halted")
    why = driver.find_element(By.ID, "now-reason").text
    assert why.startswith(f"why: {control['next']['reason']} (") and "None" not in why, why
    # Freshness: stale iff the last publish (from the store) is older than the SLA.
    last = max(e.published_at for e in epochs).replace(tzinfo=UTC).timestamp()
    value, classes = card(driver, "now-freshness")
    stale = time.time() - last > spec.control.freshness_sla_s
    assert stale == control["freshness"]["stale"] and ("bad" in classes) == stale, (value, classes, control)
    assert value.startswith(f"{'stale' if stale else 'fresh'}: last publish "), value
    # The epoch table: an epoch's own output only when it had a commit of its own; a shared
    # commit's count and timings once, on the group (from the store, not from the payload).
    shown, groups = live_rows(driver), group_rows(driver)
    by_group: dict[int, list] = {}
    for e in epochs:
        by_group.setdefault(e.group_id, []).append(e)
    assert sorted(groups) == sorted(by_group), groups
    for gid, members in by_group.items():
        shared = len(members) > 1
        assert groups[gid]["rows-output"] == str(sum(e.rows["output"] for e in members)), (groups[gid], members)
        assert groups[gid]["epochs"] == ", ".join(str(e.epoch_id) for e in members)
        compute = f"compute {members[-1].timings['compute_s']}"
        for e in members:
            row = shown[e.epoch_id]
            assert row["rows-output"] == (f"group {gid}" if shared else str(e.rows["output"])), (row, e.rows)
            assert row["rows-output"] == (f"group {gid}" if api_epochs[e.epoch_id]["commit"] else
                                          str(api_epochs[e.epoch_id]["rows_out"]))
            assert (compute in row["timings"]) != shared, row
        assert (compute in groups[gid]["timings"]) == shared, groups[gid]
    # Validation: the plot's title counts the epochs per outcome.
    passed = sum(1 for e in epochs if e.validation and all(r["success"] for r in e.validation.values()))
    title = driver.find_element(By.CSS_SELECTOR, "svg#plot-validation").get_attribute("aria-label")
    assert title.startswith(f"validation: {passed} passed, {len(epochs) - passed} failed of {len(epochs)} epochs"), \
        title
    assert "None" not in driver.find_element(By.ID, "now").text


def test_the_console_shows_a_pipeline_and_rolls_it_back(ran, server, browser, spark):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver, login = browser, server
    url = login.server.url
    # Not logged in yet: the console's page is refused like the API.
    driver.get(f"{url}/sluice/ui/{NAME}")
    assert "Not authenticated" in driver.find_element(By.TAG_NAME, "body").text
    # Airflow's login page (simple auth manager) sets the session cookie the console uses.
    driver.get(f"{url}/")
    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.NAME, "username"))
    driver.find_element(By.NAME, "username").send_keys(USER)
    driver.find_element(By.NAME, "password").send_keys(login.password)
    driver.find_element(By.CSS_SELECTOR, "button[type='submit']").click()
    WebDriverWait(driver, 60).until(lambda d: any(c["name"] == "_token" for c in d.get_cookies()))

    # The list of pipelines, under Browse.
    open_tab(driver, f"{url}/plugin/sluice-pipelines")
    listed = driver.find_element(By.CSS_SELECTOR, f"table#pipelines tr[data-pipeline='{NAME}']").text
    assert NAME in listed

    # The pipeline's tab: the epoch table and the plots show what the store holds.
    open_tab(driver, f"{url}/dags/{NAME}/plugin/sluice-epochs")
    log = EpochStore()
    epochs = log.epochs(NAME)
    shown = live_rows(driver)
    assert sorted(shown) == [e.epoch_id for e in epochs], shown
    for e in epochs:
        row = shown[e.epoch_id]
        assert row["range"] == f"[{e.start}, {e.end})" and row["state"] == "published", row
        assert row["rows-input"] == str(e.rows["input"]), (row, e.rows)
        assert row["rows-rejected"] == str(e.rows.get("rejected", 0)), (row, e.rows)
        assert row["delta"] == " ".join(f"{k}@{v}" for k, v in e.delta_versions.items()), (row, e.delta_versions)
        assert row["validation"] == "passed", row
    assert driver.find_element(By.CSS_SELECTOR, "#now-backlog-files b").text == "0"
    # The freshness it can hold: 2 x the median group wall (first planned to last published) + a poll.
    spans: dict[int, list] = {}
    for e in epochs:
        spans.setdefault(e.group_id, []).extend([e.planned_at, e.published_at])
    walls = sorted((max(s) - min(s)).total_seconds() for s in spans.values())
    floor = 2 * statistics.median(walls) + ran.control.poll_interval_s
    card = driver.find_element(By.CSS_SELECTOR, "#now-sla-floor")
    assert abs(float(card.find_element(By.TAG_NAME, "b").text.removesuffix(" s")) - floor) <= 0.11, (card.text, walls)
    assert ("bad" in card.get_attribute("class")) == (floor > ran.control.freshness_sla_s), card.get_attribute("class")
    assert f"median of the last {len(walls)}" in card.get_attribute("title"), card.get_attribute("title")
    check_cards_and_tables(driver, login, ran, epochs)
    # Epoch 2 was committed alone; epochs 0 and 1 share group 0's commit, counted on the group.
    assert marks(driver, "plot-rows", "output") == [(2, epochs[2].rows["output"])]
    assert marks(driver, "plot-group-output", "output") == [
        (0, epochs[0].rows["output"] + epochs[1].rows["output"]), (1, epochs[2].rows["output"])]
    assert marks(driver, "plot-epoch-size", "files") == [(e.epoch_id, e.end - e.start) for e in epochs]
    assert marks(driver, "plot-k", "k") == [(0, 2), (1, 1)]  # groups of 2 epochs, then 1
    assert len(marks(driver, "plot-group-time", "coordination")) == 2
    # Processing: the group's compute and writes once (not once per epoch), within its wall.
    for (gid, shown_s), members in zip(marks(driver, "plot-group-time", "processing"), ([0, 1], [2]), strict=True):
        times = epochs[members[-1]].timings
        spent = times["compute_s"] + sum(v for k, v in times.items() if k.startswith("write_") and k.endswith("_s"))
        wall = (max(epochs[i].published_at for i in members) - min(epochs[i].planned_at for i in members))
        assert abs(shown_s - min(spent, wall.total_seconds())) <= 0.011, (gid, shown_s, times)
    assert len(marks(driver, "plot-freshness", "freshness")) == 3
    arrived = marks(driver, "plot-backlog", "arrived")
    assert [n for _, n in arrived] == list(range(1, 7)), arrived  # six files arrived
    assert marks(driver, "plot-backlog", "backlog")[-1][1] == 0  # and none is left
    screenshot(driver, "console-epochs")

    # Roll back through the page: the preview says what goes, then a confirmation. Epoch 1
    # shares its group's Delta commit with epoch 0, so its preview restores to before epoch 0.
    driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe"))

    def preview(to_epoch: int) -> str:
        Select(driver.find_element(By.ID, "rollback-to")).select_by_value(str(to_epoch))
        driver.find_element(By.ID, "rollback-preview-button").click()
        return WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.ID, "preview-epochs").text.startswith("rolls back") and
            d.find_element(By.ID, "rollback-preview").text)

    driver.find_element(By.ID, "rollback-reason").send_keys("console test: recompute epoch 2")
    shared = preview(1)
    assert "rolls back 3 epoch(s): 0 [0, 2), 1 [2, 4), 2 [4, 6); keeps 0" in shared, shared
    assert "epochs [0] share a Delta commit with epoch 1" in shared, shared
    text = preview(2)
    assert "rolls back 1 epoch(s): 2 [4, 6); keeps 2" in text, text
    assert f"output {epochs[2].rows['output']}," in driver.find_element(By.ID, "preview-rows").text
    restore = driver.find_element(By.ID, "preview-restore").text
    assert f"campaign_views to version {epochs[1].delta_versions['campaign_views']}" in restore, restore
    assert not log.pending_rollback(NAME) and log.generation(NAME) == 0  # a preview changes nothing
    # The shadow preview: sluice_rollback_preview, run by the scheduler, recomputes epoch 2 with
    # the same code into a shadow table: every row as the oracle has it, none changed.
    driver.find_element(By.ID, "shadow-preview-button").click()
    counts = WebDriverWait(driver, 400, poll_frequency=2).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#shadow-preview .shadow-counts")).pop().text
    rows = len(expected_window_counts(landed(ran)))
    assert counts.startswith(f"campaign_views: {rows} rows published (version ") and counts.endswith(
        f"), {rows} after the rollback: +0 added, -0 removed, ~0 changed"), counts
    assert driver.find_elements(By.ID, "shadow-unchanged")
    assert not log.pending_rollback(NAME) and log.generation(NAME) == 0
    screenshot(driver, "console-rollback-preview")
    driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe"))
    driver.find_element(By.ID, "rollback-confirm").click()
    link = WebDriverWait(driver, 30).until(lambda d: d.find_element(By.CSS_SELECTOR, "#rollback a.run"))
    run_id = link.get_attribute("data-run-id")

    with login.client() as client:
        # The run waits for a second person; the requester's own approval is refused below.
        approve(login, client, run_id, login.reviewer_token)
        states = standalone.wait_for_run_state(login.server, client, "sluice_rollback", run_id, timeout=400)
        assert states["rollback"] == "success" and states["checkpoint"] == "success", states
        run = client.get(f"/api/v2/dags/sluice_rollback/dagRuns/{run_id}").json()
        assert run["conf"]["pipeline"] == NAME and run["conf"]["to_epoch"] == 2, run
    assert log.generation(NAME) == 1
    after = log.epochs(NAME)
    assert [(e.epoch_id, e.start, e.end, e.state) for e in after] == [
        (e.epoch_id, e.start, e.end, protocol.PUBLISHED) for e in epochs]
    assert_matches_oracle(spark, ran, log)
    log.close()

    # Four eyes: a rollback its requester approves fails, and nothing changes.
    with login.client() as client:
        # through the console's route (a run triggered on sluice_rollback directly is refused)
        r = client.post(f"/sluice/pipelines/{NAME}/actions/rollback",
                        json={"to_epoch": 0, "reason": "approve it myself"})
        r.raise_for_status()
        own = r.json()["dag_run_id"]
        approve(login, client, own, login.token)
        standalone.wait_for_run_state(login.server, client, "sluice_rollback", own, timeout=300, state="failed")
        assert standalone.task_states(client, "sluice_rollback", own)["rollback"] == "failed"
    failure = "\n".join(p.read_text(errors="replace") for p in
                        (login.server.home / "logs" / "dag_id=sluice_rollback" / f"run_id={own}").rglob("*.log*"))
    assert f"approved by '{USER}', who asked for it" in failure, failure[-2000:]
    log = EpochStore()
    assert log.generation(NAME) == 1 and not log.pending_rollback(NAME)
    log.close()

    # The page shows the new generation, and the rolled-back epochs greyed out.
    open_tab(driver, f"{url}/dags/{NAME}/plugin/sluice-epochs")
    gone = driver.find_elements(By.CSS_SELECTOR, "table#epochs tr[data-live='false']")
    assert sorted(int(tr.get_attribute("data-epoch")) for tr in gone) == [2]
    assert sorted(live_rows(driver)) == [0, 1, 2]
    screenshot(driver, "console-after-rollback")

    # A page of the last two epoch ids (``?epochs=2`` sets the page size; 1,000 by default), every
    # generation of each; "show more" reads two more: all of them, and no button any more.
    driver.switch_to.default_content()
    driver.get(f"{url}/sluice/ui/{NAME}?epochs=2")
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true"
    assert sorted(live_rows(driver)) == [1, 2]
    gone = driver.find_elements(By.CSS_SELECTOR, "table#epochs tr[data-live='false']")
    assert [int(tr.get_attribute("data-epoch")) for tr in gone] == [2]
    assert "the last 2 epochs (from epoch 1)" in driver.find_element(By.ID, "epochs-window").text
    driver.find_element(By.ID, "epochs-more").click()
    WebDriverWait(driver, 30, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: sorted(live_rows(d)) == [0, 1, 2])
    assert not driver.find_elements(By.ID, "epochs-more")
    assert Path(SCREENSHOTS / "console-epochs.png").stat().st_size > 10_000


def approve(login: Login, client: httpx.Client, run_id: str, token: str) -> None:
    """Answer the run's approval task "Approve" as the user of ``token``, once it waits.

    A person answers minutes later; a script answers at once, and Airflow 3.3.2 then races
    itself: the scheduler requeues the task for the answer before it has handled the executor's
    event of the pause, and marks the task failed ("state changed externally"). So the answer
    waits for the scheduler's line that it handled that event."""
    standalone.wait_for_task_state(login.server, client, "sluice_rollback", run_id, "approve", {"awaiting_input"}, 120)
    handled = f"TaskInstance Finished: dag_id=sluice_rollback, task_id=approve, run_id={run_id}"
    standalone.wait_for(lambda: handled in login.server.log_path.read_text(errors="replace"), 60,
                        "the scheduler to handle the pause of the approval task", server=login.server)
    with login.client(token) as as_user:
        r = as_user.patch(f"/api/v2/dags/sluice_rollback/dagRuns/{run_id}/taskInstances/approve/-1/hitlDetails",
                          json={"chosen_options": ["Approve"]})
    assert r.status_code == 200, r.text
