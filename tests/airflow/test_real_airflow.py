"""End to end under a real Airflow: ``airflow standalone`` (scheduler, dag-processor,
api-server, triggerer, LocalExecutor) in a subprocess, driven through its REST API, with
Airflow's metadata and the epoch store on a real Postgres server (each its own database and
role, as a deployment has them; the README's path on SQLite is ``tests/acceptance``).

What ``dag.test()`` cannot show, shown here:
* the backlog sensor defers and the *real* triggerer imports ``sluice.airflow.triggers.
  BacklogTrigger`` from the plugins folder, polls an empty folder, and fires once data lands;
* ``run_group`` runs ``sluice/jobs/run_group.py`` through spark-submit from a LocalExecutor worker,
  and task code reaches the epoch store while Airflow blocks its metadata DB;
* ``@continuous`` starts the next group run by itself; a cron pipeline (``in_process`` Spark
  inside the worker) runs on its schedule;
* clearing ``run_group`` of a past run through the REST API rolls that group and every later
  one back and recomputes their recorded ranges under a new generation;
* an Airflow backfill (scheduler-managed) recomputes the epochs whose data arrived in its
  intervals; ``checkpoint`` emits an Asset event per sink with the epochs and Delta version.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url

from sluice import protocol
from sluice.spec import PipelineSpec
from sluice.store import EpochStore
from tests.airflow import standalone
from tests.pipelines import assert_matches_oracle, land, make_pipeline

pytestmark = pytest.mark.postgres

CONTINUOUS = "real_af_continuous"
CRON = "real_af_cron"
BACKFILL = "real_af_backfill"
EVENT = "real_af_event"
STALE = "real_af_stale"
CLUSTER = "real_af_cluster"
TRIGGER = "sluice.airflow.triggers.BacklogTrigger"
GROUP_TASKS = ("wait_for_backlog", "plan_group", "run_group", "validate", "checkpoint")
#: Landing days of the backfill pipeline's files (two files a day, one epoch each).
DAYS = ("2026-11-18T10:00:00+00:00", "2026-11-19T10:00:00+00:00", "2026-11-20T10:00:00+00:00")
#: The cron part costs about one Spark group (~70-90 s here); SLUICE_E2E_CRON=0 leaves it out.
WITH_CRON = os.environ.get("SLUICE_E2E_CRON", "1") != "0"


def land_atomically(spec: PipelineSpec, files: int, seed: int, prefix: str) -> list[Path]:
    """Generate files in a staging folder, then move them into the landing folder in one go,
    so the trigger sees all of them or none (a group's shape is then deterministic)."""
    staging = spec.landing_dir.parent / f"staging-{prefix}"
    staged_spec = spec.model_copy(update={"source": spec.source.model_copy(update={"path": str(staging)})})
    staged = land(staged_spec, files=files, seed=seed, prefix=prefix, malformed_fraction=0.02)
    for path in staged:
        os.replace(path, spec.landing_dir / path.name)
    return [spec.landing_dir / p.name for p in staged]


@pytest.fixture(scope="module")
def pipelines() -> tuple[PipelineSpec, PipelineSpec, PipelineSpec]:
    """Written before the server starts, so its first parse already has their DAGs."""
    continuous = make_pipeline(CONTINUOUS, **{
        "schedule": "@continuous", "spark.mode": "submit", "control.epoch_files": 2,
        "control.group_epochs": 2, "control.poll_interval_s": 2})
    cron = make_pipeline(CRON, **{
        "schedule": "*/1 * * * *", "spark.mode": "in_process", "control.epoch_files": 2,
        "control.group_epochs": 2, "control.poll_interval_s": 2})
    land_atomically(cron, files=2, seed=7, prefix="cron")  # there before its first scheduled run
    backfill = make_pipeline(BACKFILL, **{
        "schedule": "@daily", "spark.mode": "in_process", "control.epoch_files": 2,
        "control.group_epochs": 3, "control.poll_interval_s": 2})
    files = land_atomically(backfill, files=6, seed=11, prefix="day")
    for i, path in enumerate(files):  # files 0-1 landed on the 18th, 2-3 on the 19th, 4-5 on the 20th
        stamp = datetime.fromisoformat(DAYS[i // 2]).timestamp() + i
        os.utime(path, (stamp, stamp))
    return continuous, cron, backfill


@pytest.fixture(scope="module")
def databases(postgres) -> Iterator[dict[str, str]]:
    """This module's Airflow metadata database and epoch store, on Postgres; the test's own
    reads of the store (``EpochStore()``) go there too."""
    urls = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres.database(owner="airflow"),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "SLUICE_STORE_URL": postgres.database()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLUICE_STORE_URL", urls["SLUICE_STORE_URL"])
        yield urls


@pytest.fixture(scope="module")
def event_pipeline() -> PipelineSpec:
    """An event-driven pipeline (``schedule: "@backlog"``), written before the server starts."""
    return make_pipeline(EVENT, **{"schedule": "@backlog", "spark.mode": "in_process", "control.epoch_files": 2,
                                   "control.group_epochs": 2, "control.poll_interval_s": 2})


@pytest.fixture(scope="module")
def stale_pipeline() -> PipelineSpec:
    """A pipeline with freshness alerts whose DAG stays paused: its landed data goes stale."""
    spec = make_pipeline(STALE, **{"spark.mode": "in_process", "control.poll_interval_s": 2,
                                   "control.freshness_sla_s": 5, "alerts": {"freshness": True}})
    land_atomically(spec, files=2, seed=31, prefix="stale")
    return spec


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory) -> Iterator[Any]:
    """A Spark standalone master and two workers on 127.0.0.1, each its own JVM and folder."""
    from include.spark_cluster import start

    cluster = start(tmp_path_factory.mktemp("spark-cluster"), workers=2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def cluster_pipeline() -> PipelineSpec:
    """``ysb`` through spark-submit against the cluster (connection ``spark_cluster``), with a
    transform whose Python UDF runs in the executors."""
    return make_pipeline(CLUSTER, **{"spark.mode": "submit", "spark.conn_id": "spark_cluster",
                                     "transform": "tests.cluster_transforms.campaign_views_udf",
                                     "control.epoch_files": 2, "control.group_epochs": 2,
                                     "control.poll_interval_s": 2})


@pytest.fixture(scope="module")
def server(pipelines, event_pipeline, stale_pipeline, cluster_pipeline, databases, spark_cluster,
           tmp_path_factory) -> Iterator[standalone.Server]:
    connection = json.dumps({"conn_type": "spark", "host": spark_cluster.master_url})
    srv = standalone.start(tmp_path_factory.mktemp("standalone") / "airflow",
                           extra_env={**databases, "AIRFLOW_CONN_SPARK_CLUSTER": connection})
    try:
        yield srv
    finally:
        killed = standalone.stop(srv)
        left = standalone.marked_processes(srv.marker)
        assert not left, f"processes of the Airflow server still running: {[p.pid for p in left]}"
        if killed:
            print(f"[standalone] had to SIGKILL {killed}")


@contextlib.contextmanager
def dump_on_failure(srv: standalone.Server, dag_ids: tuple[str, ...]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print(standalone.diagnostics(srv, dag_ids))
        raise


def task_log(srv: standalone.Server, dag_id: str, run_id: str, task_id: str, pattern: str = "*.log*") -> str:
    """The task's log files (all tries, and the trigger's part) as written by the server."""
    folder = srv.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
    return "\n".join(p.read_text(errors="replace") for p in sorted(folder.glob(pattern)))


def task_log_holding(srv: standalone.Server, dag_id: str, run_id: str, task_id: str, needle: str,
                     timeout: float = 30) -> str:
    """The task's log once it holds ``needle`` (its files are written apart from the state the
    API reports, so a finished task's log is not read at once); else its tail, in the failure."""

    def holding() -> str | None:
        text = task_log(srv, dag_id, run_id, task_id)
        return text if needle in text else None

    try:
        return standalone.wait_for(holding, timeout, f"{needle!r} in the log of {dag_id}/{run_id}/{task_id}",
                                   interval=0.5)
    except TimeoutError:
        raise AssertionError(f"{needle!r} not in the log of {task_id}: "
                             f"{task_log(srv, dag_id, run_id, task_id)[-2000:]}") from None


def assert_group_published(srv, client, dag_id: str, run_id: str, group_id: int, epoch_ids: list[int]) -> None:
    result = standalone.xcom(client, dag_id, run_id, "checkpoint")
    group = result["group"]
    assert group["group_id"] == group_id, result
    assert [e["epoch_id"] for e in group["epochs"]] == epoch_ids, result
    assert {e["state"] for e in group["epochs"]} == {protocol.PUBLISHED}, result
    assert result["backlog"]["files"] == 0, result
    task_log_holding(srv, dag_id, run_id, "checkpoint", f"Published group {group_id} of {dag_id}")


def wait_deferred(srv, client, dag_id: str, run_id: str) -> dict:
    """The sensor of the run, once it sits deferred on the backlog trigger."""
    ti = standalone.wait_for_task_state(srv, client, dag_id, run_id, "wait_for_backlog", {"deferred"}, 120)
    assert ti["trigger"] and ti["trigger"]["classpath"] == TRIGGER, ti
    return ti


def wait_trigger_started(srv, dag_id: str, run_id: str) -> None:
    """Until the real triggerer has loaded the trigger (its log says so, next to the task's)."""

    def started() -> bool:
        return "starting" in task_log(srv, dag_id, run_id, "wait_for_backlog", "*.log.trigger.*")

    standalone.wait_for(started, 90, f"the triggerer to start the trigger of {dag_id}/{run_id}", server=srv)


def wait_trigger_polled(srv, dag_id: str, run_id: str) -> None:
    """Until the trigger has polled the backlog once and found nothing to start (its log says so)."""

    def polled() -> bool:
        return "no group to start yet" in task_log(srv, dag_id, run_id, "wait_for_backlog", "*.log.trigger.*")

    standalone.wait_for(polled, 120, f"the trigger of {dag_id}/{run_id} to poll an empty backlog", server=srv)


def report(client, dag_id: str, run_id: str) -> None:
    """Print how long each task of the run took."""
    tis = standalone.task_instances(client, dag_id, run_id)
    print(f"[real-airflow] {dag_id} {run_id}: " + ", ".join(
        f"{task} {ti['duration'] or 0:.0f} s" for task, ti in tis.items()))


def test_pipelines_run_under_airflow_standalone(pipelines, server, spark):
    continuous, cron, _ = pipelines
    started = time.monotonic()
    with server.client() as client, dump_on_failure(server, (CONTINUOUS, CRON)):
        standalone.wait_healthy(server, client, timeout=180)
        for dag_id in (CONTINUOUS, CRON):
            dag = standalone.wait_for_dag(server, client, dag_id, timeout=120)
            assert dag["is_paused"], "new DAGs start paused"
        print(f"[real-airflow] healthy, DAGs parsed after {time.monotonic() - started:.0f} s")
        standalone.set_paused(client, CONTINUOUS, False)
        if WITH_CRON:
            standalone.set_paused(client, CRON, False)

        # 1. No data yet: the first @continuous run's sensor defers into the real triggerer.
        run1 = standalone.wait_for_run(server, client, CONTINUOUS, 0, timeout=60)["dag_run_id"]
        wait_deferred(server, client, CONTINUOUS, run1)
        wait_trigger_started(server, CONTINUOUS, run1)
        print(f"[real-airflow] {CONTINUOUS} deferred after {time.monotonic() - started:.0f} s")

        # 2. Meanwhile the cron pipeline (data landed beforehand; Spark inside the worker task)
        #    runs on its schedule. The continuous sensor waits all along, holding no worker slot.
        log = EpochStore()
        if WITH_CRON:
            cron_run = standalone.wait_for_run(server, client, CRON, 0, timeout=90)
            assert cron_run["run_type"] == "scheduled", cron_run
            states = standalone.wait_for_run_state(server, client, CRON, cron_run["dag_run_id"], timeout=240)
            assert all(states[t] == "success" for t in GROUP_TASKS), states
            report(client, CRON, cron_run["dag_run_id"])
            assert_group_published(server, client, CRON, cron_run["dag_run_id"], group_id=0, epoch_ids=[0])
            cron_epochs = log.epochs(CRON)
            assert [(e.start, e.end) for e in cron_epochs] == [(0, 2)]
            assert {e.state for e in cron_epochs} == {protocol.PUBLISHED}
            assert_matches_oracle(spark, cron, log)
            print(f"[real-airflow] cron group published after {time.monotonic() - started:.0f} s")

        # 3. Data lands: the trigger fires, the run plans, spark-submits and publishes one group.
        # The sensor defers to the triggerer, whose first poll finds the folder empty (its log
        # says so: an event to wait for, not a fixed sleep); the data lands after it.
        wait_deferred(server, client, CONTINUOUS, run1)
        wait_trigger_polled(server, CONTINUOUS, run1)
        land_atomically(continuous, files=4, seed=1, prefix="a")
        states = standalone.wait_for_run_state(server, client, CONTINUOUS, run1, timeout=240)
        assert all(states[t] == "success" for t in GROUP_TASKS), states
        assert states["drain_again"] == "skipped", states  # drain is off: one group per run
        report(client, CONTINUOUS, run1)
        print(f"[real-airflow] first group published after {time.monotonic() - started:.0f} s")

        sensed = standalone.xcom(client, CONTINUOUS, run1, "wait_for_backlog")
        assert sensed["reason"].startswith("efficient group") and sensed["backlog"]["files"] == 4, sensed
        sensor_log = task_log_holding(server, CONTINUOUS, run1, "wait_for_backlog", " polls")
        polls = re.search(r"after (\d+) polls", sensor_log)
        assert polls and int(polls.group(1)) >= 2, "the trigger must have polled the empty folder first"
        assert_group_published(server, client, CONTINUOUS, run1, group_id=0, epoch_ids=[0, 1])
        assert [(e.group_id, e.start, e.end) for e in log.epochs(CONTINUOUS)] == [(0, 0, 2), (0, 2, 4)]
        assert {e.state for e in log.epochs(CONTINUOUS)} == {protocol.PUBLISHED}
        assert log.lease_holder(CONTINUOUS) is None
        assert_matches_oracle(spark, continuous, log)
        # The store's URL (it may hold a password) is in neither the plan's XCom nor the Spark
        # step's rendered template fields, which anyone who may read the DAG sees.
        url = os.environ["SLUICE_STORE_URL"]
        plan = standalone.xcom(client, CONTINUOUS, run1, "plan_group")
        spark_step = client.get(f"/api/v2/dags/{CONTINUOUS}/dagRuns/{run1}/taskInstances/run_group").json()
        assert plan["group_id"] == 0 and "run_group.py" in json.dumps(spark_step["rendered_fields"]), spark_step
        assert url not in json.dumps(plan) and url not in json.dumps(spark_step["rendered_fields"])
        password = make_url(url).password
        assert password not in json.dumps(plan) and password not in json.dumps(spark_step["rendered_fields"])
        for task in GROUP_TASKS:
            assert password not in task_log(server, CONTINUOUS, run1, task), f"the store's password in {task}'s log"
        assert password not in server.log_path.read_text(errors="replace"), "the store's password in Airflow's log"

        # 4. @continuous starts the next run by itself; it waits, deferred, for the next data.
        run2 = standalone.wait_for_run(server, client, CONTINUOUS, 1, timeout=60)["dag_run_id"]
        assert run2 != run1
        wait_deferred(server, client, CONTINUOUS, run2)
        wait_trigger_started(server, CONTINUOUS, run2)
        land_atomically(continuous, files=2, seed=2, prefix="b")
        states = standalone.wait_for_run_state(server, client, CONTINUOUS, run2, timeout=240)
        assert all(states[t] == "success" for t in GROUP_TASKS), states
        report(client, CONTINUOUS, run2)
        assert_group_published(server, client, CONTINUOUS, run2, group_id=1, epoch_ids=[2])
        epochs = log.epochs(CONTINUOUS)
        assert [(e.group_id, e.start, e.end) for e in epochs] == [(0, 0, 2), (0, 2, 4), (1, 4, 6)]
        assert {e.state for e in epochs} == {protocol.PUBLISHED}
        assert_matches_oracle(spark, continuous, log)
        # Every publish emitted an Asset event per sink, carrying its epochs and the versions.
        extras = [e["extra"] for e in asset_events(client, f"sluice/{CONTINUOUS}/campaign_views")]
        assert [x["epochs"] for x in extras] == [[0, 1], [2]], extras
        assert extras[1]["version"] == epochs[2].delta_versions["campaign_views"], extras
        assert extras[1]["versions"][1] == extras[1]["version"] and extras[1]["versions"][0] > extras[0]["version"]
        log.close()
        print(f"[real-airflow] second group published after {time.monotonic() - started:.0f} s")

        for dag_id in (CONTINUOUS, CRON):
            standalone.set_paused(client, dag_id, True)
        output = server.log_path.read_text(errors="replace")
        assert "Trigger failed to load code" not in output
        print(f"[real-airflow] done after {time.monotonic() - started:.0f} s")


def asset_events(client, name: str) -> list[dict]:
    r = client.get("/api/v2/assets", params={"name_pattern": name})
    r.raise_for_status()
    assets = [a for a in r.json()["assets"] if a["name"] == name]
    assert assets, f"no asset {name}"
    r = client.get("/api/v2/assets/events", params={"asset_id": assets[0]["id"], "limit": 100})
    r.raise_for_status()
    return r.json()["asset_events"]


@pytest.mark.variant  # CI: tests/acceptance/test_readme_path.py clears run_group of a past run (with a run waiting)
def test_clearing_a_past_group_rolls_back_and_recomputes(pipelines, server, spark):
    """Clear run_group of the first group's run through the REST API: that group and the
    later one are rolled back (generation 0 -> 1) and recomputed with their recorded ranges."""
    continuous = pipelines[0]
    log = EpochStore()
    before = [(e.epoch_id, e.start, e.end, e.state) for e in log.epochs(CONTINUOUS)]
    assert before == [(0, 0, 2, "published"), (1, 2, 4, "published"), (2, 4, 6, "published")], before
    with server.client() as client, dump_on_failure(server, (CONTINUOUS,)):
        runs = standalone.dag_runs(client, CONTINUOUS)
        run1, run2 = runs[0]["dag_run_id"], runs[1]["dag_run_id"]
        # Every publish emitted an Asset event per sink, carrying the epochs and the version.
        events = asset_events(client, f"sluice/{CONTINUOUS}/campaign_views")
        extras = [e["extra"] for e in events]
        assert [x["epochs"] for x in extras] == [[0, 1], [2]], extras
        assert extras[1]["version"] == log.epochs(CONTINUOUS)[2].delta_versions["campaign_views"], extras

        # The DAG is paused; end the run that sits waiting for data, so the cleared run can start.
        for run in runs[2:]:
            if run["state"] in ("queued", "running"):
                r = client.patch(f"/api/v2/dags/{CONTINUOUS}/dagRuns/{run['dag_run_id']}", json={"state": "failed"})
                r.raise_for_status()
        r = client.post(f"/api/v2/dags/{CONTINUOUS}/clearTaskInstances", json={
            "dry_run": False, "only_failed": False, "task_ids": ["run_group"], "dag_run_id": run1,
            "include_downstream": True, "reset_dag_runs": True})
        r.raise_for_status()
        cleared = {ti["task_id"] for ti in r.json()["task_instances"]}
        assert {"run_group", "validate", "checkpoint"} <= cleared, cleared
        standalone.set_paused(client, CONTINUOUS, False)
        try:
            states = standalone.wait_for_run_state(server, client, CONTINUOUS, run1, timeout=300)
        finally:
            standalone.set_paused(client, CONTINUOUS, True)
        assert all(states[t] == "success" for t in ("run_group", "validate", "checkpoint")), states
        report(client, CONTINUOUS, run1)

        assert log.generation(CONTINUOUS) == 1
        assert {e.state for e in log.epochs(CONTINUOUS, generation=0)} == {protocol.ROLLED_BACK}
        after = [(e.epoch_id, e.start, e.end, e.state) for e in log.epochs(CONTINUOUS)]
        assert after == [(0, 0, 2, "published"), (1, 2, 4, "published"), (2, 4, 6, "published")], after
        assert_matches_oracle(spark, continuous, log)
        result = standalone.xcom(client, CONTINUOUS, run1, "checkpoint")
        assert [e["epoch_id"] for e in result["group"]["epochs"]] == [0, 1, 2], result
        task_log_holding(server, CONTINUOUS, run1, "run_group", "rolled back to epoch 0")
        assert [e["extra"]["epochs"] for e in asset_events(client, f"sluice/{CONTINUOUS}/campaign_views")][-1] \
            == [0, 1, 2]
        assert standalone.task_states(client, CONTINUOUS, run2)["checkpoint"] == "success"
    log.close()


def test_backfill_recomputes_the_epochs_that_arrived_in_its_intervals(pipelines, server, spark):
    """A @daily pipeline processes six files that landed over three days; an Airflow backfill
    over two of the days recomputes the epochs whose data arrived in them, and the epochs that
    share their Delta commit (one commit per group).

    The backfill is started while the scheduled run is in its group (its ``run_group`` task is
    SIGSTOPped to hold it there): the backfill waits for the pipeline, takes nothing from the
    live run, and goes on once that run has published."""
    backfill = pipelines[2]
    log = EpochStore()
    with server.client() as client, dump_on_failure(server, (BACKFILL,)):
        standalone.wait_healthy(server, client, timeout=180)  # at once when an earlier test waited
        standalone.wait_for_dag(server, client, BACKFILL, timeout=120)
        standalone.set_paused(client, BACKFILL, False)  # catchup off: one run, for the latest day
        first = standalone.wait_for_run(server, client, BACKFILL, 0, timeout=90)
        run_group = standalone.wait_for_task_state(server, client, BACKFILL, first["dag_run_id"], "run_group",
                                                   {"running"}, timeout=300)
        task = standalone.wait_for(lambda: standalone.task_process(run_group["id"]), 30,
                                   f"the process of {BACKFILL}/run_group", server=server)
        task.suspend()  # SIGSTOP: the scheduled run holds the pipeline's lease, mid-group
        try:
            body = {"dag_id": BACKFILL, "from_date": "2026-11-19T00:00:00Z", "to_date": "2026-11-20T00:00:00Z",
                    "max_active_runs": 1, "reprocess_behavior": "none"}
            for _ in range(10):  # 503 means Airflow's SQLite metadata DB was locked: retry, as documented
                r = client.post("/api/v2/backfills", json=body)
                if r.status_code != 503:
                    break
                time.sleep(3)
            r.raise_for_status()
            backfill_id = r.json()["id"]
            first_backfill = "backfill__2026-11-19T00:00:00+00:00"
            owner = str(protocol.LeaseOwner.dag_run(BACKFILL, first["dag_run_id"]))

            def waits() -> bool:  # its plan_group logs that the live run holds the lease, and waits
                text = task_log(server, BACKFILL, first_backfill, "plan_group")
                return "is busy: its lease is held by" in text and owner in text

            standalone.wait_for(waits, 120, "the backfill's plan_group to find the pipeline busy", server=server)
        finally:
            task.resume()
        states = standalone.wait_for_run_state(server, client, BACKFILL, first["dag_run_id"], timeout=300)
        assert all(states[t] == "success" for t in GROUP_TASKS), states
        assert [(e.epoch_id, e.start, e.end) for e in log.epochs(BACKFILL, generation=0)] == [(0, 0, 2), (1, 2, 4),
                                                                                              (2, 4, 6)]

        def finished() -> dict | None:
            got = client.get(f"/api/v2/backfills/{backfill_id}")
            got.raise_for_status()
            runs = [run for run in standalone.dag_runs(client, BACKFILL) if run["run_type"] == "backfill"]
            done = got.json()["completed_at"] and runs and all(run["state"] in ("success", "failed") for run in runs)
            return runs if done else None

        runs = standalone.wait_for(finished, 600, f"backfill {backfill_id} of {BACKFILL}", interval=3,
                                   server=server)
        for run in runs:
            report(client, BACKFILL, run["dag_run_id"])
        assert {run["state"] for run in runs} == {"success"}, runs
        # The epochs whose last file landed inside a backfill run's data interval.
        stamps = [datetime.fromisoformat(d).timestamp() for d in DAYS]
        intervals = []
        for run in runs:  # a point-in-time interval (trigger timetable) covers the day that starts there
            start = datetime.fromisoformat(run["data_interval_start"].replace("Z", "+00:00"))
            end = datetime.fromisoformat(run["data_interval_end"].replace("Z", "+00:00"))
            intervals.append((start.timestamp(), (end if end > start else start + timedelta(days=1)).timestamp()))
        recomputed = sorted(i for i, t in enumerate(stamps) if any(a <= t + 2 * i + 1 < b for a, b in intervals))
        assert recomputed, (intervals, stamps)
        assert log.generation(BACKFILL) == 1
        # The first run's three epochs are one Delta commit per table (commit: group): recomputing
        # any of them restores the version before that commit, so all three are rolled back.
        old = {e.epoch_id: e.state for e in log.epochs(BACKFILL, generation=0)}
        assert old == {i: "rolled_back" for i in range(3)}, old
        # Epochs after the backfilled days are planned again, for the next regular run.
        expected = [(i, 2 * i, 2 * i + 2, "published" if i <= recomputed[-1] else "planned") for i in range(3)]
        assert [(e.epoch_id, e.start, e.end, e.state) for e in log.epochs(BACKFILL)] == expected
        recomputed_at = [e.committed_at for e in log.epochs(BACKFILL) if e.epoch_id in recomputed]
        assert all(t is not None for t in recomputed_at)
        if recomputed[-1] == 2:
            assert_matches_oracle(spark, backfill, log)
        standalone.set_paused(client, BACKFILL, True)
    log.close()


def test_an_event_driven_pipeline_gets_a_run_only_when_data_comes(event_pipeline, server, spark):
    """``schedule: "@backlog"``: the DAG is scheduled on an Asset whose watcher runs the backlog
    trigger in the real triggerer. No data, no run (none sits waiting); data lands, exactly one
    run is created, and it publishes the data (oracle-equal); no second run for the same data."""
    spec = event_pipeline
    with server.client() as client, dump_on_failure(server, (EVENT,)):
        standalone.wait_healthy(server, client, timeout=180)
        standalone.wait_for_dag(server, client, EVENT, timeout=120)
        standalone.set_paused(client, EVENT, False)
        time.sleep(15)  # the watcher polls an empty folder every 2 s
        assert standalone.dag_runs(client, EVENT) == [], "a run was created without data"

        land_atomically(spec, files=4, seed=21, prefix="event")
        run = standalone.wait_for_run(server, client, EVENT, 0, timeout=90)
        assert run["run_type"] == "asset_triggered", run
        states = standalone.wait_for_run_state(server, client, EVENT, run["dag_run_id"], timeout=240)
        assert all(states[t] == "success" for t in GROUP_TASKS), states
        assert_group_published(server, client, EVENT, run["dag_run_id"], group_id=0, epoch_ids=[0, 1])
        log = EpochStore()
        assert_matches_oracle(spark, spec, log)
        time.sleep(15)  # a few more polls: the data is published, nothing is due
        assert len(standalone.dag_runs(client, EVENT)) == 1, standalone.dag_runs(client, EVENT)

        land_atomically(spec, files=4, seed=22, prefix="event2")  # more data: one more run
        second = standalone.wait_for_run(server, client, EVENT, 1, timeout=90)
        states = standalone.wait_for_run_state(server, client, EVENT, second["dag_run_id"], timeout=240)
        assert all(states[t] == "success" for t in GROUP_TASKS), states
        assert_matches_oracle(spark, spec, log)
        assert len(standalone.dag_runs(client, EVENT)) == 2


def test_a_stale_pipeline_raises_a_freshness_alert(stale_pipeline, server):
    """``alerts.freshness``: the pipeline's data waits past its SLA (its DAG is paused), the
    freshness trigger fires in the real triggerer, and ``sluice_alerts`` runs and fails naming
    the pipeline, the data's age and the SLA, once."""
    with server.client() as client, dump_on_failure(server, ("sluice_alerts",)):
        standalone.wait_healthy(server, client, timeout=180)
        standalone.wait_for_dag(server, client, "sluice_alerts", timeout=120)
        run = standalone.wait_for_run(server, client, "sluice_alerts", 0, timeout=120)
        assert run["run_type"] == "asset_triggered", run
        states = standalone.wait_for_run_state(server, client, "sluice_alerts", run["dag_run_id"], timeout=120,
                                               state="failed")
        assert states == {"freshness": "failed"}, states
        text = task_log_holding(server, "sluice_alerts", run["dag_run_id"], "freshness",
                                f"pipeline '{STALE}' is stale: its oldest unpublished data is")
        assert "past its freshness SLA of 5.0 s" in text
        control = client.get(f"/sluice/pipelines/{STALE}/control").json()
        assert control["freshness"]["breached"] and control["freshness"]["alerts"], control
        time.sleep(10)  # still stale: no second alert for the same breach
        assert len(standalone.dag_runs(client, "sluice_alerts")) == 1


def test_a_pipeline_runs_on_a_spark_standalone_cluster(cluster_pipeline, spark_cluster, server, spark):
    """spark-submit against ``spark://``: executors in two worker JVMs, each in its own working
    directory, run the transform's UDF from the shipped code; the table equals the oracle."""
    spec = cluster_pipeline
    with server.client() as client, dump_on_failure(server, (CLUSTER,)):
        standalone.wait_healthy(server, client, timeout=180)
        standalone.wait_for_dag(server, client, CLUSTER, timeout=120)
        standalone.set_paused(client, CLUSTER, False)
        land_atomically(spec, files=4, seed=41, prefix="cluster")
        run = standalone.wait_for_run(server, client, CLUSTER, 0, timeout=60)
        states = standalone.wait_for_run_state(server, client, CLUSTER, run["dag_run_id"], timeout=300)
        assert all(states[t] == "success" for t in GROUP_TASKS), states
        standalone.set_paused(client, CLUSTER, True)
        assert_group_published(server, client, CLUSTER, run["dag_run_id"], group_id=0, epoch_ids=[0, 1])
        assert_matches_oracle(spark, spec, EpochStore())
        # The application had an executor in each worker: its folder app-<id>/<executor> in both.
        per_worker = [{p.parent.parent.name for p in work.glob("app-*/*/stderr")}
                      for work in spark_cluster.worker_dirs()]
        assert len(per_worker) == 2 and set.intersection(*per_worker), per_worker
        submit_log = task_log_holding(server, CLUSTER, run["dag_run_id"], "run_group", "sluice-pyfiles-")
        assert spark_cluster.master_url in submit_log and "sluice-pyfiles-" in submit_log
