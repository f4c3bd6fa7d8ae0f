"""What ``dedup`` costs a group: the same group processed and committed with and without it.

Two pipelines read the same landed files (``--records`` JSON records: an id, a time, a value;
ids drawn from ``2 * --records`` so about a fifth repeat within the group, times spread over
two horizons). One has ``dedup: {keys: [id], within: 1h, time: at}``, the other none; both
have the same SQL transform and one append sink. Each side is run once through ``run_once``
(files registered, tables created, the JVM warmed), then each repetition processes the group
again exactly as a group commit does (``SparkCompute.prepare_group`` and ``GroupJob._write_all``,
every table of the pipeline, the seen-keys MERGE included), with the dedup side's seen-keys
table RESTOREd (not timed) to one of two state sizes (``--states``: keys already seen, the
even-numbered ones in the group's id range, their times within the horizon of some records and
not of others). The sides alternate (ABBA) on one session. Records/s = the group's records / wall seconds;
CPU-s per 1,000 records from the whole process tree (the JVM included).

    python -m bench.dedup [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import CpuMeter, configure, results_dir, session, stats, write_result

T0 = 1_800_000_000
WITHIN_S = 3600


def land(folder: Path, records: int, files: int, seed: int) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = records // files
    for i in range(files):
        lines = [json.dumps({"id": f"k{rng.randrange(2 * records):09d}", "at": T0 + rng.randrange(2 * WITHIN_S),
                             "v": rng.randrange(1000)}) for _ in range(per_file)]
        (folder / f"r{i:04d}.json").write_text("\n".join(lines) + "\n")


def spec_for(work: Path, name: str, landing: Path, dedup: bool) -> Any:
    import yaml

    from sluice.spec import load_spec

    raw: dict[str, Any] = {
        "schedule": None,
        "source": {"path": str(landing), "settle_s": 0, "schema": {"id": "string", "at": "long", "v": "long"},
                   "required": ["id", "at"]},
        "transform": {"sql": "SELECT id, at, v FROM records"},
        "sinks": [{"name": "out", "mode": "append", "path": str(work / "tables" / name / "out")}],
        "control": {"adaptive": False, "epoch_files": 2, "group_epochs": 4, "freshness_sla_s": 5},
        "spark": {"mode": "in_process", "conf": {"spark.sql.shuffle.partitions": "4"}},
    }
    if dedup:
        raw["dedup"] = {"keys": ["id"], "within": f"{WITHIN_S}s", "time": "at"}
    path = Path(os.environ["SLUICE_PIPELINES_DIR"]) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_spec(path)


def measure(work: Path, records: int, states: list[int], reps: int, seed: int) -> dict[str, Any]:
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from sluice.delta.spark import SparkTables
    from sluice.protocol import rules
    from sluice.protocol.group import GroupJob
    from sluice.protocol.run import run_once
    from sluice.protocol.runtime import Runtime
    from sluice.store import EpochStore

    spark = session("sluice-bench-dedup")
    landing = work / "landing"
    land(landing, records, files=8, seed=seed)
    store = EpochStore()
    specs = {"plain": spec_for(work, "bench_plain", landing, False),
             "dedup": spec_for(work, "bench_dedup", landing, True)}
    for spec in specs.values():
        run_once(spec, store, spark, drain=True)
    tables = SparkTables(spark)
    runtime = Runtime.spark(spark)
    jobs = {name: GroupJob(spec, store, runtime) for name, spec in specs.items()}
    epochs = {name: store.epochs(spec.name) for name, spec in specs.items()}
    # The state sizes: RESTORE the seen keys to empty, then append synthetic keys (epoch -1, older
    # than any of the group's); the even ones fall in the group's id range, the odd ones outside.
    state_path = specs["dedup"].dedup_table
    DeltaTable.forPath(spark, state_path).restoreToVersion(0)
    state_versions: dict[int, int] = {}
    have = 0
    for size in sorted(states):
        more = size - have
        (spark.range(have, size).select(
            F.format_string("k%09d", F.when(F.col("id") % 2 == 0, F.col("id"))
                            .otherwise(F.col("id") + 10 * records)).alias("id"),
            (F.lit(T0) + (F.col("id") * 7919) % (2 * WITHIN_S)).cast("long").alias("_seen_at"),
            F.lit(-1).alias("_epoch"), F.lit(False).alias("_deleted"))
         .write.format("delta").mode("append").save(state_path))
        have += more
        state_versions[size] = tables.version(state_path)
    starts = {name: tables.version(spec.sinks[0].path) for name, spec in specs.items()}
    rejected_starts = {name: tables.version(spec.rejected_table) for name, spec in specs.items()}
    meter = CpuMeter(os.getpid())
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    deduplicated: dict[int, int] = {}
    # Each repetition writes under a newer lease token than any in the tables (Delta skips a
    # txnVersion it has seen; RESTORE does not take the recorded ones back).
    token = max(rules.txn_token(tables.txn_version(t.path, t.app_id(0)) or 0)
                for job in jobs.values() for t in job.tables.values())
    for rep in range(reps + 1):  # the first repetition is a warm-up, dropped
        for size in states:
            sides = ["plain", f"dedup_{size}"] if (rep + states.index(size)) % 2 == 0 else [f"dedup_{size}", "plain"]
            for side in sides:
                name = "dedup" if side.startswith("dedup") else "plain"
                spec = specs[name]
                DeltaTable.forPath(spark, spec.sinks[0].path).restoreToVersion(starts[name])
                DeltaTable.forPath(spark, spec.rejected_table).restoreToVersion(rejected_starts[name])
                if name == "dedup":
                    DeltaTable.forPath(spark, state_path).restoreToVersion(state_versions[size])
                token += 1
                cpu0, t0 = meter.sample(), time.perf_counter()
                prepared = jobs[name].compute.prepare_group(epochs[name])
                try:
                    prepared.wait()
                    jobs[name]._write_all(SimpleNamespace(fence=token), prepared, epochs[name])
                finally:
                    prepared.release()
                elapsed, used = time.perf_counter() - t0, meter.sample() - cpu0
                if name == "dedup":
                    deduplicated[size] = sum(prepared.n_deduplicated.values())
                if rep:
                    seconds.setdefault(side, []).append(elapsed)
                    cpu.setdefault(side, []).append(used)
    meter.stop()
    n_input = sum(sum(e.rows.get("input", 0) for e in epochs[n]) for n in ("plain",))
    spark.stop()
    store.close()
    rates = {side: [n_input / s for s in values] for side, values in seconds.items()}
    per_k = {side: [c / n_input * 1000 for c in values] for side, values in cpu.items()}
    return {"records": n_input, "states": states, "reps": reps, "seed": seed, "within_s": WITHIN_S,
            "deduplicated": deduplicated, "seconds": {k: stats(v) for k, v in seconds.items()},
            "records_per_s": {k: stats(v, 0) for k, v in rates.items()},
            "cpu_s_per_1000": {k: stats(v, 4) for k, v in per_k.items()}}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = ["plain", *[f"dedup_{s}" for s in result["states"]]]
    labels = ["no dedup", *[f"dedup, {s:,} keys seen" for s in result["states"]]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    for ax, metric, title in ((axes[0], "records_per_s", "records/s"),
                              (axes[1], "cpu_s_per_1000", "CPU-s per 1,000 records")):
        r = result[metric]
        med = [r[s]["median"] for s in sides]
        err = [[m - r[s]["min"] for s, m in zip(sides, med, strict=True)],
               [r[s]["max"] - m for s, m in zip(sides, med, strict=True)]]
        ax.barh(labels, med, xerr=err, capsize=4, color=["#999999", "#3b75af", "#1f4e79"][: len(sides)])
        ax.set_xlabel(f"{title}\n(median, min-max; {result['reps']} reps per side and state size)")
    fig.suptitle(f"dedup: one group of {result['records']:,} records (prepare + commit), local[2]")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repetitions")
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--states", type=int, nargs=2, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    work = configure("dedup")
    records = args.records or (20_000 if args.quick else 100_000)
    states = args.states or ([10_000, 100_000] if args.quick else [100_000, 1_000_000])
    result = measure(work, records, list(states), args.reps or (2 if args.quick else 4), args.seed)
    result["config"] = {"quick": args.quick, "spark": "local[2]", "shuffle_partitions": 4}
    write_result("dedup", result)
    plot(result, results_dir() / "dedup.png")
    print(json.dumps({"records_per_s": {k: v["median"] for k, v in result["records_per_s"].items()},
                      "cpu_s_per_1000": {k: v["median"] for k, v in result["cpu_s_per_1000"].items()},
                      "deduplicated": result["deduplicated"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
