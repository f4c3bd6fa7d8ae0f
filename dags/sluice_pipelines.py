"""One DAG per pipeline spec in ``include/pipelines/`` (see ``sluice.airflow.dag_factory``).

Only valid specs become DAGs here, so a typo in one spec never takes the other pipelines'
DAGs away; ``sluice_spec_errors.py`` reports the broken ones as an import error naming the
file and the field.
"""

from __future__ import annotations

from sluice.airflow.dag_factory import build_dag
from sluice.errors import SpecError
from sluice.paths import pipelines_dir
from sluice.spec import load_spec

for _path in sorted(pipelines_dir().glob("*.yaml")):
    try:
        _spec = load_spec(_path)
    except SpecError:
        continue  # reported by sluice_spec_errors.py
    globals()[f"dag_{_spec.name}"] = build_dag(_spec)
