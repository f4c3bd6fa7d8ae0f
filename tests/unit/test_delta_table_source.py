"""The Delta-table source without Spark: an upstream table's ``_delta_log`` written by hand
(commit files as Delta writes them), a real epoch store on SQLite. What is registered, the
backlog, and every refusal: an upstream RESTORE that undid registered versions (until they are
skipped on purpose), a vacuumed file, a version cleaned from the log, rows removed."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sluice.errors import SourceError, SpecError
from sluice.protocol.leases import acquire_lease
from sluice.protocol.operations import skip_entry
from sluice.protocol.planning import plan_group
from sluice.sources import source_for
from sluice.sources.delta_table import DeltaTableSource
from sluice.spec import load_spec
from sluice.store import EpochStore

T0 = 1_767_225_600  # commit times, seconds


def commit(table: Path, version: int, operation: str = "WRITE", *, adds: int = 1, removes: int = 0,
           restored_to: int | None = None, meta: dict | None = None) -> None:
    """One commit file as Delta writes it: commitInfo (``meta``: the userMetadata sluice writes),
    then add (and remove) actions."""
    log = table / "_delta_log"
    log.mkdir(parents=True, exist_ok=True)
    params = {"version": restored_to} if restored_to is not None else {"mode": "Append"}
    lines = [{"commitInfo": {"timestamp": (T0 + version) * 1000, "operation": operation,
                             "operationParameters": params}}]
    if meta is not None:
        lines[0]["commitInfo"]["userMetadata"] = json.dumps(meta)
    for i in range(adds):
        name = f"part-{version:05d}-{i}.snappy.parquet"
        (table / name).write_bytes(b"x" * (100 + version))
        lines.append({"add": {"path": name, "size": 100 + version, "partitionValues": {}, "dataChange": True}})
    lines += [{"remove": {"path": f"gone-{i}.parquet", "dataChange": True}} for i in range(removes)]
    (log / f"{version:020d}.json").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


@pytest.fixture
def setup(tmp_path):
    upstream = tmp_path / "up"
    spec_path = tmp_path / "pipelines" / "down.yaml"
    spec_path.parent.mkdir()
    spec_path.write_text(textwrap.dedent(f"""\
        source:
          type: delta
          table: {upstream}
          schema:
            ad_id: string
        transform: ysb.views
        sinks:
          - name: out
            mode: append
            path: {tmp_path / "down" / "out"}
        """))
    spec = load_spec(spec_path)
    log = EpochStore(f"sqlite:///{tmp_path / 'store.db'}")
    yield upstream, spec, log
    log.close()


def registered(log: EpochStore, spec) -> list[str]:
    return [e.path.rsplit("@", 1)[1] for e in log.manifest(spec.name)]


def test_each_version_that_changed_data_is_one_entry_oldest_first(setup):
    upstream, spec, log = setup
    source = source_for(spec, log)
    assert isinstance(source, DeltaTableSource)
    with pytest.raises(SourceError, match="no Delta table there"):
        source.discover()
    commit(upstream, 0, "CREATE TABLE", adds=0)
    commit(upstream, 1, adds=2)
    commit(upstream, 2, "OPTIMIZE", adds=1, removes=2)  # no data change: not read
    commit(upstream, 3)
    backlog = source.backlog()
    assert (backlog.files, backlog.bytes) == (2, 2 * 101 + 103), backlog
    assert log.manifest(spec.name) == [], "a backlog poll registers nothing"
    assert source.discover() == 2
    assert registered(log, spec) == ["1", "3"]
    assert [e.mtime for e in log.manifest(spec.name)] == [T0 + 1, T0 + 3]
    commit(upstream, 4)
    assert source.discover() == 3 and registered(log, spec) == ["1", "3", "4"]
    assert source.describe(log.manifest(spec.name)) == {"table": str(upstream), "versions": [1, 3, 4],
                                                        "skipped": []}
    assert [e.position for e in source.check_retained(0, 3)] == [0, 1, 2]


def test_an_upstream_restore_stops_the_pipeline_until_the_undone_versions_are_skipped(setup):
    upstream, spec, log = setup
    source = source_for(spec, log)
    for v in range(4):
        commit(upstream, v)
    source.discover()  # versions 0..3
    commit(upstream, 4, "RESTORE", adds=0, restored_to=1)  # the upstream rolled back: 2 and 3 are undone
    commit(upstream, 5)
    with pytest.raises(SourceError) as stopped:
        source.discover()
    message = str(stopped.value)
    assert "restored to version 1" in message and "undoing versions [2, 3]" in message, message
    assert f"delta://{upstream}@2" in message and "skip" in message and "epoch" not in message, message
    with pytest.raises(SourceError, match="undoing versions"):
        source.check_retained(0, 2)
    assert registered(log, spec) == ["0", "1", "2", "3"], "nothing registered while stopped"
    for v in (2, 3):
        skip_entry(log, spec.name, f"delta://{upstream}@{v}", by="test", reason="upstream restore")
    assert source.discover() == 5 and registered(log, spec) == ["0", "1", "2", "3", "5"]


def test_versions_undone_before_they_were_registered_are_never_read(setup):
    upstream, spec, log = setup
    for v in range(3):
        commit(upstream, v)
    commit(upstream, 3, "RESTORE", adds=0, restored_to=0)
    commit(upstream, 4)
    source = source_for(spec, log)
    source.discover()
    assert registered(log, spec) == ["0", "4"]


def test_only_versions_the_upstream_published_are_registered(setup):
    """Issue 37 item 6: the upstream (a sluice pipeline of the same store) commits group 0's
    version and its driver dies before the store publishes it. The downstream polls then: the
    version waits (today it was registered, and the upstream's rerun RESTORE then halted the
    downstream until an operator skipped it). The rerun RESTOREs it and writes the group again;
    once published, that version is registered, and nothing needs a skip."""
    upstream, spec, log = setup
    up = "up"
    log.register_files(up, [(f"/landing/f{i}.json", 100, 1000.0 + i) for i in range(4)])
    lease = acquire_lease(log, up, "run-1")
    group = plan_group(log, lease, epoch_size=4, k=1)
    assert group is not None
    meta = {"pipeline": up, "sink": "out", "generation": group.epochs[0].generation,
            "epochs": [[e.epoch_id, e.start, e.end] for e in group.epochs], "token": lease.fence}
    commit(upstream, 0, "CREATE TABLE", adds=0)
    commit(upstream, 1, meta=meta)  # the crashed attempt's commit: never published
    source = source_for(spec, log)
    source.discover()
    assert registered(log, spec) == [] and source.backlog().files == 0, "an unpublished version waits"
    # the upstream's rerun: RESTORE the crashed attempt's version, write the group again, publish
    commit(upstream, 2, "RESTORE", adds=0, restored_to=0, meta={**meta, "restore_to": 0})
    commit(upstream, 3, meta=meta)
    source.discover()
    assert registered(log, spec) == [], "committed in Delta, not published in the store yet: it waits"
    for e in group.epochs:
        log.mark_committed(lease, [(e, {"out": 3}, {}, {"epoch_s": 0.1}, None)])
    log.finish_group(lease, group.group_id)
    source.discover()
    assert registered(log, spec) == ["3"]
    # a later group, published: registered after it, in order
    commit(upstream, 4, meta={**meta, "epochs": [[1, 4, 8]]})
    source.discover()
    assert registered(log, spec) == ["3"], "epoch 1 is not even planned upstream: version 4 waits"


def test_an_upstream_this_store_does_not_know_is_read_as_its_log_says(setup):
    """Versions sluice wrote for a pipeline of another store: nothing to hold them to, so they
    are registered as committed (what a chained pipeline across stores has always done)."""
    upstream, spec, log = setup
    meta = {"pipeline": "elsewhere", "sink": "out", "generation": 1, "epochs": [[0, 0, 4]], "token": 1}
    commit(upstream, 0, "CREATE TABLE", adds=0)
    commit(upstream, 1, meta=meta)
    source_for(spec, log).discover()
    assert registered(log, spec) == ["1"]


def test_a_range_that_cannot_be_read_again_is_refused_naming_the_version(setup):
    upstream, spec, log = setup
    source = source_for(spec, log)
    for v in range(3):
        commit(upstream, v)
    commit(upstream, 3, "DELETE", adds=1, removes=1)
    source.discover()
    (upstream / "part-00001-0.snappy.parquet").unlink()  # VACUUM
    with pytest.raises(SourceError, match=r"data file\(s\) version 1 added are gone .*@1"):
        source.check_retained(0, 3)
    (upstream / "_delta_log" / f"{0:020d}.json").unlink()  # log retention
    with pytest.raises(SourceError, match=r"version 0 .* no longer in the upstream's log"):
        source.check_retained(0, 1)
    with pytest.raises(SourceError, match=r"version 3 \(DELETE\) removed rows; .*change_feed"):
        source.check_retained(3, 4)


def test_a_pipeline_cannot_read_its_own_sink(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text(textwrap.dedent(f"""\
        source: {{type: delta, table: {tmp_path / 't'}, schema: {{a: string}}}}
        transform: ysb.views
        sinks: [{{name: out, mode: append, path: {tmp_path / 't'}}}]
        """))
    with pytest.raises(SpecError, match="cannot read its own output"):
        load_spec(path)
