"""Registers sluice with Airflow: an epoch-log API mounted on the api-server at ``/sluice``.

Nothing here runs inside the scheduler or the dag-processor (no priority weight strategy, no
timetable): those run in Airflow's own database transactions, which sluice must never touch.

The package ``sluice`` itself sits in this plugins folder, so the scheduler, the workers and
the triggerer (which imports ``sluice.airflow.triggers.BacklogTrigger``) all find it.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from sluice.api.app import app


class SluicePlugin(AirflowPlugin):
    name = "sluice"
    fastapi_apps = [{"app": app, "url_prefix": "/sluice", "name": "sluice epoch log"}]
