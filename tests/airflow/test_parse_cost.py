"""What every task pays before it runs: Airflow parses the DAG file in each task's own process
(plan, run, validate, checkpoint: four or more per group), so the sluice DAG files import nothing
heavy that a step does not need. Each of these cost 0.25-0.7 s of every task, and of the group's
coordination (``python -m bench.overhead --airflow-only``): the controllers' numpy and scipy
(the plan and checkpoint steps import them when they run), Great Expectations (the group's own
process loads it while it waits on Spark, ``validation.warm_in_background``), and Airflow's Spark
provider where no DAG submits (a Connect server). Cost: ~6 s (one Python process parsing both
DAG files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sluice.paths import project_root

PROBE = """
import json, runpy, sys
for path in sys.argv[2:]:
    runpy.run_path(path)
print(json.dumps(sorted(m for m in sys.argv[1].split(",") if m in sys.modules)))
"""
HEAVY = ["numpy", "scipy", "sluice.control", "great_expectations", "pyspark",
         "airflow.providers.apache.spark.operators.spark_submit"]


def test_parsing_the_dag_files_imports_no_library_a_task_step_does_not_need(tmp_path):
    dags = project_root() / "dags"
    root = project_root()
    env = {**os.environ, "SLUICE_SPARK_REMOTE": "sc://127.0.0.1:15002",  # every group on a Connect server
           "PYTHONPATH": os.pathsep.join([str(root / "plugins"), str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(HEAVY), str(dags / "sluice_pipelines.py"),
                          str(dags / "sluice_operations.py")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == [], f"parsing the DAG files imported {imported}"
