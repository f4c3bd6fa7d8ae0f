"""Pipelines chained by table versions (issue 15 item 3), on real Spark and Delta: ``ysb_clean``
appends view events; a downstream pipeline reads its table's versions and counts views per ad.
The downstream table equals an oracle computed from the upstream's raw files with plain json;
an upstream rollback (a RESTORE) stops the downstream with the documented message and changes
nothing; the steps the message names bring the downstream back to the oracle of what the
upstream still holds."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from include.generators.ysb import raw_events
from sluice.errors import SluiceError
from sluice.protocol import operations
from sluice.protocol.run import run_once
from sluice.sources import source_for
from sluice.sources.delta_versions import undone_by_restore
from sluice.spec import load_spec
from sluice.store import EpochStore
from tests.integration.test_exactly_once import kill_at
from tests.pipelines import land, landed, make_pipeline, roll_back


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


def views_per_ad(paths: list[Path]) -> Counter:
    """The oracle: valid view events per ad in the raw files."""
    return Counter(e["ad_id"] for _, _, e in raw_events(paths) if e is not None and e["event_type"] == "view")


def table_views(spark, path: str) -> Counter:
    return Counter({r["ad_id"]: r["views"] for r in spark.read.format("delta").load(path).collect()})




def downstream_of(upstream, folder: Path, name: str = "chain_down"):
    spec_path = folder / f"{name}.yaml"
    spec_path.write_text(yaml.safe_dump({
        "schedule": None,
        "source": {"type": "delta", "table": upstream.sinks[0].path,
                   "schema": {"ad_id": "string", "event_time": "timestamp"}, "required": ["ad_id"]},
        "transform": "tests.integration.chain_transforms.views_per_ad",
        "sinks": [{"name": "views", "mode": "aggregate", "keys": ["ad_id"], "sums": ["views"],
                   "path": f"{Path(upstream.sinks[0].path).parents[2]}/{name}/tables/views"}],
        "control": {"adaptive": False, "epoch_files": 2, "group_epochs": 2},
        "spark": {"mode": "in_process"},
    }, sort_keys=False))
    return load_spec(spec_path)


def test_a_chained_pipeline_equals_the_oracle_and_stops_on_an_upstream_rollback(spark, store):
    up = make_pipeline("chain_up", base="ysb_clean", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                                        "schedule": None})
    down = downstream_of(up, Path(up.path).parent)
    land(up, files=4, seed=21, malformed_fraction=0.03)
    run_once(up, store, spark, drain=True)
    run_once(down, store, spark, drain=True)
    assert table_views(spark, down.sinks[0].path) == views_per_ad(landed(up))
    source = source_for(down, store)
    versions = [v for e in store.epochs(down.name)
                for v in source.describe(store.manifest(down.name, e.start, e.end))["versions"]]
    assert versions == sorted(versions) and len(versions) == len(set(versions)), versions

    # More upstream data: the downstream reads only the new versions.
    land(up, files=4, seed=22, malformed_fraction=0.03, prefix="second")
    run_once(up, store, spark, drain=True)
    run_once(down, store, spark, drain=True)
    assert table_views(spark, down.sinks[0].path) == views_per_ad(landed(up))
    before = table_views(spark, down.sinks[0].path)
    # Every upstream row, read back through the versions exactly (timestamps to the microsecond),
    # each named by its version, data file and line.
    end = len(store.manifest(down.name))
    read = source.read(spark, 0, end).collect()
    upstream_rows = spark.read.format("delta").load(up.sinks[0].path).collect()
    assert Counter((r["ad_id"], r["event_time"]) for r in read) == Counter(
        (r["ad_id"], r["event_time"]) for r in upstream_rows)
    assert all(r["_file"].startswith(f"delta://{up.sinks[0].path}@") and r["_line"] >= 1 for r in read)

    # The upstream rolls back its last group (a RESTORE): the downstream stops, changing nothing.
    last_group = max(e.group_id for e in store.epochs(up.name))
    roll_back(spark, up, store, min(e.epoch_id for e in store.epochs(up.name)
                                             if e.group_id == last_group))
    with pytest.raises(SluiceError) as stopped:
        run_once(down, store, spark, drain=True)
    message = str(stopped.value)
    assert "chain_down" in message and "was restored to version" in message and "skip" in message, message
    assert table_views(spark, down.sinks[0].path) == before

    # What the message says: skip the undone versions, then roll the downstream back (recompute).
    commits = source._commits()
    entries = store.manifest(down.name)
    version_at = {int(e.path.rsplit("@", 1)[1]): e.position for e in entries}
    epoch_of = {v: e.epoch_id for e in store.epochs(down.name) for v, p in version_at.items()
                if e.start <= p < e.end}
    found = undone_by_restore(up.sinks[0].path, commits, sorted(version_at), epoch_of)
    assert found is not None and f"epoch {found.first_epoch}" in message
    for v in found.undone:
        operations.skip_file(down, store, f"delta://{up.sinks[0].path}@{v}", by="test", reason="upstream restore")
    roll_back(spark, down, store, found.first_epoch, recompute=True)
    run_once(down, store, spark, drain=True)
    live = [Path(f.path) for e in store.epochs(up.name) if e.state == "published"  # what the upstream holds
            for f in store.manifest(up.name, e.start, e.end)]
    assert len(live) < len(landed(up))
    assert table_views(spark, down.sinks[0].path) == views_per_ad(live)


@pytest.mark.spark_crash
def test_an_upstream_crash_never_reaches_the_downstream(spark, store):
    """Issue 37 item 6. The upstream's driver is SIGKILLed after its group's Delta commit, before
    the store records it; the downstream polls then, and registers nothing of that unpublished
    version. The upstream's rerun RESTOREs the attempt and writes the group again; the downstream
    then reads the published versions only, with no halt and no skip, and equals the oracle from
    the upstream's raw files (before the fix: the crashed version was registered, and the rerun's
    RESTORE halted the downstream until an operator skipped it). Cost: ~60 s (one killed Spark
    application in its own process, then in-process runs)."""
    up = make_pipeline("chain_crash_up", base="ysb_clean", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                                              "schedule": None})
    down = downstream_of(up, Path(up.path).parent, "chain_crash_down")
    land(up, files=4, seed=31, malformed_fraction=0.03)
    kill_at(up, "after_delta_commit")
    assert not [e for e in store.epochs(up.name) if e.state == "published"]
    run_once(down, store, spark, drain=True)
    source = source_for(down, store)
    commits = {c.version: c for c in source._commits()}
    early = [int(e.path.rsplit("@", 1)[1]) for e in store.manifest(down.name)]
    # the table's creation (empty, no epoch) may be read; the crashed group's version may not
    assert all(not commits[v].epochs for v in early), [commits[v] for v in early]
    assert any(c.epochs and c.operation != "RESTORE" for c in commits.values()), "the crash left no version"
    run_once(up, store, spark, drain=True)  # the rerun: RESTORE, write again, publish
    run_once(down, store, spark, drain=True)
    assert table_views(spark, down.sinks[0].path) == views_per_ad(landed(up))
    commits = {c.version: c for c in source._commits()}
    published = {v for e in store.epochs(up.name) for v in e.delta_versions.values()}
    read = [int(e.path.rsplit("@", 1)[1]) for e in store.manifest(down.name)]
    assert all(not commits[v].epochs or v in published for v in read), (read, published)
