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
        if name.startswith("dag_"):
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
