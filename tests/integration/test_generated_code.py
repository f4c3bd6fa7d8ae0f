"""A group generates no Java code the group before it did not: Spark writes an int literal (an
epoch id) into the source of the code it generates, so a plan that carried the epoch ids made
every group's read and per-epoch queries (transform, GX suite, checkpoint) new classes, compiled
by Janino and then by the JIT again, on a Connect server that lives for days (bench/README.md,
"A server that has served 40 groups")."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.protocol.run import run_once
from sluice.store import EpochStore
from tests.integration.test_delta_source import downstream_of, table_views, views_per_ad
from tests.pipelines import assert_matches_oracle, land, landed, make_pipeline


def compilations(spark):
    """Spark's count of the classes it compiled (``CodegenMetrics``), process-wide."""
    return spark.sparkContext._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()


def test_a_later_group_compiles_no_new_classes(spark):
    """Four groups of two epochs each (other epoch ids, other files) through the GX-validated
    YSB pipeline: the third and fourth compile at most 4 classes each that Spark's code cache
    does not hold already (10 each when the plans carried the epoch ids), and the table equals
    the oracle. What they still compile is GX's: it bundles a suite's metrics into one
    aggregate in an order that varies from one validation to the next (3 sums, 6 orders), so an
    epoch's validation may meet an order not yet cached (2 classes); the cache fills once it has
    met them all. The count is Spark's own (``CodegenMetrics``). Cost: four groups of 2 tiny
    files, about 15 s on 2 cores."""
    spec = make_pipeline("same_code", **{"control.epoch_files": 1, "control.group_epochs": 2,
                                         "spark.mode": "in_process"})
    metric = compilations(spark)
    store = EpochStore()
    compiled = []
    try:
        for seed in (1, 2, 3, 4):
            land(spec, files=2, rate_per_file=20, seed=seed)
            before = metric.getCount()
            run_once(spec, store, spark)
            compiled.append(metric.getCount() - before)
        assert [len(g.epochs) for g in store.groups(spec.name)] == [2, 2, 2, 2]
        assert_matches_oracle(spark, spec, store)
    finally:
        store.close()
    print(f"classes compiled by each group: {compiled}")
    assert max(compiled[2:]) <= 4, compiled


@pytest.mark.variant
def test_a_delta_source_group_compiles_no_new_classes(spark):
    """A pipeline reading a Delta table's versions (no GX suite): its fifth and sixth groups, of
    other versions and files, compile no class at all (2 each when the read tagged rows by a
    CASE of the group's versions and files; the fourth meets once-only code, 14-16 classes with
    either, not traced), and the downstream table equals the oracle from the upstream's raw
    files. Cost: six upstream and six downstream groups, about 45 s (variant: ``make
    test-all``)."""
    up = make_pipeline("same_code_up", base="ysb_clean", **{"control.epoch_files": 1, "control.group_epochs": 2,
                                                            "schedule": None, "spark.mode": "in_process"})
    down = downstream_of(up, Path(up.path).parent, name="same_code_down")
    metric = compilations(spark)
    store = EpochStore()
    compiled = []
    try:
        for seed in (1, 2, 3, 4, 5, 6):
            land(up, files=2, rate_per_file=20, seed=seed)
            run_once(up, store, spark)
            before = metric.getCount()
            run_once(down, store, spark)
            compiled.append(metric.getCount() - before)
        assert table_views(spark, down.sinks[0].path) == views_per_ad(landed(up))
    finally:
        store.close()
    print(f"classes compiled by each downstream group: {compiled}")
    assert max(compiled[4:]) == 0, compiled
