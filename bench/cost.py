"""CPU-seconds to keep YSB within a 60 s freshness SLA: sluice (run-once groups, started by the
backlog trigger's own decision) against an always-on Structured Streaming query.

    python -m bench.cost [--quick] [--window 150]

Per input rate (low, medium, high; one file per second) events land for ``window`` seconds.

* **always-on**: one Structured Streaming query, ``processingTime`` trigger of 30 s (so a
  record waits at most 30 s plus one batch), ``foreachBatch`` writing the same Delta tables
  the same way as sluice. Charged: its process tree's CPU from its first trigger on (its
  start-up is amortised over a life of days).
* **sluice**, under ``control.objective: cost``: the decision of ``sluice.adaptive.decide``
  (the same the backlog trigger takes, freshness SLA 60 s) starts each group as a run-once
  application (``sluice run-group --plan``), with its own JVM (charged: each application's
  whole process tree, start-up included) or as a client of a warm Spark Connect server
  (charged: the clients plus the server's whole CPU over the window, idle included); plus the
  Airflow task processes of a group (``airflow_cpu_s_per_group``, measured under Connect in
  ``overhead.json`` when ``bench.overhead`` ran under Airflow, else not charged and said so).

The sides run one after another, each with the whole machine: sides sharing two cores slow
each other's groups past the SLA.
Also recorded: the core-seconds each side *reserves* (cores while its JVM is up; the Connect
server and the always-on query are up all the time), which is what a job cluster or serverless
Spark bills, as ``savings_reserved_<rate>`` for the JVM-per-group side.

CPU is sampled from ``/proc`` over each process tree (``bench.common.CpuMeter``); both sides
run the same parse, reject split, transform and idempotent MERGE, with GX off. Freshness
(publish time minus the file's landing time) is recorded for both, so neither wins by
missing the SLA. Writes ``bench/results/cost.json`` and ``cost.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC
from pathlib import Path
from typing import Any

from bench.common import ROOT, CpuMeter, configure, results_dir, write_result, write_spec, ysb_spec_yaml

RATES = {"low": 100, "medium": 1_000, "high": 5_000}  # events per second
SLA_S = 60
SS_TRIGGER_S = 30
CORES = 2  # every side runs local[2]: what a deployment would reserve for it
WARM_UP_FILES = 10

ALWAYS_ON = r"""
import json, os, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1] + "/plugins", sys.argv[1]]
from sluice.spec import load_spec
from sluice.spark import get_session
from sluice.runner import load_reference, load_transform, split_rejected
from sluice.sinks.delta import DeltaSink, EpochRange, rejected_sink
from sluice.sources import FileSource
spec = load_spec(sys.argv[2]); trigger_s = int(sys.argv[3]); done_flag = Path(sys.argv[4])
# A long-lived driver: the JVM's default JIT (C2), not sluice's run-once options.
spark = get_session("always-on", master=f"local[{sys.argv[5]}]",
                    extra_conf={"spark.driver.extraJavaOptions": "-XX:+TieredCompilation"})
spark.sparkContext.setLogLevel("WARN")
refs = load_reference(spark, spec); transform = load_transform(spec.transform)
sink = DeltaSink(spec.name, spec.sinks[0]); rejected = rejected_sink(spec.name, spec.rejected_table)
def write_batch(batch, batch_id):
    records = batch.persist()
    try:
        valid, bad = split_rejected(records, spec, 0, batch_id)
        files = [r["_file"] for r in records.select("_file").distinct().collect()]
        kw = {"epochs": [EpochRange(batch_id, batch_id, batch_id + 1)], "generation": 0, "token": 1}
        rejected.write(spark, bad, skip_empty=True, **kw)
        sink.write(spark, transform(valid, refs), **kw)
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


def land(landing: Path, rate: int, window: float, stop: threading.Event) -> None:
    """One file per second at ``rate`` events per second, landed atomically."""
    from include.generators.ysb import generate

    staging = landing.parent / f".staging-{landing.name}"
    start = time.time()
    second = 0
    while not stop.is_set() and second < window:
        for path in generate(staging, rate=rate, duration=1, files_per_second=1, seed=second,
                             start_ms=int((start + second) * 1000), prefix=f"e{second:06d}"):
            os.replace(path, landing / path.name)
        second += 1
        time.sleep(max(0.0, start + second - time.time()))


def always_on(work: Path, rate_name: str, rate: int, window: float) -> dict[str, Any]:
    """Charged from the end of an untimed warm-up batch: a query that lives for days has long
    paid its start-up and JIT warm-up."""
    from include.generators.ysb import generate

    root = work / f"always-on-{rate_name}"
    landing = root / "landing"
    landing.mkdir(parents=True)
    generate(landing, rate=rate, duration=WARM_UP_FILES, files_per_second=1, seed=10**6, prefix="warmup")
    spec = write_spec(root, ysb_spec_yaml(f"cost_ss_{rate_name}", landing, root / "tables" / "campaign_views"))
    done = root / "done"
    proc = subprocess.Popen([sys.executable, "-c", ALWAYS_ON, str(ROOT), str(spec.path), str(SS_TRIGGER_S), str(done),
                             str(CORES)],
                            stdout=subprocess.PIPE, stderr=(root / "always_on.log").open("w"), text=True)
    meter = CpuMeter(proc.pid)

    def next_row() -> dict[str, Any]:
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=60)
            raise RuntimeError(f"always-on query for {rate_name} exited early ({proc.returncode}): "
                               f"{(root / 'always_on.log').read_text()[-2000:]}")
        return json.loads(line)

    warm_up = next_row()
    while "batch" not in warm_up:  # {"started": ...} comes first, usually
        warm_up = next_row()
    if warm_up.get("files") != WARM_UP_FILES:
        raise RuntimeError(f"always-on warm-up batch read {warm_up.get('files')} files, not {WARM_UP_FILES}")
    started = time.time()
    cpu_at_start = meter.sample()
    startup_cpu = cpu_at_start
    stop = threading.Event()
    lander = threading.Thread(target=land, args=(landing, rate, window, stop), daemon=True)
    lander.start()
    batches, files_done = [], 0
    expected = int(window)
    while files_done < expected:
        row = next_row()
        batches.append(row)
        files_done += row["files"]
    end = time.time()
    cpu = meter.sample() - cpu_at_start
    done.touch()
    proc.wait(timeout=60)
    meter.stop()
    freshness = [f for b in batches for f in b["freshness"]]
    return {"cpu_s": round(cpu, 1), "startup_cpu_s": round(startup_cpu, 1), "wall_s": round(end - started, 1),
            "reserved_core_s": round(CORES * (end - started), 1),
            "batches": len(batches), "files": files_done, "max_freshness_s": round(max(freshness), 1),
            "mean_freshness_s": round(sum(freshness) / len(freshness), 1)}


def sluice_connect(work: Path, rate_name: str, rate: int, window: float) -> dict[str, Any]:
    """sluice with each group on a warm Spark Connect server: charged the server's whole CPU
    over the window (idle included) plus each run-once client."""
    from bench.overhead import start_connect_server

    server, url = start_connect_server(work)
    meter = CpuMeter(server.pid)
    base = 0.0
    try:
        # An untimed warm-up pipeline first: a server that lives for days has long paid its JIT warm-up.
        sluice(work, f"{rate_name}_warmup", rate, WARM_UP_FILES, tag="connect", env={"SLUICE_SPARK_REMOTE": url})
        base = meter.sample()
        result = sluice(work, rate_name, rate, window, tag="connect",
                        env={"SLUICE_SPARK_REMOTE": url})
    finally:
        server_cpu = meter.stop() - base
        server.terminate()
        server.wait(timeout=60)
    result["client_cpu_s"] = result["cpu_s"]
    result["server_cpu_s"] = round(server_cpu, 1)
    result["reserved_core_s"] = round(CORES * result["wall_s"], 1)  # the server is up all the time
    result["cpu_s"] = round(result["cpu_s"] + server_cpu, 1)
    return result


def sluice(work: Path, rate_name: str, rate: int, window: float, tag: str = "submit",
           env: dict[str, str] | None = None) -> dict[str, Any]:
    from sluice import adaptive
    from sluice.paths import RUN_GROUP_APP
    from sluice.sources import FileSource
    from sluice.store import EpochLog

    root = work / f"sluice-{tag}-{rate_name}"
    landing = root / "landing"
    landing.mkdir(parents=True)
    raw = ysb_spec_yaml(f"cost_sluice_{tag}_{rate_name}", landing, root / "tables" / "campaign_views")
    # epoch_files: before anything is measured, epochs of what the always-on side takes per batch
    raw["control"].update(adaptive=True, objective="cost", freshness_sla_s=SLA_S, epoch_files=SS_TRIGGER_S,
                          group_epochs=1, poll_interval_s=1)
    spec = write_spec(Path(os.environ["SLUICE_PIPELINES_DIR"]), raw)
    store = f"sqlite:///{root / 'sluice.db'}"
    epoch_log = EpochLog(store)
    source = FileSource(spec, epoch_log)
    stop = threading.Event()
    lander = threading.Thread(target=land, args=(landing, rate, window, stop), daemon=True)
    t0 = time.time()
    lander.start()
    groups, cpu, reserved = [], 0.0, 0.0
    poll_cpu = 0.0
    while lander.is_alive() or source.backlog().files:
        p0 = time.process_time()
        backlog = source.backlog()
        verdict = adaptive.decide(spec, epoch_log, backlog.files, backlog.oldest_age_s,
                                  [f[2] for f in source.list_folder()], continuous=lander.is_alive())
        poll_cpu += time.process_time() - p0
        if not verdict.fire:
            time.sleep(spec.control.poll_interval_s)
            continue
        plan = dict(verdict.plan(), fired_at=time.time())
        proc = subprocess.Popen([sys.executable, str(RUN_GROUP_APP), "--pipeline", spec.name,
                                 "--plan", "--store-url", store, "--epoch-size", str(plan["epoch_size"]),
                                 "-k", str(plan["k"]), "--plan-extra", json.dumps(plan)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "SLUICE_SPARK_MASTER": f"local[{CORES}]", **(env or {})})
        meter = CpuMeter(proc.pid)
        _, err = proc.communicate()
        group_cpu = meter.stop()
        reserved += CORES * (time.time() - plan["fired_at"])
        if proc.returncode:
            raise RuntimeError(f"group failed ({proc.returncode}): {err[-2000:]}")
        cpu += group_cpu
        groups.append({"at_s": round(plan["fired_at"] - t0, 1), "reason": plan["reason"], "cpu_s": round(group_cpu, 1),
                       "epoch_size": plan["epoch_size"], "k": plan["k"]})
    freshness = []
    for e in epoch_log.epochs(spec.name):
        published = e.published_at.replace(tzinfo=UTC).timestamp() if e.published_at else None
        freshness += [published - f.mtime for f in epoch_log.manifest(spec.name, e.start, e.end)] if published else []
    epoch_log.engine.dispose()
    return {"cpu_s": round(cpu + poll_cpu, 1), "trigger_poll_cpu_s": round(poll_cpu, 2),
            "wall_s": round(time.time() - t0, 1), "reserved_core_s": round(reserved, 1),
            "groups": groups, "max_freshness_s": round(max(freshness), 1),
            "mean_freshness_s": round(sum(freshness) / len(freshness), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--rates", help="comma-separated subset of low,medium,high (quick: low only)")
    args = parser.parse_args(argv)
    window = args.window or (40 if args.quick else 150)
    rates = args.rates or ("low" if args.quick else ",".join(RATES))
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
        "window_s": window, "sla_s": SLA_S, "ss_trigger_s": SS_TRIGGER_S, "rates_eps": RATES, "quick": args.quick,
        "airflow_cpu_s_per_group": airflow_cpu}}
    for name in rates.split(","):
        rate = RATES[name]
        print(f"rate {name} ({rate} events/s), {window:.0f} s of arrivals", flush=True)
        # One side at a time, each on its own landing folder and the same window: sides that
        # shared the two cores slowed each other's groups past the SLA.
        out: dict[str, Any] = {}
        for key, fn in (("always_on", always_on), ("sluice", sluice), ("sluice_connect", sluice_connect)):
            out[key] = fn(work, name, rate, window)
            print(f"  {key}: {out[key]['cpu_s']} CPU-s, max freshness {out[key]['max_freshness_s']} s", flush=True)
        for side_name in ("sluice", "sluice_connect"):
            if airflow_cpu:
                side_result = out[side_name]
                side_result["airflow_cpu_s"] = round(airflow_cpu * len(side_result["groups"]), 1)
                side_result["cpu_s"] = round(side_result["cpu_s"] + side_result["airflow_cpu_s"], 1)
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
        print(f"  {name}: always-on {out['always_on']['cpu_s']} CPU-s, sluice {out['sluice']['cpu_s']} CPU-s "
              f"({len(out['sluice']['groups'])} groups), with Connect {out['sluice_connect']['cpu_s']} CPU-s; "
              f"savings x{out['savings_submit']} / x{out['savings_connect']}; max freshness "
              f"{out['always_on']['max_freshness_s']} / {out['sluice']['max_freshness_s']} / "
              f"{out['sluice_connect']['max_freshness_s']} s; reserved core-s x{out['savings_reserved_submit']}",
              flush=True)
    write_result("cost", result)
    plot(result, results_dir() / "cost.png")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["rates"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    sides = (("always_on", "always-on Structured Streaming"), ("sluice", "sluice, spark-submit per group"),
             ("sluice_connect", "sluice on a warm Connect server"))
    for i, (key, label) in enumerate(sides):
        axes[0].bar([j + (i - 1) * 0.27 for j in range(len(names))],
                    [result["rates"][n]["cpu_s_per_hour"][key] for n in names], 0.27, label=label)
        axes[1].bar([j + (i - 1) * 0.27 for j in range(len(names))],
                    [result["rates"][n][key]["reserved_core_s"] / result["rates"][n][key]["wall_s"] * 3600
                     for n in names],
                    0.27, label=label)
        axes[2].bar([j + (i - 1) * 0.27 for j in range(len(names))],
                    [result["rates"][n][key]["max_freshness_s"] for n in names], 0.27, label=label)
    for ax in axes:
        ax.set_xticks(range(len(names)), [f"{n}\n{result['config']['rates_eps'][n]} ev/s" for n in names])
    axes[0].set_ylabel("CPU-seconds per hour")
    axes[1].set_ylabel("core-seconds reserved per hour of its run")
    axes[2].axhline(result["config"]["sla_s"], color="red", linestyle=":")
    axes[2].set_ylabel("max freshness (s)")
    fig.suptitle("Cost at a 60 s freshness SLA (2 cores)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
