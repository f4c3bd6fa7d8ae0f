"""What the Spark benchmarks share: an isolated work folder set before sluice is imported, YSB
input files, a bench pipeline spec, and medians with their min-max."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def results_dir() -> Path:
    """``bench/results`` (``$SLUICE_BENCH_RESULTS``: ``make bench-quick`` writes to ``quick/``)."""
    return Path(os.environ.get("SLUICE_BENCH_RESULTS", RESULTS))
WORK = ROOT / "var" / "bench"


def configure(name: str) -> Path:
    """A fresh work folder ``var/bench/<name>`` with its own data folder and epoch store."""
    work = WORK / name
    shutil.rmtree(work, ignore_errors=True)
    (work / "pipelines").mkdir(parents=True)
    os.environ.update({"SLUICE_DATA_DIR": str(work / "var"), "SLUICE_PIPELINES_DIR": str(work / "pipelines"),
                       "SLUICE_STORE_URL": f"sqlite:///{work / 'sluice.db'}", "GX_ANALYTICS_ENABLED": "false"})
    for p in (ROOT / "plugins", ROOT):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    return work


def run_group_args(pipeline: str, store_url: str | None = None, *, epoch_size: int | None = None,
                   k: int | None = None, plan: dict[str, Any] | None = None) -> list[str]:
    """``sluice run-group``'s arguments for a group the application plans itself (``--plan``), as
    the benchmarks run each group: the pipeline, the epoch store, the sizes. With ``plan`` (a
    ``Verdict.plan()``), the sizes are the plan's (``--first-size`` for its probe epoch) and the
    plan is recorded beside the group (``--plan-extra``).

    >>> run_group_args("ysb", epoch_size=4, k=2)
    ['--pipeline', 'ysb', '--plan', '--epoch-size', '4', '-k', '2']
    """
    first_size = None
    if plan is not None:
        epoch_size, k, first_size = plan["epoch_size"], plan["k"], plan.get("first_size")
    args = ["--pipeline", pipeline, "--plan"]
    if store_url is not None:
        args += ["--store-url", store_url]
    if epoch_size is not None:
        args += ["--epoch-size", str(epoch_size)]
    if k is not None:
        args += ["-k", str(k)]
    if first_size:  # a probe epoch first (0 or absent: none)
        args += ["--first-size", str(first_size)]
    if plan is not None:
        args += ["--plan-extra", json.dumps(plan)]
    return args


def ysb_spec_yaml(name: str, landing: Path, table: Path, *, epoch_files: int = 4, k: int = 1,
                  validate: bool = False, mode: str = "aggregate") -> dict[str, Any]:
    """The shipped ``ysb`` pipeline with fixed sizes, in-process, reading ``landing`` and writing
    ``table``; without its GX suite unless ``validate`` (the throughput runs compare the
    bookkeeping, and GX's cost is reported by itself)."""
    raw = yaml.safe_load((ROOT / "include" / "pipelines" / "ysb.yaml").read_text())
    raw.update(name=name, description="benchmark copy of ysb", schedule=None)
    raw["source"]["path"] = str(landing)
    sink = raw["sinks"][0]
    sink["path"] = str(table)
    if not validate:
        sink.pop("expectations", None)
    if mode == "append":
        raw["transform"] = "ysb.clean_events"
        raw["sinks"][0] = {"name": "view_events", "mode": "append", "path": str(table)}
    raw["control"].update(adaptive=False, epoch_files=epoch_files, group_epochs=k)
    raw["spark"]["mode"] = "in_process"
    return raw


def write_spec(folder: Path, raw: dict[str, Any]) -> Any:
    from sluice.spec import load_spec

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_spec(path)


def land_ysb(landing: Path, files: int, events_per_file: int, seed: int = 0,
             malformed_fraction: float = 0.001) -> list[Path]:
    """``files`` YSB files of ``events_per_file`` events, with distinct increasing mtimes."""
    from include.generators.ysb import generate

    landing.mkdir(parents=True, exist_ok=True)
    paths = generate(landing, rate=events_per_file, duration=files, files_per_second=1, seed=seed,
                     start_ms=1_700_000_000_000, malformed_fraction=malformed_fraction)
    for i, path in enumerate(sorted(paths)):
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    return sorted(paths)


def stats(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median with min and max beside it (and the values themselves)."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "values": [round(v, digits) for v in values]}


def write_result(name: str, result: dict[str, Any]) -> Path:
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    return path


def session(app: str = "sluice-bench", cores: int = 2, ui: bool = False) -> Any:
    """A local session; ``ui`` turns Spark's UI on, whose REST API serves per-task metrics."""
    from sluice.spark import get_session

    conf = {"spark.ui.enabled": "true", "spark.ui.port": "4140", "spark.ui.retainedJobs": "10000",
            "spark.ui.retainedStages": "10000"}
    spark = get_session(app, master=f"local[{cores}]", extra_conf=conf if ui else None)
    spark.sparkContext.setLogLevel("WARN")
    return spark


class CpuMeter:
    """CPU-seconds (user + system) of a process and all its descendants, sampled every
    ``interval`` s while it runs: a JVM started by PySpark is a grandchild that nobody waits
    for, so ``RUSAGE_CHILDREN`` would miss it. What a process burns in its last
    ``interval`` is missed; ``stop`` takes a final sample first."""

    def __init__(self, pid: int | None = None, interval: float = 0.25, find: Any = None) -> None:
        """Meter the tree of ``pid``, or whatever processes ``find()`` returns at each sample."""
        import threading

        import psutil

        self.root = psutil.Process(pid) if pid is not None else None
        self.find = find
        self.seen: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.interval = interval
        self.gib_s = 0.0  # resident memory of the tree integrated over time (GiB-seconds)
        self.peak_rss_gib = 0.0
        self._last_rss: tuple[float, float] | None = None  # (monotonic time, GiB) of the last sample
        self._lock = threading.RLock()  # the loop and the caller both sample and read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def sample(self) -> float:
        with self._lock:
            return self._sample()

    def _sample(self) -> float:
        import psutil

        try:
            procs = list(self.find()) if self.find else [self.root, *self.root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            procs = []
        rss = 0
        for p in procs:
            try:
                t = p.cpu_times()
                self.seen[p.pid] = max(self.seen.get(p.pid, 0.0), t.user + t.system)
                self.names[p.pid] = p.name()  # again each time: spark-submit is bash until it execs java
                rss += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self._integrate_rss(rss / 2**30)
        return self.total

    def _integrate_rss(self, gib: float) -> None:
        """GiB-seconds by the trapezoid rule between samples (what memory-billed Spark charges)."""
        import time

        now = time.monotonic()
        if self._last_rss is not None:
            self.gib_s += (now - self._last_rss[0]) * (gib + self._last_rss[1]) / 2
        self._last_rss = (now, gib)
        self.peak_rss_gib = max(self.peak_rss_gib, gib)

    def by_name(self, name: str) -> float:
        """CPU-seconds of the processes called ``name`` (e.g. ``java``)."""
        with self._lock:
            return sum(v for pid, v in self.seen.items() if self.names.get(pid) == name)

    @property
    def total(self) -> float:
        with self._lock:
            return sum(self.seen.values())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> float:
        self.sample()
        self._stop.set()
        self._thread.join()
        return self.total


def foreach_batch_writer(spark: Any, spec: Any, batches: list[int]) -> Any:
    """The Structured Streaming baselines' ``foreachBatch``: sluice's own reject split,
    transform and Delta writes (MERGE with ``txnAppId``/``txnVersion = batchId``), so the
    systems compared differ only in bookkeeping and epoch boundaries. Appends each batch id."""
    from sluice.compute import load_reference, rejected_sink, split_rejected, transform_for
    from sluice.delta.spark import SparkTables
    from sluice.model import EpochRange
    from sluice.protocol.tables import PipelineTable

    transform = transform_for(spec)
    refs: dict[str, Any] = {}
    tables = SparkTables(spark)
    sink = PipelineTable(spec.name, spec.sinks[0])
    rejected = PipelineTable(spec.name, rejected_sink(spec))

    def write_batch(batch: Any, batch_id: int) -> None:
        if not refs:
            refs.update(load_reference(spark, spec))
        records = batch.persist()
        try:
            valid, bad = split_rejected(records, spec, 0, batch_id)
            output = transform(valid, refs)
            kw = {"epochs": [EpochRange(batch_id, batch_id, batch_id + 1)], "generation": 0, "token": 1}
            rejected.write(tables, bad, skip_empty=True, **kw)
            sink.write(tables, output, **kw)
        finally:
            records.unpersist()
        batches.append(batch_id)

    return write_batch
