"""The shadow rollback preview (``sluice.preview``): a release that lost half the campaigns
(quarantined by validation) is fixed; the preview of a rollback with recompute predicts, row by
row, what the rollback then does, while it changes nothing: the published table, the epoch
store and the source are as before. Every figure is checked against an oracle computed from the
raw files, not against sluice's own reader."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from include.generators.ysb import expected_window_counts
from sluice.delta.spark import SparkTables
from sluice.preview import saved_previews, shadow_preview
from sluice.protocol.run import run_once
from sluice.store import EpochStore
from tests.integration.test_operations import BUGGY, rollback_and_recompute
from tests.pipelines import land, landed, make_pipeline, table_counts


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


def shadow_counts(spark, path: str) -> dict[tuple[str, int], int]:
    return {(r["campaign_id"], int(r["window_start"].timestamp() * 1000)): r["views"]
            for r in spark.read.format("delta").load(path).collect()}


def test_a_shadow_preview_predicts_the_rollback_and_changes_nothing(spark, store):
    sizes = {"control.epoch_files": 2, "control.group_epochs": 2, "validation.policy": "quarantine",
             "spark.mode": "in_process"}
    spec = make_pipeline("shadow", **sizes)
    land(spec, files=8, seed=12)
    run_once(spec, store, spark)  # epochs 0, 1: the good release
    buggy = make_pipeline("shadow", transform=BUGGY, **sizes)
    run_once(buggy, store, spark, drain=True)  # epochs 2, 3: half the campaigns quarantined
    published = table_counts(spark, spec)
    oracle = expected_window_counts(landed(spec))
    assert published != oracle
    version = SparkTables(spark).version(spec.sinks[0].path)
    before = [(e.epoch_id, e.state, e.generation) for e in store.epochs(spec.name)]

    report = shadow_preview(spec, store, spark, to_epoch=2)  # the fixed release is the current code
    assert not report.problems and report.recomputed_epochs == [2, 3] and report.restored_to_epoch == 2
    (diff,) = report.sinks
    # Nothing changed: the table's version, its rows, the epoch log.
    assert SparkTables(spark).version(spec.sinks[0].path) == version and table_counts(spark, spec) == published
    assert [(e.epoch_id, e.state, e.generation) for e in store.epochs(spec.name)] == before
    assert store.generation(spec.name) == 0 and store.pending_rollback(spec.name) is None
    # The shadow holds the oracle; the diff is published -> oracle, key by key.
    assert shadow_counts(spark, diff.shadow_path) == dict(oracle)
    added = {k for k in oracle if k not in published}
    removed = {k for k in published if k not in oracle}
    changed = {k for k in oracle if k in published and published[k] != oracle[k]}
    assert (diff.added, diff.removed, diff.changed) == (len(added), len(removed), len(changed))
    assert diff.published_rows == len(published) and diff.shadow_rows == len(oracle)
    assert diff.added + diff.changed > 0 and diff.sample
    for row in diff.sample:
        key = (row["key"]["campaign_id"],
               int(datetime.fromisoformat(row["key"]["window_start"]).replace(tzinfo=UTC).timestamp() * 1000))
        assert row["change"] == ("added" if key in added else "removed" if key in removed else "changed")
        assert (row["shadow"] or {}).get("views") == oracle.get(key)
        assert (row["published"] or {}).get("views") == published.get(key)
    assert saved_previews(spec.name)[0]["preview_id"] == report.preview_id

    # The rollback it previewed leaves exactly the shadow's rows.
    rollback_and_recompute(spark, spec, store, to_epoch=2)
    assert table_counts(spark, spec) == shadow_counts(spark, diff.shadow_path) == oracle

    # Previewed again with the same code: nothing would change. A bad epoch is reported.
    again = shadow_preview(spec, store, spark, to_epoch=3)  # the recompute wrote 2 and 3 in one commit
    assert again.as_dict()["unchanged"] and again.recomputed_epochs == [2, 3] and again.restored_to_epoch == 2
    assert again.notes and "epochs [2] share a Delta commit with epoch 3" in again.notes[0]
    refused = shadow_preview(spec, store, spark, to_epoch=99)
    assert refused.problems and not refused.sinks
    assert [p["preview_id"] for p in saved_previews(spec.name)] == [refused.preview_id, again.preview_id,
                                                                    report.preview_id]
