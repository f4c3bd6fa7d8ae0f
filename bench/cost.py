"""What it costs to keep YSB within a freshness SLA: sluice (run-once groups, started by the
backlog trigger's own decision) against an always-on Structured Streaming query, at SLAs of
60 s, 5 min and 15 min (and 1 h), for one pipeline and for eight.

    python -m bench.cost [--quick] [--window 150] [--rates low,medium,high]
                         [--sweep-rate medium] [--slas 60,300] [--pipelines 8] [--skip-8p]

Three sides, one at a time, each with the whole machine (sides sharing two cores slow each
other's groups past the SLA):

* **always-on**: one Structured Streaming query, ``processingTime`` trigger of the SLA minus
  15 s (the longest that meets it: a record waits at most the trigger plus one batch),
  ``foreachBatch`` writing the same Delta tables the same way as sluice. Charged from the end
  of an untimed warm-up batch (a query that lives for days has long paid its start-up).
* **sluice**, under ``control.objective: cost``: the decision of ``sluice.adaptive.decide``
  (the same the backlog trigger takes, polling every SLA / 60: 1 s at 60 s, 5 s at 5 min, 15 s at
  15 min, 30 s at most; charged per poll) starts each group as a run-once application
  (``sluice run-group --plan``) with its own JVM (charged: each application's whole process
  tree, start-up included), plus the Airflow task processes of a group
  (``airflow_cpu_s_per_group`` from ``overhead.json``, Connect mode, when it was measured).
* **sluice on a warm Spark Connect server**: the same, each group a client of the server
  (charged: the clients plus the server's whole CPU over the window, idle included).

Figures per hour of operation: CPU-seconds, core-seconds *reserved* (cores while a JVM is up:
always for the always-on query and the Connect server, a group's wall for a JVM per group;
what a job cluster or serverless Spark bills) and memory GiB-seconds (resident memory of each
process tree, integrated; CPU and memory sampled from ``/proc`` by ``bench.common.CpuMeter``).

* ``rates``: the 60 s comparison at each input rate (one file per second), as before.
* ``slas``: at ``--sweep-rate``, the SLAs in ``--slas`` are measured (``window`` = the larger of
  ``--window`` and 2 SLAs of arrivals); 15 min and 1 h come from a model of measured
  components (``model``): idle CPU per second of the always-on driver and the Connect server,
  and per batch or group a fixed and a per-record part of CPU, wall and memory, fitted to the
  batches and groups of the measured runs (the SLAs measured, and the 60 s runs at the other
  rates: one SLA's batches at one rate all have about the same size). The model must predict
  the measured points within 15 % (``model.check``); every figure says whether it is
  ``modelled``.
* ``multi``: ``--pipelines`` pipelines at a 5 min SLA (their arrivals staggered by SLA / n, the
  rate split among them) on one Connect server against as many always-on queries.

Goals: ``savings_reserved_15min`` >= 10, ``savings_cpu_15min`` >= 1.5 (always-on over a JVM
per group), ``savings_cpu_connect_15min`` >= 3 (over a warm Connect server), ``savings_cpu_1h`` >= 3;
``savings_cpu_8p_5min`` >= 3 and ``savings_mem_8p_5min`` >= 5 (eight always-on
queries over eight pipelines on one Connect server). Writes ``bench/results/cost.json`` and
``cost.png``.

``savings_cpu_bound_<sla>`` and ``savings_cpu_connect_bound_<sla>``: the CPU savings a side
would show if its groups cost their per-record work alone (no fixed cost, no idle, no Airflow):
the always-on query's CPU an hour over the fitted per-record CPU times the records of an hour.
Discontinuous runs process the same records with the same engine, so no scheduling reaches
past it; a goal above it is out of reach at this rate. ``--bounds`` adds them to an existing
``cost.json`` from its own model (nothing is measured again).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    CpuMeter,
    configure,
    results_dir,
    run_group_args,
    write_result,
    write_spec,
    ysb_spec_yaml,
)

RATES = {"low": 100, "medium": 1_000, "high": 5_000}  # events per second
SLAS = {"60s": 60, "5min": 300, "15min": 900, "1h": 3600}  # freshness SLA, seconds
SLA_S = 60  # the per-rate comparison's SLA
TRIGGER_MARGIN_S = 15  # always-on trigger = SLA - this: one batch's wall and a file's landing
CORES = 2  # every side runs local[2]: what a deployment would reserve for it
WARM_UP_FILES = 10
IDLE_S = 30.0  # seconds each long-lived JVM is watched idle, before arrivals, for its idle CPU
MARGIN_S = 2.0  # the controllers' margin: the deadline rule's lead is the poll interval plus this
POLLS_PER_SLA = 60  # the backlog trigger polls every SLA / this (1 s at 60 s, 15 s at 15 min; at most 30 s)
MODEL_TOLERANCE = 0.15


def trigger_for(sla_s: float) -> int:
    return int(sla_s - TRIGGER_MARGIN_S)


def poll_for(sla_s: float) -> int:
    """sluice's poll interval at an SLA: a 1 s poll costs a long SLA CPU and buys it nothing."""
    return int(min(30, max(1, sla_s // POLLS_PER_SLA)))


ALWAYS_ON = r"""
import json, os, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1] + "/plugins", sys.argv[1]]
from sluice.spec import load_spec
from sluice.spark import get_session
from sluice.compute import load_reference, rejected_sink, split_rejected, transform_for
from sluice.delta.spark import SparkTables
from sluice.model import EpochRange
from sluice.protocol.tables import PipelineTable
from sluice.sources import FileSource
spec = load_spec(sys.argv[2]); trigger_s = int(sys.argv[3]); done_flag = Path(sys.argv[4])
# A long-lived driver: the JVM's default JIT (C2), not sluice's run-once options.
spark = get_session("always-on", master=f"local[{sys.argv[5]}]",
                    extra_conf={"spark.driver.extraJavaOptions": "-XX:+TieredCompilation"})
spark.sparkContext.setLogLevel("WARN")
refs = load_reference(spark, spec); transform = transform_for(spec)
tables = SparkTables(spark)
sink = PipelineTable(spec.name, spec.sinks[0]); rejected = PipelineTable(spec.name, rejected_sink(spec))
def write_batch(batch, batch_id):
    records = batch.persist()
    try:
        valid, bad = split_rejected(records, spec, 0, batch_id)
        files = [r["_file"] for r in records.select("_file").distinct().collect()]
        kw = {"epochs": [EpochRange(batch_id, batch_id, batch_id + 1)], "generation": 0, "token": 1}
        rejected.write(tables, bad, skip_empty=True, **kw)
        sink.write(tables, transform(valid, refs), **kw)
    finally:
        records.unpersist()
    now = time.time()
    print(json.dumps({"batch": batch_id, "files": len(files), "at": now,
                      "freshness": [now - os.stat(f).st_mtime for f in files]}), flush=True)
stream = (spark.readStream.format("text").option("wholetext", True).option("pathGlobFilter", "*.json")
          .load(str(spec.landing_dir)))
query = (FileSource(spec, None).parse(stream).writeStream.foreachBatch(write_batch)
         .option("checkpointLocation", str(Path(spec.sinks[0].path).parent / "checkpoint"))
         .trigger(processingTime=f"{trigger_s} seconds").start())
print(json.dumps({"started": time.time()}), flush=True)
while not done_flag.exists():
    if not query.isActive:  # the batch failed: say why and exit, rather than leave the parent waiting
        print(f"always-on query stopped: {query.exception()}", file=sys.stderr, flush=True)
        spark.stop()
        sys.exit(1)
    time.sleep(0.5)
query.stop(); spark.stop()
"""


def land(landing: Path, rate: int, window: float, stop: threading.Event, delay_s: float = 0.0) -> None:
    """One file per second at ``rate`` events per second, landed atomically, from ``delay_s`` on."""
    from include.generators.ysb import generate

    if stop.wait(delay_s):
        return
    staging = landing.parent / f".staging-{landing.name}"
    start = time.time()
    second = 0
    while not stop.is_set() and second < window:
        for path in generate(staging, rate=rate, duration=1, files_per_second=1, seed=second,
                             start_ms=int((start + second) * 1000), prefix=f"e{second:06d}"):
            os.replace(path, landing / path.name)
        second += 1
        time.sleep(max(0.0, start + second - time.time()))


@dataclass
class AlwaysOn:
    """One always-on query in its own process: started and warmed up (untimed), watched idle,
    then fed by a lander; each batch's CPU is the meter's increase since the previous batch."""

    work: Path
    name: str
    rate: int
    window: float
    trigger_s: int
    delay_s: float = 0.0
    idle_s: float = IDLE_S
    batches: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> None:
        from include.generators.ysb import generate

        self.root = self.work / f"always-on-{self.name}"
        self.landing = self.root / "landing"
        self.landing.mkdir(parents=True)
        generate(self.landing, rate=self.rate, duration=WARM_UP_FILES, files_per_second=1, seed=10**6,
                 prefix="warmup")
        spec = write_spec(self.root, ysb_spec_yaml(f"cost_ss_{self.name}", self.landing,
                                                   self.root / "tables" / "campaign_views"))
        self.done = self.root / "done"
        self.log = self.root / "always_on.log"
        self.proc = subprocess.Popen([sys.executable, "-c", ALWAYS_ON, str(ROOT), str(spec.path), str(self.trigger_s),
                                      str(self.done), str(CORES)],
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True)
        self.meter = CpuMeter(self.proc.pid)

    def next_row(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"always-on query {self.name} exited early ({self.proc.returncode}): "
                               f"{self.log.read_text()[-2000:]}")
        return json.loads(line)

    def warm_up(self) -> None:
        row = self.next_row()
        while "batch" not in row:  # {"started": ...} comes first, usually
            row = self.next_row()
        if row.get("files") != WARM_UP_FILES:
            raise RuntimeError(f"always-on warm-up batch read {row.get('files')} files, not {WARM_UP_FILES}")
        self.startup_cpu = self.meter.sample()

    def run(self) -> None:
        """Idle for ``idle_s`` (its idle CPU), then ``window`` seconds of arrivals until every
        file was in a batch. The charged span runs from the end of the idle watch."""
        time.sleep(self.idle_s)
        cpu = self.meter.sample()
        self.idle_cpu_per_s = (cpu - self.startup_cpu) / self.idle_s
        self.gib_at_start = self.meter.gib_s
        self.started = time.time()
        self.stop = threading.Event()
        lander = threading.Thread(target=land, args=(self.landing, self.rate, self.window, self.stop, self.delay_s),
                                  daemon=True)
        lander.start()
        files_done, last_cpu, last_at = 0, cpu, self.started
        while files_done < int(self.window):
            row = self.next_row()
            now_cpu = self.meter.sample()
            self.batches.append({"files": row["files"], "records": row["files"] * self.rate,
                                 "cpu_s": now_cpu - last_cpu, "gap_s": row["at"] - last_at,
                                 "freshness": row["freshness"]})
            files_done += row["files"]
            last_cpu, last_at = now_cpu, row["at"]
        self.end = time.time()
        self.cpu = self.meter.sample() - cpu
        self.gib_s = self.meter.gib_s - self.gib_at_start  # now: a query kept up longer is not charged

    def finish(self) -> dict[str, Any]:
        gib_s = self.gib_s
        self.done.touch()
        self.proc.wait(timeout=120)
        self.meter.stop()
        wall = self.end - self.started
        freshness = [f for b in self.batches for f in b["freshness"]]
        return {"cpu_s": round(self.cpu, 1), "startup_cpu_s": round(self.startup_cpu, 1), "wall_s": round(wall, 1),
                "reserved_core_s": round(CORES * wall, 1), "gib_s": round(gib_s, 1),
                "idle_cpu_per_s": round(self.idle_cpu_per_s, 4), "trigger_s": self.trigger_s,
                "batches": len(self.batches), "files": sum(b["files"] for b in self.batches),
                "batch_costs": [{k: round(v, 2) for k, v in b.items() if k != "freshness"} for b in self.batches],
                "max_freshness_s": round(max(freshness, default=0.0), 1),
                "mean_freshness_s": round(sum(freshness) / max(1, len(freshness)), 1)}


def always_on(work: Path, name: str, rate: int, window: float, sla_s: float = SLA_S) -> dict[str, Any]:
    query = AlwaysOn(work, name, rate, window, trigger_for(sla_s))
    query.start()
    try:
        query.warm_up()
        query.run()
    except BaseException:
        query.proc.kill()
        raise
    return query.finish()


def sluice_connect(work: Path, name: str, rate: int, window: float, sla_s: float = SLA_S) -> dict[str, Any]:
    """sluice with each group on a warm Spark Connect server: charged the server's whole CPU
    over the window (idle included) plus each run-once client."""
    from bench.overhead import start_connect_server

    (work / name).mkdir(parents=True, exist_ok=True)
    server, url = start_connect_server(work / name)
    meter = CpuMeter(server.pid)
    base = gib_base = idle_cpu_per_s = 0.0
    try:
        # An untimed warm-up pipeline first: a server that lives for days has long paid its JIT warm-up.
        sluice(work, f"{name}_warmup", rate, WARM_UP_FILES, tag="connect", env={"SLUICE_SPARK_REMOTE": url},
               sla_s=sla_s)
        idle_from = meter.sample()
        time.sleep(IDLE_S)
        base = meter.sample()
        idle_cpu_per_s = (base - idle_from) / IDLE_S
        gib_base = meter.gib_s
        result = sluice(work, name, rate, window, tag="connect", env={"SLUICE_SPARK_REMOTE": url}, sla_s=sla_s,
                        server=meter)
    finally:
        server_cpu = meter.stop() - base
        server.terminate()
        server.wait(timeout=60)
    result["client_cpu_s"] = result["cpu_s"]
    result["server_cpu_s"] = round(server_cpu, 1)
    result["server_idle_cpu_per_s"] = round(idle_cpu_per_s, 4)
    result["server_gib_s"] = round(meter.gib_s - gib_base, 1)
    result["gib_s"] = round(result["gib_s"] + result["server_gib_s"], 1)
    result["reserved_core_s"] = round(CORES * result["wall_s"], 1)  # the server is up all the time
    result["cpu_s"] = round(result["cpu_s"] + server_cpu, 1)
    return result


def sluice(work: Path, name: str, rate: int, window: float, tag: str = "submit",
           env: dict[str, str] | None = None, sla_s: float = SLA_S, delay_s: float = 0.0,
           server: CpuMeter | None = None) -> dict[str, Any]:
    from sluice import adaptive
    from sluice.paths import RUN_GROUP_APP
    from sluice.sources import FileSource
    from sluice.store import EpochStore

    root = work / f"sluice-{tag}-{name}"
    landing = root / "landing"
    landing.mkdir(parents=True)
    raw = ysb_spec_yaml(f"cost_sluice_{tag}_{name}", landing, root / "tables" / "campaign_views")
    # epoch_files: before anything is measured, epochs of what the always-on side takes per batch
    raw["control"].update(adaptive=True, objective="cost", freshness_sla_s=sla_s, epoch_files=trigger_for(sla_s),
                          group_epochs=1, poll_interval_s=poll_for(sla_s))
    spec = write_spec(Path(os.environ["SLUICE_PIPELINES_DIR"]), raw)
    store_at = f"sqlite:///{root / 'sluice.db'}"
    store = EpochStore(store_at)
    source = FileSource(spec, store)
    stop = threading.Event()
    lander = threading.Thread(target=land, args=(landing, rate, window, stop, delay_s), daemon=True)
    t0 = time.time()
    lander.start()
    groups, cpu, reserved, gib_s = [], 0.0, 0.0, 0.0
    poll_cpu, polls = 0.0, 0
    while lander.is_alive() or source.backlog().files:
        polls += 1
        p0 = time.thread_time()
        backlog = source.backlog()
        verdict = adaptive.decide_backlog(spec, store, backlog, continuous=lander.is_alive())
        poll_cpu += time.thread_time() - p0
        if not verdict.fire:
            time.sleep(spec.control.poll_interval_s)
            continue
        plan = dict(verdict.plan(), fired_at=time.time())
        server_before = server.sample() if server else 0.0
        proc = subprocess.Popen([sys.executable, str(RUN_GROUP_APP), *run_group_args(spec.name, store_at, plan=plan)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "SLUICE_SPARK_MASTER": f"local[{CORES}]", **(env or {})})
        meter = CpuMeter(proc.pid)
        _, err = proc.communicate()
        group_cpu = meter.stop()
        wall = time.time() - plan["fired_at"]
        reserved += CORES * wall
        gib_s += meter.gib_s
        if proc.returncode:
            raise RuntimeError(f"group failed ({proc.returncode}): {err[-2000:]}")
        cpu += group_cpu
        ran = [g for g in store.groups(spec.name) if g.plan.get("fired_at") == plan["fired_at"]]
        if not ran:
            raise RuntimeError(f"pipeline {spec.name}: the run planned no group for {plan}")
        records = sum(int(e.rows.get("input") or 0) for e in ran[-1].epochs)
        groups.append({"at_s": round(plan["fired_at"] - t0, 1), "reason": plan["reason"], "cpu_s": round(group_cpu, 1),
                       "epoch_size": plan["epoch_size"], "k": plan["k"], "records": records,
                       "wall_s": round(wall, 1), "gib_s": round(meter.gib_s, 1),
                       "server_cpu_s": round(server.sample() - server_before, 1) if server else None})
    freshness = []
    for e in store.epochs(spec.name):
        published = e.published_at.replace(tzinfo=UTC).timestamp() if e.published_at else None
        freshness += [published - f.mtime for f in store.manifest(spec.name, e.start, e.end)] if published else []
    store.engine.dispose()
    return {"cpu_s": round(cpu + poll_cpu, 1), "trigger_poll_cpu_s": round(poll_cpu, 2), "polls": polls,
            "poll_interval_s": spec.control.poll_interval_s,
            "wall_s": round(time.time() - t0, 1), "reserved_core_s": round(reserved, 1), "gib_s": round(gib_s, 1),
            "groups": groups, "max_freshness_s": round(max(freshness, default=0.0), 1),
            "mean_freshness_s": round(sum(freshness) / max(1, len(freshness)), 1)}


# -- the model: measured components, predicted per hour ------------------------------------------


@dataclass(frozen=True)
class Linear:
    """``fixed + per_record * records``, least squares over measured (records, value) points,
    both parts >= 0 (through the origin when the points do not separate them)."""

    fixed: float
    per_record: float

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> Linear:
        import numpy as np

        xs, ys = (np.array(v, float) for v in zip(*points, strict=True))
        if len(points) >= 2 and np.ptp(xs) > 0:
            slope, intercept = np.polyfit(xs, ys, 1)
            if slope >= 0 and intercept >= 0:
                return cls(float(intercept), float(slope))
            if slope < 0:
                return cls(float(ys.mean()), 0.0)
        return cls(0.0, float(ys.sum() / max(xs.sum(), 1.0)))

    def __call__(self, records: float) -> float:
        return self.fixed + self.per_record * records


@dataclass(frozen=True)
class CostModel:
    """Per hour of one pipeline at ``rate`` events/s under an SLA, from measured components."""

    always_on_idle_cpu_per_s: float
    always_on_batch_cpu: Linear  # CPU of a batch beyond the idle rate
    always_on_gib: float  # resident GiB of the always-on driver
    jvm_group_cpu: Linear
    jvm_group_wall: Linear
    jvm_group_gib_s: Linear
    connect_idle_cpu_per_s: float
    connect_group_cpu: Linear  # client + the server's increase during the group, beyond idle
    connect_group_wall: Linear
    connect_gib: float  # resident GiB of the server
    connect_client_gib_s: Linear
    airflow_cpu_per_group: float
    poll_cpu_per_s: float  # the backlog trigger's own polling (in the triggerer), per second at the measured intervals
    poll_cpu_per_poll: float  # the same per poll: what the model charges, at ``poll_for(sla)``
    max_group_records: float  # the largest group (max_group_epochs x max_epoch_records): fires when full

    def group_span(self, wall: Linear, sla_s: float, rate: float) -> float:
        """Seconds of arrivals per group under the deadline rule: a group fires when its oldest
        file is ``sla - wall - lead`` old, so ``span = sla - lead - wall(rate * span)``."""
        span = (sla_s - poll_for(sla_s) - MARGIN_S - wall.fixed) / (1 + wall.per_record * rate)
        return max(1.0, min(span, self.max_group_records / rate))

    def predict(self, sla_s: float, rate: float) -> dict[str, dict[str, float]]:
        """Per hour of steady operation: a batch every trigger, a group every span."""
        trigger = trigger_for(sla_s)
        batches = 3600.0 / trigger
        out = {"always_on": {
            "cpu_s": self.always_on_idle_cpu_per_s * 3600 + batches * self.always_on_batch_cpu(rate * trigger),
            "reserved_core_s": CORES * 3600.0, "gib_s": self.always_on_gib * 3600}}
        polling = self.poll_cpu_per_poll * 3600 / poll_for(sla_s)
        span = self.group_span(self.jvm_group_wall, sla_s, rate)
        groups = 3600.0 / span
        out["sluice"] = {
            "cpu_s": polling
            + groups * (self.jvm_group_cpu(rate * span) + self.airflow_cpu_per_group),
            "reserved_core_s": groups * CORES * self.jvm_group_wall(rate * span),
            "gib_s": groups * self.jvm_group_gib_s(rate * span)}
        span = self.group_span(self.connect_group_wall, sla_s, rate)
        groups = 3600.0 / span
        out["sluice_connect"] = {
            "cpu_s": self.connect_idle_cpu_per_s * 3600 + polling
            + groups * (self.connect_group_cpu(rate * span) + self.airflow_cpu_per_group),
            "reserved_core_s": CORES * 3600.0,
            "gib_s": self.connect_gib * 3600 + groups * self.connect_client_gib_s(rate * span)}
        return {side: {k: round(v, 1) for k, v in figures.items()} for side, figures in out.items()}

    def as_run(self, run: dict[str, Any], rate: float) -> dict[str, float]:
        """The CPU-seconds a measured run should have cost, from its own number of batches and
        groups (a finite window ends in a partial one) and its arrivals: checks the components."""
        records = rate * run["window_s"]
        always, jvm, connect = run["always_on"], run["sluice"], run["sluice_connect"]
        n = always["batches"]
        out = {"always_on": self.always_on_idle_cpu_per_s * always["wall_s"]
               + n * self.always_on_batch_cpu(records / n)}
        n = len(jvm["groups"])
        out["sluice"] = (self.poll_cpu_per_poll * self.polls(jvm)
                         + n * (self.jvm_group_cpu(records / n) + self.airflow_cpu_per_group))
        n = len(connect["groups"])
        out["sluice_connect"] = (self.connect_idle_cpu_per_s * connect["wall_s"]
                                 + self.poll_cpu_per_poll * self.polls(connect)
                                 + n * (self.connect_group_cpu(records / n) + self.airflow_cpu_per_group))
        return {side: round(v, 1) for side, v in out.items()}

    @staticmethod
    def polls(side: dict[str, Any]) -> float:
        """A run's polls (estimated from its wall time and interval for a run that did not count them)."""
        return side.get("polls") or side["wall_s"] / side.get("poll_interval_s", 1)

    @classmethod
    def from_runs(cls, runs: list[dict[str, Any]], airflow_cpu: float, max_group_records: float,
                  sizes: Sequence[dict[str, Any]] = ()) -> CostModel:
        """Components from the batches and groups of every measured SLA (``runs``: one per SLA).
        ``sizes`` (the 60 s runs at the other input rates) add their batches and groups to the
        fixed + per-record fits only: at one rate every batch of a run has the same size, so one
        SLA's batches alone cannot tell a batch's fixed cost from its per-record cost. What is per
        second or per run (idle CPU, resident memory, polling) comes from ``runs`` alone."""
        always = [r["always_on"] for r in runs]
        fitted = [*runs, *sizes]
        jvm = [g for r in fitted for g in r["sluice"]["groups"]]
        connect = [r["sluice_connect"] for r in runs]
        idle = sum(a["idle_cpu_per_s"] for a in always) / len(always)
        batch = [(b["records"], max(0.0, b["cpu_s"] - r["always_on"]["idle_cpu_per_s"] * b["gap_s"]))
                 for r in fitted for b in r["always_on"]["batch_costs"]]
        c_idle = sum(c["server_idle_cpu_per_s"] for c in connect) / len(connect)
        c_groups = [(g, r["sluice_connect"]["server_idle_cpu_per_s"])
                    for r in fitted for g in r["sluice_connect"]["groups"]]
        return cls(
            always_on_idle_cpu_per_s=idle, always_on_batch_cpu=Linear.fit(batch),
            always_on_gib=sum(a["gib_s"] / a["wall_s"] for a in always) / len(always),
            jvm_group_cpu=Linear.fit([(g["records"], g["cpu_s"]) for g in jvm]),
            jvm_group_wall=Linear.fit([(g["records"], g["wall_s"]) for g in jvm]),
            jvm_group_gib_s=Linear.fit([(g["records"], g["gib_s"]) for g in jvm]),
            connect_idle_cpu_per_s=c_idle,
            # the client's own CPU only where Airflow's figure (which holds it) is not charged
            connect_group_cpu=Linear.fit([
                (g["records"], (0.0 if airflow_cpu else g["cpu_s"])
                 + max(0.0, g["server_cpu_s"] - idle_s * g["wall_s"])) for g, idle_s in c_groups]),
            connect_group_wall=Linear.fit([(g["records"], g["wall_s"]) for g, _ in c_groups]),
            connect_gib=sum((c["server_gib_s"]) / c["wall_s"] for c in connect) / len(connect),
            connect_client_gib_s=Linear.fit([(g["records"], g["gib_s"]) for g, _ in c_groups]),
            airflow_cpu_per_group=airflow_cpu, max_group_records=max_group_records,
            poll_cpu_per_s=sum(r[side]["trigger_poll_cpu_s"] / r[side]["wall_s"] for r in runs
                               for side in ("sluice", "sluice_connect")) / (2 * len(runs)),
            poll_cpu_per_poll=sum(r[side]["trigger_poll_cpu_s"] for r in runs for side in ("sluice", "sluice_connect"))
            / sum(cls.polls(r[side]) for r in runs for side in ("sluice", "sluice_connect")))


def per_hour(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A measured run's figures per hour: what follows the work (batches, groups; a JVM per
    group's cores and memory) per hour of arrivals, what follows the clock (an idle driver's or
    server's CPU; their cores and memory) per hour of its run: ``idle * 3600 + (cpu - idle *
    wall) / window * 3600``. A finite window ends in a partial batch or group, which the steady
    state (the model) does not have."""
    window, hour = run["window_s"], 3600.0
    always, jvm, connect = run["always_on"], run["sluice"], run["sluice_connect"]
    return {
        "always_on": {"cpu_s": round(clock_and_work(always["cpu_s"], always["idle_cpu_per_s"], always["wall_s"],
                                                    window), 1),
                      "reserved_core_s": CORES * hour, "gib_s": round(always["gib_s"] / always["wall_s"] * hour, 1)},
        "sluice": {k: round(jvm[k] / window * hour, 1) for k in ("cpu_s", "reserved_core_s", "gib_s")},
        "sluice_connect": {
            "cpu_s": round(clock_and_work(connect["server_cpu_s"], connect["server_idle_cpu_per_s"], connect["wall_s"],
                                          window) + (connect["cpu_s"] - connect["server_cpu_s"]) / window * hour, 1),
            "reserved_core_s": CORES * hour,
            "gib_s": round(connect["server_gib_s"] / connect["wall_s"] * hour
                           + (connect["gib_s"] - connect["server_gib_s"]) / window * hour, 1)}}


def clock_and_work(cpu_s: float, idle_per_s: float, wall_s: float, window_s: float) -> float:
    """CPU per hour of a long-lived process: its idle rate, plus its work per hour of arrivals."""
    return idle_per_s * 3600 + max(0.0, cpu_s - idle_per_s * wall_s) / window_s * 3600


def measure_sla(work: Path, rate_name: str, rate: int, sla_s: float, window: float,
                airflow_cpu: float | None, parallel: bool = False) -> dict[str, Any]:
    """The three sides at one SLA: one after another, or (``parallel``, for SLAs of minutes,
    where each side is idle most of the time) side by side, to fit the run into the hour."""
    out: dict[str, Any] = {"sla_s": sla_s, "window_s": window, "trigger_s": trigger_for(sla_s), "parallel": parallel}
    label = f"{rate_name}_{int(sla_s)}s"
    sides = (("always_on", always_on), ("sluice", sluice), ("sluice_connect", sluice_connect))

    def side(key: str, fn: Any) -> None:
        out[key] = fn(work, label, rate, window, sla_s=sla_s)
        print(f"  SLA {sla_s:.0f} s, {key}: {out[key]['cpu_s']} CPU-s, max freshness "
              f"{out[key]['max_freshness_s']} s", flush=True)

    if parallel:
        run_all([lambda key=key, fn=fn: side(key, fn) for key, fn in sides])
    else:
        for key, fn in sides:
            side(key, fn)
    charge_airflow(out, airflow_cpu)
    return out


def charge_airflow(out: dict[str, Any], airflow_cpu: float | None) -> None:
    """Add the Airflow task processes of each group. On a Connect server the group's client is
    the DAG's ``run_group`` task itself, whose CPU the Airflow figure (measured in Connect mode)
    already holds: the bench's stand-in client processes are then not charged again
    (``client_groups_cpu_s`` keeps what they cost)."""
    if not airflow_cpu:
        return
    for side_name in ("sluice", "sluice_connect"):
        side = out[side_name]
        side["airflow_cpu_s"] = round(airflow_cpu * len(side["groups"]), 1)
        side["cpu_s"] = round(side["cpu_s"] + side["airflow_cpu_s"], 1)
    connect = out["sluice_connect"]
    connect["client_groups_cpu_s"] = client_groups_cpu(connect)
    connect["cpu_s"] = round(connect["cpu_s"] - connect["client_groups_cpu_s"], 1)


def client_groups_cpu(run: dict[str, Any]) -> float:
    """What a Connect run's stand-in client processes cost (each group's ``cpu_s``)."""
    return round(sum(g["cpu_s"] for g in run["groups"]), 1)


def max_group_records() -> float:
    """The largest group the cost objective takes: ``max_group_epochs`` epochs of the ceiling."""
    from sluice.control.epoch_size import EpochSizeConfig
    from sluice.spec import ControlSpec

    return float(ControlSpec().max_group_epochs * EpochSizeConfig().max_epoch_records)


def sla_sweep(work: Path, rate_name: str, slas: list[float], window: float, airflow_cpu: float | None,
              reuse: dict[str, Any] | None, save: Any = None,
              sizes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Measure the SLAs given, model the rest, and check the model against what was measured:
    each measured SLA is predicted by a model fitted to the *other* SLAs' batches and groups
    (leave one out), both its CPU (from the run's own number of batches and groups) and its
    interval between groups (the deadline rule's span). ``sizes``: the 60 s runs at the other
    input rates, whose batches and groups widen the range of sizes the fits see."""
    rate = RATES[rate_name]
    runs: dict[str, dict[str, Any]] = {}
    for sla_s in slas:
        label = next(k for k, v in SLAS.items() if v == sla_s)
        w = max(window, 3 * sla_s) if sla_s > SLA_S else window
        if reuse is not None and sla_s == SLA_S:
            runs[label] = {"sla_s": sla_s, "window_s": w, "trigger_s": trigger_for(sla_s), **reuse}
        else:
            runs[label] = measure_sla(work, rate_name, rate, sla_s, w, airflow_cpu, parallel=sla_s > SLA_S)
        if save:
            save({"rate": rate_name, "runs": runs})  # a later failure keeps what was measured
    largest = max_group_records()
    extra = list((sizes or {}).values())
    model = CostModel.from_runs(list(runs.values()), airflow_cpu or 0.0, largest, extra)
    check: dict[str, Any] = {}
    for label, run in runs.items():
        others = [r for other, r in runs.items() if other != label]
        if not others:
            continue
        held_out = CostModel.from_runs(others, airflow_cpu or 0.0, largest, extra)
        as_run = held_out.as_run(run, rate)
        errors = {side: round(as_run[side] / run[side]["cpu_s"] - 1, 3) for side in as_run}
        starts = [g["at_s"] for g in run["sluice"]["groups"] if g["reason"].startswith("freshness")]
        span_measured = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else None
        span_model = held_out.group_span(held_out.jvm_group_wall, run["sla_s"], rate)
        if span_measured:
            errors["group_span"] = round(span_model / span_measured - 1, 3)
        check[label] = {"cpu_s_measured": {side: run[side]["cpu_s"] for side in as_run}, "cpu_s_model": as_run,
                        "group_span_s_measured": round(span_measured, 1) if span_measured else None,
                        "group_span_s_model": round(span_model, 1), "error": errors,
                        "within": all(abs(e) <= MODEL_TOLERANCE for e in errors.values())}
    figures: dict[str, Any] = {}
    for label, sla_s in SLAS.items():
        predicted = model.predict(sla_s, rate)
        if label in runs:
            figures[label] = {"modelled": False, "per_hour": per_hour(runs[label]), "model_per_hour": predicted}
        else:
            figures[label] = {"modelled": True, "per_hour": predicted}
        hour = figures[label]["per_hour"]
        figures[label]["savings_cpu"] = round(hour["always_on"]["cpu_s"] / hour["sluice"]["cpu_s"], 2)
        figures[label]["savings_cpu_connect"] = round(hour["always_on"]["cpu_s"] / hour["sluice_connect"]["cpu_s"], 2)
        figures[label]["savings_reserved"] = round(hour["always_on"]["reserved_core_s"]
                                                   / hour["sluice"]["reserved_core_s"], 2)
        figures[label]["savings_mem"] = round(hour["always_on"]["gib_s"] / hour["sluice"]["gib_s"], 2)
    return {"rate": rate_name, "rate_eps": rate, "figures": figures, "runs": runs,
            "model": {**{k: (v.__dict__ if isinstance(v, Linear) else v) for k, v in model.__dict__.items()},
                      "check": check, "tolerance": MODEL_TOLERANCE,
                      "fitted_to": {"slas_s": [r["sla_s"] for r in runs.values()],
                                    "rates_at_60s": sorted(sizes or {})},
                      "within_tolerance": bool(check) and all(c["within"] for c in check.values())}}


def savings_bounds(sweep: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per SLA of the sweep, the most CPU savings a JVM per group (``jvm``) and a warm Connect
    server (``connect``) could show: the always-on side's CPU an hour over the fitted per-record
    CPU of that side's groups times an hour of records (a group with nothing but its records'
    work)."""
    model, records_h = sweep["model"], sweep["rate_eps"] * 3600
    bounds = {}
    for label, figures in sweep["figures"].items():
        always_on = figures["per_hour"]["always_on"]["cpu_s"]
        bounds[label] = {side: round(always_on / (model[f"{side}_group_cpu"]["per_record"] * records_h), 2)
                         for side in ("jvm", "connect")}
    return bounds


def add_bounds(result: dict[str, Any]) -> None:
    """``savings_cpu_bound_<sla>``, ``savings_cpu_connect_bound_<sla>``, and each CPU goal's
    ``bound`` (the 8-pipeline goal's is not modelled)."""
    bounds = savings_bounds(result["slas"])
    for label, bound in bounds.items():
        result[f"savings_cpu_bound_{label}"] = bound["jvm"]
        result[f"savings_cpu_connect_bound_{label}"] = bound["connect"]
    for key, goal in result.get("goals", {}).items():
        if not key.startswith("savings_cpu_"):
            continue
        rest = key.removeprefix("savings_cpu_")  # "15min", or "connect_15min"
        side, label = ("connect", rest.removeprefix("connect_")) if rest.startswith("connect_") else ("jvm", rest)
        if label in bounds:
            goal["bound"] = bounds[label][side]
            goal["reachable"] = goal["bound"] >= goal["goal"]


def multi_pipeline(work: Path, pipelines: int, rate: int, sla_s: float, window: float,
                   airflow_cpu: float | None) -> dict[str, Any]:
    """``pipelines`` pipelines at ``rate / pipelines`` each, arrivals staggered by SLA / n: as many
    always-on queries, against one Connect server serving them all; the two sides side by side
    (at a 5 min SLA both are idle most of the time). Per hour: each always-on query over its
    own span (idle included), each sluice client over its window of arrivals, and the server's
    idle rate plus its work for the n windows."""
    each = max(1, rate // pipelines)
    stagger = sla_s / pipelines
    sides: dict[str, Any] = {}

    def always_on_side() -> None:
        queries = [AlwaysOn(work, f"multi{i}", each, window, trigger_for(sla_s), delay_s=i * stagger)
                   for i in range(pipelines)]
        try:
            for q in queries:
                q.start()
            for q in queries:
                q.warm_up()
            run_all([q.run for q in queries])
        except BaseException:
            for q in queries:
                if hasattr(q, "proc"):
                    q.proc.kill()
            raise
        sides["always_on"] = [q.finish() for q in queries]

    def connect_side() -> None:
        sides["sluice_connect"] = shared_connect(work, pipelines, each, sla_s, window, stagger, airflow_cpu)

    run_all([always_on_side, connect_side])
    ss = sides["always_on"]
    ss_cpu_h = sum(clock_and_work(r["cpu_s"], r["idle_cpu_per_s"], r["wall_s"], window) for r in ss)
    ss_gib_h = sum(r["gib_s"] / r["wall_s"] * 3600 for r in ss)
    connect = sides["sluice_connect"]
    print(f"  {pipelines} always-on queries: {ss_cpu_h:.0f} CPU-s/h, {ss_gib_h:.0f} GiB-s/h; on one Connect "
          f"server: {connect['cpu_s_per_hour']:.0f} CPU-s/h, {connect['gib_s_per_hour']:.0f} GiB-s/h", flush=True)
    return {"pipelines": pipelines, "rate_eps_each": each, "sla_s": sla_s, "window_s": window, "stagger_s": stagger,
            "always_on": {"cpu_s_per_hour": round(ss_cpu_h, 1), "gib_s_per_hour": round(ss_gib_h, 1),
                          "max_freshness_s": max(r["max_freshness_s"] for r in ss), "queries": ss},
            "sluice_connect": connect,
            "savings_cpu": round(ss_cpu_h / connect["cpu_s_per_hour"], 2),
            "savings_mem": round(ss_gib_h / connect["gib_s_per_hour"], 2)}


def run_all(jobs: list[Any]) -> None:
    """Run the callables in threads and re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(job: Any) -> None:
        try:
            job()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def shared_connect(work: Path, pipelines: int, each: int, sla_s: float, window: float, stagger: float,
                   airflow_cpu: float | None) -> dict[str, Any]:
    from bench.overhead import start_connect_server

    (work / "multi-connect").mkdir(parents=True, exist_ok=True)
    server, url = start_connect_server(work / "multi-connect")
    meter = CpuMeter(server.pid)
    runs: list[dict[str, Any]] = [{} for _ in range(pipelines)]
    env = {"SLUICE_SPARK_REMOTE": url}
    try:
        sluice(work, "multi_warmup", each, WARM_UP_FILES, tag="connect", env=env, sla_s=sla_s)
        idle_from = meter.sample()
        time.sleep(IDLE_S)
        base = meter.sample()
        idle = (base - idle_from) / IDLE_S
        gib_base = meter.gib_s
        t0 = time.time()

        def one(i: int) -> None:
            runs[i] = sluice(work, f"multi{i}", each, window, tag="connect", env=env, sla_s=sla_s,
                             delay_s=i * stagger)

        run_all([lambda i=i: one(i) for i in range(pipelines)])
        span = time.time() - t0
        server_cpu = meter.sample() - base
        server_gib_s = meter.gib_s - gib_base
    finally:
        meter.stop()
        server.terminate()
        server.wait(timeout=60)
    charge_airflow_groups = [(airflow_cpu or 0.0) * len(r["groups"]) for r in runs]
    # With Airflow's figure charged, the stand-in clients are not (see charge_airflow).
    clients_cpu_h = sum((r["cpu_s"] - (client_groups_cpu(r) if airflow_cpu else 0.0) + a) / window * 3600
                        for r, a in zip(runs, charge_airflow_groups, strict=True))
    # the server's idle rate, plus its work for the n windows of arrivals
    server_cpu_h = idle * 3600 + max(0.0, server_cpu - idle * span) / window * 3600
    clients_gib_h = sum(r["gib_s"] / window * 3600 for r in runs)
    server_gib_h = server_gib_s / span * 3600
    return {"cpu_s_per_hour": round(clients_cpu_h + server_cpu_h, 1),
            "gib_s_per_hour": round(clients_gib_h + server_gib_h, 1),
            "server_cpu_s": round(server_cpu, 1), "server_idle_cpu_per_s": round(idle, 4),
            "server_cpu_s_per_hour": round(server_cpu_h, 1), "server_gib_s_per_hour": round(server_gib_h, 1),
            "clients_cpu_s_per_hour": round(clients_cpu_h, 1), "clients_gib_s_per_hour": round(clients_gib_h, 1),
            "airflow_cpu_s": round(sum(charge_airflow_groups), 1),
            "max_freshness_s": max(r["max_freshness_s"] for r in runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=float, help="seconds of arrivals per rate at the 60 s SLA")
    parser.add_argument("--rates", help="comma-separated subset of low,medium,high for the 60 s comparison "
                                        "(quick: low only; empty: none)")
    parser.add_argument("--sweep-rate", default="medium", help="the rate of the SLA sweep and the model")
    parser.add_argument("--slas", help="measured SLAs in seconds (default 60,300; quick: 60)")
    parser.add_argument("--pipelines", type=int, default=8)
    parser.add_argument("--skip-8p", action="store_true", help="leave out the multi-pipeline case")
    parser.add_argument("--bounds", action="store_true",
                        help="only add the savings bounds to the existing cost.json, from its own model")
    args = parser.parse_args(argv)
    if args.bounds:
        path = results_dir() / "cost.json"
        result = json.loads(path.read_text())
        add_bounds(result)
        write_result("cost", result)
        print(json.dumps({k: v for k, v in result.items() if "_bound_" in k}), flush=True)
        return 0
    window = args.window or (40 if args.quick else 150)
    rates = args.rates if args.rates is not None else ("low" if args.quick else ",".join(RATES))
    slas = [float(s) for s in (args.slas or ("60" if args.quick else "60,300")).split(",")]
    unknown = [s for s in slas if s not in SLAS.values()]
    unknown += [r for r in filter(None, rates.split(",")) if r not in RATES]
    if unknown or args.sweep_rate not in RATES:
        parser.error(f"unknown SLA or rate: {unknown or args.sweep_rate} "
                     f"(SLAs {list(SLAS.values())}, rates {list(RATES)})")
    work = configure("cost")
    overhead = results_dir() / "overhead.json"
    airflow_cpu = None
    if overhead.is_file():
        # The Connect-mode figure: the Airflow task processes and the run_group client. Under
        # spark-submit the same measurement also holds the driver's Python process, which the
        # JVM-per-group side here already counts in its own process tree.
        measured = json.loads(overhead.read_text()).get("airflow", {})
        airflow_cpu = (measured.get("connect") or {}).get("airflow_cpu_s_per_group")
    result: dict[str, Any] = {"rates": {}, "config": {
        "window_s": window, "sla_s": SLA_S, "ss_trigger_s": trigger_for(SLA_S), "rates_eps": RATES,
        "quick": args.quick, "airflow_cpu_s_per_group": airflow_cpu, "slas_s": SLAS, "measured_slas_s": slas,
        "trigger_margin_s": TRIGGER_MARGIN_S, "idle_watch_s": IDLE_S}}
    for name in filter(None, rates.split(",")):
        rate = RATES[name]
        print(f"rate {name} ({rate} events/s), {window:.0f} s of arrivals", flush=True)
        out = measure_sla(work, name, rate, SLA_S, window, airflow_cpu)
        out["savings_submit"] = round(out["always_on"]["cpu_s"] / out["sluice"]["cpu_s"], 2)
        out["savings_connect"] = round(out["always_on"]["cpu_s"] / out["sluice_connect"]["cpu_s"], 2)
        out["savings"] = max(out["savings_submit"], out["savings_connect"])
        # What a job cluster or serverless Spark bills: cores reserved while the JVM is up.
        reserved = out["always_on"]["reserved_core_s"] / out["sluice"]["reserved_core_s"]
        out["savings_reserved_submit"] = round(reserved, 2)
        out["cpu_s_per_hour"] = {k: round(out[k]["cpu_s"] / window * 3600)
                                 for k in ("always_on", "sluice", "sluice_connect")}
        result["rates"][name] = out
        result[f"savings_{name}"] = out["savings"]
        result[f"savings_reserved_{name}"] = out["savings_reserved_submit"]
        write_result("cost", result)  # a later failure keeps what was measured
        print(f"  {name}: savings x{out['savings_submit']} / x{out['savings_connect']}; reserved core-s "
              f"x{out['savings_reserved_submit']}", flush=True)
    reuse = result["rates"].get(args.sweep_rate)
    print(f"SLA sweep at {args.sweep_rate}: measured {slas}", flush=True)
    sweep = sla_sweep(work, args.sweep_rate, slas, window, airflow_cpu,
                      {k: reuse[k] for k in ("always_on", "sluice", "sluice_connect")} if reuse else None,
                      save=lambda partial: write_result("cost", {**result, "slas_partial": partial}),
                      sizes={name: out for name, out in result["rates"].items() if name != args.sweep_rate})
    result["slas"] = sweep
    for label, figures in sweep["figures"].items():
        result[f"savings_cpu_{label}"] = figures["savings_cpu"]
        result[f"savings_reserved_{label}"] = figures["savings_reserved"]
        result[f"savings_cpu_connect_{label}"] = figures["savings_cpu_connect"]
    goals = {"savings_reserved_15min": (result["savings_reserved_15min"], 10.0),
             "savings_cpu_15min": (result["savings_cpu_15min"], 1.5),
             "savings_cpu_connect_15min": (result["savings_cpu_connect_15min"], 3.0),
             "savings_cpu_1h": (result["savings_cpu_1h"], 3.0)}
    if not args.skip_8p and not args.quick:
        print(f"{args.pipelines} pipelines at a 5 min SLA", flush=True)
        write_result("cost", result)
        multi = multi_pipeline(work, args.pipelines, RATES[args.sweep_rate], SLAS["5min"],
                               max(window, 2 * SLAS["5min"]), airflow_cpu)
        result["multi"] = multi
        result[f"savings_cpu_{args.pipelines}p_5min"] = multi["savings_cpu"]
        result[f"savings_mem_{args.pipelines}p_5min"] = multi["savings_mem"]
        goals.update({f"savings_cpu_{args.pipelines}p_5min": (multi["savings_cpu"], 3.0),
                      f"savings_mem_{args.pipelines}p_5min": (multi["savings_mem"], 5.0)})
    result["goals"] = {k: {"value": v, "goal": g, "met": v >= g} for k, (v, g) in goals.items()}
    result["goals"]["model_within_15pct"] = {"value": sweep["model"]["check"],
                                             "met": sweep["model"]["within_tolerance"]}
    add_bounds(result)
    print(json.dumps(result["goals"], indent=1), flush=True)
    write_result("cost", result)
    plot(result, results_dir() / "cost.png")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = (("always_on", "always-on Structured Streaming"), ("sluice", "sluice, a JVM per group"),
             ("sluice_connect", "sluice on a warm Connect server"))
    names = list(result["rates"])
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    top, bottom = axes
    for i, (key, label) in enumerate(sides):
        if names:
            top[0].bar([j + (i - 1) * 0.27 for j in range(len(names))],
                       [result["rates"][n]["cpu_s_per_hour"][key] for n in names], 0.27, label=label)
            top[1].bar([j + (i - 1) * 0.27 for j in range(len(names))],
                       [result["rates"][n][key]["reserved_core_s"] / result["rates"][n][key]["wall_s"] * 3600
                        for n in names], 0.27)
            top[2].bar([j + (i - 1) * 0.27 for j in range(len(names))],
                       [result["rates"][n][key]["max_freshness_s"] for n in names], 0.27)
    for ax in top:
        ax.set_xticks(range(len(names)), [f"{n}\n{result['config']['rates_eps'][n]} ev/s" for n in names])
    top[0].set_ylabel("CPU-seconds per hour")
    top[1].set_ylabel("core-seconds reserved per hour of its run")
    top[2].axhline(result["config"]["sla_s"], color="red", linestyle=":")
    top[2].set_ylabel("max freshness (s)")
    top[0].set_title(f"at a {result['config']['sla_s']} s SLA, per input rate")

    sweep = result.get("slas")
    if sweep:
        labels = list(sweep["figures"])
        for col, (metric, ylabel) in enumerate((("cpu_s", "CPU-seconds per hour"),
                                                ("reserved_core_s", "core-seconds reserved per hour"),
                                                ("gib_s", "memory GiB-seconds per hour"))):
            ax = bottom[col]
            for i, (key, _) in enumerate(sides):
                for j, sla in enumerate(labels):
                    fig_sla = sweep["figures"][sla]
                    ax.bar(j + (i - 1) * 0.27, fig_sla["per_hour"][key][metric], 0.27, color=f"C{i}",
                           hatch="//" if fig_sla["modelled"] else None, edgecolor="white")
            ax.set_yscale("log")
            kinds = ["modelled" if sweep["figures"][sla]["modelled"] else "measured" for sla in labels]
            ax.set_xticks(range(len(labels)), [f"SLA {sla}\n{kind}" for sla, kind in zip(labels, kinds, strict=True)])
            ax.set_ylabel(ylabel)
        bottom[0].set_title(f"per SLA at {sweep['rate_eps']} ev/s (hatched: modelled)")
    title = "What a freshness SLA costs (2 cores): always-on Structured Streaming against sluice"
    multi = result.get("multi")
    if multi:  # not a panel of its own: its figures go under the title
        title += (f"\n{multi['pipelines']} pipelines at a 5 min SLA on one Connect server against as many "
                  f"always-on queries: CPU x{multi['savings_cpu']}, memory x{multi['savings_mem']}")
    fig.suptitle(title)
    fig.legend(*top[0].get_legend_handles_labels(), loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
