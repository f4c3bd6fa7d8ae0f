"""Unit tests of where the shadow rollback preview deletes (``sluice.preview``; no Spark): only
its own folders, whatever a run id or a report read back holds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

_PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice import preview  # noqa: E402
from sluice.errors import SluiceError  # noqa: E402

PIPELINE = "preview_paths"


@pytest.fixture
def data(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def plant_report(root: Path, name: str, preview_id: str, created_at: float) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.json").write_text(json.dumps({"pipeline": PIPELINE, "preview_id": preview_id,
                                                   "created_at": created_at}))


@pytest.mark.parametrize("run_id", ["manual__2026-01-01T00:00:00+00:00", "../../..", "..", "a/../../b", ""])
def test_a_preview_folder_is_a_child_of_the_pipelines_previews_folder(data, run_id):
    folder = preview.preview_folder(PIPELINE, run_id)
    assert folder.parent == data / "previews" / PIPELINE and folder.name not in ("", ".", "..")


def test_pruning_old_previews_never_deletes_outside_the_previews_folder(data):
    """A report whose id climbs out (written by an earlier release, or planted) is pruned as the
    oldest: its id's folder, resolved, would be ``<data>/victim``."""
    victim = data / "victim"
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("not a preview")
    root = data / "previews" / PIPELINE
    plant_report(root, "planted", "../../victim", created_at=1.0)
    for n in range(preview.KEEP):
        plant_report(root, f"p{n}", f"p{n}", created_at=10.0 + n)
        (root / f"p{n}").mkdir()
    report = preview.ShadowPreview(PIPELINE, "newest", to_epoch=0, created_at=100.0)
    preview._save(report, preview.preview_folder(PIPELINE, report.preview_id))
    assert (victim / "keep.txt").read_text() == "not a preview"
    assert not (root / "p0").exists() and not (root / "p0.json").exists(), "the oldest real preview is pruned"


def test_removing_refuses_a_folder_outside_or_a_link(data, tmp_path):
    root = data / "previews" / PIPELINE
    root.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("x")
    os.symlink(elsewhere, root / "linked")
    for folder in (root / ".." / ".." / ".." / "elsewhere", root / "linked", root, data):
        with pytest.raises(SluiceError, match=repr(PIPELINE)):
            preview.remove_preview(PIPELINE, folder)
    assert (elsewhere / "keep.txt").exists()
    with pytest.raises(SluiceError, match="not a pipeline name"):
        preview.previews_dir("../etc")


def test_a_saved_report_keeps_the_run_id_it_was_given(data):
    """The console finds a run's preview by the run id it triggered (``manual__...+00:00``): the
    report holds that id as given; only its folder and file names are made safe. (Sanitising
    the id itself left the console waiting for a preview that had been saved.)"""
    run_id = "manual__2026-11-27T10:28:04.848051+00:00"
    report = preview.ShadowPreview(PIPELINE, run_id, to_epoch=0, created_at=1.0)
    folder = preview.preview_folder(PIPELINE, run_id)
    preview._save(report, folder)
    assert [p["preview_id"] for p in preview.saved_previews(PIPELINE)] == [run_id]
    assert folder.with_name(f"{folder.name}.json").is_file() and ":" not in folder.name
