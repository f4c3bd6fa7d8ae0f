"""Unit tests of the table-side records (``sluice.store.records``): the version header, records
of earlier releases, refusals that name the file (no Spark, no Airflow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

_PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice.delta.spark import LocalFiles  # noqa: E402
from sluice.store import records  # noqa: E402

FILES = LocalFiles()


def epoch_fields(epoch_id: int, generation: int = 0, start: int | None = None, files: int = 2) -> dict:
    start = epoch_id * files if start is None else start
    return {"pipeline": "p", "epoch_id": epoch_id, "generation": generation, "group_id": 0, "start": start,
            "end": start + files, "state": "published", "sink": "out", "version": 3,
            "files": [[f"/landing/f{start + i}.json", 10 + i, 100.5 + i] for i in range(files)]}


def test_an_epoch_record_round_trips_under_its_version_header(tmp_path):
    table = tmp_path / "out"
    path = records.write_epoch(FILES, table, epoch_fields(4, generation=2))
    assert path == table / "_sluice" / "epochs" / "000000004-g2.json"
    body = json.loads(path.read_text())
    assert list(body)[:2] == ["record", "format"] and body["record"] == "epoch" and body["format"] == records.FORMAT
    assert not list(path.parent.glob(".*")), "no temporary file left behind"
    [record], rollbacks = records.read(FILES, [str(table)])
    assert rollbacks == []
    assert (record.epoch_id, record.generation, record.start, record.end) == (4, 2, 8, 10)
    assert record.files == (("/landing/f8.json", 10, 100.5), ("/landing/f9.json", 11, 101.5))
    assert "format" not in record.fields and record.fields["sink"] == "out"


def test_records_without_a_header_are_read_as_written_by_earlier_releases(tmp_path):
    table = tmp_path / "out"
    folder = table / "_sluice" / "epochs"
    folder.mkdir(parents=True)
    (folder / "000000000-g0.json").write_text(json.dumps(epoch_fields(0), sort_keys=True))
    (table / "_sluice" / "rollbacks").mkdir()
    (table / "_sluice" / "rollbacks" / "g1.json").write_text(json.dumps({"generation": 1, "to_epoch": 0}))
    [record], [rollback] = records.read(FILES, [str(table)])
    assert record.epoch_id == 0 and rollback.restored_to_epoch == 0 and rollback.undoes(record)


def test_a_record_of_a_newer_format_is_refused_with_its_file(tmp_path):
    table = tmp_path / "out"
    path = records.write_epoch(FILES, table, epoch_fields(0))
    path.write_text(json.dumps(dict(json.loads(path.read_text()), format=records.FORMAT + 1)))
    with pytest.raises(records.RecordError, match=rf"{path}.*format {records.FORMAT + 1}"):
        records.read(FILES, [str(table)])


@pytest.mark.parametrize("text, message", [
    ('{"record": "epoch", "format": 1, "epoch_id": 0', "cannot be read"),  # a truncated copy
    ("[1, 2]", "not a JSON object"),
    ('{"record": "epoch", "format": 1, "epoch_id": 0}', "missing or malformed field"),
    ('{"record": "rollback", "format": 1, "generation": 1, "to_epoch": 0}', "'rollback' record in the epochs"),
])
def test_a_damaged_record_is_refused_with_its_file(tmp_path, text, message):
    folder = tmp_path / "out" / "_sluice" / "epochs"
    folder.mkdir(parents=True)
    (folder / "000000000-g0.json").write_text(text)
    with pytest.raises(records.RecordError, match=message) as raised:
        records.read(FILES, [str(tmp_path / "out")])
    assert str(folder / "000000000-g0.json") in str(raised.value)


def test_a_rollback_into_a_group_commit_undoes_from_where_its_restore_went(tmp_path):
    """``to_epoch`` 3 fell inside the group commit of epochs 2..4: the RESTORE went to before
    epoch 2, so the rebuilt store must not keep epoch 2's record of the old generation."""
    table = tmp_path / "out"
    for epoch_id in range(5):
        records.write_epoch(FILES, table, epoch_fields(epoch_id))
    records.write_rollback(FILES, table, {"generation": 1, "to_epoch": 3, "restored_to_epoch": 2})
    for epoch_id in (2, 3):  # recomputed in generation 1; epoch 4 not yet
        records.write_epoch(FILES, table, epoch_fields(epoch_id, generation=1))
    epochs, rollbacks = records.read(FILES, [str(table)])
    assert [(r.epoch_id, r.generation) for r in records.live(epochs, rollbacks)] == [(0, 0), (1, 0), (2, 1), (3, 1)]
