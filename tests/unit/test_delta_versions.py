"""The Delta-table source's rules: which upstream versions are registered, and an upstream
RESTORE that undid registered versions (the pipeline must stop, naming the epoch)."""

from __future__ import annotations

import pytest

from sluice.errors import SourceError
from sluice.protocol import TableCommit
from sluice.sources.delta_versions import TableVersion, undone_by_restore, versions_to_register


def history(*ops: tuple[int, str] | tuple[int, str, int]) -> list[TableCommit]:
    """Commits newest first, from (version, operation[, restored_to]) oldest first."""
    return [TableCommit(version=v[0], operation=v[1], restored_to=v[2] if len(v) > 2 else None)
            for v in reversed(ops)]


UPSTREAM = history((0, "CREATE TABLE"), (1, "WRITE"), (2, "MERGE"), (3, "OPTIMIZE"), (4, "WRITE"))


def test_entry_paths_round_trip_and_a_foreign_path_is_refused():
    v = TableVersion("/data/tables/ysb_clean/campaign_views", 12)
    assert TableVersion.parse(v.path) == v
    with pytest.raises(SourceError, match="not a Delta table version"):
        TableVersion.parse("kafka://t/0/0-10")


def test_versions_that_changed_data_are_registered_oldest_first():
    assert versions_to_register("/t", UPSTREAM, None) == [1, 2, 4]
    assert versions_to_register("/t", UPSTREAM, 2) == [4]
    assert versions_to_register("/t", UPSTREAM, 4) == []


def test_versions_undone_before_registration_are_never_read():
    restored = history(*[(c.version, c.operation) for c in reversed(UPSTREAM)], (5, "RESTORE", 2), (6, "WRITE"))
    assert versions_to_register("/t", restored, None) == [1, 2, 6]  # 4 was undone by the RESTORE to 2
    assert versions_to_register("/t", restored, 2) == [6]


def test_a_restore_undoing_registered_versions_names_the_epoch_to_roll_back_to():
    restored = history(*[(c.version, c.operation) for c in reversed(UPSTREAM)], (5, "RESTORE", 1), (6, "WRITE"))
    found = undone_by_restore("/t", restored, registered=[1, 2, 4], epoch_of_version={1: 0, 2: 1, 4: 1})
    assert found is not None and found.undone == (2, 4) and found.first_epoch == 1 and found.restored_to == 1
    text = found.message("downstream")
    assert "restored to version 1" in text and "TO_EPOCH=1" in text and "versions [2, 4]" in text


def test_a_restore_that_undoes_nothing_registered_is_ignored():
    restored = history(*[(c.version, c.operation) for c in reversed(UPSTREAM)], (5, "RESTORE", 4))
    assert undone_by_restore("/t", restored, registered=[1, 2, 4], epoch_of_version={}) is None
    # Versions registered but not planned yet: the fix is to skip them, not a rollback.
    early = history((0, "CREATE TABLE"), (1, "WRITE"), (2, "WRITE"), (3, "RESTORE", 1))
    found = undone_by_restore("/t", early, registered=[1, 2], epoch_of_version={1: 0})
    assert found is not None and found.undone == (2,) and found.first_epoch is None
    assert "sluice_skip_file" in found.message("downstream")


def test_a_restore_undone_by_a_later_restore_stops_nothing():
    # 7 restores to 3 (undoing 4-6), 8 restores to 6: 4, 5 and 6 are in the table again.
    chain = history(*[(v, "WRITE") for v in range(7)], (7, "RESTORE", 3), (8, "RESTORE", 6), (9, "WRITE"))
    assert undone_by_restore("/t", chain, registered=[1, 4, 5, 6], epoch_of_version={}) is None
    assert versions_to_register("/t", chain, 6) == [9]
    deeper = history(*[(v, "WRITE") for v in range(7)], (7, "RESTORE", 3), (8, "RESTORE", 5))
    found = undone_by_restore("/t", deeper, registered=[1, 4, 5, 6], epoch_of_version={6: 2})
    assert found is not None and found.undone == (6,) and found.restore_version == 8 and found.first_epoch == 2


def test_versions_the_log_no_longer_holds_and_were_never_read_stop_registration():
    cleaned = [c for c in UPSTREAM if c.version >= 2]  # log retention left versions 2 on
    with pytest.raises(SourceError, match=r"no longer holds versions 0 to 1 .* Nothing was registered"):
        versions_to_register("/t", cleaned, None)
    with pytest.raises(SourceError, match="no longer holds versions 1 to 1"):
        versions_to_register("/t", cleaned, 0)
    assert versions_to_register("/t", cleaned, 1) == [2, 4]  # what was read last is cleaned: fine
