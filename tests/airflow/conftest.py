import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def airflow_db():
    """A migrated Airflow metadata DB (SQLite, in the test session's AIRFLOW_HOME): a copy of
    the migrated template (``standalone.migrated_db``), not a migration of its own."""
    from airflow import settings

    from tests.airflow.standalone import migrated_db

    url = os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    dest = Path(url.removeprefix("sqlite:///"))
    if settings.engine is not None:
        settings.engine.dispose()
    dest.unlink(missing_ok=True)
    migrated_db(dest)
