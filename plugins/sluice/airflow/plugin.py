"""Registers sluice with Airflow: an epoch-log API mounted on the api-server at ``/sluice``, and
the console's pages in the Airflow UI: a "sluice epochs" tab on every DAG (a pipeline's page; on
other DAGs it says they are not pipelines) and "sluice pipelines" under Browse. The UI shows
them in a frame; they are served by the same app, behind the same login and DAG permissions.

Nothing here runs inside the scheduler or the dag-processor (no priority weight strategy, no
timetable): those run in Airflow's own database transactions, which sluice must never touch.

Airflow finds it through the ``airflow.plugins`` entry point of an installed sluice, or through
``plugins/sluice_plugin.py`` of a checkout (whose plugins folder holds the package itself, so
the scheduler, the workers and the triggerer all import the same code).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from sluice.api.app import app


class SluicePlugin(AirflowPlugin):
    name = "sluice"
    fastapi_apps = [{"app": app, "url_prefix": "/sluice", "name": "sluice epoch log"}]
    external_views = [
        {"name": "sluice epochs", "href": "/sluice/ui/{DAG_ID}", "destination": "dag", "url_route": "sluice-epochs"},
        {"name": "sluice pipelines", "href": "/sluice/ui", "destination": "nav", "category": "browse",
         "url_route": "sluice-pipelines"},
    ]
