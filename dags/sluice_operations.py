"""``sluice_rollback``, ``sluice_recover`` and ``sluice_skip_file``: operator actions on any pipeline, triggered with
params from the Airflow UI; ``sluice_alerts``: freshness alerts (see ``sluice.airflow.dag_factory``)."""

from __future__ import annotations

from sluice.airflow.dag_factory import operations_dags
from sluice.spec import load_pipeline_specs

globals().update(operations_dags(load_pipeline_specs()[0]))  # the errors: sluice_spec_errors.py
