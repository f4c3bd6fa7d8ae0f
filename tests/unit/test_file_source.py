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

from sluice.errors import SourceError  # noqa: E402
from sluice.protocol.leases import acquire_lease  # noqa: E402
from sluice.protocol.planning import plan_group  # noqa: E402
from sluice.sources import FileSource  # noqa: E402
from sluice.spec import load_spec  # noqa: E402
from sluice.store import EpochStore  # noqa: E402

NAME = "landing_test"
T0 = 1_700_000_000.0  # a fixed mtime base, long ago


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
