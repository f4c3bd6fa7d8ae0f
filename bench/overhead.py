"""Where a group's time goes when it is not processing records.

    python -m bench.overhead [--quick] [--skip-airflow]
    python -m bench.overhead --connect [--connect-reps 4] [--profile [1,1,4]]   # ~6-10 min
    python -m bench.overhead --airflow-only [--modes connect] [--ks 1,32,32,32]   # ~8 min a mode

1. **Cold start**: a fresh Python process builds a SparkSession with Delta, runs one query,
   then commits one small Delta table (the first commit loads Delta's classes). Also its
   CPU-seconds (process tree), which ``cost.py`` charges per run-once group.
2. **Fixed cost per epoch**: many tiny epochs (20 records each) in a warm session; per
   epoch with and without the GX suite, and per step (read, ``_rejected``, MERGE).
3. **Airflow coordination per group** under a real ``airflow standalone`` (LocalExecutor,
   SQLite): from the sensor's fire to the checkpoint's end, every gap between tasks and the
   Spark application's start, from the task instances (REST) and the epoch log. First a
   group of k = 1 gives the coordination cost C and the epoch time E; then a group runs at the
   k that Drizzle's AIMD settles at (the smallest with C / (C + k E) <= 10 %), and its
   measured ``coordination_fraction`` is the figure of record. Once with ``spark-submit`` per
   group and, when the Spark Connect server starts, once against it (``spark.mode: connect``).

Writes ``bench/results/overhead.json`` and ``overhead.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    CpuMeter,
    configure,
    land_ysb,
    results_dir,
    run_group_args,
    session,
    stats,
    write_result,
    write_spec,
    ysb_spec_yaml,
)

COLD_START = r"""
import json, os, sys, time, resource
t0 = time.perf_counter()
sys.path[:0] = [sys.argv[1] + "/plugins", sys.argv[1]]
from sluice.spark import get_session
t_import = time.perf_counter()
spark = get_session("sluice-cold-start", master="local[2]")
t_session = time.perf_counter()
spark.range(1).count()
t_query = time.perf_counter()
spark.range(10).write.format("delta").mode("append").save(sys.argv[2])
t_delta = time.perf_counter()
import psutil
jvm = psutil.Process(spark.sparkContext._gateway.proc.pid).cpu_times()
me = resource.getrusage(resource.RUSAGE_SELF)
spark.stop()
print(json.dumps({"cpu_s": jvm.user + jvm.system + me.ru_utime + me.ru_stime, "import_s": t_import - t0,
                  "session_s": t_session - t_import, "first_query_s": t_query - t_session,
                  "first_delta_commit_s": t_delta - t_query, "to_first_commit_s": t_delta - t0}))
"""


def cold_start(work: Path, reps: int) -> dict[str, Any]:
    rows = []
    for i in range(reps):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", COLD_START, str(ROOT), str(work / f"cold{i}")],
                             capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row.update(process_wall_s=wall)
        rows.append(row)
        print(f"  cold start {i + 1}: {json.dumps({k: round(v, 2) for k, v in row.items()})}", flush=True)
    return {key: stats([r[key] for r in rows], 2) for key in rows[0]}


def epoch_fixed_cost(work: Path, epochs: int) -> dict[str, Any]:
    """Per-epoch seconds when an epoch holds next to nothing (one file of 20 records)."""
    from sluice.protocol.run import run_once
    from sluice.store import EpochStore

    spark = session("sluice-bench-overhead")
    landing = work / "tiny"
    land_ysb(landing, epochs, 20, malformed_fraction=0.0)
    result = {}
    for validate in (False, True):
        tag = "gx" if validate else "plain"
        root = work / f"fixed-{tag}"
        spec = write_spec(root, ysb_spec_yaml(f"bench_fixed_{tag}", landing, root / "campaign_views",
                                              epoch_files=1, k=epochs, validate=validate))
        store = EpochStore(f"sqlite:///{root / 'sluice.db'}")
        t0 = time.perf_counter()
        run_once(spec, store, spark, epoch_size=1, k=epochs)
        wall = time.perf_counter() - t0
        timings = [e.timings for e in store.epochs(spec.name)][1:]  # the first epoch pays class loading
        steps = {key: stats([t.get(key, 0.0) for t in timings], 3) for key in timings[0]
                 if isinstance(timings[0][key], int | float)}
        result[tag] = {"epochs": epochs, "group_wall_s": round(wall, 2), "per_epoch_s": steps["epoch_s"],
                       "steps": steps, "marginal_epoch_s": marginal_epoch_cost(work, spark, tag, validate, epochs)}
        print(f"  fixed cost per epoch ({tag}): {steps['epoch_s']}; one more epoch in a group: "
              f"{result[tag]['marginal_epoch_s']}", flush=True)
        store.engine.dispose()
    gx = [v for k, v in result["gx"]["steps"].items() if k.startswith("validate_")]
    result["gx_per_epoch_s"] = gx[0] if gx else None
    spark.stop()
    return result


def marginal_epoch_cost(work: Path, spark: Any, tag: str, validate: bool, epochs: int,
                        reps: int = 3) -> dict[str, Any]:
    """What one more tiny epoch adds to a group: (wall of a group of ``epochs`` tiny epochs -
    wall of a group of one) / (epochs - 1), warm session, paired per repetition."""
    from sluice.protocol.run import run_once
    from sluice.store import EpochStore

    marginal = []
    for rep in range(reps):
        walls = {}
        for k in (1, epochs) if rep % 2 == 0 else (epochs, 1):
            root = work / f"marginal-{tag}-{rep}-{k}"
            land_ysb(root / "landing", k, 20, malformed_fraction=0.0)
            spec = write_spec(root, ysb_spec_yaml(f"bench_marginal_{tag}_{rep}_{k}", root / "landing",
                                                  root / "campaign_views", epoch_files=1, k=k, validate=validate))
            store = EpochStore(f"sqlite:///{root / 'sluice.db'}")
            t0 = time.perf_counter()
            run_once(spec, store, spark, epoch_size=1, k=k)
            walls[k] = time.perf_counter() - t0
            store.engine.dispose()
        marginal.append((walls[epochs] - walls[1]) / (epochs - 1))
    return stats(marginal, 3)


# -- Airflow -----------------------------------------------------------------------------------

def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def group_breakdown(client: Any, dag_id: str, run_id: str, spec: Any, store: Any) -> dict[str, Any]:
    """Seconds of each step of one DAG run's group, from the task instances and the epoch log."""
    from tests.airflow import standalone

    tis = standalone.task_instances(client, dag_id, run_id)
    fired = standalone.xcom(client, dag_id, run_id, "wait_for_backlog")["fired_at"]
    planned = standalone.xcom(client, dag_id, run_id, "plan_group")
    group = store.group(spec.name, planned["group_id"])
    epoch_s = [e.timings["epoch_s"] for e in group.epochs]
    # One commit per group: every epoch is committed at once and carries the group's wall time
    # (its epoch_s is a share of it); one commit per epoch: the first epoch started epoch_s[0]
    # before its own commit.
    group_s = group.epochs[0].timings.get("group_s")
    first_commit = min(e.committed_at.replace(tzinfo=UTC).timestamp() for e in group.epochs)
    first_epoch_start = first_commit - (group_s if group_s is not None else epoch_s[0])
    work_s = group_s if group_s is not None else sum(epoch_s)  # from the first epoch's start to the last commit
    t = {task: (_ts(ti["start_date"]), _ts(ti["end_date"])) for task, ti in tis.items()}
    wall = t["checkpoint"][1] - fired
    steps = {
        "sensor_fire_to_plan_start_s": t["plan_group"][0] - fired,
        "plan_group_s": t["plan_group"][1] - t["plan_group"][0],
        "plan_to_run_gap_s": t["run_group"][0] - t["plan_group"][1],
        "spark_start_s": first_epoch_start - t["run_group"][0],
        "epochs_s": sum(epoch_s),
        "run_group_tail_s": t["run_group"][1] - first_epoch_start - work_s,
        "run_to_validate_gap_s": t["validate"][0] - t["run_group"][1],
        "validate_s": t["validate"][1] - t["validate"][0],
        "validate_to_checkpoint_gap_s": t["checkpoint"][0] - t["validate"][1],
        "checkpoint_s": t["checkpoint"][1] - t["checkpoint"][0],
    }
    coordination = wall - sum(epoch_s)
    return {"run_id": run_id, "k": len(epoch_s), "epoch_files": group.epochs[0].end - group.epochs[0].start,
            "group_wall_s": round(wall, 2), "coordination_s": round(coordination, 2),
            "coordination_fraction": round(coordination / wall, 4),
            "first_epoch_s": epoch_s[0], "warm_epoch_s": stats(epoch_s[1:] or epoch_s, 3)["median"],
            "steps": {k: round(v, 2) for k, v in steps.items()}}


def airflow_coordination(work: Path, mode: str, epoch_files: int, events_per_file: int,
                         max_k: int, ks: list[int] | None = None) -> dict[str, Any]:
    """DAG runs of a ``schedule: None`` pipeline, triggered through the REST API: k = 1, then
    the k at which coordination falls to 10 % (Drizzle's AIMD, up to ``max_k``); or, given
    ``ks``, one group at each of those k (the last is the steady state reported)."""
    from sluice.spec import get_spec
    from sluice.store import EpochStore
    from tests.airflow import standalone

    # What `make` exports, for a run without it: the server inherits this environment.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    for key, value in {"AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
                       "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
                       "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PYSPARK_PYTHON": sys.executable,
                       "AIRFLOW_CONN_SPARK_DEFAULT": '{"conn_type": "spark", "host": "local[2]"}'}.items():
        os.environ.setdefault(key, value)
    os.environ["PYTHONPATH"] = f"{ROOT / 'plugins'}{os.pathsep}{ROOT}"  # absolute: tasks run elsewhere
    name = f"bench_af_{mode}"
    dag_id = name  # a pipeline's DAG is named after it
    landing = Path(os.environ["SLUICE_DATA_DIR"]) / "landing" / name
    raw = ysb_spec_yaml(name, landing, Path(os.environ["SLUICE_DATA_DIR"]) / "tables" / name,
                        epoch_files=epoch_files, k=1, validate=True)
    raw["spark"]["mode"] = "submit"  # connect: the DAG runs the group in the worker, on the warm server
    raw["control"]["poll_interval_s"] = 1
    write_spec(Path(os.environ["SLUICE_PIPELINES_DIR"]), raw)
    spec = get_spec(name)
    staging = work / f"staging-{mode}"
    land_ysb(staging, epoch_files * (sum(ks) if ks else 1 + 3 * max_k), events_per_file)
    connect = None
    if mode == "connect":  # the Airflow server started next inherits SLUICE_SPARK_REMOTE
        connect, os.environ["SLUICE_SPARK_REMOTE"] = start_connect_server(work)
    server = standalone.start(work / f"airflow-{mode}")

    def server_tree() -> list[Any]:
        """The Connect server's JVM, which runs the epochs in connect mode."""
        import psutil

        if connect is None:
            return []
        try:
            root = psutil.Process(connect.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    try:
        with server.client() as client:
            standalone.wait_healthy(server, client, timeout=240)
            standalone.wait_for_dag(server, client, dag_id, timeout=180)
            standalone.set_paused(client, dag_id, False)
            store = EpochStore()
            groups = []
            meter = CpuMeter(find=lambda: [*standalone.marked_processes(server.marker), *server_tree()],
                             interval=0.5)
            idle0 = meter.sample()  # the server's idle CPU rate, to subtract from each group's
            time.sleep(20)
            idle_rate = (meter.sample() - idle0) / 20

            def run_group(files: list[Path], k: int) -> dict[str, Any]:
                landing.mkdir(parents=True, exist_ok=True)
                for path in files:
                    os.replace(path, landing / path.name)
                cpu0, java0, t0 = meter.sample(), meter.by_name("java"), time.monotonic()
                r = client.post(f"/api/v2/dags/{dag_id}/dagRuns",
                                json={"logical_date": None, "conf": {"epoch_size": epoch_files, "k": k}})
                r.raise_for_status()
                run_id = r.json()["dag_run_id"]
                standalone.wait_for_run_state(server, client, dag_id, run_id, timeout=1800)
                row = group_breakdown(client, dag_id, run_id, spec, store)
                cpu, java = meter.sample() - cpu0, meter.by_name("java") - java0
                row["cpu_s"] = {"all": round(cpu, 1), "spark_jvm": round(java, 1), "airflow_tasks": round(
                    cpu - java - idle_rate * (time.monotonic() - t0), 1), "server_idle_per_s": round(idle_rate, 3)}
                print(f"  airflow ({mode}) k={k}: {json.dumps(row)}", flush=True)
                return row

            files = iter(sorted(staging.glob("*.json")))
            k_run = 1
            k_star = None if ks else max_k
            for k in ks or []:
                groups.append(run_group([next(files) for _ in range(epoch_files * k)], k))
            # Drizzle's AIMD: grow k until coordination is <= 10 % of the group, i.e.
            # k >= 9 C / E. The k = 1 run has only a cold epoch, so its estimate is low and
            # a second step uses the warm epoch time of the first k > 1 run.
            for _ in range(0 if ks else 4):
                groups.append(run_group([next(files) for _ in range(epoch_files * k_run)], k_run))
                last = groups[-1]
                c, e = last["coordination_s"], last["warm_epoch_s"]
                # Aim at 9.5 %, not at the 10 % edge: C moves a little from group to group.
                k_star = max(1, math.ceil(c * (1 - 0.095) / (0.095 * e))) if e > 0 else max_k
                if last["coordination_fraction"] <= 0.10 or k_run >= max_k or min(k_star, max_k) <= k_run:
                    break
                k_run = min(k_star, max_k)
            k_run = groups[-1]["k"]  # the k of the last group run, the steady state reported
            standalone.set_paused(client, dag_id, True)
            meter.stop()
    except BaseException:
        print(standalone.diagnostics(server, (dag_id,)))
        raise
    finally:
        standalone.stop(server)
        if connect is not None:
            os.environ.pop("SLUICE_SPARK_REMOTE", None)
            connect.terminate()
            connect.wait(timeout=60)
    steady = groups[-1]
    by_k: dict[int, list[float]] = {}
    for g in groups:
        by_k.setdefault(g["k"], []).append(g["coordination_fraction"])
    return {"mode": mode, "groups": groups, "k_aimd": k_star, "k_run": k_run,
            "coordination_fraction_by_k": {k: stats(v, 4) for k, v in sorted(by_k.items())},
            "airflow_cpu_s_per_group": stats([g["cpu_s"]["airflow_tasks"] for g in groups], 1)["median"],
            "coordination_s_per_group": groups[0]["coordination_s"],
            "coordination_fraction": steady["coordination_fraction"]}


# -- a group's fixed CPU on a warm Spark Connect server ----------------------------------------

CONNECT_SIZES = (1, 4, 8)  # files of 10,000 events per group: the fit's records axis
CONNECT_UI_PORT = 4151


class _ServerCpu:
    """The Connect server JVM's CPU-seconds (utime + stime of /proc/<pid>/stat, every thread),
    sampled every ``interval`` s with ``time.monotonic()``: a group's client (another process)
    stamps its steps with the same clock, so each step gets the server CPU spent during it."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        import threading

        self.pid, self.interval = pid, interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def read(self) -> float:
        with open(f"/proc/{self.pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime (fields 14, 15)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.monotonic(), self.read()))

    def at(self, t: float) -> float:
        """CPU-seconds at ``t``, interpolated between samples."""
        import bisect

        i = bisect.bisect_left(self.samples, (t, -1.0))
        if i <= 0:
            return self.samples[0][1]
        if i >= len(self.samples):
            return self.samples[-1][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _java_pid(proc: subprocess.Popen[bytes]) -> int:
    """The server's JVM: spark-submit's java (itself, once it execs, or its child)."""
    import psutil

    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        if p.name() == "java":
            return p.pid
    raise RuntimeError("no java process under the Connect server")


def _steps(trace: dict[str, Any], server: _ServerCpu, idle_rate: float) -> dict[str, dict[str, float]]:
    """Per traced step (summed over its calls): wall, client CPU, and the server's CPU beyond
    idle while it ran (steps nest: ``commit_group`` holds the writes; see ``connect_trace.STEPS``)."""
    steps: dict[str, dict[str, float]] = {}
    for name, _thread, t0, t1, cpu in trace["calls"]:
        row = steps.setdefault(name, {"calls": 0, "wall_s": 0.0, "client_cpu_s": 0.0, "server_cpu_s": 0.0})
        row["calls"] += 1
        row["wall_s"] += t1 - t0
        row["client_cpu_s"] += cpu
        row["server_cpu_s"] += max(0.0, server.at(t1) - server.at(t0) - idle_rate * (t1 - t0))
    return {k: {m: round(v, 3) for m, v in row.items()} for k, row in steps.items()}


def _jvm_counters(pid: int, port: int = CONNECT_UI_PORT) -> dict[str, float]:
    """The JVM's own CPU accounting (``jcmd PerfCounter.print``): seconds spent by the JIT
    compilers and in GC pauses so far, and Spark's code generation (Janino) so far."""
    out = subprocess.run(["jcmd", str(pid), "PerfCounter.print"], capture_output=True, text=True).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    freq = float(values.get("sun.os.hrt.frequency", "1e9"))
    gc = sum(float(v) for k, v in values.items() if re.fullmatch(r"sun\.gc\.collector\.\d+\.time", k))
    counters = {"jit_s": float(values.get("java.ci.totalTime", 0)) / freq, "gc_pause_s": gc / freq}
    try:
        from sluice.net import get_json

        metrics = get_json(_ui_url("/metrics/json", port))["histograms"]
        key = next(k for k in metrics if k.endswith("CodeGenerator.compilationTime"))
        counters["codegen_classes"] = metrics[key]["count"]
        counters["codegen_s"] = metrics[key]["mean"] * metrics[key]["count"] / 1000
    except Exception:  # no metrics servlet
        pass
    return counters


def _ui_url(path: str, port: int = CONNECT_UI_PORT) -> str:
    return f"http://127.0.0.1:{port}{path}"


def _rest(path: str, port: int = CONNECT_UI_PORT) -> Any:
    """Spark's REST API (``/api/v1``) on the server's UI."""
    from sluice.net import get_json

    return get_json(_ui_url(f"/api/v1{path}", port))


def _app_id(port: int, timeout_s: float = 60) -> str:
    """The application's id from its UI, which may come up after the server listens."""
    from sluice.net import poll_json

    return poll_json(_ui_url("/api/v1/applications", port), lambda apps: str(apps[0]["id"]), timeout_s, every_s=1)


def _spark_jobs(app: str, since_job: int, port: int = CONNECT_UI_PORT) -> tuple[list[dict[str, Any]], int]:
    """The server's jobs after ``since_job`` (Spark's REST API): name, stages, tasks, executor CPU."""
    jobs = [j for j in _rest(f"/applications/{app}/jobs", port) if j["jobId"] > since_job]
    stages = {s["stageId"]: s for s in _rest(f"/applications/{app}/stages", port)}
    out = []
    for j in sorted(jobs, key=lambda j: j["jobId"]):
        cpu = sum(stages[s].get("executorCpuTime", 0) for s in j["stageIds"] if s in stages) / 1e9
        out.append({"job": j["jobId"], "name": j["name"][:90], "stages": len(j["stageIds"]),
                    "tasks": j["numTasks"], "executor_cpu_s": round(cpu, 3)})
    return out, max([j["jobId"] for j in jobs], default=since_job)


def connect_groups(work: Path, reps: int, profile: tuple[int, ...] = (), warm_groups: int = 4,
                   variants: dict[str, dict[str, Any]] | None = None, server_java: str | None = None) -> dict[str, Any]:
    """A group's fixed CPU on a warm Connect server: ``reps`` groups of each size in
    ``CONNECT_SIZES`` (alternating) of one pipeline, each a ``run_group --plan`` client
    (``connect_trace``) against the server; per group the client's CPU and the server JVM's
    CPU beyond its idle rate (of which the JIT compilers', GC pauses' and Spark's code
    generation, from the JVM's counters), and the server's Spark jobs (REST API);
    ``CPU = fixed + per_record * records`` fitted as ``cost.py`` does (``Linear``).

    ``variants`` (A/B): label -> ``{"conf": spark.conf of the pipeline, "env": client env,
    "java": the server's JVM options}``, each its own pipeline, their groups alternating; a
    variant with other ``java`` options than another gets a server of its own (``server_java``:
    the default, ``None``: ``sluice.spark.connect_java_options()``). ``profile``: more
    groups under JFR (server) after the measured ones, of these numbers of files."""
    from bench.cost import Linear
    from sluice.spark import start_connect_server as start
    from sluice.store import EpochStore

    variants = variants or {"base": {}}
    events = 10_000
    root = work / "connect"
    order = []
    for rep in range(reps):
        for size in CONNECT_SIZES if rep % 2 == 0 else CONNECT_SIZES[::-1]:
            labels = list(variants) if (rep + CONNECT_SIZES.index(size)) % 2 == 0 else list(variants)[::-1]
            order += [(label, size) for label in labels]
    # The warm groups take every size in turn: a size never run before pays its own JIT (the
    # 80 k groups, when only the smaller two warmed the server, tilted the fit's slope up).
    warm = [(label, CONNECT_SIZES[i % len(CONNECT_SIZES)]) for i in range(warm_groups) for label in variants]
    profiled = [(next(iter(variants)), n) for n in profile]
    pipes: dict[str, dict[str, Any]] = {}
    for label, variant in variants.items():
        name = f"bench_connect_{label}"
        base = root / label
        raw = ysb_spec_yaml(name, base / "landing", base / "tables" / "campaign_views", epoch_files=1, k=1,
                            validate=True)
        raw["spark"]["conf"] = {**(raw["spark"].get("conf") or {}), **variant.get("conf", {})}
        write_spec(Path(os.environ["SLUICE_PIPELINES_DIR"]), raw)
        (base / "landing").mkdir(parents=True)
        total = sum(n for lab, n in [*warm, *order, *profiled] if lab == label)
        pipes[label] = {"name": name, "landing": base / "landing", "store": f"sqlite:///{base / 'sluice.db'}",
                        "files": iter(land_ysb(base / "staging", total, events)), "env": variant.get("env", {})}
    # A variant with its own ``java`` options (JVM flags) gets a server of its own (all warm,
    # each measured by its own JVM's CPU); the others share the first.
    # ``"server": "spark_class"``: Spark's own server class (a class loader per session), as before.
    java_of = {label: (v.get("java", server_java), v.get("server", "sluice")) for label, v in variants.items()}
    servers: dict[Any, dict[str, Any]] = {}
    started: list[subprocess.Popen[bytes]] = []
    try:
        for i, (java, kind) in enumerate(dict.fromkeys(java_of.values())):
            port = CONNECT_UI_PORT + i
            ui = {"spark.ui.enabled": "true", "spark.ui.port": str(port),
                  "spark.ui.retainedJobs": "100000", "spark.ui.retainedStages": "100000"}
            with _server_kind(kind):
                proc, url = start(work / f"connect-server-{i}.log", "local[2]", conf=ui, java_options=java)
            started.append(proc)
            pid = _java_pid(proc)
            servers[(java, kind)] = {"proc": proc, "url": url, "pid": pid, "cpu": _ServerCpu(pid), "port": port,
                                     "app": _app_id(port), "last_job": -1, "idle": 0.0}
    except BaseException:  # no server outlives a failed start
        for proc in started:
            proc.terminate()
        raise
    pid = servers[java_of[next(iter(variants))]]["pid"]  # (the JFR profile's)
    traces = root / "traces"
    traces.mkdir(parents=True)
    stores = {label: EpochStore(p["store"]) for label, p in pipes.items()}

    def group(label: str, n_files: int, tag: str) -> dict[str, Any]:
        pipe = pipes[label]
        srv = servers[java_of[label]]
        server, pid, port, idle_rate, url = srv["cpu"], srv["pid"], srv["port"], srv["idle"], srv["url"]
        for _ in range(n_files):
            path = next(pipe["files"])
            os.replace(path, pipe["landing"] / path.name)
        trace_path = traces / f"{tag}.json"
        jvm0 = _jvm_counters(pid, port)
        t0 = time.monotonic()
        s0 = server.read()
        client = subprocess.Popen([sys.executable, str(ROOT / "bench" / "connect_trace.py"), str(trace_path),
                                   *run_group_args(pipe["name"], pipe["store"], epoch_size=n_files, k=1)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "SLUICE_SPARK_REMOTE": url, **pipe["env"]})
        meter = CpuMeter(client.pid, interval=0.1)
        _, err = client.communicate()
        client_cpu = meter.stop()
        wall = time.monotonic() - t0
        time.sleep(0.3)  # the server's last RPCs' tail
        server_cpu = server.read() - s0 - idle_rate * (time.monotonic() - t0)
        jvm1 = _jvm_counters(pid, port)
        if client.returncode:
            raise RuntimeError(f"group failed ({client.returncode}): {err[-3000:]}")
        g = stores[label].groups(pipe["name"])[-1]
        records = sum(int(e.rows.get("input") or 0) for e in g.epochs)
        trace = json.loads(trace_path.read_text())
        jobs, srv["last_job"] = _spark_jobs(srv["app"], srv["last_job"], port)
        row = {"variant": label, "tag": tag, "files": n_files, "records": records, "wall_s": round(wall, 2),
               "client_cpu_s": round(client_cpu, 2), "server_cpu_s": round(server_cpu, 2),
               "cpu_s": round(client_cpu + server_cpu, 2), "spark_jobs": len(jobs),
               "spark_job_executor_cpu_s": round(sum(j["executor_cpu_s"] for j in jobs), 2),
               "server_jvm": {k: round(jvm1[k] - jvm0.get(k, 0.0), 3) for k in jvm1},
               "steps": _steps(trace, server, idle_rate), "jobs": jobs,
               "timings": g.epochs[0].timings}
        print(f"  connect group {tag} ({label}): files={n_files} records={records} wall={wall:.1f}s "
              f"client={client_cpu:.2f} server={server_cpu:.2f} jobs={len(jobs)} {row['server_jvm']}", flush=True)
        return row

    try:
        for i, (label, n) in enumerate(warm):  # a server that lives for days has paid its JIT warm-up
            group(label, n, f"warm{i}-{label}")
        c0, t0 = {k: srv["cpu"].read() for k, srv in servers.items()}, time.monotonic()
        time.sleep(15)
        for k, srv in servers.items():
            srv["idle"] = (srv["cpu"].read() - c0[k]) / (time.monotonic() - t0)
        rows = [group(label, n, f"g{i}-{n}-{label}") for i, (label, n) in enumerate(order)]
        profile_out: dict[str, Any] = {}
        if profiled:
            jfr = root / "server.jfr"
            subprocess.run(["jcmd", str(pid), "JFR.start", "name=sluice"], check=True, capture_output=True)
            prows = [group(label, n, f"jfr{i}-{n}-{label}") for i, (label, n) in enumerate(profiled)]
            subprocess.run(["jcmd", str(pid), "JFR.dump", "name=sluice", f"filename={jfr}"], check=True,
                           capture_output=True)
            subprocess.run(["jcmd", str(pid), "JFR.stop", "name=sluice"], capture_output=True)
            profile_out = {"jfr": str(jfr), "groups": [{k: r[k] for k in ("tag", "records", "cpu_s", "server_cpu_s")}
                                                      for r in prows]}
    finally:
        for store in stores.values():
            store.engine.dispose()
        for srv in servers.values():
            srv["cpu"].stop()
            srv["proc"].terminate()
            try:
                srv["proc"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                srv["proc"].kill()
    out: dict[str, Any] = {}
    for label in variants:
        mine = [r for r in rows if r["variant"] == label]
        out[label] = _connect_fit(mine, Linear)
    first = out[next(iter(variants))]
    result = dict(first)
    if len(variants) > 1:
        result["ab"] = {label: {k: v for k, v in fit.items() if k != "connect_group_steps"}
                        for label, fit in out.items()}
        result["ab_variants"] = variants
        result["ab_steps"] = {label: fit["connect_group_steps"] for label, fit in out.items()}
    result.update(connect_server_idle_cpu_per_s=round(servers[java_of[next(iter(variants))]]["idle"], 4),
                  connect_server_idle_by_java_options={f"{java if java is not None else 'default'} ({kind})":
                                                       round(v["idle"], 4) for (java, kind), v in servers.items()},
                  groups=rows, profile=profile_out,
                  config={"sizes_files": list(CONNECT_SIZES), "events_per_file": events, "reps": reps,
                          "server_java_options": dict(java_of),
                          "warm_groups": warm_groups,
                          "pipeline": "ysb (aggregate MERGE, GX suite), commit: group, k = 1",
                          "server": f"local[2], warm ({warm_groups} groups per variant first)"})
    return result


@contextlib.contextmanager
def _server_kind(kind: str) -> Iterator[None]:
    """``spark_class``: ``start_connect_server`` submits Spark's ``SparkConnectServer`` class, as
    sluice did before its own application (``sluice/jobs/connect_server.py``), for an A/B."""
    import sluice.spark as sp

    if kind == "sluice":
        yield
        return
    made = sp.connect_server_command

    def spark_class(*args: Any, **kwargs: Any) -> list[str]:
        cmd, out = made(*args, **kwargs)[:-1], []  # without the application
        for i, arg in enumerate(cmd):
            if arg.split("=", 1)[0] in sp.CONNECT_SERVER_CONF and cmd[i - 1] == "--conf":
                out.pop()  # its --conf
            else:
                out.append(arg)
        return [out[0], "--class", "org.apache.spark.sql.connect.service.SparkConnectServer", *out[1:]]

    sp.connect_server_command = spark_class
    try:
        yield
    finally:
        sp.connect_server_command = made


def _connect_fit(rows: list[dict[str, Any]], linear: Any) -> dict[str, Any]:
    """The fixed (intercept) and per-record CPU of ``rows``' groups, and each step's fixed part."""
    cpu = linear.fit([(r["records"], r["cpu_s"]) for r in rows])
    server_fit = linear.fit([(r["records"], r["server_cpu_s"]) for r in rows])
    client_fit = linear.fit([(r["records"], r["client_cpu_s"]) for r in rows])
    steps = {}
    for key in sorted({k for r in rows for k in r["steps"]}):
        per = {}
        for side in ("server_cpu_s", "client_cpu_s", "wall_s"):
            per[side.replace("_s", "_fixed_s")] = round(
                linear.fit([(r["records"], r["steps"].get(key, {}).get(side, 0.0)) for r in rows]).fixed, 3)
        per["calls"] = rows[-1]["steps"].get(key, {}).get("calls", 0)
        steps[key] = per
    for key in sorted({k for r in rows for k in r["server_jvm"]}):
        steps[f"server_jvm:{key}"] = {"server_cpu_fixed_s": round(
            linear.fit([(r["records"], r["server_jvm"].get(key, 0.0)) for r in rows]).fixed, 3)}
    steps["spark_tasks(executorCpuTime)"] = {"server_cpu_fixed_s": round(
        linear.fit([(r["records"], r["spark_job_executor_cpu_s"]) for r in rows]).fixed, 3)}
    smallest = [r for r in rows if r["files"] == min(CONNECT_SIZES)]
    return {"connect_group_fixed_cpu_s": round(server_fit.fixed, 2),
            "connect_group_fixed_cpu_with_client_s": round(cpu.fixed, 2),
            "connect_group_client_fixed_cpu_s": round(client_fit.fixed, 2),
            "connect_group_cpu_per_million_records_s": round(cpu.per_record * 1e6, 2),
            "smallest_group": {"records": smallest[0]["records"],
                               "server_cpu_s": stats([r["server_cpu_s"] for r in smallest], 2),
                               "client_cpu_s": stats([r["client_cpu_s"] for r in smallest], 2),
                               "wall_s": stats([r["wall_s"] for r in smallest], 2),
                               "spark_jobs": stats([r["spark_jobs"] for r in smallest], 0)},
            "connect_group_steps": steps}


def merge_result(name: str, update: dict[str, Any]) -> None:
    """Add ``update``'s keys to an existing result file (keeps the others)."""
    path = results_dir() / f"{name}.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update(update)
    write_result(name, result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-airflow", action="store_true")
    parser.add_argument("--airflow-only", action="store_true",
                        help="only the Airflow coordination of --modes, merged into overhead.json (other keys kept)")
    parser.add_argument("--max-k", type=int, default=None, help="the largest k the AIMD may run (32; 8 with --quick)")
    parser.add_argument("--ks", default=None, help="groups at these k (e.g. 1,32) instead of the AIMD's")
    parser.add_argument("--modes", default="submit,connect", help="run_group modes measured under Airflow")
    parser.add_argument("--connect", action="store_true",
                        help="only a group's fixed CPU on a warm Connect server (added to overhead.json)")
    parser.add_argument("--connect-reps", type=int, default=4, help="groups of each size (--connect)")
    parser.add_argument("--profile", nargs="?", const="1,1,4", default="",
                        help="--connect: more groups under JFR, of these numbers of files (default 1,1,4)")
    parser.add_argument("--connect-warm", type=int, default=4, help="--connect: untimed groups first")
    parser.add_argument("--server-java-options", default=None,
                        help="--connect: JVM options of the Connect server (default: sluice's own)")
    parser.add_argument("--ab", default=None,
                        help='--connect A/B: JSON {"label": {"conf": {...}, "env": {...}}, ...}, groups alternating')
    args = parser.parse_args(argv)
    work = configure("overhead")
    if args.connect:
        profile = tuple(int(n) for n in args.profile.split(",") if n)
        out = connect_groups(work, args.connect_reps, profile=profile, warm_groups=args.connect_warm,
                             variants=json.loads(args.ab) if args.ab else None, server_java=args.server_java_options)
        write_result("overhead_connect_ab" if args.ab else "overhead_connect_groups", out)  # every group's steps
        # Of an A/B run the last variant's figures are the ones of record (``ab`` holds every variant's).
        last = out["ab"][list(out["ab"])[-1]] | {"connect_group_steps": out["ab_steps"][list(out["ab"])[-1]]} \
            if args.ab else out
        merge_result("overhead", {k: v for k, v in last.items() if k.startswith("connect_group")}
                     | {"connect_server_idle_cpu_per_s": out["connect_server_idle_cpu_per_s"],
                        "connect_group_smallest": last["smallest_group"]}
                     | ({"connect_group_ab": out["ab"], "connect_group_ab_variants": out["ab_variants"]}
                        if args.ab else {}))
        print(json.dumps({k: v for k, v in out.items()
                          if k.startswith("connect_group_") and k != "connect_group_steps"}))
        return 0
    max_k = args.max_k or (8 if args.quick else 32)
    path = results_dir() / "overhead.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    if args.airflow_only:  # the other figures of overhead.json stay as they were
        result = kept
    else:  # a warm Connect server's figures (--connect) are kept, but by a quick run's
        result = {} if args.quick else {k: v for k, v in kept.items() if k.startswith("connect_")}
        print("cold start", flush=True)
        result["cold_start"] = cold_start(work, 2 if args.quick else 3)
        print("fixed cost per epoch", flush=True)
        result["epoch_fixed_cost"] = epoch_fixed_cost(work, 5 if args.quick else 12)
    result.setdefault("airflow", {})
    if not args.skip_airflow:
        for mode in args.modes.split(","):
            print(f"airflow coordination ({mode})", flush=True)
            try:
                result["airflow"][mode] = airflow_coordination(
                    work, mode, epoch_files=4, events_per_file=10_000, max_k=max_k,
                    ks=[int(k) for k in args.ks.split(",")] if args.ks else None)
            except Exception as exc:  # keep the other figures; say what failed
                result["airflow"][mode] = {"failed": f"{type(exc).__name__}: {exc}"}
    measured = {m: r for m, r in result["airflow"].items() if "coordination_fraction" in r}
    if measured:
        best = min(measured, key=lambda m: measured[m]["coordination_fraction"])
        result["coordination_fraction"] = measured[best]["coordination_fraction"]
        result["coordination_mode"] = best
        result["steady_state_k"] = measured[best]["k_run"]
        result["airflow_cpu_s_per_group"] = measured[best]["airflow_cpu_s_per_group"]
    result["config"] = {"quick": args.quick, "spark": "local[2]", "executor": "LocalExecutor (airflow standalone)"}
    write_result("overhead", result)
    plot(result, results_dir() / "overhead.png")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("coordination", "steady"))}))
    return 0


def start_connect_server(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A warm Spark Connect server (local[2]); returns it and its ``sc://`` URL once it listens."""
    from sluice.spark import start_connect_server as start

    return start(work / "connect-server.log", "local[2]")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    cold = result["cold_start"]
    keys = ["import_s", "session_s", "first_query_s", "first_delta_commit_s"]
    left = 0.0
    for key in keys:
        axes[0].barh(["cold start"], [cold[key]["median"]], left=left, label=key.removesuffix("_s"))
        left += cold[key]["median"]
    fixed = result["epoch_fixed_cost"]
    colours: dict[str, Any] = {}  # one colour and one legend entry per step
    for tag in ("plain", "gx"):
        left = 0.0
        for key, value in fixed[tag]["steps"].items():
            if key == "epoch_s" or not value["median"]:
                continue
            step = key.removesuffix("_s")
            bar = axes[0].barh([f"tiny epoch ({tag})"], [value["median"]], left=left, color=colours.get(step),
                               label=None if step in colours else step)
            colours.setdefault(step, bar.patches[0].get_facecolor())
            left += value["median"]
    axes[0].set_xlabel("seconds (median)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("cold start and fixed cost per epoch")
    labels, bottoms = [], []
    for mode, r in result.get("airflow", {}).items():
        for g in r.get("groups", []):
            labels.append(f"{mode} k={g['k']}")
            bottoms.append(g["steps"])
    if bottoms:
        left_by_bar = [0.0] * len(bottoms)
        for key in bottoms[0]:
            values = [b[key] for b in bottoms]
            axes[1].barh(labels, values, left=left_by_bar, label=key.removesuffix("_s"))
            left_by_bar = [a + v for a, v in zip(left_by_bar, values, strict=True)]
        axes[1].legend(fontsize=7)
        axes[1].set_xlabel("seconds from the sensor's fire")
        axes[1].set_title("a group under Airflow (LocalExecutor)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
