"""Unit tests of ``sluice.sources.FileSource`` discovery, backlog and retention checks (no Spark)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

_PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice import boundary  # noqa: E402
from sluice.errors import SourceError  # noqa: E402
from sluice.protocol.leases import acquire_lease  # noqa: E402
from sluice.protocol.planning import plan_group  # noqa: E402
from sluice.sources import FileSource  # noqa: E402
from sluice.sources.files import Sighting, settled  # noqa: E402
from sluice.spec import load_spec  # noqa: E402
from sluice.store import EpochStore  # noqa: E402

NAME = "landing_test"
T0 = 1_700_000_000.0  # a fixed mtime base, long ago


@pytest.fixture(autouse=True)
def real_clock(monkeypatch) -> None:
    """The host's own clock, whatever an earlier test in this process left installed (the
    simulation's virtual one): a file's settling is judged by it."""
    monkeypatch.setattr(boundary, "CLOCK", None)


@pytest.fixture
def landing(tmp_path: Path) -> Path:
    folder = tmp_path / "landing"
    folder.mkdir()
    return folder


@pytest.fixture
def spec(tmp_path: Path, landing: Path):
    path = tmp_path / "specs" / f"{NAME}.yaml"
    path.parent.mkdir()
    path.write_text(f"""\
source:
  path: {landing}
  format: json
  pattern: "*.json"
  schema: {{id: string, n: long}}
transform: demo.clean
sinks:
  - name: out
    mode: append
    path: {tmp_path}/tables/out
""")
    return load_spec(path)


@pytest.fixture
def log(tmp_path: Path):
    store = EpochStore(f"sqlite:///{tmp_path}/s.db")
    yield store
    store.close()


@pytest.fixture
def source(spec, log) -> FileSource:
    return FileSource(spec, log)


def land(folder: Path, name: str, mtime: float, content: str = '{"id": "a", "n": 1}\n') -> str:
    path = folder / name
    path.write_text(content)
    os.utime(path, (mtime, mtime))
    return os.path.abspath(path)


def names(listing) -> list[str]:
    return [Path(p).name for p, _, _ in listing]


def test_spec_points_at_tmp_landing(spec, landing):
    assert spec.landing_dir == landing
    assert spec.name == NAME


def test_discovery_order_is_mtime_then_path(source, landing):
    land(landing, "c.json", T0 + 20)
    land(landing, "a.json", T0 + 30)
    land(landing, "d.json", T0 + 10)
    land(landing, "b.json", T0 + 10)  # same mtime as d: path breaks the tie
    listing = source.list_folder()
    assert names(listing) == ["b.json", "d.json", "c.json", "a.json"]
    assert listing[0] == (str(landing / "b.json"), len('{"id": "a", "n": 1}\n'), T0 + 10)
    assert all(os.path.isabs(p) for p, _, _ in listing)


def test_hidden_and_non_matching_files_are_ignored(source, landing):
    land(landing, "ok.json", T0)
    land(landing, ".in_flight.json", T0)
    land(landing, "_tmp.json", T0)
    land(landing, "notes.txt", T0)
    land(landing, "data.json.crc", T0)
    (landing / "sub.json").mkdir()  # a folder matching the pattern is not a file
    assert names(source.list_folder()) == ["ok.json"]


def test_discover_registers_in_order_and_keeps_positions(source, log, landing):
    land(landing, "b.json", T0 + 2)
    land(landing, "a.json", T0 + 1)
    assert source.discover() == 2
    # A file that lands later but carries an older mtime is appended: positions never change.
    land(landing, "old.json", T0)
    land(landing, "new.json", T0 + 3)
    assert source.discover() == 4
    assert [Path(e.path).name for e in log.manifest(NAME)] == ["a.json", "b.json", "old.json", "new.json"]
    assert [e.position for e in log.manifest(NAME)] == [0, 1, 2, 3]
    assert source.discover() == 4  # idempotent


def test_backlog_counts_files_bytes_and_oldest_age(source, landing):
    now = time.time()
    land(landing, "a.json", now - 100, "x" * 10)
    land(landing, "b.json", now - 50, "y" * 32)
    land(landing, ".hidden.json", now - 1000, "z" * 7)
    backlog = source.backlog()
    assert backlog.files == 2
    assert backlog.bytes == 42
    assert 100 <= backlog.oldest_age_s < 160
    assert backlog.next_offset == 0
    assert backlog.as_dict() == {"files": 2, "bytes": 42, "oldest_age_s": backlog.oldest_age_s, "next_offset": 0,
                                 "refused": []}


def test_backlog_is_read_only(source, log, landing):
    land(landing, "a.json", T0)
    land(landing, "b.json", T0 + 1)
    assert source.backlog().files == 2
    assert len(log.manifest(NAME)) == 0
    assert log.known_files(NAME) == set()
    assert source.backlog().files == 2  # polling again changes nothing either


def test_empty_backlog(source):
    backlog = source.backlog()
    assert (backlog.files, backlog.bytes, backlog.oldest_age_s, backlog.next_offset) == (0, 0, None, 0)


def test_backlog_excludes_planned_files_and_counts_registered_and_new(source, log, landing):
    for i in range(5):
        land(landing, f"f{i}.json", T0 + i, "x" * (i + 1))
    source.discover()
    lease = acquire_lease(log, NAME, "run-1")
    plan_group(log, lease, epoch_size=2, k=1)  # plans f0, f1
    land(landing, "g.json", T0 + 10, "x" * 100)  # landed, not registered yet
    backlog = source.backlog()
    assert backlog.next_offset == 2
    assert backlog.files == 4  # f2, f3, f4 (registered, unplanned) + g (new)
    assert backlog.bytes == 3 + 4 + 5 + 100


def test_check_retained_returns_entries_when_unchanged(source, landing):
    for i in range(3):
        land(landing, f"f{i}.json", T0 + i)
    source.discover()
    entries = source.check_retained(0, 3)
    assert [e.position for e in entries] == [0, 1, 2]
    assert [Path(e.path).name for e in source.check_retained(1, 2)] == ["f1.json"]


def test_check_retained_deleted_file(source, landing):
    land(landing, "f0.json", T0)
    gone = land(landing, "f1.json", T0 + 1)
    source.discover()
    os.remove(gone)
    source.check_retained(0, 1)  # the other file is fine
    with pytest.raises(SourceError) as info:
        source.check_retained(0, 2)
    message = str(info.value)
    assert repr(NAME) in message
    assert gone in message
    assert "offset 1" in message and "no longer in the landing folder" in message


def test_check_retained_changed_size(source, landing):
    path = land(landing, "f0.json", T0, "x" * 10)
    source.discover()
    with open(path, "a") as fh:
        fh.write("appended\n")
    with pytest.raises(SourceError) as info:
        source.check_retained(0, 1)
    message = str(info.value)
    assert repr(NAME) in message and path in message
    assert "size 10 -> 19 bytes" in message and "must be immutable" in message


def test_check_retained_rewritten_same_size(source, landing):
    path = land(landing, "f0.json", T0, "x" * 10)
    source.discover()
    with open(path, "w") as fh:
        fh.write("y" * 10)
    os.utime(path, (T0 + 60, T0 + 60))
    with pytest.raises(SourceError, match="must be immutable"):
        source.check_retained(0, 1)


def test_check_retained_replaced_by_folder(source, landing):
    path = land(landing, "f0.json", T0)
    source.discover()
    os.remove(path)
    os.mkdir(path)  # unreadable as a file (IsADirectoryError), even for root
    with pytest.raises(SourceError, match="cannot read file") as info:
        source.check_retained(0, 1)
    assert repr(NAME) in str(info.value) and path in str(info.value)


def test_range_beyond_manifest_is_an_incomplete_store(source, landing):
    land(landing, "f0.json", T0)
    source.discover()
    with pytest.raises(SourceError, match=r"manifest holds 1 entries for offsets \[0, 3\)"):
        source.check_retained(0, 3)


@pytest.mark.parametrize("call", ["list_folder", "discover", "backlog"])
def test_missing_landing_folder(source, spec, landing, call):
    landing.rmdir()
    with pytest.raises(SourceError) as info:
        getattr(source, call)()
    message = str(info.value)
    assert repr(NAME) in message
    assert str(landing) in message
    assert spec.path in message  # where to fix source.path


def test_a_symbolic_link_out_of_the_landing_folder_is_refused_and_reported(source, landing, tmp_path, caplog):
    land(landing, "a.json", 1000.0)
    land(landing, "b.json", 1001.0)
    os.symlink(landing / "b.json", landing / "c.json")  # within the folder: read like any file
    secret = tmp_path / "elsewhere" / "secret.json"
    secret.parent.mkdir()
    secret.write_text('{"id": "x", "n": 1}\n')
    os.symlink(secret, landing / "d.json")
    os.symlink("../elsewhere/secret.json", landing / "e.json")  # relative, leading out all the same
    with caplog.at_level("WARNING", logger="sluice.sources.files"):
        listing = source.list_folder()
        source.list_folder()  # unchanged: reported once, not at every poll
    assert names(listing) == ["a.json", "b.json", "c.json"]
    assert [r.split(" is ")[0] for r in source.refused] == [str(landing / "d.json"), str(landing / "e.json")]
    assert all(str(secret) in r for r in source.refused)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("outside the landing folder" in w for w in warnings), warnings
    backlog = source.backlog()
    assert backlog.files == 3 and len(backlog.as_dict()["refused"]) == 2
    source.discover()
    assert str(secret) not in {e.path for e in source.store.manifest(source.spec.name)}


def test_a_file_landed_again_with_new_content_is_new_data_kept_as_a_copy(source, log, landing, caplog):
    first = '{"id": "a", "n": 1}\n'
    land(landing, "daily.json", T0, first)
    assert source.discover() == 1
    second = '{"id": "b", "n": 2}\n{"id": "c", "n": 3}\n'
    land(landing, "daily.json", T0 + 86400, second)  # the same name, new content
    backlog = source.backlog()  # the first content (registered, not planned yet) and the new one
    assert (backlog.files, backlog.bytes) == (2, len(first) + len(second)), backlog
    with caplog.at_level("WARNING", logger="sluice.sources.files"):
        assert source.discover() == 2
    entries = log.manifest(NAME)
    assert entries[0].path == str(landing / "daily.json")
    kept = Path(entries[1].path)
    assert kept.parent == landing / "_sluice" / "relanded" and kept.suffix == ".json"
    assert kept.read_text() == second and (entries[1].size, entries[1].mtime) == (len(second), T0 + 86400)
    assert "landed again with new content" in caplog.text
    assert source.discover() == 2 and source.backlog().files == 2, "unchanged now: nothing new"
    assert names(source.list_folder()) == ["daily.json"], "the kept copies are not listed as landed files"
    assert source.check_retained(1, 2)[0].path == str(kept), "the copy reads back as it was"
    with pytest.raises(SourceError, match=r"changed after it was discovered.*Landed again"):
        source.check_retained(0, 1)  # the first content is gone
    third = '{"id": "d", "n": 4}\n'
    land(landing, "daily.json", T0 + 2 * 86400, third)
    assert source.discover() == 3 and Path(log.manifest(NAME)[2].path).read_text() == third
    land(landing, "daily.json", T0 + 86400, second)  # an old version back again: seen already
    assert source.discover() == 3


@pytest.mark.parametrize("link", ["_sluice", "_sluice/relanded"])
def test_a_relanded_copy_is_never_written_through_a_symbolic_link(source, log, landing, tmp_path, link):
    """An uploader links ``_sluice`` (or its ``relanded``) to the DAGs folder, lands ``job.json``
    and lands it again with new content: the copy would put the uploader's content there."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (landing / link).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(dags, landing / link)
    path = land(landing, "job.json", T0, '{"id": "a", "n": 1}\n')
    assert source.discover() == 1
    land(landing, "job.json", T0 + 60, '{"id": "b", "n": 2}\n')
    with pytest.raises(SourceError) as info:
        source.discover()
    message = str(info.value)
    assert repr(NAME) in message and path in message, message
    assert f"{landing / link} is a symbolic link" in message, message
    assert list(dags.rglob("*")) == [], "nothing is written where the link leads"
    assert len(log.manifest(NAME)) == 1


def test_a_link_planted_where_the_copy_is_written_is_replaced_not_followed(source, log, landing, tmp_path):
    """The copy's temporary name is predictable (modification time and size): a link planted
    there is removed, and the copy is written in ``_sluice/relanded`` all the same."""
    outside = tmp_path / "dags" / "evil.json"
    outside.parent.mkdir()
    land(landing, "job.json", T0)
    assert source.discover() == 1
    content = '{"id": "b", "n": 2}\n'
    land(landing, "job.json", T0, content)
    mtime_ns = 1_700_000_060_000_000_000
    os.utime(landing / "job.json", ns=(mtime_ns, mtime_ns))
    kept = landing / "_sluice" / "relanded"
    kept.mkdir(parents=True)
    os.symlink(outside, kept / f".job.relanded-{mtime_ns}-{len(content)}.json.tmp")
    assert source.discover() == 2
    assert not outside.exists(), "nothing is written where the link leads"
    copy = Path(log.manifest(NAME)[1].path)
    assert copy.parent == kept and not copy.is_symlink() and copy.read_text() == content


def test_a_file_written_in_chunks_across_polls_is_registered_once_settled_with_its_final_size(
        source, log, landing, monkeypatch):
    clock = [T0 + 1000.0]
    monkeypatch.setattr(boundary, "CLOCK", lambda: clock[0])  # the source's "now", as the simulation sets it
    settle_s = source.spec.source.settle_s
    path = landing / "upload.json"
    chunks = ['{"id": "a", "n": 1}\n', '{"id": "b", "n": 2}\n', '{"id": "c", "n": 3}\n']
    for chunk in chunks:  # one chunk per poll, each less than settle_s after the last
        with open(path, "a") as fh:
            fh.write(chunk)
        os.utime(path, (clock[0], clock[0]))
        assert source.discover() == 0 and source.backlog().files == 0
        clock[0] += settle_s / 2
    assert source.discover() == 0, "written less than settle_s ago"
    clock[0] += settle_s / 2
    assert source.backlog().files == 1 and source.discover() == 1
    assert source.discover() == 1, "registered once"
    [entry] = log.manifest(NAME)
    assert (entry.path, entry.size) == (str(path), len("".join(chunks)))
    assert source.read_bytes(entry) == "".join(chunks).encode()
    assert not (landing / "_sluice").exists(), "no copy of an earlier size"


def test_a_file_dated_ahead_of_the_clock_settles_across_the_polls_of_one_source(source, log, landing, monkeypatch):
    clock = [T0]
    monkeypatch.setattr(boundary, "CLOCK", lambda: clock[0])
    land(landing, "ahead.json", T0 + 3600)  # its writer's clock is an hour ahead
    assert source.discover() == 0
    clock[0] += source.spec.source.settle_s
    assert FileSource(source.spec, log).discover() == 0, "another process: the modification time alone decides"
    assert source.discover() == 1, "unchanged across polls for settle_s"


@pytest.mark.parametrize(("mtime", "seen", "settle_s", "expected"), [
    (990.0, None, 5.0, True),  # unchanged for 10 s, as its modification time says
    (997.0, None, 5.0, False),  # modified 3 s ago
    (997.0, None, 0.0, True),  # settle_s 0: at once
    (990.0, Sighting(10, 990.0, 999.0), 5.0, True),  # seen before, unchanged
    (990.0, Sighting(9, 990.0, 990.0), 5.0, False),  # grew since the previous poll, whatever its mtime
    (990.0, Sighting(10, 980.0, 990.0), 5.0, False),  # rewritten since the previous poll
    (1100.0, None, 5.0, False),  # dated ahead of this host's clock: not known to be quiet yet
    (1100.0, Sighting(10, 1100.0, 994.0), 5.0, True),  # ... but unchanged across polls for 6 s
    (1100.0, Sighting(10, 1100.0, 997.0), 5.0, False),  # ... for 3 s only
])
def test_the_settle_rule(mtime, seen, settle_s, expected):
    assert settled(10, mtime, 1000.0, settle_s, seen) is expected


def test_read_bytes_gives_the_registered_bytes_or_names_a_file_that_changed(source, log, landing):
    path = land(landing, "f0.json", T0, "x" * 10)
    source.discover()
    [entry] = source.check_retained(0, 1)
    assert source.read_bytes(entry) == b"x" * 10
    with open(path, "a") as fh:
        fh.write("appended\n")
    os.utime(path, (T0, T0))  # the modification time kept: the size tells
    with pytest.raises(SourceError) as info:
        source.read_bytes(entry)
    assert repr(NAME) in str(info.value) and path in str(info.value) and "size 10 -> 19 bytes" in str(info.value)
