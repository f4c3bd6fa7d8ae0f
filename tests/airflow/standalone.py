"""A real Airflow for end-to-end tests: ``airflow standalone`` (scheduler, dag-processor,
api-server, triggerer; LocalExecutor) in a subprocess, plus small REST helpers.

The server gets its own ``AIRFLOW_HOME`` and SQLite metadata DB (never the in-process tests'
one), free ports, and the ``SLUICE_*`` settings of the test session, so its tasks and its
triggerer use the test session's pipelines folder, data folder and epoch store.

Every process the server starts carries ``SLUICE_STANDALONE_ID`` in its environment; ``stop``
terminates the server's process group and then whatever still carries that marker (task
processes and spark-submit JVMs run in process groups of their own).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from sluice.net import free_port

MARKER = "SLUICE_STANDALONE_ID"
T = TypeVar("T")


@dataclass
class Server:
    home: Path
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    marker: str
    _log_file: Any = field(repr=False, default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        # simple_auth_manager_all_admins: the api-server adds an admin token to every request.
        return httpx.Client(base_url=self.url, timeout=30.0)


def server_env(home: Path, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base``, by default the test session's (``SLUICE_*``,
    ``AIRFLOW_CONN_SPARK_DEFAULT``, ``PYSPARK_PYTHON``, the DAG and plugins folders, the venv
    first on PATH; see ``tests/conftest.py``), with its own Airflow home, DB and ports."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "AIRFLOW__CORE__UNIT_TEST_MODE"}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "2",
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
        "AIRFLOW__SCHEDULER__JOB_HEARTBEAT_SEC": "2",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
        "GX_ANALYTICS_ENABLED": "false",
    })
    return env


def airflow_command() -> str:
    return str(Path(sys.executable).parent / "airflow")


def migrated_db(dest: Path) -> Path:
    """Copy a migrated SQLite metadata DB to ``dest`` (when it is not there yet): migrating
    costs seconds a server start need not pay. The template is made once per Airflow version
    under ``var/test-cache/`` (a file lock makes the two test workers wait for one migration);
    with the FAB provider installed, ``db migrate`` makes its tables too, so that template is
    another (``tests/airflow/fab.py`` needs them; a template from before FAB has none)."""
    import importlib.util

    from airflow import __version__

    if dest.exists():
        return dest
    cache = Path(__file__).resolve().parents[2] / "var" / "test-cache"
    cache.mkdir(parents=True, exist_ok=True)
    fab = "-fab" if importlib.util.find_spec("airflow.providers.fab") else ""
    template = cache / f"airflow-{__version__}{fab}.db"
    with (cache / "airflow.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            partial = template.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            home = cache / "migrate-home"
            env = {**server_env(home, 0), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{partial}"}
            done = subprocess.run([airflow_command(), "db", "migrate"], env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"airflow db migrate failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
            partial.rename(template)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, dest)
    return dest


def start(home: Path, command: tuple[str, ...] = ("standalone",), extra_env: dict[str, str] | None = None,
          base_env: dict[str, str] | None = None, airflow: str | None = None) -> Server:
    """Start ``airflow standalone`` (or another ``airflow`` command, with ``extra_env``) in a
    new session (its own process group). ``base_env`` replaces the test session's environment
    and ``airflow`` the venv's command (a fresh install's)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**server_env(home, port, base_env), **(extra_env or {})}
    if env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == f"sqlite:///{home / 'airflow.db'}" and airflow is None:
        migrated_db(home / "airflow.db")
    marker = uuid.uuid4().hex
    env[MARKER] = marker
    log_path = home / "standalone.out"
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [airflow or airflow_command(), *command],
        cwd=home, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Server(home=home, port=port, proc=proc, log_path=log_path, marker=marker, _log_file=log_file)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Processes (other than this one) whose environment carries the server's marker."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(MARKER) == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _signal_all(server: Server, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to the server's process group and to every marked process (task processes
    and spark-submit JVMs run in groups of their own). Returns the marked pids signalled."""
    try:
        os.killpg(server.proc.pid, sig)
    except ProcessLookupError:
        pass
    signalled = []
    for p in marked_processes(server.marker):
        try:
            p.send_signal(sig)
            signalled.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return signalled


def stop(server: Server, grace_s: float = 30.0) -> list[int]:
    """SIGTERM the server's process group and every marked process, wait, then SIGKILL what is
    left. Returns the pids that needed SIGKILL."""
    _signal_all(server, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        server.proc.poll()
        if server.proc.returncode is not None and not marked_processes(server.marker):
            break
        time.sleep(0.5)
    killed = _signal_all(server, signal.SIGKILL)
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    psutil.wait_procs([p for p in marked_processes(server.marker)], timeout=10)
    if server._log_file is not None:
        server._log_file.close()
    return killed


# -- waiting ---------------------------------------------------------------------------------


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0,
             server: Server | None = None) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds (or at
    once if the server has died), saying what was awaited and what was last seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last:
                return last
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited ({server.proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


def health(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/api/v2/monitor/health")
    r.raise_for_status()
    return r.json()


def is_healthy(status: dict[str, Any]) -> bool:
    return all((status.get(c) or {}).get("status") == "healthy"
               for c in ("metadatabase", "scheduler", "triggerer", "dag_processor"))


def wait_healthy(server: Server, client: httpx.Client, timeout: float = 180.0) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        last.update(health(client))
        return dict(last) if is_healthy(last) else None

    return wait_for(check, timeout, "a healthy scheduler, triggerer and dag-processor", server=server)


# -- REST ------------------------------------------------------------------------------------


def get_dag(client: httpx.Client, dag_id: str) -> dict[str, Any] | None:
    r = client.get(f"/api/v2/dags/{dag_id}")
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def import_errors(client: httpx.Client) -> list[dict[str, Any]]:
    r = client.get("/api/v2/importErrors")
    r.raise_for_status()
    return r.json()["import_errors"]


def wait_for_dag(server: Server, client: httpx.Client, dag_id: str, timeout: float = 120.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        errors = import_errors(client)
        if errors:
            raise AssertionError(f"DAG import errors: {errors}")
        return get_dag(client, dag_id)

    return wait_for(check, timeout, f"DAG {dag_id} to be parsed", server=server)


def set_paused(client: httpx.Client, dag_id: str, paused: bool) -> None:
    r = client.patch(f"/api/v2/dags/{dag_id}", json={"is_paused": paused})
    r.raise_for_status()
    assert r.json()["is_paused"] is paused, r.json()


def dag_runs(client: httpx.Client, dag_id: str) -> list[dict[str, Any]]:
    """All runs of the DAG, oldest first."""
    r = client.get(f"/api/v2/dags/{dag_id}/dagRuns", params={"order_by": "run_after", "limit": 100})
    r.raise_for_status()
    return r.json()["dag_runs"]


def task_instances(client: httpx.Client, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
    r = client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
    r.raise_for_status()
    return {ti["task_id"]: ti for ti in r.json()["task_instances"]}


def task_states(client: httpx.Client, dag_id: str, run_id: str) -> dict[str, str | None]:
    return {task: ti["state"] for task, ti in task_instances(client, dag_id, run_id).items()}


def xcom(client: httpx.Client, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
    r = client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")
    r.raise_for_status()
    return r.json()["value"]


def task_process(ti_id: str) -> psutil.Process | None:
    """The process running a task instance: Airflow titles it ``airflow worker -- <ti id>``
    (its supervisor's title names the workload, not the id). Found by that title among all
    processes, since ``setproctitle`` can overwrite the environment that carries the marker;
    the id is a UUID, so no other server's task matches."""
    for p in psutil.process_iter():
        try:
            if " ".join(p.cmdline()).strip().endswith(f"-- {ti_id}"):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def wait_for_run(server: Server, client: httpx.Client, dag_id: str, index: int, timeout: float) -> dict[str, Any]:
    """The ``index``-th run (0 = first) of the DAG, once it exists."""

    def check() -> dict[str, Any] | None:
        runs = dag_runs(client, dag_id)
        return runs[index] if len(runs) > index else None

    return wait_for(check, timeout, f"run #{index} of {dag_id}", server=server)


def wait_for_task_state(server: Server, client: httpx.Client, dag_id: str, run_id: str, task_id: str,
                        states: set[str], timeout: float) -> dict[str, Any]:
    """The task instance once it is in one of ``states``; fails early on a terminal other state."""
    terminal = {"success", "failed", "skipped", "upstream_failed", "removed"}

    def check() -> dict[str, Any] | None:
        ti = task_instances(client, dag_id, run_id).get(task_id)
        if ti and ti["state"] in states:
            return ti
        if ti and ti["state"] in terminal:
            raise AssertionError(f"{dag_id}/{run_id}/{task_id} ended {ti['state']}, expected {states}: "
                                 f"{task_states(client, dag_id, run_id)}")
        return None

    return wait_for(check, timeout, f"{dag_id}/{run_id}/{task_id} in {sorted(states)}", server=server)


def wait_for_run_state(server: Server, client: httpx.Client, dag_id: str, run_id: str, timeout: float,
                       state: str = "success") -> dict[str, str | None]:
    """Task states of the run once it has ended in ``state``; fails early if it ends otherwise."""

    def check() -> dict[str, str | None] | None:
        r = client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        r.raise_for_status()
        run_state = r.json()["state"]
        if run_state == state:
            return task_states(client, dag_id, run_id)
        if run_state in ("success", "failed"):
            raise AssertionError(f"{dag_id}/{run_id} ended {run_state}: {task_states(client, dag_id, run_id)}")
        return None

    return wait_for(check, timeout, f"{dag_id}/{run_id} to end in {state}", interval=2.0, server=server)


# -- diagnostics -----------------------------------------------------------------------------


def tail(path: Path, lines: int = 80, skip: str | None = None) -> str:
    """The last ``lines`` lines of a file, leaving out those containing ``skip``."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<{path}: {exc}>"
    return "\n".join([line for line in text if not (skip and skip in line)][-lines:])


def diagnostics(server: Server, dag_ids: tuple[str, ...] = (), lines: int = 60) -> str:
    """The tail of the server's output and of the task (and trigger) logs of ``dag_ids``."""
    parts = [f"===== {server.log_path} (without the api-server's access log) =====",
             tail(server.log_path, lines * 2, skip="[http.access]")]
    logs = server.home / "logs"
    for dag_id in dag_ids:
        for path in sorted(logs.glob(f"dag_id={dag_id}/**/*.log*"), key=lambda p: p.stat().st_mtime)[-8:]:
            parts += [f"===== {path.relative_to(logs)} =====", tail(path, lines)]
    return "\n".join(parts)
