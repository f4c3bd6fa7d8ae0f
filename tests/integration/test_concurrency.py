"""Concurrent epochs (A-scheduler): independent epochs of a group are computed at once, yet
committed in epoch order, exactly once; a failure stops the later epochs from committing."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from include.generators.ysb import parse_valid
from sluice import protocol
from sluice.errors import SpecError
from sluice.faults import InjectedFault
from sluice.protocol.run import run_once
from sluice.store import EpochStore
from tests.pipelines import invalid_lines, land, landed, make_pipeline, rejected_lines


def view_oracle(paths: list[Path]) -> Counter:
    """(user_id, ad_id, event_time ms) of every valid view event in the raw files."""
    found: Counter = Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            event = parse_valid(line) if line.strip() else None
            if event and event["event_type"] == "view":
                found[(event["user_id"], event["ad_id"], int(event["event_time"]))] += 1
    return found


def table_views(spark, path: str) -> Counter:
    return Counter((r["user_id"], r["ad_id"], int(r["event_time"].timestamp() * 1000))
                   for r in spark.read.format("delta").load(path).collect())


def delta_commits(path: str) -> list[dict]:
    """(version, epoch) of every data commit of the table, read from its _delta_log."""
    commits = []
    for log_file in sorted((Path(path) / "_delta_log").glob("*.json")):
        for line in log_file.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            meta = json.loads(info["userMetadata"]) if info and info.get("userMetadata") else {}
            if meta.get("epochs"):  # not the table's creation, nor a fence
                commits.append({"version": int(log_file.stem), **meta})
    return commits


def concurrent_pipeline(name: str, level: int | str = 3):
    """ysb_clean without its GX suite (GX runs one validation at a time anyway; its gate has
    its own tests), one file per epoch, six epochs per group, a Delta commit per epoch (under
    one commit per group the group is one Spark job: nothing to run concurrently)."""
    return make_pipeline(name, base="ysb_clean", **{
        "control.epoch_files": 1, "control.group_epochs": 6, "control.concurrent_epochs": level, "commit": "epoch",
        "sinks": [{"name": "view_events", "mode": "append",
                   "path": f"${{SLUICE_DATA_DIR}}/{name}/tables/view_events"}]})


def test_concurrent_epochs_commit_in_order_and_exactly_once(spark):
    spec = concurrent_pipeline("concurrent_ok")
    land(spec, files=6, rate_per_file=300, malformed_fraction=0.03)
    log = EpochStore()
    done = run_once(spec, log, spark)
    epochs = log.epochs(spec.name)
    assert [e.state for e in epochs] == [protocol.PUBLISHED] * 6
    assert {e.timings.get("concurrency") for e in epochs} == {3}, "the epochs were not computed concurrently"
    assert done[0]["group"]["epochs"][0]["epoch_id"] == 0
    # Exactly once, against the raw files.
    assert table_views(spark, spec.sinks[0].path) == view_oracle(landed(spec))
    rejected = rejected_lines(spark, spec)
    assert sorted(rejected) == sorted(invalid_lines(landed(spec)))
    # Committed in epoch order: each table's data commits carry increasing epochs.
    for path in (spec.sinks[0].path, spec.rejected_table):
        order = [c["epoch"] for c in delta_commits(path)]
        assert order == sorted(order) and len(order) == len(set(order)), f"{path}: commits in order {order}"
    views = [c["epoch"] for c in delta_commits(spec.sinks[0].path)]
    assert views == list(range(6))
    versions = [e.delta_versions["view_events"] for e in epochs]
    assert versions == sorted(versions)


def test_a_failure_stops_later_epochs_and_the_rerun_lands_everything_once(spark, monkeypatch):
    spec = concurrent_pipeline("concurrent_fail")
    land(spec, files=5, rate_per_file=300, malformed_fraction=0.03)
    log = EpochStore()
    monkeypatch.setenv("SLUICE_FAULT", "mid_write@2")
    monkeypatch.setenv("SLUICE_FAULT_MODE", "raise")
    with pytest.raises(InjectedFault) as info:
        run_once(spec, log, spark)
    assert "injected fault at mid_write (epoch 2)" in str(info.value)
    states = [e.state for e in log.epochs(spec.name)]
    assert states[:3] == [protocol.COMMITTED, protocol.COMMITTED, protocol.FAILED], states
    assert all(s not in (protocol.COMMITTED, protocol.PUBLISHED) for s in states[3:]), states
    assert [c["epoch"] for c in delta_commits(spec.sinks[0].path)] == [0, 1]
    monkeypatch.delenv("SLUICE_FAULT")
    run_once(spec, log, spark)
    assert [e.state for e in log.epochs(spec.name)] == [protocol.PUBLISHED] * 5
    assert table_views(spark, spec.sinks[0].path) == view_oracle(landed(spec))
    assert sorted(rejected_lines(spark, spec)) == sorted(invalid_lines(landed(spec)))


def test_stateful_pipelines_refuse_concurrency(spark):
    path = Path(os.environ["SLUICE_PIPELINES_DIR"]) / "concurrent_stateful.yaml"
    try:
        with pytest.raises(SpecError, match="concurrent_epochs: 2 needs independent epochs"):
            make_pipeline("concurrent_stateful", **{"control.concurrent_epochs": 2})
    finally:
        path.unlink(missing_ok=True)  # the DAG factory reads every spec in the folder
    spec = make_pipeline("concurrent_stateful_auto", **{"control.concurrent_epochs": "auto"})
    assert not spec.independent_epochs
