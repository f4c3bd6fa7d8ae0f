"""``SluiceStoreHook``: the epoch store's connection, as an Airflow hook owns one.

The store is sluice's own database (SQLite under ``$AIRFLOW_HOME`` by default, Postgres in a
deployment), never Airflow's metadata database. Its URL comes from ``$SLUICE_STORE_URL``, else
the Airflow connection ``sluice_store`` (its extra ``url``, or its URI), else the default; every
task resolves it itself, so it never travels in XCom or a rendered template field, and its
password is masked in the task's logs.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook

from sluice.store import EpochStore


def connection_url(conn_id: str = "sluice_store") -> str | None:
    """The store URL the Airflow connection ``conn_id`` holds, or ``None`` when there is none."""
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception:  # no such connection, or not inside Airflow: the caller falls back
        return None
    url = conn.extra_dejson.get("url")
    if url:
        return url
    return conn.get_uri().replace("postgres://", "postgresql+psycopg2://", 1)


class SluiceStoreHook(BaseHook):
    """The epoch store of sluice's pipelines (``get_store``); ``conn_id`` names the Airflow
    connection holding its URL (default ``sluice_store``)."""

    conn_name_attr = "sluice_store_conn_id"
    default_conn_name = "sluice_store"
    conn_type = "generic"
    hook_name = "sluice epoch store"

    def __init__(self, sluice_store_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sluice_store_conn_id = sluice_store_conn_id

    def get_url(self) -> str:
        """The store's URL (``store_url``'s lookup), its password masked in this task's logs."""
        import os

        from sqlalchemy.engine import make_url

        from sluice.store import store_url

        url = os.environ.get("SLUICE_STORE_URL") or connection_url(self.sluice_store_conn_id) or store_url()
        try:
            password = make_url(url).password
        except Exception:  # not a URL SQLAlchemy parses: EpochStore will say so
            password = None
        if password:
            from airflow.sdk.log import mask_secret

            mask_secret(str(password))
        return url

    def get_store(self) -> EpochStore:
        return EpochStore(self.get_url())

    def get_conn(self) -> EpochStore:
        return self.get_store()
