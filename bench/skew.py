"""Prompt partitioning against hash and Spark AQE on skewed keys (Zipf z in 0.5, 1.0, 1.5, 2.0).

    python -m bench.skew [--quick]       (also run by ``make bench-sched``)

**Workload: an epoch appended to a Delta table partitioned by key**, with the rows laid out by
key first so that each table partition gets one writer (``repartition(P, key)``, the usual way
to avoid P files per partition per epoch). Chosen because nothing shrinks it before the
shuffle: every row of a key must reach that key's writer, so a hot key makes a straggler
task. Per-key sums or distinct counts were not chosen: Spark's partial aggregation (and, for a
distinct count, its shuffle on (key, value)) already removes the skew before the shuffle by
key; the second part measures exactly that, with per-key sums, to say where Prompt buys
nothing.

Three layouts of the same rows, each timed from the Parquet input to the Delta commit:
* ``hash``: ``repartition(P, key)`` (sluice's ``partitioning: hash``);
* ``prompt``: an exact key count, Alg. 2's plan, exact placement (``partitioning: prompt``);
  the pre-pass is inside the timing;
* ``aqe``: ``rebalance(key)``, which Spark's AQE splits when a partition is skewed
  (``optimizeSkewsInRebalancePartitions``), with the advisory partition size set to the hash
  run's shuffle bytes / P so that AQE aims at P equal tasks rather than 64 MB ones.

Partition imbalance (max/mean records read by the write stage's tasks) and the coefficient
of variation of their run times come from Spark's own task metrics (the UI's REST API).
Throughput is records / wall second. On ``local[2]`` a balanced layout can be at most
``c = 2`` times faster than one task holding everything; ``throughput_bound`` is the speed-up
a perfect balance could give over hash here, max(largest hash partition, N/c) / (N/c).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

from bench.common import configure, session, stats, write_result
from sluice.net import get_json

ZS = (0.5, 1.0, 1.5, 2.0)
KEYS = 200  # distinct keys = table partitions per epoch
PARTITIONS = 8  # write tasks (spark.sql.shuffle.partitions)
CORES = 2


def make_input(folder: Path, rows: int, z: float, seed: int) -> Path:
    """A Parquet file of ``rows`` events whose ``key`` follows Zipf(z) over KEYS keys."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    weights = np.arange(1, KEYS + 1, dtype=float) ** -z
    ranks = rng.choice(KEYS, size=rows, p=weights / weights.sum())
    table = pa.table({
        "key": pa.array([f"key-{r:04d}" for r in ranks]),
        "event_id": pa.array(np.arange(rows, dtype=np.int64)),
        "event_time": pa.array(1_767_225_600_000 + rng.integers(0, 60_000, rows, dtype=np.int64)),
        "user_id": pa.array([f"user-{u:08x}" for u in rng.integers(0, 1 << 32, rows)]),
        "amount": pa.array(rng.exponential(10.0, rows)),
        "payload": pa.array([f"p{u:016x}{u:016x}" for u in rng.integers(0, 1 << 62, rows)]),
    })
    path = folder / f"zipf-{z}.parquet"
    pq.write_table(table, path)
    return path


class TaskMetrics:
    """Per-task metrics of the jobs of one job group, from the Spark UI's REST API."""

    def __init__(self, spark: Any) -> None:
        self.sc = spark.sparkContext
        self.base = f"{self.sc.uiWebUrl}/api/v1/applications/{self.sc.applicationId}"

    def _get(self, path: str) -> Any:
        return get_json(self.base + path, timeout_s=30)

    def write_stage(self, group: str) -> dict[str, Any]:
        """The stage of the group that read the most shuffle records (the write after the
        layout's shuffle): its tasks' records read and run times."""
        time.sleep(1.0)  # the listener bus delivers task ends asynchronously
        stages = [s for job in self._get("/jobs?status=succeeded") if job.get("jobGroup") == group
                  for s in job["stageIds"]]
        best: tuple[int, list[dict[str, Any]]] | None = None
        for stage_id in stages:
            try:
                attempts = self._get(f"/stages/{stage_id}")
            except urllib.error.HTTPError as exc:  # a skipped stage (its shuffle was reused) has no entry
                if exc.code == 404:
                    continue
                raise
            for attempt in attempts:
                tasks = self._get(f"/stages/{stage_id}/{attempt['attemptId']}/taskList?length=100000")
                read = sum(t["taskMetrics"]["shuffleReadMetrics"]["recordsRead"] for t in tasks
                           if t.get("status") == "SUCCESS")
                if read and (best is None or read > best[0]):
                    best = (read, [t for t in tasks if t.get("status") == "SUCCESS"])
        if best is None:
            raise RuntimeError(f"no shuffle-reading stage in job group {group}")
        tasks = best[1]
        records = [t["taskMetrics"]["shuffleReadMetrics"]["recordsRead"] for t in tasks]
        bytes_read = [t["taskMetrics"]["shuffleReadMetrics"]["localBytesRead"]
                      + t["taskMetrics"]["shuffleReadMetrics"]["remoteBytesRead"] for t in tasks]
        run_ms = [t["taskMetrics"]["executorRunTime"] for t in tasks]
        mean_ms = statistics.fmean(run_ms)
        return {"tasks": len(tasks), "records": records, "shuffle_bytes": sum(bytes_read),
                "imbalance": round(max(records) / statistics.fmean(records), 3) if sum(records) else 1.0,
                "task_time_cv": round(statistics.pstdev(run_ms) / mean_ms, 3) if mean_ms else 0.0,
                "max_task_s": round(max(run_ms) / 1000, 3)}


def write_partitioned(spark: Any, source: Path, table: Path, method: str, advisory: int | None) -> float:
    """One epoch from the Parquet file into a Delta table partitioned by ``key``; seconds."""
    from sluice.sinks import layout

    df = spark.read.parquet(str(source))
    t0 = time.perf_counter()
    if method == "aqe":
        if advisory:
            spark.conf.set("spark.sql.adaptive.advisoryPartitionSizeInBytes", str(advisory))
        laid = df.hint("rebalance", "key")
    else:
        laid, _ = layout.by_partition_columns(df, ["key"], method, PARTITIONS, seed=1)
    laid.write.format("delta").mode("append").partitionBy("key").save(str(table))
    elapsed = time.perf_counter() - t0
    spark.conf.unset("spark.sql.adaptive.advisoryPartitionSizeInBytes")
    return elapsed


def sum_by_key(spark: Any, source: Path, method: str) -> float:
    """Per-key sums of the epoch (what an aggregate sink MERGEs), computed and discarded."""
    from sluice.sinks import layout

    df = spark.read.parquet(str(source))
    t0 = time.perf_counter()
    summed, _ = layout.sums_by_key(df, ["key"], ["amount"], method, PARTITIONS, seed=1)
    summed.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


def run(spark: Any, quick: bool = False, reps: int | None = None, work: Path | None = None) -> dict[str, Any]:
    """The skew benchmark in an existing session (its UI must be on, for the task metrics)."""
    import shutil

    reps = reps or (2 if quick else 3)
    rows = 300_000 if quick else 1_000_000
    work = work or configure("skew")
    inputs = work / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    spark.conf.set("spark.sql.shuffle.partitions", str(PARTITIONS))
    metrics = TaskMetrics(spark)
    sc = spark.sparkContext
    per_z: dict[str, Any] = {}
    for z in ZS:
        source = make_input(inputs, rows, z, seed=int(z * 100))
        counts = spark.read.parquet(str(source)).groupBy("key").count().collect()
        top = max(r["count"] for r in counts) / rows
        print(f"  z={z}: {rows:,} rows, {len(counts)} keys, hottest key {top:.1%}", flush=True)
        times: dict[str, list[float]] = {m: [] for m in ("hash", "prompt", "aqe")}
        stage: dict[str, list[dict[str, Any]]] = {m: [] for m in times}
        # A warm-up hash run, discarded: its shuffle size sets AQE's advisory partition size.
        sc.setJobGroup(f"skew-{z}-warm-up", "warm-up")
        write_partitioned(spark, source, work / "tables" / f"warm-up-{z}", "hash", None)
        advisory = max(1, metrics.write_stage(f"skew-{z}-warm-up")["shuffle_bytes"] // PARTITIONS)
        shutil.rmtree(work / "tables" / f"warm-up-{z}")
        for rep in range(reps):
            for method in (("hash", "prompt", "aqe") if rep % 2 == 0 else ("aqe", "prompt", "hash")):
                group = f"skew-{z}-{method}-{rep}"
                sc.setJobGroup(group, group)
                table = work / "tables" / group
                seconds = write_partitioned(spark, source, table, method, advisory)
                found = metrics.write_stage(group)
                # The oracle: the table holds every input row once.
                written = spark.read.format("delta").load(str(table))
                if written.count() != rows or written.select("event_id").distinct().count() != rows:
                    raise AssertionError(f"z={z} {method}: the table does not hold the {rows} input rows once")
                shutil.rmtree(table)
                times[method].append(seconds)
                stage[method].append(found)
                print(f"    {method:6s} rep {rep}: {seconds:6.2f} s, imbalance {found['imbalance']:.2f}, "
                      f"task-time CV {found['task_time_cv']:.2f}, {found['tasks']} tasks", flush=True)
        agg = {m: [] for m in ("hash", "prompt")}
        for rep in range(reps):
            for method in ("hash", "prompt") if rep % 2 == 0 else ("prompt", "hash"):
                agg[method].append(sum_by_key(spark, source, method))
        sc.setJobGroup("", "")
        rps = {m: stats([rows / t for t in ts], 0) for m, ts in times.items()}
        largest_hash = max(statistics.median(max(s["records"]) for s in stage["hash"]), rows / CORES)
        row = {
            "rows": rows, "keys": len(counts), "hottest_key_share": round(top, 4), "rps": rps,
            "imbalance_hash": statistics.median(s["imbalance"] for s in stage["hash"]),
            "imbalance_prompt": statistics.median(s["imbalance"] for s in stage["prompt"]),
            "imbalance_aqe": statistics.median(s["imbalance"] for s in stage["aqe"]),
            "aqe_tasks": statistics.median(s["tasks"] for s in stage["aqe"]),
            "task_time_cv": {m: statistics.median(s["task_time_cv"] for s in stage[m]) for m in stage},
            "throughput_ratio_prompt_hash": round(statistics.median(times["hash"]) / statistics.median(
                times["prompt"]), 3),
            "throughput_ratio_aqe_hash": round(statistics.median(times["hash"]) / statistics.median(times["aqe"]), 3),
            "paired_ratio_prompt_hash": [round(h / p, 3) for h, p in zip(times["hash"], times["prompt"], strict=True)],
            "throughput_bound": round(largest_hash / (rows / CORES), 3),
            "sum_by_key_s": {m: stats(ts) for m, ts in agg.items()},
            "sum_ratio_prompt_hash": round(statistics.median(agg["hash"]) / statistics.median(agg["prompt"]), 3),
        }
        per_z[str(z)] = row
        print(f"  z={z}: prompt/hash x{row['throughput_ratio_prompt_hash']} (bound x{row['throughput_bound']}), "
              f"aqe/hash x{row['throughput_ratio_aqe_hash']}, sums prompt/hash x{row['sum_ratio_prompt_hash']}",
              flush=True)
    return {"workload": "Delta append partitioned by key, one writer per key", "keys": KEYS,
            "partitions": PARTITIONS, "cores": CORES, "rows": rows, "reps": reps, "per_z": per_z}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    work = configure("skew")
    spark = session("sluice-bench-skew", ui=True)
    result = run(spark, quick=args.quick, work=work)
    write_result("skew", result)
    print(json.dumps({z: {k: v for k, v in r.items() if k.startswith(("imbalance", "throughput"))}
                      for z, r in result["per_z"].items()}, indent=1))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
