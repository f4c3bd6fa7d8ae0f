"""What a group held in Spark's memory, by Spark's own accounting, is recorded with its epochs
and teaches the controllers their memory bound (issue 17: epoch sizes bounded by measured
memory, not only by a constant)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice import adaptive
from sluice.protocol.run import run_once
from sluice.store import EpochStore
from tests.pipelines import land, make_pipeline


def test_a_group_records_the_memory_it_held_and_the_controllers_learn_it(spark, tmp_path: Path):
    store = EpochStore(f"sqlite:///{tmp_path}/s.db")
    spec = make_pipeline("memory_measured", **{"control.adaptive": True})
    paths = land(spec, files=5, rate_per_file=2_000)
    # the controllers' probe: a first epoch of 3 files, then 2 (a group of two epoch sizes)
    run_once(spec, store, spark, epoch_size=2, k=2, first_size=3, extra={
        "reason": "efficient group: slow start", "rate_rps": 2_000.0, "file_rate": 1.0, "partitions": 2})
    epochs = store.epochs(spec.name)
    assert [e.end - e.start for e in epochs] == [3, 2]
    assert all(e.timings.get("memory_peak_mb", 0) > 0 for e in epochs), [e.timings for e in epochs]
    # the budget is Spark's unified memory: (heap - 300 MB reserved) * spark.memory.fraction
    heap_mb = spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory() / 2**20
    fraction = float(spark.conf.get("spark.memory.fraction", "0.6"))
    assert epochs[0].timings["memory_budget_mb"] == pytest.approx((heap_mb - 300) * fraction, rel=0.05)
    assert epochs[0].timings["memory_peak_mb"] <= epochs[0].timings["memory_budget_mb"]

    # One commit per group reads the group's epochs together: one sample of all their records,
    # counted from the raw files (every line is one record read).
    per_file = [sum(1 for line in path.read_text().splitlines() if line.strip()) for path in paths]
    lines = sum(per_file)
    state = adaptive.load_state(spec, store)
    assert state.epoch.memory_unit == "group"
    assert state.epoch.memory_samples == [(float(lines), epochs[0].timings["memory_peak_mb"])]
    # each epoch's cost sample holds its own records: the probe's 3 files, then the other 2
    assert [n for n, _ in state.epoch.cost_samples] == [float(sum(per_file[:3])), float(sum(per_file[3:]))]
    store.close()
