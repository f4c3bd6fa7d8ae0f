"""Exactly-once under faults (Structured Streaming §6.1 on Delta), against an oracle computed
from the raw files: crash the Spark job (SIGKILL, and an injected exception) after planning,
in the middle of writing, and after the Delta commit but before the epoch-log commit; run
again; the table must equal the oracle and the epoch log must stay contiguous."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sluice import protocol
from sluice.delta.spark import SparkTables
from sluice.errors import PipelineBusyError
from sluice.faults import InjectedFault
from sluice.paths import RUN_GROUP_APP
from sluice.protocol import operations
from sluice.protocol.leases import acquire_lease
from sluice.protocol.run import PipelineRun, run_once
from sluice.protocol.runtime import Runtime
from sluice.store import EpochStore
from tests.pipelines import assert_matches_oracle, land, make_pipeline

RUN_GROUP = str(RUN_GROUP_APP)


@pytest.fixture
def store(store_backend):
    """The test session's epoch store: SQLite, then a real Postgres server (``store_backend``)."""
    log = EpochStore()
    yield log
    log.close()


class GroupJob:
    """``sluice/jobs/run_group.py`` in its own process, its output going to files: a pipe nobody reads
    fills with 64 KiB of Spark's log and blocks the process in write(2), a hang that looks like
    a stop (it carried a zombie past its fault point, silent, until the pipe was drained)."""

    def __init__(self, pipeline: str, *args: str, env: dict[str, str] | None = None) -> None:
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, RUN_GROUP, "--pipeline", pipeline, *args],
                                     env={**os.environ, **(env or {})}, stdout=self._out, stderr=self._err, text=True)
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def state(self) -> str:
        """The process state letter of /proc (``T``: stopped)."""
        with open(f"/proc/{self.pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Wait for the process; its stdout and stderr."""
        self.proc.wait(timeout=timeout)
        self._out.seek(0)
        return self._out.read(), self.stderr()


def app_txn(spark, spec, sink_path: str, sink: str) -> int | None:
    """The last epoch Delta recorded for the table's generation-0 app id (None: none)."""
    recorded = SparkTables(spark).txn_version(sink_path, protocol.sink_app_id(spec.name, sink, 0))
    return None if recorded is None else protocol.txn_epoch(recorded)


def assert_crashed_at(point: str, spark, spec, store) -> None:
    """The crash left the state the fault point describes (so the test exercises it). Group
    commit: epochs 0 and 1 are one group, so one commit per table."""
    epochs = {e.epoch_id: e for e in store.epochs(spec.name)}
    main = app_txn(spark, spec, spec.sinks[0].path, spec.sinks[0].name)
    rejected = app_txn(spark, spec, spec.rejected_table, "_rejected")
    if point == "after_plan":
        assert epochs and all(e.state in protocol.UNFINISHED for e in epochs.values())
        assert main in (None, -1), "nothing may be written after planning only (a fence at most)"
    elif point == "mid_write":
        assert epochs[0].state in protocol.UNFINISHED and epochs[1].state in protocol.UNFINISHED
        assert rejected == 1 and main in (None, -1), "the group's rejected table written, its aggregate table not yet"
    elif point == "after_delta_commit":
        assert epochs[1].state in protocol.UNFINISHED and main == 1, "epochs 0..1 in Delta, not in the log"
    else:  # before_publish
        assert epochs[0].state == epochs[1].state == protocol.COMMITTED
        assert_records_complete(spec, store, states=(protocol.COMMITTED,))


def assert_records_complete(spec, store, states=(protocol.PUBLISHED,)) -> None:
    """Every published epoch (of ``states``) has its JSON record next to every sink."""
    for sink in spec.sinks:
        folder = Path(sink.path) / "_sluice" / "epochs"
        for e in store.epochs(spec.name):
            if e.state in states:
                record = folder / f"{e.epoch_id:09d}-g{e.generation}.json"
                assert record.is_file(), f"no epoch record {record}"
                assert json.loads(record.read_text())["state"] == protocol.PUBLISHED


def kill_at(spec, point: str, at: int | None = 1) -> None:
    proc = GroupJob(spec.name, "--plan", "--drain",
                             env={"SLUICE_FAULT": point + (f"@{at}" if at is not None else ""),
                                  "SLUICE_FAULT_MODE": "kill"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"the job was not killed at {point}: rc={proc.returncode}\n{err[-3000:]}"


# after_plan and before_publish (~75 s): make test-all; CI keeps the kills inside the commit
# (mid_write, after_delta_commit), test_soak's random kills, and the simulation's kill at every step.
_OUTSIDE_THE_COMMIT = (pytest.mark.spark_crash, pytest.mark.variant)


@pytest.mark.postgres_variant
@pytest.mark.parametrize("point", [pytest.param("after_plan", marks=_OUTSIDE_THE_COMMIT), "mid_write",
                                   "after_delta_commit", pytest.param("before_publish", marks=_OUTSIDE_THE_COMMIT)])
def test_sigkill_then_rerun_is_exactly_once(point, spark, store):
    spec = make_pipeline(f"kill_{point}", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=6, malformed_fraction=0.03, late_fraction=0.05, late_max_s=25)
    kill_at(spec, point)
    assert_crashed_at(point, spark, spec, store)
    land(spec, files=2, seed=2, malformed_fraction=0.03)  # more data arrives meanwhile
    # The dead process's lease is taken over (same host, process gone); its epochs rerun first.
    groups = run_once(spec, store, spark, drain=True)
    if point != "before_publish":
        assert groups[0]["group"]["plan"]["reason"].startswith("reprocess epochs")
    assert_matches_oracle(spark, spec, store)
    assert {e.state for e in store.epochs(spec.name)} == {protocol.PUBLISHED}
    assert_records_complete(spec, store)


# CI: test_operations' SIGKILL between the RESTOREs of a rollback; the simulation kills at every RESTORE
@pytest.mark.variant
def test_sigkill_between_the_restores_of_a_rerun(spark, store):
    """A group commit in both tables but not in the log; the rerun that restores them is killed
    after the first RESTORE; the next rerun still lands everything once."""
    spec = make_pipeline("kill_reconcile", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=4, malformed_fraction=0.05)
    kill_at(spec, "after_delta_commit")
    kill_at(spec, "mid_reconcile", at=None)
    main = SparkTables(spark).txn_version(spec.sinks[0].path, protocol.sink_app_id(spec.name, "campaign_views", 0))
    assert protocol.txn_token(main) >= 2, "the second run fenced the tables with its own token"
    run_once(spec, store, spark, drain=True)
    assert_matches_oracle(spark, spec, store)
    assert_records_complete(spec, store)


@pytest.mark.postgres_variant
@pytest.mark.spark_crash
@pytest.mark.parametrize("point", [pytest.param("after_plan", marks=pytest.mark.variant),
                                   pytest.param("mid_write", marks=pytest.mark.variant), "after_delta_commit"])
def test_injected_exception_then_rerun_is_exactly_once_per_epoch_commits(point, spark, store, monkeypatch):
    spec = make_pipeline(f"raise_{point}", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                                "commit": "epoch"})
    land(spec, files=4, malformed_fraction=0.03, late_fraction=0.05)
    monkeypatch.setenv("SLUICE_FAULT", f"{point}@1")
    with pytest.raises(InjectedFault):
        run_once(spec, store, spark)
    epochs = {e.epoch_id: e for e in store.epochs(spec.name)}
    main = app_txn(spark, spec, spec.sinks[0].path, spec.sinks[0].name)
    if point == "mid_write":
        assert epochs[0].state == protocol.COMMITTED and epochs[1].state == protocol.FAILED
        assert app_txn(spark, spec, spec.rejected_table, "_rejected") == 1 and main == 0
    elif point == "after_delta_commit":
        assert epochs[1].state == protocol.FAILED and main == 1
    if point != "after_plan":
        assert "InjectedFault" in store.epochs(spec.name)[1].error
    monkeypatch.delenv("SLUICE_FAULT")
    run_once(spec, store, spark, drain=True)
    assert_matches_oracle(spark, spec, store)
    versions = {e.delta_versions["campaign_views"] for e in store.epochs(spec.name)}
    assert len(versions) == 2, "commit: epoch gives each epoch its own Delta version"


@pytest.mark.postgres_variant
def test_a_write_under_an_older_token_is_refused_by_delta(spark, store):
    """Once a newer owner's token is in a table, Delta skips an older token's commit: the writer
    gets FencedError and the table does not change."""
    from sluice.errors import FencedError
    from sluice.model import EpochRange
    from sluice.protocol.tables import pipeline_tables

    spec = make_pipeline("fenced_write", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=4, malformed_fraction=0.03)
    run_once(spec, store, spark, drain=True)
    sink = next(t for t in pipeline_tables(spec) if t.name == "campaign_views")
    tables = SparkTables(spark)
    old = acquire_lease(store, spec.name, "old-owner")
    store.release_lease(old)
    newer = acquire_lease(store, spec.name, "newer-owner")
    try:
        assert sink.fence(tables, 0, newer.fence) is not None
        before = tables.version(sink.path)
        frame = spark.read.format("delta").load(sink.path).limit(3)
        with pytest.raises(FencedError, match="refused by Delta"):
            sink.write(tables, frame, epochs=[EpochRange(9, 10, 12)], generation=0, token=old.fence)
        assert tables.version(sink.path) == before
    finally:
        store.release_lease(newer)
    assert_matches_oracle(spark, spec, store)


@pytest.mark.postgres_variant
def test_a_zombie_stopped_in_its_group_commit_is_refused_after_a_take_over(spark, store):
    """SIGSTOP a run between the two tables of its group commit until its lease expires; a new
    owner takes over, reruns the group, rolls back and recomputes; SIGCONT: the zombie's commit
    is refused by the table (its token is below the new owner's) and the tables equal the oracle."""
    spec = make_pipeline("zombie", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                      "control.lease_ttl_s": 6})
    land(spec, files=4, malformed_fraction=0.05)
    zombie = GroupJob(spec.name, "--plan", env={"SLUICE_FAULT": "mid_write@1", "SLUICE_FAULT_MODE": "stop"})
    failure: BaseException | None = None
    try:
        deadline = time.monotonic() + 600  # only a guard: the run stops itself at its fault point
        while zombie.state() != "T":
            assert zombie.poll() is None, zombie.stderr()[-3000:]
            assert time.monotonic() < deadline, "the run never stopped at its fault point"
            time.sleep(0.5)
        assert_crashed_at("mid_write", spark, spec, store)  # between the two tables of its group commit
        deadline = time.monotonic() + 60
        while store.lease_holder(spec.name) is not None:  # its lease expires: no renewal while stopped
            assert time.monotonic() < deadline
            time.sleep(0.5)
        run_once(spec, store, spark, owner="new-owner", drain=True)
        assert_matches_oracle(spark, spec, store)
        lease = acquire_lease(store, spec.name, "new-owner")
        report = operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=0, reason="zombie test",
                                     recompute=True)
        PipelineRun(spec, store, "new-owner", Runtime.spark(spark)).process(report["group_id"])
        PipelineRun(spec, store, "new-owner").validate()
        PipelineRun(spec, store, "new-owner", Runtime.spark(spark)).publish()
    except BaseException as exc:
        failure = exc
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    _, err = zombie.communicate(timeout=300)
    if failure is not None:  # with what the zombie said, which explains most failures here
        raise AssertionError(f"{failure!r}\n--- the zombie's stderr (tail) ---\n{err[-4000:]}") from failure
    assert zombie.returncode != 0 and "FencedError" in err, err[-3000:]
    assert "refused by Delta" in err or "taken over" in err, err[-3000:]
    assert_matches_oracle(spark, spec, store)
    assert_records_complete(spec, store)


@pytest.mark.postgres_variant
def test_two_concurrent_runs_one_fails_fast(spark, store):
    spec = make_pipeline("concurrent", **{"control.epoch_files": 2, "control.group_epochs": 4})
    land(spec, files=8, malformed_fraction=0.02)
    first = GroupJob(spec.name, "--plan", "--drain")
    deadline = time.monotonic() + 60
    while store.lease_holder(spec.name) is None:  # wait until the first run holds the lease
        assert first.poll() is None, first.stderr()[-3000:]
        assert time.monotonic() < deadline, "the first run never took the lease"
        time.sleep(0.1)
    second = GroupJob(spec.name, "--plan", "--drain")
    _, err2 = second.communicate(timeout=120)
    out1, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1[-3000:]
    assert second.returncode == 2, f"second run should fail fast, rc={second.returncode}\n{err2[-3000:]}"
    assert "PipelineBusyError" in err2 and f"pipeline '{spec.name}' is busy" in err2
    assert "starting Spark application" in err1, "the first run logs its Spark start (the check below can fail)"
    assert "starting Spark application" not in err2, "the second run must fail before it starts Spark"
    assert len(json.loads(out1.strip().splitlines()[-1])) >= 1
    with pytest.raises(PipelineBusyError):  # and in-process, while a lease is held
        other = acquire_lease(store, spec.name, "holder")
        try:
            PipelineRun(spec, store, "intruder").plan()
        finally:
            store.release_lease(other)
    assert_matches_oracle(spark, spec, store)
