"""A real Spark standalone cluster on 127.0.0.1 without Docker: a master and workers, each its
own JVM with its own working directory, started with the launcher classes pip's PySpark ships
(``bin/spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``; pip's
PySpark has no ``sbin/``).

The workers get a clean environment (no ``PYTHONPATH``): Python code an executor runs (a UDF of
a transform) must come with the application (``--py-files``, ``sluice.spark.python_files``),
as it would on machines of their own.

``python -m include.spark_cluster`` (``make spark-cluster``) runs one in the foreground.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sluice.net import free_port, get_json
from sluice.paths import data_dir

#: What a worker offers: one core and 1 GiB each (two workers on this 2-core machine).
WORKER_CORES = 1
WORKER_MEMORY = "1g"


def _spark_class() -> str:
    from pyspark.find_spark_home import _find_spark_home

    return str(Path(_find_spark_home()) / "bin" / "spark-class")


@dataclass
class SparkCluster:
    root: Path
    port: int
    ui_port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def worker_dirs(self) -> list[Path]:
        return sorted(self.root.glob("worker-*/work"))

    def state(self) -> dict:
        """The master's own view (its web UI's JSON): workers, running and completed apps."""
        return get_json(f"http://127.0.0.1:{self.ui_port}/json/", timeout_s=5)

    def stop(self, timeout: float = 30) -> None:
        for proc in reversed(self.procs):  # workers first, then the master
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _launch(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def start(root: Path, workers: int = 2, timeout: float = 120) -> SparkCluster:
    """A master and ``workers`` workers under ``root``; returns once every worker is ALIVE."""
    root.mkdir(parents=True, exist_ok=True)
    # A clean environment: what the JVMs need, nothing of this process's Python path.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "JAVA_HOME", "HOME", "LANG", "TMPDIR")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(root / "logs"))
    cluster = SparkCluster(root=root, port=free_port(), ui_port=free_port())
    cluster.procs.append(_launch(
        [_spark_class(), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(cluster.port), "--webui-port", str(cluster.ui_port)], root / "master.log", env))
    for i in range(workers):
        work = root / f"worker-{i}" / "work"
        work.mkdir(parents=True, exist_ok=True)
        cluster.procs.append(_launch(
            [_spark_class(), "org.apache.spark.deploy.worker.Worker", cluster.master_url, "--host", "127.0.0.1",
             "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY, "--work-dir", str(work),
             "--webui-port", str(free_port())], root / f"worker-{i}.log", {**env, "SPARK_WORKER_DIR": str(work)}))
    deadline = time.monotonic() + timeout
    while True:
        dead = [p for p in cluster.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
                             for log in sorted(root.glob("*.log")))
            cluster.stop()
            raise RuntimeError(f"the Spark cluster did not come up ({len(dead)} process(es) exited):\n{logs}")
        try:
            alive = [w for w in cluster.state().get("workers", []) if w.get("state") == "ALIVE"]
            if len(alive) == workers:
                return cluster
        except OSError:  # the master's UI is not up yet
            pass
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", type=Path, default=data_dir() / "spark-cluster")
    args = parser.parse_args()
    cluster = start(args.data, args.workers)
    print(f"Spark master {cluster.master_url} (UI http://127.0.0.1:{cluster.ui_port}), {args.workers} workers; "
          f"use it with AIRFLOW_CONN_SPARK_DEFAULT='{{\"conn_type\": \"spark\", \"host\": \"{cluster.master_url}\"}}'."
          " Ctrl-C stops it", flush=True)
    try:
        while all(p.poll() is None for p in cluster.procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
