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
from sluice.protocol.leases import acquire_lease
from sluice.protocol.run import PipelineRun, cli_owner, run_once
from sluice.protocol.runtime import Runtime
from sluice.sources import source_for
from sluice.sources.delta_versions import undone_by_restore
from sluice.spec import load_spec
from sluice.store import EpochStore
from tests.pipelines import land, landed, make_pipeline


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


def roll_back(spark, spec, store, to_epoch: int, recompute: bool = False) -> None:
    """``sluice_rollback``, step by step as its tasks run."""
    owner = cli_owner()
    report = operations.rollback(spec, store, Runtime.spark(spark), acquire_lease(store, spec.name, owner),
                                to_epoch=to_epoch, reason="upstream restore", recompute=recompute)
    PipelineRun(spec, store, owner, Runtime.spark(spark)).process(report["group_id"])
    PipelineRun(spec, store, owner).validate()
    PipelineRun(spec, store, owner, Runtime.spark(spark)).publish()


def downstream_of(upstream, folder: Path):
    spec_path = folder / "chain_down.yaml"
    spec_path.write_text(yaml.safe_dump({
        "schedule": None,
        "source": {"type": "delta", "table": upstream.sinks[0].path,
                   "schema": {"ad_id": "string", "event_time": "timestamp"}, "required": ["ad_id"]},
        "transform": "tests.integration.chain_transforms.views_per_ad",
        "sinks": [{"name": "views", "mode": "aggregate", "keys": ["ad_id"], "sums": ["views"],
                   "path": f"{Path(upstream.sinks[0].path).parents[2]}/chain_down/tables/views"}],
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
