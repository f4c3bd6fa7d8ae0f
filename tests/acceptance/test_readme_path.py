"""The README's own path, walked as a new user walks it, in the Makefile's environment only.

A copy of the checkout (sharing `.venv` and the Delta jars) with nothing of the test session's
settings (no ``SLUICE_STORE_URL``, no test pipelines folder, no Airflow home of the tests):
``make airflow`` as documented, log in with the generated admin password, unpause ``ysb``
through REST, ``make generate``; the table must equal an oracle computed from the raw files
while the scheduler stays healthy. Then "Operating a pipeline" (docs/operating.md): clear
``run_group`` of a past run with its REST body, ``make rollback``, the README's
backfill line run by bash as printed, and a landing folder of bad input (a zero-byte file,
a Latin-1 line, JSON arrays, one 50 MB line; and, in ``make test-all``, a file that vanishes
after it was planned, which halts the pipeline at ``control.max_attempts`` until ``make
skip-file``); each step ends equal to the oracle, with every bad record in ``_rejected``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from include.generators.ysb import expected_window_counts, raw_events
from sluice.paths import project_root
from tests.airflow import standalone
from tests.pipelines import invalid_lines

# The walk takes 8-11 min of a worker: CI (make test-full) runs it, the everyday make test does not.
pytestmark = pytest.mark.acceptance

#: Environment the test session adds (tests/conftest.py, `make test`'s own make) and a user's
#: shell would not have (under MAKELEVEL, make prints "Entering directory" lines to stdout).
TEST_ONLY = ("SLUICE_", "AIRFLOW", "PYSPARK_", "GX_", "PYTHONPATH", "SPARK_", "MAKE", "MFLAGS")


def _runs_scheduler(process) -> bool:
    try:
        return process.cmdline()[-1:] == ["scheduler"]
    except Exception:  # it exited between the listing and now
        return False


class User:
    """A new user's checkout and shell: runs `make` targets and talks to the API as admin."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.marker = uuid.uuid4().hex
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(TEST_ONLY)}
        self.env[standalone.MARKER] = self.marker  # only so that the test can stop every process
        self.unhealthy_samples = 0
        self.health_samples = 0
        self.client: httpx.Client | None = None
        self.server: standalone.Server | None = None

    def make(self, *args: str, timeout: float = 600) -> str:
        out = subprocess.run(["make", *args], cwd=self.root, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, f"make {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    def bash(self, line: str, timeout: float = 300) -> str:
        out = subprocess.run(["bash", "-c", line], cwd=self.root, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, f"{line} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    def check_health(self) -> None:
        """Fail once the scheduler is unhealthy and its process is gone. Under load on two cores
        a live scheduler's heartbeat can lag past Airflow's threshold: that alone is not a
        failure (the waits' own timeouts catch a scheduler that lives but does nothing)."""
        status = standalone.health(self.client)
        self.health_samples += 1
        if (status.get("scheduler") or {}).get("status") == "healthy":
            return
        self.unhealthy_samples += 1
        alive = [p for p in standalone.marked_processes(self.marker) if _runs_scheduler(p)]
        assert alive, f"the scheduler is unhealthy and its process is gone: {status}\n" \
            f"{standalone.tail(self.server.log_path, 120)}"

    def wait(self, check: Any, timeout: float, what: str, interval: float = 3.0) -> Any:
        def checked() -> Any:
            self.check_health()
            return check()

        return standalone.wait_for(checked, timeout, what, interval=interval, server=self.server)

    def epochs(self, pipeline: str = "ysb") -> list[dict[str, Any]]:
        r = self.client.get(f"/sluice/pipelines/{pipeline}/epochs")
        r.raise_for_status()
        return r.json()

    def trigger_runs(self, dag_id: str) -> list[dict[str, Any]]:
        return standalone.dag_runs(self.client, dag_id)


def copy_checkout(dest: Path) -> Path:
    """The working tree as a fresh clone would have it, plus the set-up `make` would redo."""
    root = project_root()
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                            text=True, check=True).stdout.split("\n")
    for name in filter(None, listed):
        src = root / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(root / ".venv")
    (dest / "var").mkdir(exist_ok=True)
    (dest / "var" / "jars").symlink_to(root / "var" / "jars")
    return dest


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[User]:
    root = copy_checkout(tmp_path_factory.mktemp("readme") / "sluice")
    u = User(root, standalone.free_port())
    log_path = root / "make-airflow.log"
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(["make", "airflow", f"PORT={u.port}"], cwd=root, env=u.env, stdout=log_file,
                            stderr=subprocess.STDOUT, start_new_session=True)
    u.server = standalone.Server(home=root / "var" / "airflow", port=u.port, proc=proc, log_path=log_path,
                                 marker=u.marker, _log_file=log_file)
    try:
        passwords = root / "var" / "airflow" / "simple_auth_manager_passwords.json.generated"
        standalone.wait_for(lambda: passwords.exists() and json.loads(passwords.read_text() or "{}"), 300,
                            "the generated admin password", server=u.server)
        password = json.loads(passwords.read_text())["admin"]

        def token() -> str | None:
            r = httpx.post(f"{u.server.url}/auth/token", json={"username": "admin", "password": password},
                           timeout=30)
            return r.json()["access_token"] if r.status_code in (200, 201) else None

        access = standalone.wait_for(token, 300, "a login as admin", interval=2, server=u.server)
        u.client = httpx.Client(base_url=u.server.url, timeout=60,
                                headers={"Authorization": f"Bearer {access}"})
        standalone.wait_healthy(u.server, u.client, timeout=300)
        standalone.wait_for_dag(u.server, u.client, "ysb", timeout=180)
        yield u
    finally:
        standalone.stop(u.server)
        # What the user's shell would do with Ctrl-C; make's own children are gone by now.
        with_pgid = [u.server.proc.pid]
        for pid in with_pgid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- the oracle ---------------------------------------------------------------------------------


def landed(user: User) -> list[Path]:
    return sorted((user.root / "var" / "landing" / "ysb").glob("*.json"))


def committed(table: Path) -> bool:
    """Whether the Delta table has its first commit. ``_delta_log/`` is made before its first
    commit file: a read in between fails with DELTA_TABLE_NOT_FOUND, not "no rows yet"."""
    return any((table / "_delta_log").glob("*.json"))


def table_counts(spark: Any, path: Path) -> Counter:
    counts: Counter = Counter()
    for r in spark.read.format("delta").load(str(path)).collect():
        key = (r["campaign_id"], int(r["window_start"].timestamp() * 1000))
        assert key not in counts, f"duplicate key {key} in {path}"
        counts[key] = r["views"]
    return counts


def equals_oracle(spark: Any, user: User) -> dict[str, Any] | None:
    """The aggregate table equals the raw files' window counts (None while it does not)."""
    table = user.root / "var" / "tables" / "ysb" / "campaign_views"
    if not committed(table):
        return None
    expected = expected_window_counts(landed(user))
    got = table_counts(spark, table)
    return {"windows": len(got), "views": sum(got.values())} if got == expected else None


def rejected(spark: Any, user: User) -> list[tuple[str, int, str]]:
    table = user.root / "var" / "tables" / "ysb" / "_rejected"
    if not committed(table):
        return []
    return [(r["file"], r["line"], r["reason"]) for r in spark.read.format("delta").load(str(table)).collect()]


def wait_for_oracle(spark: Any, user: User, what: str, timeout: float = 900) -> dict[str, Any]:
    return user.wait(lambda: equals_oracle(spark, user), timeout, f"the ysb table to equal the oracle ({what})",
                     interval=5)


# -- the README, step by step ---------------------------------------------------------------------


def test_quickstart_unpause_generate_equals_oracle(spark, user):
    """README quickstart: unpause ysb, `make generate`; the scheduler survives the first runs."""
    standalone.set_paused(user.client, "ysb", False)
    user.make("generate", "RATE=1000", "DURATION=16", "SEED=3")
    wait_for_oracle(spark, user, "after make generate")
    assert user.health_samples > 0, "the waits checked the scheduler's health"
    user.wait(lambda: (standalone.health(user.client).get("scheduler") or {}).get("status") == "healthy", 300,
              "a healthy scheduler after the first runs")
    # docs/operating.md "Why a group started": the sensor's rule and the figures it compared. The
    # oracle holds once the group's Delta commit lands; its checkpoint task publishes the epochs after
    def all_published() -> list[dict[str, Any]]:
        epochs = [e for e in user.epochs() if e["state"] != "rolled_back"]
        return epochs if epochs and all(e["state"] == "published" for e in epochs) else []

    published = user.wait(all_published, 120, "the checkpoint to publish the group's epochs")
    assert all(e["started"] and e["started"]["explanation"] for e in published), published
    for why in (e["started"] for e in published):
        if why["rule"] == "efficient group":
            assert why["backlog_files"] >= why["group_files"], why
        elif why["rule"] == "freshness":
            assert why["oldest_age_s"] + why["predicted_wall_s"] >= why["freshness_sla_s"], why
        else:
            assert why["rule"] == "drain" and why["backlog_files"] > 0, why
    versions = user.client.get("/api/v2/dags/ysb/dagVersions").json()
    assert versions["total_entries"] == 1, f"ysb got new DAG versions while nothing changed: {versions}"


def test_clear_run_group_of_a_past_run_rolls_back_in_one_step(spark, user):
    """docs/operating.md "Clearing a task rolls back": the REST body as printed, and nothing else."""
    def finished_runs() -> list[dict[str, Any]]:
        return [r for r in user.trigger_runs("ysb") if r["state"] == "success"
                and standalone.task_states(user.client, "ysb", r["dag_run_id"]).get("checkpoint") == "success"]

    # the oracle holds once a checkpoint published; its DAG run may still be deciding whether to drain on
    runs = user.wait(finished_runs, 120, "a ysb run that published a group to finish")
    run_id = runs[0]["dag_run_id"]
    before = max(e["live_generation"] for e in user.epochs())

    def waiting_for_data() -> str | None:
        for run in user.trigger_runs("ysb"):
            if run["state"] == "running" and standalone.task_states(
                    user.client, "ysb", run["dag_run_id"]).get("wait_for_backlog") == "deferred":
                return run["dag_run_id"]
        return None

    # The hard case, on purpose: a run of the @continuous DAG sits waiting for data.
    user.wait(waiting_for_data, 300, "a ysb run waiting for data in its deferred sensor")
    r = user.client.post("/api/v2/dags/ysb/clearTaskInstances", json={
        "dry_run": False, "only_failed": False, "task_ids": ["run_group"], "dag_run_id": run_id,
        "include_downstream": True})
    r.raise_for_status()

    def rerun_done() -> dict | None:
        states = standalone.task_states(user.client, "ysb", run_id)
        gens = {e["live_generation"] for e in user.epochs() if e["live"]}
        return states if states.get("checkpoint") == "success" and max(gens) > before else None

    user.wait(rerun_done, 600, f"the cleared run {run_id} to roll back and recompute")
    # Downstream learns it as the change it is: a recompute (rows removed and written again), not
    # a plain publish; its versions cover the RESTORE too.
    last = asset_events(user, "sluice/ysb/campaign_views")[-1]["extra"]
    assert last["change"] == "recompute" and last["versions"][0] <= last["version"], last
    history = user.epochs()
    assert any(e["state"] == "rolled_back" for e in history), "the rolled-back epochs must stay visible"
    assert all(e["files"] for e in history), "every epoch lists its files"
    wait_for_oracle(spark, user, "after clear-to-rollback")


def asset_events(user: User, name: str) -> list[dict[str, Any]]:
    """The Asset's events, oldest first."""
    r = user.client.get("/api/v2/assets", params={"name_pattern": name})
    r.raise_for_status()
    asset = next(a for a in r.json()["assets"] if a["name"] == name)
    r = user.client.get("/api/v2/assets/events", params={"asset_id": asset["id"], "limit": 1000,
                                                         "order_by": "timestamp"})
    r.raise_for_status()
    return r.json()["asset_events"]


def downstream_changes(user: User) -> list[dict[str, Any]]:
    """What the example downstream DAG's runs received: the extras of their triggering events."""
    changes = []
    for run in user.trigger_runs("ysb_downstream"):
        r = user.client.get(f"/api/v2/dags/ysb_downstream/dagRuns/{run['dag_run_id']}/upstreamAssetEvents")
        r.raise_for_status()
        changes += [dict(e["extra"] or {}, source_dag_id=e["source_dag_id"]) for e in r.json()["asset_events"]]
    return changes


def test_make_rollback_recomputes(spark, user):
    """`make rollback` with recompute; the DAG downstream of the table learns that rows were
    removed (an Asset event with the rollback) and then recomputed."""
    standalone.set_paused(user.client, "ysb_downstream", False)
    before = max(e["live_generation"] for e in user.epochs())
    user.make("rollback", "PIPELINE=ysb", "TO_EPOCH=1", "REASON=acceptance: a bad release")

    def rolled_back() -> list | None:
        runs = user.trigger_runs("sluice_rollback")
        failed = [r for r in runs if r["state"] == "failed"]
        assert not failed, f"sluice_rollback failed: {failed}"
        return runs if runs and all(r["state"] == "success" for r in runs) else None

    user.wait(rolled_back, 600, "sluice_rollback to succeed")
    live = [e for e in user.epochs() if e["live"]]
    assert max(e["live_generation"] for e in live) > before
    assert [e for e in user.epochs() if e["epoch_id"] >= 1 and e["state"] == "rolled_back"]
    wait_for_oracle(spark, user, "after make rollback")

    def received() -> list | None:
        got = [c for c in downstream_changes(user) if c.get("source_dag_id") == "sluice_rollback"]
        kinds = {c.get("change") for c in got}
        return got if {"rollback", "recompute"} <= kinds else None

    got = user.wait(received, 300, "ysb_downstream runs triggered by the rollback and the recompute")
    rollback = next(c for c in got if c["change"] == "rollback")
    assert rollback["to_epoch"] == 1 and rollback["reason"] == "acceptance: a bad release", rollback
    assert rollback["pipeline"] == "ysb" and 1 in rollback["rolled_back_epochs"], rollback
    assert rollback["restored_to_version"] is not None, rollback


@pytest.mark.variant  # ~150-215 s; CI: test_real_airflow.py's backfill (a live run waits, epochs recomputed)
def test_readme_backfill_command_processes_the_range(spark, user):
    """The README's backfill line, run by bash as printed: ysb_clean has never run, so the
    backfill plans the landed data for the first time; its table must equal the raw views."""
    readme = (user.root / "README.md").read_text()
    lines = [line.strip().strip("`") for line in readme.splitlines() if line.strip().startswith("make backfill")]
    assert lines, "the README prints no `make backfill` line"
    user.bash(lines[0])
    table = user.root / "var" / "tables" / "ysb_clean" / "view_events"

    def views_equal() -> dict | None:
        if not committed(table):
            return None
        expected = Counter((e["user_id"], e["ad_id"], int(e["event_time"]))
                           for _, _, e in raw_events(landed(user)) if e and e["event_type"] == "view")
        got = Counter((r["user_id"], r["ad_id"], int(r["event_time"].timestamp() * 1000))
                      for r in spark.read.format("delta").load(str(table)).collect())
        return {"rows": sum(got.values())} if got == expected else None

    def backfill_done() -> list | None:
        backfills = user.client.get("/api/v2/backfills", params={"dag_id": "ysb_clean"}).json()["backfills"]
        runs = [r for r in user.trigger_runs("ysb_clean") if r["run_type"] == "backfill"]
        finished = backfills and all(b["completed_at"] for b in backfills) and runs
        return runs if finished and views_equal() else None

    # The scheduled run that unpausing starts may take the data first; the backfill's runs then
    # wait for its lease (not steal it) and find nothing left. Either way: all of it, once.
    runs = user.wait(backfill_done, 1200, "the backfill to complete and ysb_clean to equal the raw view events",
                     interval=5)
    assert all(r["state"] == "success" for r in runs), [(r["dag_run_id"], r["state"]) for r in runs]


@pytest.mark.variant  # ~135 s under the scheduler; CI: test_bad_input.py's same bad files, in-process
def test_bad_input_is_rejected_line_by_line(spark, user):
    folder = user.root / "var" / "landing" / "ysb"
    good = landed(user)[0].read_text().splitlines()
    staging = user.root / "var" / "staging"
    staging.mkdir()
    (staging / "bad-empty.json").write_bytes(b"")
    (staging / "bad-latin1.json").write_bytes(("\n".join(good[:5]) + "\n").encode()
                                              + '{"ad_id": "caf\u00e9"}\n'.encode("latin-1")
                                              + ("\n".join(good[5:10]) + "\n").encode())
    (staging / "bad-arrays.json").write_text("\n".join(f"[{line}]" for line in good[:5]) + "\n" + good[5] + "\n")
    (staging / "bad-huge.json").write_text(good[0] + "\n" + '{"ad_id": "' + "x" * (50 * 1024 * 1024) + '"}\n'
                                           + good[1] + "\n")
    for path in sorted(staging.iterdir()):
        os.replace(path, folder / path.name)
    wait_for_oracle(spark, user, "with bad files")
    got = {(f, line) for f, line, _ in rejected(spark, user)}
    assert invalid_lines(landed(user)) <= got, "every bad line of the raw files is in _rejected"
    reasons = {f.rsplit("/", 1)[-1]: reason for f, _, reason in rejected(spark, user)}
    assert "max_record_bytes" in reasons["bad-huge.json"] and "UTF-8" in reasons["bad-latin1.json"]


@pytest.mark.variant  # ~230 s of scheduler retries; CI keeps the same story without the scheduler
def test_a_vanished_file_halts_the_pipeline_until_make_skip_file(spark, user):
    """A file that vanishes after it was planned: its epoch fails, names the file, and the
    pipeline halts at max_attempts (Airflow's retry, then the next run's); `make skip-file` lets
    it go on without the file. In CI without the scheduler: test_operations.py's
    ``test_vanished_file_halts_at_max_attempts_then_a_recorded_skip_lets_the_pipeline_go_on``,
    the ``sluice_skip_file`` DAG in test_dag_test.py, a halted DAG's sensor there too."""
    folder = user.root / "var" / "landing" / "ysb"
    good = landed(user)[0].read_text().splitlines()
    victim = folder / "vanishing.json"
    victim.write_text("\n".join(good[:20]) + "\n")

    def planned() -> bool:
        return any(f["path"] == str(victim) for e in user.epochs() for f in e["files"])

    user.wait(planned, 300, "the vanishing file to be planned", interval=0.3)
    victim.unlink()

    def halted() -> dict | None:
        control = user.client.get("/sluice/pipelines/ysb/control").json()
        return control if control["halted"] else None

    control = user.wait(halted, 900, "the pipeline to halt on the vanished file")
    assert str(victim) in control["halted"] and "3 times" in control["halted"], control["halted"]
    assert control["next"]["fire"] is None, "a halted pipeline's sensor does not fire"
    failed = [e for e in user.epochs() if e["state"] == "failed"]
    assert failed and failed[0]["attempts"] == 3 and "no longer in the landing folder" in failed[0]["error"]
    out = user.make("skip-file", "PIPELINE=ysb", f"FILE={victim}", "REASON=acceptance: upload lost")
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert report["skipped"]["reason"] == "acceptance: upload lost"

    def published_without_it() -> bool:
        holders = [e for e in user.epochs() if e["live"] and any(f["path"] == str(victim) for f in e["files"])]
        return bool(holders) and holders[0]["state"] == "published"

    user.wait(published_without_it, 600, "the epoch of the skipped file to be published")
    wait_for_oracle(spark, user, "after skipping the vanished file")
    skipped = [f["skipped"] for e in user.epochs() for f in e["files"] if f["path"] == str(victim)]
    assert skipped and skipped[0]["reason"] == "acceptance: upload lost" and skipped[0]["by"], skipped
