"""sluice through a warm Spark Connect server (``spark.remote``): the server is started here
(``sluice.spark.start_connect_server``, the command ``python -m sluice.spark connect-server`` runs),
and a group runs as ``sluice/jobs/run_group.py`` with ``SLUICE_SPARK_REMOTE`` set, which is what an
Airflow worker does when the variable is set: no JVM of its own. The tables are then read back
with the test session and compared with the oracle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sluice import protocol
from sluice.delta.spark import SparkTables
from sluice.net import free_port, poll_json
from sluice.paths import RUN_GROUP_APP
from sluice.spark import start_connect_server
from sluice.store import EpochStore
from tests.pipelines import assert_matches_oracle, land, make_pipeline


def _compiled_classes(ui_port: int) -> int:
    """Classes of generated code the server has compiled so far (Spark's CodeGenerator metrics)."""
    return poll_json(f"http://127.0.0.1:{ui_port}/metrics/json",
                     lambda m: next(v["count"] for k, v in m["histograms"].items()
                                    if k.endswith("CodeGenerator.compilationTime")))


def test_a_new_session_reuses_the_code_earlier_sessions_generated(connect_server, connect_ui_port):
    """Each group is a new client session. Spark's own server class gives every session a class
    loader of its own, and compiled code is cached by class loader: a warm server compiled the
    same classes again for every group (~95, a third of a small group's server CPU with their
    JIT). sluice's server shares them: the same query in a second session compiles nothing.
    cost: ~8-12 s (two client processes on the module's server)."""
    # A client process per session, as each group is (a Connect session made in this process
    # would turn the test session's builder to Connect mode).
    client = ("import sys\n"
              "from pyspark.sql import SparkSession\n"
              "s = SparkSession.builder.remote(sys.argv[1]).getOrCreate()\n"
              "rows = (s.range(500).selectExpr('id * 7919 % 13 AS k', 'id').where('k <> 5').groupBy('k')\n"
              "        .agg({'id': 'max'}).orderBy('k').collect())\n"
              "print(','.join(str(r['k']) for r in rows))\n"
              "s.stop()\n")

    def run_in_a_new_session() -> int:
        before = _compiled_classes(connect_ui_port)
        done = subprocess.run([sys.executable, "-c", client, connect_server], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == [",".join(str(k) for k in range(13) if k != 5)]  # computed, not skipped
        return _compiled_classes(connect_ui_port) - before

    first = run_in_a_new_session()
    assert first > 0, "the query compiled no code: it no longer tests the cache"
    assert run_in_a_new_session() == 0


@pytest.fixture(scope="module")
def connect_ui_port() -> int:
    """The server's UI port: its metrics servlet counts the server's compiled classes."""
    return free_port()


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory, connect_ui_port) -> Iterator[str]:
    proc, url = start_connect_server(tmp_path_factory.mktemp("connect") / "server.log", "local[2]",
                                     conf={"spark.ui.enabled": "true", "spark.ui.port": str(connect_ui_port)})
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_groups_run_through_a_warm_connect_server(spark, connect_server):
    spec = make_pipeline("connect_ysb", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=6, malformed_fraction=0.03)
    env = {**os.environ, "SLUICE_SPARK_REMOTE": connect_server}
    # Two run-once applications (the second finds the server warm): two epochs, then the last.
    for args in (["--plan"], ["--plan", "--drain"]):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(RUN_GROUP_APP), "--pipeline",
                               spec.name, *args], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        print(f"[connect] group in {time.monotonic() - t0:.1f} s")
    log = EpochStore()
    assert [e.state for e in log.epochs(spec.name)] == [protocol.PUBLISHED] * 3
    assert_matches_oracle(spark, spec, log)
    app = protocol.sink_app_id(spec.name, spec.sinks[0].name, 0)
    assert protocol.txn_epoch(SparkTables(spark).txn_version(spec.sinks[0].path, app)) == 2


@pytest.mark.variant
def test_a_sql_transform_through_a_connect_server(spark, connect_server):
    """The shipped SQL example (``ysb_sql``) as a run-once client of the Connect server, where the
    views travel inside the plan (no temporary view on the server): the table equals the oracle.
    A query naming a missing column fails the client with the spec file, transform.sql and the
    column in its error, and nothing is written. cost: ~80-90 s at load 5-7 (two clients; the module's
    server started once, ~17 s more when this test runs alone)."""
    env = {**os.environ, "SLUICE_SPARK_REMOTE": connect_server}

    def run_group(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(RUN_GROUP_APP), "--pipeline", name, "--plan", "--drain"],
                              env=env, capture_output=True, text=True, timeout=300)

    spec = make_pipeline("connect_sql", base="ysb_sql", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=4, seed=5, malformed_fraction=0.03)
    done = run_group(spec.name)
    assert done.returncode == 0, done.stderr[-3000:]
    log = EpochStore()
    assert_matches_oracle(spark, spec, log)

    broken = make_pipeline("connect_sql_broken", transform={"sql": "SELECT ad_id, nope FROM records"},
                           **{"control.epoch_files": 2})
    land(broken, files=2, seed=6)
    failed = run_group(broken.name)
    assert failed.returncode != 0
    assert "TransformError" in failed.stderr and f"{broken.path}): transform.sql: column `nope`" in failed.stderr, \
        failed.stderr[-3000:]
    assert not any(SparkTables(spark).exists(path) for path in broken.table_writers())
    assert [e.state for e in log.epochs(broken.name)] == [protocol.FAILED]
