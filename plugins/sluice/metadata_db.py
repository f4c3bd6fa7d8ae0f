"""Connection arguments for Airflow's own metadata database, set by the Makefile through
``AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS`` (and ``..._ASYNC``).

On the embedded SQLite default, the scheduler, the dag-processor, the triggerer, the
api-server and a command such as ``airflow backfill create`` all write one file; sqlite3's
default 5 s busy timeout then fails them with ``database is locked``. A 60 s timeout makes them
wait their turn instead. Any other database gets no extra arguments.
"""

from __future__ import annotations

import os
from typing import Any

SQLITE_BUSY_TIMEOUT_S = 60


def _metadata_url() -> str:
    url = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    if url:
        return url
    try:
        from airflow.configuration import conf

        return conf.get("database", "sql_alchemy_conn", fallback="sqlite://")
    except Exception:  # not loadable yet: Airflow's default is SQLite
        return "sqlite://"


def _connect_args() -> dict[str, Any]:
    return {"timeout": SQLITE_BUSY_TIMEOUT_S} if _metadata_url().startswith("sqlite") else {}


#: Airflow mutates the dict it gets (``check_same_thread``): one object per engine.
CONNECT_ARGS: dict[str, Any] = _connect_args()
CONNECT_ARGS_ASYNC: dict[str, Any] = _connect_args()
