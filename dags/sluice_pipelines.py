"""One DAG per pipeline spec in ``include/pipelines/`` (see ``sluice.airflow.dag_factory``).

A broken spec fails the import with a message naming the file and the field, shown as an
import error in the Airflow UI; the other pipelines' DAGs still load.
"""

from __future__ import annotations

from sluice.airflow.dag_factory import build_dag
from sluice.paths import pipelines_dir
from sluice.spec import load_spec

_errors = []
for _path in sorted(pipelines_dir().glob("*.yaml")):
    try:
        globals()[f"dag_{_path.stem}"] = build_dag(load_spec(_path))
    except Exception as exc:  # collect, so one bad spec does not hide the others
        _errors.append(str(exc))

if _errors:
    raise ImportError("; ".join(_errors))
