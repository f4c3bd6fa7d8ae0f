"""Registers sluice with Airflow: an epoch-log API mounted on the api-server at ``/sluice``,
and the ``OldestBacklogFirst`` priority weight strategy of the pipeline DAGs' tasks.

The package ``sluice`` itself sits in this plugins folder, so the scheduler, the workers and
the triggerer (which imports ``sluice.airflow.triggers.BacklogTrigger``) all find it.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from sluice.airflow.priority import OldestBacklogFirst
from sluice.api.app import app


class SluicePlugin(AirflowPlugin):
    name = "sluice"
    fastapi_apps = [{"app": app, "url_prefix": "/sluice", "name": "sluice epoch log"}]
    priority_weight_strategies = [OldestBacklogFirst]
