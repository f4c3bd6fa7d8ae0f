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


def kafka_connection(conn_id: str) -> tuple[str | None, str | None, dict[str, Any]]:
    """The login, password and extra of the Airflow connection ``conn_id``: a Kafka source's
    credentials (``source.connection``; ``sluice.sources.kafka.connection_settings`` reads them).
    Airflow's connection inside Airflow; outside, ``AIRFLOW_CONN_<ID>`` (URI or JSON), which
    Airflow's lookup reads first anyway. The password and the extra's passwords and secrets are
    masked in this task's logs. ``LookupError`` (without the connection's text) when there is none."""
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # not found, not inside Airflow, or a malformed AIRFLOW_CONN_ (its text may be a secret)
        raise LookupError(f"{type(exc).__name__} looking it up") from None
    try:
        extra = dict(conn.extra_dejson or {})
    except Exception:  # an extra that is not JSON
        raise LookupError("its extra is not a JSON object") from None
    secrets = [conn.password, *(v for k, v in extra.items() if "password" in k.lower() or "secret" in k.lower())]
    if any(secrets):
        from airflow.sdk.log import mask_secret

        for secret in secrets:
            if secret:
                mask_secret(str(secret))
    return conn.login or None, conn.password or None, extra


def kafka_connection_env(conn_id: str) -> dict[str, str]:
    """``{"AIRFLOW_CONN_<ID>": <the connection as JSON>}``: what a process started outside this
    task (a spark-submit job) needs in its environment to resolve ``conn_id`` as
    ``kafka_connection`` does here. Set it at execute time (never in a template field: it would
    be rendered and shown); its password is masked in this task's logs."""
    kafka_connection(conn_id)  # LookupError when there is none; masks the secrets
    return {f"AIRFLOW_CONN_{conn_id.upper()}": BaseHook.get_connection(conn_id).as_json()}


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
