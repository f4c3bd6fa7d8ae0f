"""One DAG per pipeline spec in ``include/pipelines/`` (see ``sluice.airflow.dag_factory``).

Only valid specs become DAGs here, so a typo in one spec never takes the other pipelines'
DAGs away; ``sluice_spec_errors.py`` reports the broken ones (and pipelines that write the same
table) as an import error naming the file and the field.
"""

from __future__ import annotations

from sluice.airflow.dag_factory import build_dag
from sluice.spec import load_pipeline_specs

_specs, _ = load_pipeline_specs()
for _spec in _specs.values():
    globals()[f"dag_{_spec.name}"] = build_dag(_spec)
