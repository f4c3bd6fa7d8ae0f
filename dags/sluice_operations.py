"""``sluice_rollback``, ``sluice_recover`` and ``sluice_skip_file``: operator actions on any pipeline, triggered with
params from the Airflow UI; ``sluice_alerts``: freshness alerts (see ``sluice.airflow.dag_factory``)."""

from __future__ import annotations

from sluice.airflow.dag_factory import build_alerts_dag, build_recover_dag, build_rollback_dag, build_skip_file_dag
from sluice.spec import load_pipeline_specs

_specs, _ = load_pipeline_specs()  # the errors are reported by sluice_spec_errors.py

dag_sluice_rollback = build_rollback_dag(_specs)
dag_sluice_recover = build_recover_dag(_specs)
dag_sluice_skip_file = build_skip_file_dag(_specs)
dag_sluice_alerts = build_alerts_dag(_specs)  # None (no DAG) unless a pipeline sets alerts.freshness
