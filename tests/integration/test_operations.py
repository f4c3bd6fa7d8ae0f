"""Operations against real Spark, Delta and Great Expectations, checked against oracles from
the raw files: the rollback story of Structured Streaming §7.2 under the `fail` and
`quarantine` policies, refused rollbacks, store loss and rebuild, and a poison record."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from include.generators.ysb import expected_window_counts, parse_valid
from sluice import protocol
from sluice.errors import PipelineHaltedError, SluiceError
from sluice.faults import InjectedFault
from sluice.model import RollbackIntent
from sluice.protocol import operations
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import halt_reason
from sluice.protocol.run import PipelineRun, cli_owner, run_once
from sluice.protocol.runtime import Runtime
from sluice.store import EpochStore
from sluice.validation import ValidationFailedError
from tests.pipelines import (
    assert_matches_oracle,
    invalid_lines,
    land,
    landed,
    make_pipeline,
    rejected_lines,
    roll_back,
    table_counts,
)

BUGGY = "tests.integration.buggy_transforms.campaign_views_null_campaign"


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


def states(store, spec) -> dict[int, str]:
    return {e.epoch_id: e.state for e in store.epochs(spec.name)}


def null_campaign_rows(spark, spec) -> int:
    return spark.read.format("delta").load(spec.sinks[0].path).where("campaign_id IS NULL").count()


def rollback_and_recompute(spark, spec, store, to_epoch: int) -> dict:
    return roll_back(spark, spec, store, to_epoch, recompute=True, reason="fixed transform")


@pytest.mark.parametrize("policy", ["fail", "quarantine"])
def test_rollback_story(spark, store, policy):
    """A bad release nulls campaign_id from epoch 2 on; validation catches it; the transform is
    fixed; roll back to epoch 2 and recompute: the table equals a clean run (the oracle)."""
    name = f"story_{policy}"
    spec = make_pipeline(name, **{"control.epoch_files": 2, "control.group_epochs": 2,
                                  "validation.policy": policy, "spark.mode": "in_process"})
    land(spec, files=8, seed=7)
    run_once(spec, store, spark)  # epochs 0, 1 with the good transform
    assert states(store, spec) == {0: "published", 1: "published"}
    version_before = spark.sql(f"DESCRIBE HISTORY delta.`{spec.sinks[0].path}` LIMIT 1").first()["version"]

    buggy = make_pipeline(name, transform=BUGGY, **{"control.epoch_files": 2, "control.group_epochs": 2,
                                                     "validation.policy": policy, "spark.mode": "in_process"})
    if policy == "fail":
        with pytest.raises(ValidationFailedError, match=r"epoch 2 .*failed validation.*campaign_id"):
            run_once(buggy, store, spark)
        # Nothing of the bad epoch (or the one after it) reached the table.
        assert states(store, spec) == {0: "published", 1: "published", 2: "failed", 3: "planned"}
        assert null_campaign_rows(spark, spec) == 0
        assert spark.sql(f"DESCRIBE HISTORY delta.`{spec.sinks[0].path}` LIMIT 1").first()["version"] == \
            version_before
        failed = store.epochs(spec.name)[2]
        assert failed.validation["campaign_views"]["failed"][0]["expectation"] == \
            "expect_column_values_to_not_be_null"
        with pytest.raises(PipelineHaltedError, match="epoch 2 failed validation"):
            run_once(spec, store, spark)
    else:
        run_once(buggy, store, spark, drain=True)
        assert set(states(store, spec).values()) == {"published"}
        assert null_campaign_rows(spark, spec) == 0, "failing rows must not reach the table"
        quarantine = spark.read.format("delta").load(spec.quarantine_table)
        per_epoch = {r["epoch"]: r["count"] for r in quarantine.groupBy("epoch").count().collect()}
        assert set(per_epoch) == {2, 3}
        recorded = {e.epoch_id: e.rows.get("quarantined", 0) for e in store.epochs(spec.name)}
        assert recorded == {0: 0, 1: 0, 2: per_epoch[2], 3: per_epoch[3]}
        row = json.loads(quarantine.first()["record"])
        assert row["campaign_id"] is None and row["views"] >= 1
        with pytest.raises(AssertionError):  # the published table is missing the quarantined views
            assert_matches_oracle(spark, spec, store)

    report = rollback_and_recompute(spark, spec, store, to_epoch=2)  # the fixed (original) transform
    assert report["generation"] == 1
    run_once(spec, store, spark, drain=True)
    assert_matches_oracle(spark, spec, store)
    assert store.generation(spec.name) == 1
    old = store.epochs(spec.name, generation=0)
    assert [e.state for e in old if e.epoch_id >= 2] == ["rolled_back", "rolled_back"]
    if policy == "quarantine":  # the quarantined rows of the rolled-back epochs went with them
        assert spark.read.format("delta").load(spec.quarantine_table).count() == 0


def test_rollback_is_refused_past_retention_and_changes_nothing(spark, store):
    spec = make_pipeline("refused", **{"control.epoch_files": 2, "control.group_epochs": 1,
                                       "spark.mode": "in_process"})
    land(spec, files=6, seed=8)
    run_once(spec, store, spark, drain=True)
    table = spec.sinks[0].path

    def snapshot():
        history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").select("version").collect()
        return (store.generation(spec.name), states(store, spec), max(r[0] for r in history),
                store.pending_rollback(spec.name), table_counts(spark, spec))

    before = snapshot()
    lease = acquire_lease(store, spec.name, "operator")
    gone = landed(spec)[3]  # a file of epoch 1
    moved = gone.with_name("_" + gone.name)
    gone.rename(moved)
    with pytest.raises(operations.RollbackRefusedError, match=f"source no longer holds.*{gone.name}"):
        operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=1, reason="test", recompute=True)
    assert snapshot() == before
    moved.rename(gone)

    # Vacuum every file no longer in the latest version: epoch 0's version is gone.
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        spark.sql(f"VACUUM delta.`{table}` RETAIN 0 HOURS")
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    before = snapshot()  # VACUUM itself commits (VACUUM START/END)
    with pytest.raises(operations.RollbackRefusedError, match="vacuumed"):
        operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=1, reason="test", recompute=True)
    assert snapshot() == before
    store.release_lease(lease)


def test_pipelines_sharing_a_folder_keep_their_rows_and_a_shared_table_is_never_restored(spark, store):
    """Two pipelines whose sinks share a folder get a `_rejected` table each: rolling one back
    leaves the other's rejected records (checked against the raw files) untouched. A third
    pipeline pointed at the second's `_rejected` (an explicit `rejected_path`, as the old
    default shared it): a rollback of the second is refused, naming the third, and changes nothing."""
    overrides = {"control.epoch_files": 2, "control.group_epochs": 1, "spark.mode": "in_process"}
    folder = "${SLUICE_DATA_DIR}/shared_tables"
    first = make_pipeline("apart_a", tables=folder, **overrides)
    second = make_pipeline("apart_b", tables=folder, **overrides)
    assert first.rejected_table != second.rejected_table
    assert Path(first.rejected_table).parent == Path(second.rejected_table).parent
    for seed, spec in enumerate((first, second), start=21):
        land(spec, files=4, seed=seed, malformed_fraction=0.05)
        run_once(spec, store, spark, drain=True)
    assert len(states(store, first)) == 2
    rollback_and_recompute(spark, first, store, to_epoch=0)
    assert_matches_oracle(spark, first, store)
    assert_matches_oracle(spark, second, store)  # its rejected records too, from the raw files

    third = make_pipeline("apart_c", tables=folder, rejected_path=second.rejected_table, **overrides)
    try:
        land(third, files=2, seed=23, malformed_fraction=0.2)
        run_once(third, store, spark, drain=True)
        history = f"DESCRIBE HISTORY delta.`{second.rejected_table}`"
        before = (spark.sql(history).count(), sorted(rejected_lines(spark, second)), states(store, second))
        lease = acquire_lease(store, second.name, "operator")
        with pytest.raises(operations.RollbackRefusedError, match=r"also holds rows of pipeline 'apart_c'"):
            operations.rollback(second, store, Runtime.spark(spark), lease, to_epoch=1, reason="test", recompute=True)
        store.release_lease(lease)
        assert (spark.sql(history).count(), sorted(rejected_lines(spark, second)), states(store, second)) == before
        assert invalid_lines(landed(third)) <= set(rejected_lines(spark, second)), "the third's rejected rows stay"
    finally:  # two specs sharing a table break the session's DAG folder (an import error, by design)
        Path(third.path).unlink()


@pytest.mark.variant  # CI: the simulation loses the store at every step and rebuilds it
def test_store_loss_rebuild_then_continue(spark, tmp_path):
    """Lose the store after a group committed to Delta but before it was published; rebuild
    from the epoch records; continue: nothing lost, nothing counted twice."""
    spec = make_pipeline("rebuild", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                       "spark.mode": "in_process"})
    db = tmp_path / "store.db"
    store = EpochStore(f"sqlite:///{db}")
    land(spec, files=12, seed=9)
    run_once(spec, store, spark)  # group 0: epochs 0, 1 published
    run_once(spec, store, spark, epoch_size=3, k=1)  # group 1: epoch 2 of 3 files
    import os

    os.environ["SLUICE_FAULT"] = "after_delta_commit@4"
    try:
        with pytest.raises(InjectedFault):  # epoch 3 committed, epoch 4 in Delta only, unpublished
            run_once(spec, store, spark)
    finally:
        del os.environ["SLUICE_FAULT"]
    # One group commit: epochs 3 and 4 are in Delta, not in the log.
    assert states(store, spec) == {0: "published", 1: "published", 2: "published", 3: "failed",
                                       4: "failed"}
    store.close()
    for f in db.parent.glob("store.db*"):
        f.unlink()

    # The first rebuild is killed after loading the records, before rolling back the orphans.
    import signal
    import subprocess
    import sys

    from sluice.paths import PACKAGE_DIR

    path = os.pathsep.join(p for p in (str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "sluice", "rebuild-store", "--pipeline",
                           spec.name, "--store-url", f"sqlite:///{db}"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path, "SLUICE_FAULT": "mid_rebuild",
                               "SLUICE_FAULT_MODE": "kill"}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    rebuilt = EpochStore(f"sqlite:///{db}")
    with pytest.raises(PipelineHaltedError, match="store rebuild"):
        run_once(spec, rebuilt, spark)
    report = operations.rebuild_store(spec, rebuilt, Runtime.spark(spark), "rebuild-test")
    assert report["resumed"] and report["epochs"] == 3 and report["files"] == 7
    assert report["rolled_back_orphans"] is not None, "epochs 3 and 4 were in the tables: they must go"
    assert report["generation"] == 1
    assert [(e.epoch_id, e.start, e.end, e.state) for e in rebuilt.epochs(spec.name)] == \
        [(0, 0, 2, "published"), (1, 2, 4, "published"), (2, 4, 7, "published")]
    with pytest.raises(SluiceError, match="already holds"):
        operations.rebuild_store(spec, rebuilt, Runtime.spark(spark), "rebuild-test")
    run_once(spec, rebuilt, spark, drain=True)
    assert_matches_oracle(spark, spec, rebuilt)
    rebuilt.close()


def test_poison_record_named_then_rejected_after_the_fix(spark, store):
    """A record the spec's checks let through crashes the transform (ANSI cast): the group
    fails naming its file and line; after the check is added, the rerun rejects it and every
    other record lands exactly once."""
    overrides = {"control.epoch_files": 3, "control.group_epochs": 2, "spark.mode": "in_process"}
    spec = make_pipeline("poison", base="ysb_clean", **{**overrides, "source.checks": {}})
    paths = land(spec, files=6, seed=10)
    target = paths[4]
    lines = target.read_text().split("\n")
    n = next(i for i, line in enumerate(lines) if '"event_type": "view"' in line) + 1
    lines[n - 1] = lines[n - 1].replace('"event_time": "', '"event_time": "x', 1)
    target.write_text("\n".join(lines))

    # One group commit: the group (epochs 0 and 1) fails, naming the record and its epoch.
    with pytest.raises(SluiceError, match=rf"epochs 0\.\.1 .*poison record at {target} line {n} \(epoch 1\):"):
        run_once(spec, store, spark, drain=True)
    assert states(store, spec) == {0: "failed", 1: "failed"}
    assert str(target) in store.epochs(spec.name)[1].error

    fixed = make_pipeline("poison", base="ysb_clean", **overrides)  # the shipped check rejects it
    run_once(fixed, store, spark, drain=True)
    assert set(states(store, spec).values()) == {"published"}
    rows = spark.read.format("delta").load(spec.sinks[0].path).collect()
    got = Counter((r["ad_id"], int(r["event_time"].timestamp() * 1000)) for r in rows)
    expected: Counter = Counter()
    for path in landed(spec):
        for line in Path(path).read_text().split("\n"):
            event = parse_valid(line) if line.strip() else None
            if event and event["event_type"] == "view":
                expected[(event["ad_id"], int(event["event_time"]))] += 1
    assert got == expected
    rejected = spark.read.format("delta").load(spec.rejected_table).collect()
    assert (str(target), n) in {(r["file"], r["line"]) for r in rejected}
    assert protocol.PUBLISHED == store.epochs(spec.name)[1].state


def test_vanished_file_halts_at_max_attempts_then_a_recorded_skip_lets_the_pipeline_go_on(spark, store):
    """A file gone after planning: each attempt names it; the third halts the pipeline and no
    fourth starts; `skip_file` (who, when, why) gives fresh attempts and the epoch is published
    without it, equal to the oracle of the files that remain."""
    spec = make_pipeline("skip_vanished", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                             "control.max_attempts": 3})
    files = land(spec, files=4, malformed_fraction=0.05)
    planned = PipelineRun(spec, store, "run").plan()
    victim = files[3]
    victim.unlink()
    for _ in range(3):
        with pytest.raises(SluiceError, match="no longer in the landing folder") as info:
            PipelineRun(spec, store, "run", Runtime.spark(spark)).process(planned.group_id)
        assert str(victim) in str(info.value) and "sluice_skip_file" in str(info.value)
    assert store.epochs(spec.name)[1].attempts == 3
    with pytest.raises(PipelineHaltedError, match="failed 3 times"):
        PipelineRun(spec, store, "run", Runtime.spark(spark)).process(planned.group_id)
    assert store.epochs(spec.name)[1].attempts == 3, "no attempt past max_attempts"
    PipelineRun(spec, store, "run").release()
    assert str(victim) in halt_reason(store, spec.name, 3, 10)
    with pytest.raises(PipelineHaltedError):
        PipelineRun(spec, store, "next").plan()
    report = operations.skip_file(spec, store, victim.name, by="ops:test", reason="upload lost")
    assert report["file"] == str(victim) and report["epochs"] == [1] and report["written"] == []
    assert halt_reason(store, spec.name, 3, 10) is None
    run_once(spec, store, spark, drain=True)
    assert {e.state for e in store.epochs(spec.name)} == {protocol.PUBLISHED}
    remaining = landed(spec)
    assert table_counts(spark, spec) == expected_window_counts(remaining)
    assert sorted(rejected_lines(spark, spec)) == sorted(invalid_lines(remaining))
    skipped = [f for f in store.manifest(spec.name) if f.skipped]
    assert [(f.path, f.skipped.by, f.skipped.reason) for f in skipped] == [(str(victim), "ops:test", "upload lost")]
    # A file of a published epoch: the skip is recorded for reruns, and the report says its rows
    # stay in the tables until that epoch is rolled back (a skip rewrites nothing by itself).
    first = next(e for e in store.manifest(spec.name) if e.position == 0)
    report = operations.skip_file(spec, store, first.path, by="ops:test", reason="bad upload")
    assert report["epochs"] == [0] and report["written"] == [0] and "rolled back" in report["note"]
    assert table_counts(spark, spec) == expected_window_counts(remaining)


@pytest.mark.parametrize("mode", ["recompute", pytest.param("only", marks=pytest.mark.variant),
                                  pytest.param("backfill", marks=pytest.mark.variant)])
def test_rollback_into_the_middle_of_a_group_commit(spark, store, mode):
    """Epochs 0..3 are one Delta commit per table; a rollback to epoch 2 restores the version
    before that commit, recomputes epochs 0 and 1 with their recorded ranges (and 2, 3 with
    ``recompute``; otherwise the source rewinds to epoch 2 and the next run plans it again).
    ``backfill``: the intent to epoch 2 is recorded first (a backfill's plan step), and the run
    step that completes it restores to epoch 0 under the same intent."""
    spec = make_pipeline(f"in_group_{mode}", **{"control.epoch_files": 2, "control.group_epochs": 4,
                                                "spark.mode": "in_process"})
    land(spec, files=8, seed=11, malformed_fraction=0.03)
    run_once(spec, store, spark)
    before = {e.epoch_id: (e.start, e.end) for e in store.epochs(spec.name)}
    assert len({e.delta_versions["campaign_views"] for e in store.epochs(spec.name)}) == 1, "one group commit"
    owner = cli_owner()
    lease = acquire_lease(store, spec.name, owner)
    if mode == "backfill":
        operations.begin_rollback(store, lease, RollbackIntent(2, "backfill test", owner, through_epoch=3))
        report = PipelineRun(spec, store, owner, Runtime.spark(spark)).process(None)["rollbacks"][0]
    else:
        report = operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=2, reason="in-group test",
                                    recompute=mode == "recompute")
        PipelineRun(spec, store, owner, Runtime.spark(spark)).process(report["group_id"])
    assert (report["to_epoch"], report["restored_to_epoch"], report["generation"]) == (2, 0, 1)
    PipelineRun(spec, store, owner).validate()
    PipelineRun(spec, store, owner, Runtime.spark(spark)).publish()
    assert store.pending_rollback(spec.name) is None
    now = {e.epoch_id: (e.start, e.end) for e in store.epochs(spec.name)}
    assert now[0] == before[0] and now[1] == before[1], "epochs before to_epoch keep their recorded ranges"
    if mode == "only":
        assert set(now) == {0, 1}, "epochs 2, 3 are rolled back, not planned again"
        run_once(spec, store, spark, drain=True)
    else:
        assert now == before
    assert store.generation(spec.name) == 1
    assert_matches_oracle(spark, spec, store)


def test_a_failure_after_rejected_was_written_loses_nothing_a_new_check_rejects(spark, store, monkeypatch):
    """The group's `_rejected` commit lands, then writing the sink fails (an exception). A new
    `checks:` rule then rejects purchases: the rerun restores `_rejected` and writes both
    tables afresh, so every purchase ends in `_rejected` exactly once, beside the malformed
    lines, and the sink equals the oracle."""
    from include.generators.ysb import raw_events

    overrides = {"control.epoch_files": 2, "control.group_epochs": 2, "spark.mode": "in_process"}
    spec = make_pipeline("fix_after_partial", **overrides)
    land(spec, files=4, seed=12, malformed_fraction=0.05)
    monkeypatch.setenv("SLUICE_FAULT", "mid_write")
    with pytest.raises(InjectedFault):
        run_once(spec, store, spark)
    monkeypatch.delenv("SLUICE_FAULT")
    assert rejected_lines(spark, spec), "the group's _rejected commit landed before the failure"
    assert states(store, spec) == {0: "failed", 1: "failed"}

    checks = {**spec.source.checks, "no_purchases": "event_type <> 'purchase'"}
    fixed = make_pipeline("fix_after_partial", **overrides, **{"source.checks": checks})
    run_once(fixed, store, spark, drain=True)
    paths = landed(spec)
    purchases = {(p, n) for p, n, event in raw_events(paths) if event and event["event_type"] == "purchase"}
    assert purchases, "the data holds purchases"
    rejected = rejected_lines(spark, spec)
    assert len(rejected) == len(set(rejected)), "a rejected record was written twice"
    assert set(rejected) == invalid_lines(paths) | purchases
    assert table_counts(spark, spec) == expected_window_counts(paths)


@pytest.mark.spark_crash
def test_sigkill_between_the_restores_of_a_rollback(spark, store):
    """A rollback killed after its first RESTORE leaves its intent recorded; the operator's rerun
    of the same rollback completes it and the recompute lands the oracle."""
    import signal
    import subprocess
    import sys

    from sluice.paths import project_root

    spec = make_pipeline("kill_rollback", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                             "spark.mode": "in_process"})
    land(spec, files=8, seed=13, malformed_fraction=0.05)
    run_once(spec, store, spark, drain=True)
    code = ("import sys; sys.path[:0] = ['plugins', '.']\n"
            "from sluice.protocol import operations\nfrom sluice.protocol.leases import acquire_lease\n"
            "from sluice.protocol.run import cli_owner\nfrom sluice.protocol.runtime import Runtime\n"
            "from sluice.spark import get_session\n"
            "from sluice.spec import get_spec\nfrom sluice.store import EpochStore\n"
            f"spec = get_spec({spec.name!r}); log = EpochStore()\n"
            "lease = acquire_lease(log, spec.name, cli_owner())\n"
            "operations.rollback(spec, log, Runtime.spark(get_session('kill-rollback')), lease, to_epoch=2, "
            "reason='t', recompute=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=project_root(), capture_output=True, text=True,
                          env={**__import__("os").environ, "SLUICE_FAULT": "mid_rollback", "SLUICE_FAULT_MODE": "kill"},
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert store.pending_rollback(spec.name).to_epoch == 2
    with pytest.raises(PipelineHaltedError, match="rollback"):
        run_once(spec, store, spark)
    rollback_and_recompute(spark, spec, store, to_epoch=2)
    run_once(spec, store, spark, drain=True)
    assert_matches_oracle(spark, spec, store)


def test_a_recorded_intent_whose_preconditions_fail_is_withdrawn(spark, store):
    """A backfill's plan step records its rollback intent before the run step can check the
    tables; when the run then finds a precondition broken (here a file of the range is gone),
    the refusal withdraws the intent: nothing changed, the pipeline is not left halted."""
    spec = make_pipeline("withdrawn_intent", **{"control.epoch_files": 2, "control.group_epochs": 1,
                                                "spark.mode": "in_process"})
    paths = land(spec, files=4, seed=14)
    run_once(spec, store, spark, drain=True)
    owner = cli_owner()
    lease = acquire_lease(store, spec.name, owner)
    operations.begin_rollback(store, lease, RollbackIntent(1, "backfill test", owner))
    moved = paths[-1].rename(paths[-1].with_name("_away.json"))
    with pytest.raises(operations.RollbackRefusedError, match="no longer holds"):
        operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=1, reason="backfill test",
                            recompute=True)
    store.release_lease(lease)
    assert store.pending_rollback(spec.name) is None
    assert halt_reason(store, spec.name, spec.control.max_attempts, 10) is None
    moved.rename(paths[-1])
    assert_matches_oracle(spark, spec, store)
