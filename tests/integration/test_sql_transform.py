"""SQL transforms (``transform: {sql: ...}``) on real Spark and Delta, against oracles computed in
plain Python from the raw files (``include.generators.ysb``), not through sluice's reader: the
YSB query as SQL through a SIGKILL mid-group and a rollback, an append query with concurrent
epochs, and a query naming a missing column (an error naming the spec and the column, nothing
written, halted after ``control.max_attempts``)."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
import yaml

from include.generators.ysb import expected_window_counts, load_ads, raw_events
from sluice import protocol
from sluice.delta.spark import SparkTables
from sluice.errors import PipelineHaltedError, TransformError
from sluice.paths import project_root
from sluice.preview import shadow_preview
from sluice.protocol.run import run_once
from sluice.store import EpochStore
from tests.integration.test_exactly_once import GroupJob, app_txn
from tests.integration.test_operations import rollback_and_recompute
from tests.integration.test_shadow_preview import shadow_counts
from tests.pipelines import assert_matches_oracle, land, landed, make_pipeline

#: The YSB query (jobs/transforms/ysb.py campaign_views) as SQL, as the shipped example spec has it.
YSB_SQL = yaml.safe_load((project_root() / "include" / "pipelines" / "ysb_sql.yaml").read_text())["transform"]["sql"]
#: A bad release: counts every event type, not only views.
BUGGY_SQL = YSB_SQL.replace("WHERE records.event_type = 'view'", "WHERE records.event_type IS NOT NULL")
#: A release naming a column the records lack (event_tme).
BROKEN_SQL = YSB_SQL.replace("CAST(records.event_time AS BIGINT)", "CAST(records.event_tme AS BIGINT)")
SIZES = {"control.epoch_files": 2, "control.group_epochs": 2}


def seed_for(test: str, default: int) -> int:
    """The inputs' seed: ``SLUICE_TEST_SEED`` or the test's own, printed to rerun a failure."""
    seed = int(os.environ.get("SLUICE_TEST_SEED") or default)
    print(f"{test}: seed {seed} (SLUICE_TEST_SEED={seed} reruns it)")
    return seed


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


@pytest.mark.spark_crash
@pytest.mark.variant  # ~70-100 s; CI: the crash points on the Python transform, SQL in test_connect/test_dedup
def test_sql_transform_killed_mid_group_then_rolled_back_equals_the_oracle(spark, store):
    """The YSB query as SQL (records JOIN the ads reference, GROUP BY into an aggregate sink):
    the Spark driver is SIGKILLed mid-group (the rejected table committed, the aggregate not);
    the rerun equals the oracle. A bad SQL release then publishes wrong counts; the shadow preview
    of a rollback recomputes the oracle with the fixed SQL, and the rollback to the release's first
    epoch (RESTORE, recompute) leaves it in the table. A later release naming a missing column
    fails before any table changes. cost: ~105-135 s on the shared 2-core machine at load 5-9,
    where test_exactly_once's mid_write SIGKILL test took 74 s at load 5 (the killed driver's
    own JVM start is most of both)."""
    seed = seed_for("sql kill+rollback", 11)
    assert BUGGY_SQL != YSB_SQL
    spec = make_pipeline("sql_ysb", base="ysb_sql", **SIZES)  # the shipped example
    land(spec, files=4, seed=seed, malformed_fraction=0.03, late_fraction=0.05, late_max_s=25)
    job = GroupJob(spec.name, "--plan", "--drain", env={"SLUICE_FAULT": "mid_write@1", "SLUICE_FAULT_MODE": "kill"})
    _, err = job.communicate(timeout=300)
    assert job.returncode == -signal.SIGKILL, f"the driver was not killed mid-write: rc={job.returncode}\n{err[-3000:]}"
    assert app_txn(spark, spec, spec.rejected_table, "_rejected") == 1, "the group's _rejected commit is in Delta"
    assert app_txn(spark, spec, spec.sinks[0].path, "campaign_views") in (None, -1), "its aggregate commit is not"
    assert {e.state for e in store.epochs(spec.name)} <= set(protocol.UNFINISHED)

    groups = run_once(spec, store, spark, drain=True)
    assert groups[0]["group"]["plan"]["reason"].startswith("reprocess epochs")
    assert_matches_oracle(spark, spec, store)

    buggy = make_pipeline("sql_ysb", base="ysb_sql", transform={"sql": BUGGY_SQL}, **SIZES)
    land(spec, files=4, seed=seed + 1, malformed_fraction=0.03)
    run_once(buggy, store, spark, drain=True)  # epochs 2 and 3, over-counted
    with pytest.raises(AssertionError, match="differ from the oracle"):
        assert_matches_oracle(spark, spec, store)

    spec = make_pipeline("sql_ysb", base="ysb_sql", **SIZES)  # the fix
    preview = shadow_preview(spec, store, spark, to_epoch=2)  # the fixed SQL, into a shadow table only
    assert not preview.problems and preview.recomputed_epochs == [2, 3]
    assert shadow_counts(spark, preview.sinks[0].shadow_path) == dict(expected_window_counts(landed(spec)))
    report = rollback_and_recompute(spark, spec, store, to_epoch=2)
    assert report["generation"] == 1
    assert_matches_oracle(spark, spec, store)
    assert [e.state for e in store.epochs(spec.name, generation=0) if e.epoch_id >= 2] == ["rolled_back"] * 2

    # A release naming a missing column, on the running pipeline: it fails before any table changes.
    tables = SparkTables(spark)
    versions = {path: tables.version(path) for path in spec.table_writers()}
    release = make_pipeline("sql_ysb", base="ysb_sql", transform={"sql": BROKEN_SQL}, **SIZES)
    land(spec, files=2, seed=seed + 2, malformed_fraction=0.2)  # rejected rows that must not be written either
    with pytest.raises(TransformError, match=r"sql_ysb\.yaml\): transform\.sql: column `records`\.`event_tme`"):
        run_once(release, store, spark)
    assert {path: tables.version(path) for path in spec.table_writers()} == versions, "a table changed"
    assert store.epochs(spec.name)[-1].state == protocol.FAILED


def view_events_oracle(paths) -> Counter:
    """The append query's rows, from the raw files: (ad_id, campaign_id, event time ms) of each
    valid view of a known ad."""
    ads = load_ads()
    return Counter((e["ad_id"], ads[e["ad_id"]], int(e["event_time"])) for _, _, e in raw_events(paths)
                   if e is not None and e["event_type"] == "view" and e["ad_id"] in ads)


@pytest.mark.variant
def test_sql_append_with_concurrent_epochs_equals_the_oracle(spark, store):
    """An append query (each valid view with its campaign), epochs computed two at a time in one
    SparkSession: every epoch's views reach the table exactly once, none of another epoch's.
    cost: ~27-38 s (measured at load 5-7 on the shared 2-core machine)."""
    seed = seed_for("sql append", 23)
    sql = ("SELECT r.ad_id, a.campaign_id, CAST(r.event_time AS BIGINT) AS event_time_ms\n"
           "FROM records r JOIN ads a ON r.ad_id = a.ad_id WHERE r.event_type = 'view'")
    spec = make_pipeline("sql_append", transform={"sql": sql}, commit="epoch",
                         sinks=[{"name": "views", "mode": "append", "path": "${SLUICE_DATA_DIR}/sql_append/views"}],
                         **{"control.epoch_files": 1, "control.group_epochs": 4, "control.concurrent_epochs": 2})
    land(spec, files=4, seed=seed, malformed_fraction=0.03)
    run_once(spec, store, spark, drain=True)
    rows = spark.read.format("delta").load(spec.sinks[0].path).collect()
    got = Counter((r["ad_id"], r["campaign_id"], r["event_time_ms"]) for r in rows)
    assert got == view_events_oracle(landed(spec))
    assert {e.state for e in store.epochs(spec.name)} == {protocol.PUBLISHED}
    assert any(e.timings.get("concurrency") == 2 for e in store.epochs(spec.name))


def test_sql_naming_a_missing_column_fails_naming_the_spec_and_column_and_writes_nothing(spark, store):
    """A query naming a column the records lack, on a new pipeline: the group fails with a
    TransformError naming the pipeline, the spec file, transform.sql, the column and its line in
    the query, before any table is even created; the failure counts as an attempt, so the
    pipeline halts after control.max_attempts. (A running pipeline's release of such a query:
    the end of the test above.) No Delta write at all: cost ~1 s (measured after the test above,
    at load 5)."""
    seed = seed_for("sql missing column", 31)
    assert BROKEN_SQL != YSB_SQL
    tables = SparkTables(spark)

    new = make_pipeline("sql_missing_new", transform={"sql": BROKEN_SQL}, **SIZES, **{"control.max_attempts": 2})
    land(new, files=2, seed=seed)
    with pytest.raises(TransformError) as failed:
        run_once(new, store, spark)
    message = str(failed.value)
    assert new.path in message and "transform.sql" in message and "`event_tme`" in message, message
    assert "at line 2 pos" in message, message  # the line of the spec's query, not of sluice's wrapper
    assert not any(tables.exists(path) for path in new.table_writers()), "no table may be created"
    epoch = store.epochs(new.name)[0]
    assert epoch.state == protocol.FAILED and "event_tme" in epoch.error and epoch.failures == 1
    with pytest.raises(TransformError):
        run_once(new, store, spark)
    with pytest.raises(PipelineHaltedError, match="failed 2 times"):
        run_once(new, store, spark)
