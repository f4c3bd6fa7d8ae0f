"""sluice installed as a package, used the way the deployment docs say (issue 18 item 1).

``pip install <this checkout>`` into a fresh virtualenv; a folder holding only a pipeline spec
and its transform; ``sluice init`` writes the DAG files into it and ``sluice jars`` fetches the
jars; then ``airflow standalone`` of that virtualenv with ``AIRFLOW__CORE__DAGS_FOLDER`` pointing
at the folder, in an environment with nothing of this checkout (no ``PYTHONPATH``, no
``SLUICE_*``, no plugins folder). The plugin must come from the package's entry point, the
pipeline's DAG from the folder, its spark-submit application from the installed package, and
the table must equal an oracle computed from the raw lines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.paths import PROJECT_ROOT
from tests.airflow import standalone

pytestmark = pytest.mark.package

SPEC = """\
description: orders of 10 or more, in cents
schedule: null
source:
  path: ${SLUICE_DATA_DIR}/orders/landing
  format: json
  pattern: "*.json"
  schema:
    id: string
    amount: long
  required: [id]
transform: orders.large
sinks:
  - name: large
    mode: append
    path: ${SLUICE_DATA_DIR}/orders/tables/large
control:
  adaptive: false
  epoch_files: 10
"""

TRANSFORM = '''\
from pyspark.sql import DataFrame, functions as F


def large(records: DataFrame, refs: dict) -> DataFrame:
    return records.where(F.col("amount") >= 10).select("id", "amount", (F.col("amount") * 100).alias("cents"))
'''


def land(landing: Path) -> list[Path]:
    """Five files of orders, with a line that is not JSON and a record without its required id."""
    landing.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(5):
        lines = [json.dumps({"id": f"o{f}-{i}", "amount": (i * 7 + f) % 23}) for i in range(40)]
        lines.insert(3, "{not json")
        lines.insert(9, json.dumps({"amount": 99}))
        path = landing / f"orders-{f}.json"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def oracle(paths: list[Path]) -> list[tuple[str, int, int]]:
    """The table from the raw lines, by plain json: valid records with an id and amount >= 10."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("id") is not None and record["amount"] >= 10:
                rows.append((record["id"], record["amount"], record["amount"] * 100))
    return sorted(rows)


def clean_env(venv: Path, home: Path, folder: Path) -> dict[str, str]:
    """What a new user's shell has: the virtualenv's bin first, Java, the Airflow home and DAGs
    folder, a Spark connection; nothing of this checkout."""
    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ["HOME"],
           "LANG": "C.UTF-8", "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(folder),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"})}
    for name in ("JAVA_HOME", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"])
    assert proc.returncode == 0, f"{command} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_pip_install_then_airflow_standalone_on_a_folder_of_specs(spark, tmp_path):
    venv, home, folder = tmp_path / "venv", tmp_path / "airflow", tmp_path / "dags"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # From a copy: pip builds in the source tree, and a sluice.egg-info left in plugins/ would
    # register the plugin a second time (its entry point) in every Airflow of the checkout.
    source = tmp_path / "source"
    (source / "plugins").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PROJECT_ROOT / name, source / name)
    shutil.copytree(PROJECT_ROOT / "plugins" / "sluice", source / "plugins" / "sluice",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SLUICE_")}
    run([str(venv / "bin" / "pip"), "install", "--quiet", str(source)], pip_env, timeout=1200)

    folder.mkdir()
    (folder / "orders.yaml").write_text(SPEC)
    (folder / "transforms").mkdir()
    (folder / "transforms" / "orders.py").write_text(TRANSFORM)
    env = clean_env(venv, home, folder)
    init = json.loads(run([str(venv / "bin" / "sluice"), "init"], env, timeout=120).stdout.splitlines()[-1])
    assert sorted(Path(p).name for p in init["written"]) == ["sluice_dags.py", "sluice_spec_errors.py"], init
    jars = json.loads(run([str(venv / "bin" / "sluice"), "jars"], env, timeout=600).stdout.splitlines()[-1])
    assert all(Path(p).parent == home / "sluice" / "jars" for p in jars["jars"]), jars
    # An installed sluice keeps its data under $AIRFLOW_HOME/sluice.
    raw = land(home / "sluice" / "orders" / "landing")

    server = standalone.start(home, base_env=env, airflow=str(venv / "bin" / "airflow"))
    try:
        client = server.client()
        standalone.wait_healthy(server, client)
        standalone.wait_for_dag(server, client, "orders", timeout=180)
        assert standalone.import_errors(client) == []
        for dag_id in ("sluice_rollback", "sluice_recover", "sluice_skip_file"):
            assert standalone.get_dag(client, dag_id) is not None, dag_id
        # The plugin is the installed package's entry point: there is no plugins folder.
        assert not (home / "plugins").exists() or not any((home / "plugins").iterdir())
        pipelines = client.get("/sluice/pipelines")
        assert pipelines.status_code == 200 and "orders" in pipelines.text, pipelines.text[:500]

        standalone.set_paused(client, "orders", False)
        r = client.post("/api/v2/dags/orders/dagRuns", json={"logical_date": None})
        assert r.status_code == 200, r.text
        run_id = r.json()["dag_run_id"]
        states = standalone.wait_for_run_state(server, client, "orders", run_id, timeout=600)
        assert states["run_group"] == "success", states
        step = client.get(f"/api/v2/dags/orders/dagRuns/{run_id}/taskInstances/run_group").json()
        application = json.dumps(step["rendered_fields"])
        assert str(venv) in application and "sluice/jobs/run_group.py" in application, application[:2000]
    finally:
        standalone.stop(server)

    rows = spark.read.format("delta").load(str(home / "sluice" / "orders" / "tables" / "large")).collect()
    assert sorted((r["id"], r["amount"], r["cents"]) for r in rows) == oracle(raw)
