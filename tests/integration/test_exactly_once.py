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
import time

import pytest

from sluice import protocol, service
from sluice.errors import PipelineBusyError
from sluice.faults import InjectedFault
from sluice.paths import project_root
from sluice.runner import GroupRunner
from sluice.sinks.delta import committed_txn_version
from sluice.store import EpochLog
from tests.pipelines import assert_matches_oracle, land, make_pipeline

RUN_GROUP = str(project_root() / "jobs" / "run_group.py")


@pytest.fixture
def epoch_log():
    log = EpochLog()
    yield log
    log.close()


def run_group_process(pipeline: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, RUN_GROUP, "--pipeline", pipeline, *args],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def app_txn(spark, spec, sink_path: str, sink: str) -> int | None:
    return committed_txn_version(spark, sink_path, protocol.sink_app_id(spec.name, sink, 0))


def assert_crashed_at(point: str, spark, spec, epoch_log) -> None:
    """The crash left the state the fault point describes (so the test exercises it)."""
    epochs = {e.epoch_id: e for e in epoch_log.epochs(spec.name)}
    main = app_txn(spark, spec, spec.sinks[0].path, spec.sinks[0].name)
    rejected = app_txn(spark, spec, spec.rejected_table, "_rejected")
    if point == "after_plan":
        assert epochs and all(e.state in protocol.UNFINISHED for e in epochs.values())
        assert main is None, "nothing may be written after planning only"
    elif point == "mid_write":
        assert epochs[0].state == protocol.COMMITTED and epochs[1].state in protocol.UNFINISHED
        assert rejected == 1 and main == 0, "epoch 1: rejected table written, aggregate table not yet"
    else:
        assert epochs[1].state in protocol.UNFINISHED and main == 1, "epoch 1 in Delta, not in the log"


@pytest.mark.parametrize("point", ["after_plan", "mid_write", "after_delta_commit"])
def test_sigkill_then_rerun_is_exactly_once(point, spark, epoch_log):
    spec = make_pipeline(f"kill_{point}", **{"control.epoch_files": 2, "control.group_epochs": 3})
    land(spec, files=6, malformed_fraction=0.03, late_fraction=0.05, late_max_s=25)
    proc = run_group_process(spec.name, "--plan", "--drain",
                             env={"SLUICE_FAULT": f"{point}@1", "SLUICE_FAULT_MODE": "kill"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"the job was not killed at {point}: rc={proc.returncode}\n{err[-3000:]}"
    assert_crashed_at(point, spark, spec, epoch_log)
    land(spec, files=2, seed=2, malformed_fraction=0.03)  # more data arrives meanwhile
    # The dead process's lease is taken over (same host, process gone); its epochs rerun first.
    groups = service.run_once(spec, epoch_log, spark, drain=True)
    assert groups[0]["group"]["plan"]["reason"].startswith("reprocess epochs")
    assert_matches_oracle(spark, spec, epoch_log)
    assert {e.state for e in epoch_log.epochs(spec.name)} == {protocol.PUBLISHED}


@pytest.mark.parametrize("point", ["after_plan", "mid_write", "after_delta_commit"])
def test_injected_exception_then_rerun_is_exactly_once(point, spark, epoch_log, monkeypatch):
    spec = make_pipeline(f"raise_{point}", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=4, malformed_fraction=0.03, late_fraction=0.05)
    monkeypatch.setenv("SLUICE_FAULT", f"{point}@1")
    with pytest.raises(InjectedFault):
        service.run_once(spec, epoch_log, spark)
    assert_crashed_at(point, spark, spec, epoch_log)
    if point != "after_plan":
        assert epoch_log.epochs(spec.name)[1].state == protocol.FAILED
        assert "InjectedFault" in epoch_log.epochs(spec.name)[1].error
    monkeypatch.delenv("SLUICE_FAULT")
    service.run_once(spec, epoch_log, spark, drain=True)
    assert_matches_oracle(spark, spec, epoch_log)


def test_rerunning_a_committed_epoch_changes_nothing(spark, epoch_log):
    from sluice.sinks.delta import history

    spec = make_pipeline("rerun_committed", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=4, malformed_fraction=0.03)
    service.run_once(spec, epoch_log, spark, drain=True)
    tables = [spec.sinks[0].path, spec.rejected_table]
    versions = [history(spark, t, 1).collect()[0]["version"] for t in tables]
    before = sorted(spark.read.format("delta").load(tables[0]).collect())
    lease = epoch_log.acquire_lease(spec.name, "test-rerun")
    try:
        runner = GroupRunner(spec, epoch_log, spark)
        for epoch in epoch_log.epochs(spec.name):
            result = runner.run_epoch(lease, epoch)
            assert all(c["replayed"] for c in result["commits"] if c["version"] is not None)
            assert result["commits"][1]["version"] == epoch.delta_versions["campaign_views"]
    finally:
        epoch_log.release_lease(lease)
    after = [history(spark, t, 1).collect()[0]["version"] for t in tables]
    assert after == versions, "a rerun of committed epochs created new Delta versions"
    assert sorted(spark.read.format("delta").load(tables[0]).collect()) == before
    assert_matches_oracle(spark, spec, epoch_log)


def test_two_concurrent_runs_one_fails_fast(spark, epoch_log):
    spec = make_pipeline("concurrent", **{"control.epoch_files": 2, "control.group_epochs": 4})
    land(spec, files=8, malformed_fraction=0.02)
    first = run_group_process(spec.name, "--plan", "--drain")
    deadline = time.monotonic() + 60
    while epoch_log.lease_holder(spec.name) is None:  # wait until the first run holds the lease
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first run never took the lease"
        time.sleep(0.1)
    started = time.monotonic()
    second = run_group_process(spec.name, "--plan", "--drain")
    _, err2 = second.communicate(timeout=120)
    second_s = time.monotonic() - started
    out1, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1[-3000:]
    assert second.returncode == 2, f"second run should fail fast, rc={second.returncode}\n{err2[-3000:]}"
    assert "PipelineBusyError" in err2 and f"pipeline '{spec.name}' is busy" in err2
    assert second_s < 15, f"the second run took {second_s:.1f}s to fail; it must not start Spark first"
    assert len(json.loads(out1.strip().splitlines()[-1])) >= 1
    with pytest.raises(PipelineBusyError):  # and in-process, while a lease is held
        other = epoch_log.acquire_lease(spec.name, "holder")
        try:
            service.plan(spec, epoch_log, "intruder")
        finally:
            epoch_log.release_lease(other)
    assert_matches_oracle(spark, spec, epoch_log)
