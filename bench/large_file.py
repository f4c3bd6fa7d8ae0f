"""Large landed files: peak memory of one JSON-lines file processed as one epoch, against its size.

    python -m bench.large_file [--quick] [--sizes-mb 300,1000,3000] [--driver-memory 1g] [--no-control]

The file source reads a file above ``WHOLE_FILE_MAX_BYTES`` (8 MiB) line by line
(``sources.files.number_lines``), not whole (``wholetext``: one row, one string per file). This
measures that the memory a group needs does not grow with the file: one YSB events file of each
size (default ~0.3, ~1 and ~3 GB; ``--quick`` 50, 150 and 450 MB) lands alone in a landing
folder and is processed as one epoch (one group, k = 1) by the shipped ``ysb`` pipeline
(aggregate MERGE into Delta, malformed records to ``_rejected``; GX off, as in the other Spark
benchmarks: it validates the small aggregate, not the read).

Each size is its own run-once application, launched as Airflow's ``SparkSubmitOperator`` would
(``spark.mode: submit``): ``spark-submit --master local[2] ... sluice/jobs/run_group.py
--pipeline P --plan``, with the DAG's confs, the spec's ``spark.conf`` and ``spark.driver.memory``
small (1g): a fresh JVM (driver, and the executor in local mode) and a fresh Python driver per
size. Measured per size:

* peak RSS of the JVM and of the Python driver process (its child), sampled every 0.2 s with
  psutil, and the kernel's high-water mark (``VmHWM`` of ``/proc/<pid>/status``);
* the JVM's heap: from its GC log (``-Xlog:gc``; heap used before and after each collection, the
  max heap) and from Spark's REST API (``/api/v1/applications/<id>/executors``,
  ``peakMemoryMetrics`` of the driver, polled each second);
* the bytes Spark kept on local disk (``spark.local.dir``: the group's cached records spill);
* wall time of the application and of the group (the epoch store's ``group_s``), and MB/s.

The table is checked against an oracle computed from the raw file in this process, line by
line (``include.generators.ysb.classify`` and ``window_counts`` on a generator; never the whole
file in memory), and the epoch's input and rejected counts against the oracle's.

The bigger files are generated once with ``include.generators.ysb.event_batches`` (0.1 %
malformed lines), the smaller ones are byte prefixes of it (cut at a line end). Control
(``--no-control`` skips it): the smallest file again, read whole as a small file would be
(``WHOLE_FILE_MAX_BYTES`` raised in that application only: this file is then the
spark-submit application, see ``wholetext_child``), under the same driver memory. A file above
2 GiB cannot be read whole at all (a Java array's limit).

Files live under ``var/bench/large_file/`` (git-ignored) and are deleted at the end; with less
than ~10 GB free on that disk the sizes are capped at 2 GB (said in the JSON).
Writes ``bench/results/large_file.json`` and ``large_file.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import ROOT, configure, results_dir, run_group_args, write_result, write_spec, ysb_spec_yaml
from sluice.net import get_json

MB = 1_000_000
CORES = 2
SIZES_MB = (300, 1000, 3000)
QUICK_SIZES_MB = (50, 150, 450)
#: Below this much free disk the sizes are capped (the largest file, a prefix copy and
#: Spark's spill of the cached records are on the disk at once).
MIN_FREE_BYTES = 10_000_000_000
CAPPED_MAX_MB = 2000
#: ``bounded``: the largest file's peak RSS within this factor of the smallest's.
BOUND = 1.25
EVENTS_PER_SECOND = 20_000  # event time: 20,000 events per second, so windows of 200,000 events
START_MS = 1_700_000_000_000
WHOLETEXT_FLAG = "--wholetext-child"


# -- the input -------------------------------------------------------------------------------


def generate(path: Path, size: int, seed: int = 0) -> int:
    """YSB events into ``path`` until it holds at least ``size`` bytes, in large buffered writes
    (one ``event_batches`` batch, ~5 MB, at a time). Returns the bytes written."""
    from include.generators.ysb import event_batches

    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    batches = event_batches(rate=EVENTS_PER_SECOND, duration=10 ** 7, files_per_second=1, seed=seed,
                            start_ms=START_MS, malformed_fraction=0.001)
    with open(path, "wb", buffering=16 * MB) as out:
        for lines in batches:
            chunk = ("\n".join(lines) + "\n").encode()
            out.write(chunk)
            written += len(chunk)
            if written >= size:
                break
    return written


def land_prefix(source: Path, landing: Path, size: int, mtime: int) -> Path:
    """Land the first ``size`` bytes of ``source`` (up to the end of the line they end in) as
    ``landing/ysb-000000.json``: written under a hidden name, then renamed."""
    landing.mkdir(parents=True, exist_ok=True)
    target, tmp = landing / "ysb-000000.json", landing / ".ysb-000000.json.tmp"
    with open(source, "rb") as src, open(tmp, "wb") as dst:
        left = size
        while left > 0:
            chunk = src.read(min(left, 8 * MB))
            if not chunk:
                break
            dst.write(chunk)
            left -= len(chunk)
        dst.write(src.readline())  # the rest of the last line
    os.utime(tmp, (mtime, mtime))
    os.replace(tmp, target)
    return target


def raw_lines(path: Path) -> Iterator[tuple[str, int, bytes]]:
    """``(file, line, bytes)`` of each line, as ``include.generators.ysb.raw_events`` numbers
    them (split on ``\\n``), read one line at a time."""
    with open(path, "rb", buffering=8 * MB) as fh:
        for n, raw in enumerate(fh, start=1):
            yield str(path), n, raw[:-1] if raw.endswith(b"\n") else raw


def oracle(path: Path) -> dict[str, Any]:
    """Views per (campaign, window) from the raw file, streamed; and its record counts."""
    from include.generators.ysb import classify, window_counts

    seen = Counter()

    def counted(events: Iterator[tuple[str, int, dict | None]]) -> Iterator[tuple[str, int, dict | None]]:
        for event in events:
            seen["records"] += 1
            seen["rejected"] += event[2] is None
            yield event

    t0 = time.perf_counter()
    windows = window_counts(counted(classify(raw_lines(path))))
    return {"windows": windows, "records": seen["records"], "rejected": seen["rejected"],
            "seconds": round(time.perf_counter() - t0, 1)}


# -- measuring a spark-submit application --------------------------------------------------------


def role(proc: Any) -> str:
    """What a process of the application's tree is: the JVM, the Python driver, a Python worker."""
    name = proc.name()
    if name == "java":
        return "jvm"
    if name.startswith("python"):
        cmd = " ".join(proc.cmdline())
        return "python_driver" if "run_group.py" in cmd or WHOLETEXT_FLAG in cmd else "python_workers"
    return "other"  # bash and the launcher, before spark-submit execs the JVM


def high_water_mark(pid: int) -> int | None:
    """The kernel's peak RSS of a live process (``VmHWM``), in bytes."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def folder_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


class TreeMeter:
    """RSS of a process tree by role, every ``interval`` s: peaks, the kernel's high-water
    marks, CPU-seconds, a time series; and the size of Spark's local folder."""

    def __init__(self, pid: int, local_dir: Path, interval: float = 0.2) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.local_dir = local_dir
        self.interval = interval
        self.t0 = time.monotonic()
        self.peak: dict[str, int] = {}  # role -> max RSS of one process of that role
        self.peak_total = 0
        self.hwm: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.roles: dict[int, str] = {}
        self.series: list[tuple[float, int, int]] = []  # (s, JVM RSS, Python driver RSS)
        self.local_peak = 0
        self.jvm_pid: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def sample(self, ticks: int) -> None:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        by_role: dict[str, int] = {}
        for p in procs:
            try:
                rss = p.memory_info().rss
                r = role(p)  # again each time: spark-submit is bash until it execs java
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.roles[p.pid] = r
            self.cpu[p.pid] = max(self.cpu.get(p.pid, 0.0), t.user + t.system)
            if r == "jvm":
                self.jvm_pid = p.pid
            if r in ("jvm", "python_driver"):
                hwm = high_water_mark(p.pid)
                if hwm:
                    self.hwm[p.pid] = max(self.hwm.get(p.pid, 0), hwm)
            by_role[r] = by_role.get(r, 0) + rss
            self.peak[r] = max(self.peak.get(r, 0), rss)
        self.peak_total = max(self.peak_total, sum(v for k, v in by_role.items() if k != "other"))
        self.series.append((round(time.monotonic() - self.t0, 2), by_role.get("jvm", 0),
                            by_role.get("python_driver", 0)))
        if ticks % 10 == 0 and self.local_dir.is_dir():
            self.local_peak = max(self.local_peak, folder_bytes(self.local_dir))

    def _loop(self) -> None:
        ticks = 0
        while not self._stop.wait(self.interval):
            self.sample(ticks)
            ticks += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def hwm_of(self, r: str) -> int | None:
        found = [v for pid, v in self.hwm.items() if self.roles.get(pid) == r]
        return max(found) if found else None

    def cpu_of(self, r: str) -> float:
        return round(sum(v for pid, v in self.cpu.items() if self.roles.get(pid) == r), 1)


class RestPoller:
    """``peakMemoryMetrics`` of the driver (local mode: the executor too) from Spark's REST API,
    each ``interval`` s while the application's UI is up; the last answer holds the peaks."""

    def __init__(self, port: int, interval: float = 1.0) -> None:
        self.base = f"http://127.0.0.1:{port}/api/v1/applications"
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self.max_memory: int | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _get(self, url: str) -> Any:
        return get_json(url, timeout_s=2)

    def _loop(self) -> None:
        app = None
        while not self._stop.wait(self.interval):
            try:
                app = app or self._get(self.base)[0]["id"]
                for executor in self._get(f"{self.base}/{app}/executors"):
                    if executor.get("id") != "driver":
                        continue
                    self.max_memory = executor.get("maxMemory")
                    for key, value in (executor.get("peakMemoryMetrics") or {}).items():
                        self.peaks[key] = max(self.peaks.get(key, 0), int(value))
                    self.polls += 1
            except Exception:  # the UI is not up yet, or gone
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_GC_LINE = re.compile(r"GC\(\d+\) (Pause \w+(?: \w+)?) .*?(\d+)([KMG])->(\d+)([KMG])\((\d+)([KMG])\)")
_HEAP_MAX = re.compile(r"Heap Max Capacity: (\d+)([KMG])")
_UNIT = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def gc_log(path: Path) -> dict[str, Any]:
    """Heap figures from a ``-Xlog:gc,gc+init`` file: max heap, heap used before a collection
    (its peak), after any collection and after a full one (what stayed live), collections."""
    found: dict[str, Any] = {"max_heap": None, "peak_used_before_gc": 0, "peak_used_after_gc": 0,
                             "peak_used_after_full_gc": None, "peak_committed": 0, "young_gcs": 0, "full_gcs": 0}
    if not path.is_file():
        return found
    for line in path.read_text().splitlines():
        if m := _HEAP_MAX.search(line):
            found["max_heap"] = int(m[1]) * _UNIT[m[2]]
        elif m := _GC_LINE.search(line):
            before, after = int(m[2]) * _UNIT[m[3]], int(m[4]) * _UNIT[m[5]]
            found["peak_used_before_gc"] = max(found["peak_used_before_gc"], before)
            found["peak_used_after_gc"] = max(found["peak_used_after_gc"], after)
            found["peak_committed"] = max(found["peak_committed"], int(m[6]) * _UNIT[m[7]])
            if "Full" in m[1]:
                found["full_gcs"] += 1
                found["peak_used_after_full_gc"] = max(found["peak_used_after_full_gc"] or 0, after)
            else:
                found["young_gcs"] += 1
    return found


def submit_command(spec: Any, app: list[str], gc_path: Path) -> list[str]:
    """What the DAG's ``RunGroupSubmitOperator`` runs (``sluice.airflow.dag_factory``): the
    DAG's confs and the spec's ``spark.conf``, the jars, the py-files; on local[2], with a GC log."""
    from pyspark.find_spark_home import _find_spark_home

    from sluice.paths import JOBS_DIR, jars_dir
    from sluice.spark import JAR_NAMES, python_files, run_once_java_options, spark_conf

    java_options = (f"{run_once_java_options()} -Dlog4j2.configurationFile=file:{JOBS_DIR / 'log4j2.properties'} "
                    f"-Xlog:gc,gc+init:file={gc_path}")
    conf = spark_conf({"spark.driver.extraJavaOptions": java_options, **spec.spark.conf})
    cmd = [str(Path(_find_spark_home()) / "bin" / "spark-submit"), "--master", f"local[{CORES}]",
           "--name", f"sluice-{spec.name}", "--jars", ",".join(str(jars_dir() / n) for n in JAR_NAMES),
           "--py-files", python_files(spec.transform_function)]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return cmd + app


def run_size(work: Path, tag: str, landing: Path, driver_memory: str, wholetext: bool = False) -> dict[str, Any]:
    """One spark-submit application planning and running one group of the one landed file."""
    from sluice.net import free_port
    from sluice.paths import RUN_GROUP_APP
    from sluice.store import EpochStore

    root = work / "runs" / tag
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    port = free_port()
    local_dir = root / "spark-local"
    raw = ysb_spec_yaml(f"large_{tag}", landing, root / "tables" / "campaign_views", epoch_files=1, k=1)
    raw["spark"] = {"mode": "submit", "conf": {
        "spark.sql.shuffle.partitions": "4",
        "spark.driver.memory": driver_memory,
        # Measurement only: the UI's REST API (sluice turns the UI off) and its memory metrics.
        "spark.ui.enabled": "true", "spark.ui.port": str(port),
        "spark.executor.processTreeMetrics.enabled": "true",
        "spark.executor.metrics.pollingInterval": "1s",
        "spark.local.dir": str(local_dir),
    }}
    spec = write_spec(Path(os.environ["SLUICE_PIPELINES_DIR"]), raw)
    store_at = f"sqlite:///{root / 'sluice.db'}"
    gc_path = root / "gc.log"
    group_args = run_group_args(spec.name, store_at)
    app = ([str(Path(__file__).resolve()), WHOLETEXT_FLAG, *group_args] if wholetext
           else [str(RUN_GROUP_APP), *group_args])
    cmd = submit_command(spec, app, gc_path)
    env = {**os.environ, "SLUICE_STORE_URL": store_at, "SLUICE_HOME": str(ROOT)}
    if wholetext:  # this file as the application: spark-submit puts bench/, not the root, on sys.path
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins"), str(ROOT), env.get("PYTHONPATH", "")])
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(root / "stdout.log", "wb") as out, open(root / "stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        meter = TreeMeter(proc.pid, local_dir)
        rest = RestPoller(port)
        try:
            rc = proc.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        finally:
            meter.stop()
            rest.stop()
    wall = time.perf_counter() - t0
    load = {"before": round(load_before, 2), "after_5min": round(os.getloadavg()[1], 2)}
    store = EpochStore(store_at)
    epochs = store.epochs(spec.name)
    store.engine.dispose()
    size = sum(p.stat().st_size for p in landing.glob("*.json"))
    result: dict[str, Any] = {
        "bytes": size, "mb": round(size / MB, 1), "returncode": rc, "wall_s": round(wall, 1),
        "mb_per_s": round(size / MB / wall, 1),
        "peak_rss_mb": {r: round(v / MB, 1) for r, v in sorted(meter.peak.items()) if r != "other"},
        "peak_rss_tree_mb": round(meter.peak_total / MB, 1),
        "vmhwm_mb": {r: round(v / MB, 1) for r in ("jvm", "python_driver") if (v := meter.hwm_of(r))},
        "cpu_s": {r: meter.cpu_of(r) for r in ("jvm", "python_driver")},
        "heap_gc_log_mb": {k: (round(v / MB, 1) if k not in ("young_gcs", "full_gcs") and v is not None else v)
                           for k, v in gc_log(gc_path).items()},
        "spark_peak_memory_metrics_mb": {k: round(v / MB, 1) for k, v in sorted(rest.peaks.items())
                                         if k.startswith(("JVM", "OnHeap", "OffHeap", "ProcessTreeJVMRSS",
                                                          "DirectPool", "MappedPool"))},
        "spark_storage_memory_mb": round(rest.max_memory / MB, 1) if rest.max_memory else None,
        "rest_polls": rest.polls,
        "machine_load_avg": load,  # other users' processes share the 2 cores: wall times are noisy
        "spark_local_dir_peak_mb": round(meter.local_peak / MB, 1),
        "series": [[t, round(j / MB), round(p / MB)] for t, j, p in meter.series[::5]],
        "epochs": [{"state": e.state, "rows": e.rows, "timings": e.timings, "error": e.error} for e in epochs],
        "spec": spec.name, "tables": {"sink": spec.sinks[0].path, "rejected": spec.rejected_table},
    }
    if rc != 0:
        result["stderr_tail"] = (root / "stderr.log").read_text(errors="replace")[-3000:]
    timings = epochs[0].timings if epochs and epochs[0].timings else {}
    if timings.get("group_s"):
        result["group_s"] = timings["group_s"]
        result["group_mb_per_s"] = round(size / MB / timings["group_s"], 1)
    return result


def check(spark: Any, run: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """The run's table against the oracle; its input and rejected counts against the oracle's."""
    got: Counter = Counter()
    for r in spark.read.format("delta").load(run["tables"]["sink"]).collect():
        got[(r["campaign_id"], int(r["window_start"].timestamp() * 1000))] += r["views"]
    rejected = spark.read.format("delta").load(run["tables"]["rejected"]).count()
    rows = run["epochs"][0]["rows"] if run["epochs"] else {}
    oracle_windows = expected["windows"]
    return {"windows": len(oracle_windows), "views": sum(oracle_windows.values()),
            "table_equals_oracle": got == oracle_windows,
            "differing_windows": len(set(got.items()) ^ set(oracle_windows.items())),
            "input_records": rows.get("input"), "oracle_records": expected["records"],
            "rejected_records": rows.get("rejected"), "rejected_table_rows": rejected,
            "oracle_rejected": expected["rejected"],
            "counts_equal_oracle": (rows.get("input") == expected["records"]
                                    and rows.get("rejected") == rejected == expected["rejected"])}


# -- the control: the same file read whole (as a small file is), in its own application ----------


def wholetext_child(args: list[str]) -> int:
    """spark-submit application of the control: ``sluice run-group`` with every file read
    whole (``WHOLE_FILE_MAX_BYTES`` raised in this process only)."""
    sys.path.insert(0, str(ROOT / "plugins"))
    import sluice.sources.files as files

    files.WHOLE_FILE_MAX_BYTES = 1 << 62
    from sluice.cli import main as cli_main

    return cli_main(["run-group", *args])


# -- the result ------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.3, 1]})
    colors = ["#4477aa", "#66aa55", "#cc8833", "#aa3377"]
    for run, color in zip(runs, colors, strict=False):
        t = [s[0] for s in run["series"]]
        left.plot(t, [s[1] for s in run["series"]], color=color, label=f"{run['mb']:,.0f} MB: JVM")
        left.plot(t, [s[2] for s in run["series"]], color=color, ls="--", lw=1, label=f"{run['mb']:,.0f} MB: Python")
    control = result.get("control")
    if control and control.get("series"):
        t = [s[0] for s in control["series"]]
        left.plot(t, [s[1] for s in control["series"]], color="#cc3311", lw=1.5,
                  label=f"control: {control['mb']:,.0f} MB read whole ({'failed' if control['failed'] else 'ok'})")
    max_heap = result["max_heap_mb"]
    if max_heap:
        left.axhline(max_heap, color="grey", ls=":", lw=1)
        left.text(0, max_heap, f" max heap {max_heap:,.0f} MB", va="bottom", fontsize=8, color="grey")
    left.set_xlabel("seconds since spark-submit")
    left.set_ylabel("RSS, MB")
    left.set_title(f"one landed JSON-lines file, one epoch, spark.driver.memory {result['config']['driver_memory']}")
    left.legend(fontsize=7, loc="lower right")
    labels = [f"{r['mb']:,.0f} MB\n{r['mb_per_s']} MB/s\n(group {r.get('group_mb_per_s')})" for r in runs]
    x = range(len(runs))
    width = 0.27
    series = (("JVM peak RSS", [r["peak_rss_mb"].get("jvm", 0) for r in runs], "#4477aa"),
              ("JVM heap peak used", [r["heap_gc_log_mb"]["peak_used_before_gc"] or 0 for r in runs], "#88ccee"),
              ("Python driver peak RSS", [r["peak_rss_mb"].get("python_driver", 0) for r in runs], "#66aa55"))
    for i, (name, values, color) in enumerate(series):
        bars = right.bar([j + (i - 1) * width for j in x], values, width, label=name, color=color)
        right.bar_label(bars, fmt="%.0f", fontsize=7)
    if max_heap:
        right.axhline(max_heap, color="grey", ls=":", lw=1, label="max heap (-Xmx)")
    right.set_xticks(list(x), labels)
    right.set_ylabel("MB")
    ratio = result["jvm_peak_ratio"]
    right.set_title(f"JVM peak RSS x{ratio} for x{result['size_ratio']} the bytes"
                    f" ({'bounded' if result['bounded'] else 'NOT bounded'})", fontsize=9)
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WHOLETEXT_FLAG]:
        return wholetext_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50, 150 and 450 MB (bench-quick)")
    parser.add_argument("--sizes-mb", help="comma-separated file sizes in MB (default 300,1000,3000)")
    parser.add_argument("--driver-memory", default="1g")
    parser.add_argument("--no-control", action="store_true", help="skip the whole-file control run")
    parser.add_argument("--keep", action="store_true", help="keep the generated files and tables")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes_mb.split(",")) if args.sizes_mb else list(
        QUICK_SIZES_MB if args.quick else SIZES_MB)
    work = configure("large_file")
    free = shutil.disk_usage(work).free
    capped = free < MIN_FREE_BYTES and sizes[-1] > CAPPED_MAX_MB
    if capped:
        scale = CAPPED_MAX_MB / sizes[-1]
        sizes = [max(10, round(s * scale)) for s in sizes]
        print(f"large_file: only {free / 1e9:.1f} GB free on {work}: sizes capped at {CAPPED_MAX_MB} MB", flush=True)
    print(f"large_file: sizes {sizes} MB, spark.driver.memory {args.driver_memory}, local[{CORES}]", flush=True)

    source = work / "source" / "ysb-big.json"
    t0 = time.perf_counter()
    generated = generate(source, sizes[-1] * MB)
    gen_s = time.perf_counter() - t0
    print(f"  generated {generated / MB:,.0f} MB in {gen_s:.0f} s ({generated / MB / gen_s:.0f} MB/s)", flush=True)

    runs: list[dict[str, Any]] = []
    oracles: list[dict[str, Any]] = []
    control: dict[str, Any] | None = None
    try:
        for i, size_mb in enumerate(sizes):
            landing = work / "landing" / f"{size_mb}mb"
            largest = i == len(sizes) - 1
            if largest:  # the generated file itself
                landing.mkdir(parents=True, exist_ok=True)
                path = landing / "ysb-000000.json"
                os.utime(source, (1_700_000_000, 1_700_000_000))
                os.replace(source, path)
            else:
                path = land_prefix(source, landing, size_mb * MB, 1_700_000_000)
            expected = oracle(path)
            print(f"  {path.stat().st_size / MB:,.0f} MB: oracle {expected['records']:,} records "
                  f"({expected['rejected']:,} bad), {len(expected['windows'])} windows in {expected['seconds']} s",
                  flush=True)
            run = run_size(work, f"s{size_mb}", landing, args.driver_memory)
            run["oracle_s"] = expected["seconds"]
            runs.append(run)
            oracles.append(expected)
            heap = run["heap_gc_log_mb"]
            print(f"  {run['mb']:,.0f} MB: rc {run['returncode']}, {run['wall_s']} s ({run['mb_per_s']} MB/s; "
                  f"group {run.get('group_s')} s), peak RSS JVM {run['peak_rss_mb'].get('jvm')} MB, Python "
                  f"{run['peak_rss_mb'].get('python_driver')} MB, heap peak {heap['peak_used_before_gc']} MB of "
                  f"{heap['max_heap']} MB, spill {run['spark_local_dir_peak_mb']} MB", flush=True)
            if run["returncode"] != 0:
                print(run.get("stderr_tail", ""), file=sys.stderr)
                raise RuntimeError(f"the {size_mb} MB run failed ({run['returncode']})")
            if i == 0 and not args.no_control:
                control = run_size(work, f"control{size_mb}", landing, args.driver_memory, wholetext=True)
                control["failed"] = control["returncode"] != 0 or not control["epochs"] or any(
                    e["state"] != "published" for e in control["epochs"])
                control["error"] = next((e["error"] for e in control["epochs"] if e["error"]), None)
                control.pop("stderr_tail", None)
                print(f"  control, {control['mb']:,.0f} MB read whole: {'failed' if control['failed'] else 'ok'} "
                      f"in {control['wall_s']} s, peak RSS JVM {control['peak_rss_mb'].get('jvm')} MB; "
                      f"{(control['error'] or '')[:300]}", flush=True)
            if not args.keep:
                path.unlink()
    finally:
        if not args.keep:
            shutil.rmtree(work / "source", ignore_errors=True)
            shutil.rmtree(work / "landing", ignore_errors=True)

    from bench.common import session

    spark = session("sluice-bench-large-file", cores=CORES)
    for run, expected in zip(runs, oracles, strict=True):
        run["check"] = check(spark, run, expected)
        if not run["check"]["table_equals_oracle"]:
            raise AssertionError(f"{run['mb']} MB: the table differs from the oracle: {run['check']}")
    spark.stop()

    small, large = runs[0], runs[-1]
    jvm_ratio = round(large["peak_rss_mb"]["jvm"] / small["peak_rss_mb"]["jvm"], 3)
    py_ratio = round(large["peak_rss_mb"]["python_driver"] / small["peak_rss_mb"]["python_driver"], 3)
    max_heap = max((r["heap_gc_log_mb"]["max_heap"] or 0) for r in runs) or None
    result: dict[str, Any] = {
        "sizes_mb": [r["mb"] for r in runs],
        "size_ratio": round(large["bytes"] / small["bytes"], 2),
        "peak_rss_jvm_mb": [r["peak_rss_mb"].get("jvm") for r in runs],
        "peak_rss_python_driver_mb": [r["peak_rss_mb"].get("python_driver") for r in runs],
        "vmhwm_jvm_mb": [r["vmhwm_mb"].get("jvm") for r in runs],
        "heap_peak_used_mb": [r["heap_gc_log_mb"]["peak_used_before_gc"] for r in runs],
        "heap_peak_after_gc_mb": [r["heap_gc_log_mb"]["peak_used_after_gc"] for r in runs],
        "spark_jvm_heap_peak_mb": [r["spark_peak_memory_metrics_mb"].get("JVMHeapMemory") for r in runs],
        "max_heap_mb": max_heap,
        "storage_memory_peak_mb": [r["spark_peak_memory_metrics_mb"].get("OnHeapStorageMemory") for r in runs],
        "storage_memory_max_mb": large["spark_storage_memory_mb"],
        "wall_s": [r["wall_s"] for r in runs],
        "mb_per_s": [r["mb_per_s"] for r in runs],
        "group_s": [r.get("group_s") for r in runs],
        "group_mb_per_s": [r.get("group_mb_per_s") for r in runs],
        "spark_local_dir_peak_mb": [r["spark_local_dir_peak_mb"] for r in runs],
        "jvm_peak_ratio": jvm_ratio,
        "python_peak_ratio": py_ratio,
        "bound": BOUND,
        "bounded": jvm_ratio <= BOUND and py_ratio <= BOUND,
        # What "bounded memory" means to a job: every size ran in the same fixed heap, smaller
        # than the file, which the whole-file read of the smallest file could not.
        "bounded_by_driver_memory": bool(
            max_heap and all(r["heap_gc_log_mb"]["peak_used_before_gc"] <= max_heap for r in runs)
            and large["bytes"] / MB > max_heap and control.get("failed")),
        "tables_equal_oracle": all(r["check"]["table_equals_oracle"] for r in runs),
        "counts_equal_oracle": all(r["check"]["counts_equal_oracle"] for r in runs),
        "control": control,
        "runs": runs,
        "config": {
            "quick": args.quick, "master": f"local[{CORES}]", "driver_memory": args.driver_memory,
            "launch": "spark-submit sluice/jobs/run_group.py --plan (the DAG's confs, spec spark.conf)",
            "pipeline": "include/pipelines/ysb.yaml (aggregate MERGE + _rejected), GX off, 1 file = 1 epoch, k = 1",
            "whole_file_max_bytes": 8 * 1024 * 1024, "events_per_second_of_event_time": EVENTS_PER_SECOND,
            "malformed_fraction": 0.001, "generated_mb": round(generated / MB, 1), "generate_s": round(gen_s, 1),
            "smaller_files": "byte prefixes of the largest, cut at a line end",
            "disk_free_gb_at_start": round(free / 1e9, 1), "sizes_capped_for_disk": capped,
            "rss_sampling_s": 0.2, "spark_rest_polling_s": 1.0,
        },
    }
    write_result("large_file", result)
    plot(result, results_dir() / "large_file.png")
    print(json.dumps({k: result[k] for k in ("sizes_mb", "peak_rss_jvm_mb", "peak_rss_python_driver_mb",
                                             "heap_peak_used_mb", "max_heap_mb", "wall_s", "mb_per_s",
                                             "jvm_peak_ratio", "bounded", "bounded_by_driver_memory",
                                             "tables_equal_oracle",
                                             "counts_equal_oracle")}), flush=True)
    if not args.keep:
        shutil.rmtree(work / "runs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [WHOLETEXT_FLAG]:  # spark-submit's application (the control): no bench.common
        sys.exit(wholetext_child(sys.argv[2:]))
    sys.exit(main())
