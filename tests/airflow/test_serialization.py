"""A DAG gets a new version only when its spec or code changes: the serialized form Airflow
hashes to decide (``SerializedDagModel.hash``) is the same in every parse, whatever the
process (hash seed, working directory, time), and differs once the spec changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from sluice.paths import project_root

PROBE = """
import json, runpy, sys
from airflow.models.serialized_dag import SerializedDagModel
from airflow.serialization.serialized_objects import DagSerialization
hashes = {}
for path in sys.argv[1:]:
    for name, obj in runpy.run_path(path).items():
        if name.startswith("dag_") and obj is not None:  # sluice_alerts: None without alerts
            hashes[obj.dag_id] = SerializedDagModel.hash(DagSerialization.to_dict(obj))
print(json.dumps(hashes))
"""


def parse_hashes(cwd: Path, seed: str) -> dict[str, str]:
    dags = project_root() / "dags"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", PROBE, str(dags / "sluice_pipelines.py"),
                          str(dags / "sluice_operations.py")], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_parsing_twice_gives_the_same_version_and_a_spec_change_a_new_one(tmp_path):
    first = parse_hashes(project_root(), "1")
    second = parse_hashes(tmp_path, "2")
    assert {"ysb", "ysb_clean", "sluice_rollback", "sluice_recover", "sluice_skip_file"} <= set(first)
    assert first == second, "nothing changed, yet the serialized DAGs differ"
    spec_path = Path(os.environ["SLUICE_PIPELINES_DIR"]) / "ysb.yaml"
    original = spec_path.read_text()
    try:
        raw = yaml.safe_load(original)
        raw["control"]["epoch_files"] = raw["control"]["epoch_files"] + 1
        spec_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        changed = parse_hashes(project_root(), "1")
    finally:
        spec_path.write_text(original)
    assert changed["ysb"] != first["ysb"] and changed["ysb_clean"] == first["ysb_clean"]


BAG = """
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=__import__("sys").argv[1])
errors = {k.rsplit("/", 1)[-1]: v for k, v in bag.import_errors.items()}
print(json.dumps({"dags": sorted(bag.dag_ids), "errors": errors}))
"""


def test_pipelines_that_write_the_same_table_are_an_import_error_and_the_others_load(tmp_path):
    """Airflow parses the DAG folder: two specs pointing at one `_rejected` table get no DAG and
    an import error naming both files; the third pipeline's DAG loads."""
    shipped = yaml.safe_load((project_root() / "include" / "pipelines" / "ysb.yaml").read_text())
    for name in ("orders", "refunds", "stock"):
        raw = {**shipped, "name": name, "sinks": [{**shipped["sinks"][0], "path": f"/data/tables/{name}/out"}]}
        if name != "stock":
            raw["rejected_path"] = "/data/tables/_rejected"
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "SLUICE_PIPELINES_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", BAG, str(project_root() / "dags")], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    bag = json.loads(out.stdout.strip().splitlines()[-1])
    assert "stock" in bag["dags"] and not {"orders", "refunds"} & set(bag["dags"])
    error = bag["errors"]["sluice_spec_errors.py"]
    assert "pipelines orders, refunds all write the Delta table /data/tables/_rejected" in error
    assert str(tmp_path / "orders.yaml") in error and str(tmp_path / "refunds.yaml") in error
