import pytest


@pytest.fixture(scope="session", autouse=True)
def airflow_db():
    """A migrated Airflow metadata DB (SQLite, in the test session's AIRFLOW_HOME)."""
    from airflow.utils import db

    db.resetdb(skip_init=False)
