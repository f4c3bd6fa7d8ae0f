"""The ``sluice`` command line: ``init`` writes the DAG files once and never overwrites a user's
edit unasked; a misused command ends with one line naming it and status 2."""

from __future__ import annotations

import json

from sluice.cli import DAG_FILES, main


def test_init_writes_the_dag_files_and_keeps_an_edited_one(tmp_path, capsys):
    assert main(["init", str(tmp_path)]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert sorted(p.rsplit("/", 1)[-1] for p in first["written"]) == sorted(DAG_FILES)
    for name, text in DAG_FILES.items():
        assert (tmp_path / name).read_text() == text
        compile(text, name, "exec")  # Airflow parses them as Python
        assert "airflow" in text.lower() and "dag" in text.lower()  # else safe mode skips the file

    (tmp_path / "sluice_dags.py").write_text("# mine\n")
    assert main(["init", str(tmp_path)]) == 0
    second = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [p.rsplit("/", 1)[-1] for p in second["kept (differs; --force replaces)"]] == ["sluice_dags.py"]
    assert (tmp_path / "sluice_dags.py").read_text() == "# mine\n"

    assert main(["init", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "sluice_dags.py").read_text() == DAG_FILES["sluice_dags.py"]


def test_a_misused_command_names_itself_and_exits_2(capsys):
    assert main(["run-group", "--pipeline", "ysb"]) == 2
    assert capsys.readouterr().err.startswith("sluice run-group: SluiceError: give exactly one of --group or --plan")


def test_an_unknown_pipeline_is_one_clear_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_PIPELINES_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")
    assert main(["skip-file", "--pipeline", "nope", "--file", "a.json", "--reason", "gone"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice skip-file: SpecError: no pipeline 'nope'") and str(tmp_path) in err, err
