"""A real api-server with the FAB auth manager (``apache-airflow-providers-fab``): per-DAG
permissions (``DAG:<dag_id>`` with ``can_read``/``can_edit``), which the simple auth manager
does not have. The all-admins harness (``standalone``) stays as it is for the other tests.

``setup(home, env, users)`` prepares a server's home in one process (``python -m
tests.airflow.fab``): the DAGs serialized into the metadata DB (``airflow dags reserialize``,
so no dag-processor is needed to trigger them), then FAB's roles and users."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.airflow import standalone

AUTH_MANAGER = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"


def env(secret: str) -> dict[str, str]:
    """The settings of a server with the FAB auth manager; ``secret`` is ``[api_auth] jwt_secret``,
    which the api-server, the workers and the command line share (it also keys sluice's stamps)."""
    return {"AIRFLOW__CORE__AUTH_MANAGER": AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__API_AUTH__JWT_SECRET": secret,
            "AIRFLOW__FAB__UPDATE_FAB_PERMS": "True"}


def python_path() -> dict[str, str]:
    """The checkout's modules for a subprocess (``make`` exports the same PYTHONPATH)."""
    root = Path(__file__).resolve().parents[2]
    return {"PYTHONPATH": f"{root}:{root / 'plugins'}"}


def setup(home: Path, server_env: dict[str, str], users: dict[str, dict[str, Any]]) -> None:
    """``users``: name -> {"password", "role", "permissions": [[action, resource], ...]} (the
    role is created with those permissions unless it is one of FAB's own: Admin, Viewer, ...)."""
    done = subprocess.run([sys.executable, "-m", "tests.airflow.fab", json.dumps(users)],
                          env={**server_env, **python_path()}, cwd=home, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _main(users: dict[str, dict[str, Any]]) -> None:
    from airflow.cli.commands.dag_command import dag_reserialize
    from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder

    dag_reserialize(argparse.Namespace(bundle_name=None, verbose=False))
    with get_application_builder() as appbuilder:
        sm = appbuilder.sm
        sm.sync_roles()  # FAB's own roles (Admin, Viewer, User, Op, Public) with their permissions
        for name, user in users.items():
            role = sm.find_role(user["role"])
            if role is None:
                role = sm.add_role(user["role"])
                for action, resource in user.get("permissions", []):
                    sm.add_permission_to_role(role, sm.create_permission(action, resource))
            assert sm.add_user(name, name, "test", f"{name}@example.com", role, user["password"]), name


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))


def start(home: Path, secret: str, users: dict[str, dict[str, Any]]) -> standalone.Server:
    """``airflow api-server`` alone with the FAB auth manager and ``users``."""
    extra = env(secret)
    standalone.migrated_db(home / "airflow.db")
    setup(home, {**standalone.server_env(home, 0), **extra}, users)
    return standalone.start(home, ("api-server",), extra)
