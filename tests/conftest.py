"""Test set-up: an isolated Airflow home, data folder, epoch store and pipelines folder per
test session, set before Airflow or sluice is imported; one SparkSession for the whole run."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_tmp = Path(tempfile.mkdtemp(prefix="sluice-tests-"))
_venv_bin = str(Path(sys.executable).parent)
os.environ.update({
    "AIRFLOW_HOME": str(_tmp / "airflow"),
    "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_tmp / 'airflow' / 'airflow.db'}",
    "AIRFLOW_CONN_SPARK_DEFAULT": '{"conn_type": "spark", "host": "local[2]"}',
    "SLUICE_DATA_DIR": str(_tmp / "var"),
    "SLUICE_STORE_URL": f"sqlite:///{_tmp / 'var' / 'sluice.db'}",
    "SLUICE_PIPELINES_DIR": str(_tmp / "pipelines"),
    "SLUICE_SPARK_MASTER": "local[2]",
    "GX_ANALYTICS_ENABLED": "false",
    "PYSPARK_PYTHON": sys.executable,
    "PATH": f"{_venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
})
(_tmp / "airflow").mkdir(parents=True)
(_tmp / "var").mkdir()
shutil.copytree(ROOT / "include" / "pipelines", _tmp / "pipelines")
for p in (ROOT / "plugins", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import pytest  # noqa: E402

TMP_ROOT = _tmp


@pytest.fixture(scope="session")
def spark():
    """The one SparkSession of the test run (a cold start costs ~10 s here)."""
    from sluice.spark import get_session

    # One session serves every test (many pipelines' Delta logs and caches): a 2 GiB heap
    # leaves the 50 MB-line test the headroom a fresh run-once driver has.
    session = get_session("sluice-tests", master="local[2]", extra_conf={"spark.driver.memory": "2g"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on 127.0.0.1 for the test run (started on first use)."""
    from tests.postgres import PostgresServer

    server = PostgresServer.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path: Path) -> str:
    """A new, empty epoch store: a SQLite file, then a database on the real Postgres server."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres").database()
    return f"sqlite:///{tmp_path}/s.db"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_backend(request, monkeypatch) -> str:
    """Run the test once on the SQLite epoch store and once on Postgres. The Postgres run gets
    its own data folder, so the same pipeline names make new tables and landing folders; jobs
    the test starts inherit both settings."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres")
        monkeypatch.setenv("SLUICE_STORE_URL", server.url())
        data = TMP_ROOT / "var-postgres"
        data.mkdir(exist_ok=True)
        monkeypatch.setenv("SLUICE_DATA_DIR", str(data))
    return request.param


@pytest.fixture(scope="session")
def kafka():
    """A real Kafka broker (KRaft, one node) on 127.0.0.1 for the test run (started on first use)."""
    from include.kafka.broker import start

    broker = start(TMP_ROOT / "kafka")
    yield broker
    broker.stop()


# The longest test files, longest first (from var/ci/junit.xml of a CI run: python -m
# tests.durations var/ci/junit.xml --by-file). Under --dist loadfile a worker takes the next
# file in collection order when it is free: the long ones first, the many short ones fill the
# end, and neither worker idles through a long file the other started late.
LONGEST_FIRST = ("tests/acceptance/test_readme_path.py", "tests/integration/test_exactly_once.py",
                 "tests/airflow/test_real_airflow.py", "tests/integration/test_operations.py",
                 "tests/integration/test_kafka_source.py", "tests/airflow/test_dag_test.py",
                 "tests/airflow/test_console.py", "tests/unit/test_simulation.py",
                 "tests/package/test_installed.py", "tests/integration/test_bad_input.py")


def pytest_collection_modifyitems(config, items):
    """Longest files first (``LONGEST_FIRST``). ``@pytest.mark.postgres_variant``: the test's
    Postgres run (``store_backend``) moves to ``make test-all``; CI keeps its SQLite run (the
    store steps are the same SQL on both). Postgres's contended, fencing and take-over cases stay
    in CI in the store's own Postgres tests and the simulation on a real server."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as collected
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (item.get_closest_marker("postgres_variant") and callspec is not None
                and callspec.params.get("store_backend") == "postgres"):
            item.add_marker(pytest.mark.variant)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_tmp, ignore_errors=True)
