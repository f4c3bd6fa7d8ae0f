"""One DAG per pipeline spec in ``include/pipelines/`` (see ``sluice.airflow.dag_factory``).

Only valid specs become DAGs here, so a typo in one spec never takes the other pipelines'
DAGs away; ``sluice_spec_errors.py`` reports the broken ones (and pipelines that write the same
table) as an import error naming the file and the field.
"""

from __future__ import annotations

from sluice.airflow.dag_factory import pipeline_dags
from sluice.spec import load_pipeline_specs

globals().update(pipeline_dags(load_pipeline_specs()[0]))
