"""What one table's commit costs sluice and a plain batch job, step by step (Delta alone).

Every group commits each table it writes with a Delta ``txnAppId``/``txnVersion`` (exactly once,
and the fence of the commit path). To read the txn version Delta computes the table's whole
snapshot state (``Snapshot.transactions`` → ``computedState``: a Spark job over the log, even
though the checksum file holds the set transactions), once per table per driver; a plain batch
append never does. A new table is also created empty first (a rollback can RESTORE to the
version before the first commit). This benchmark measures those steps on tiny tables, so the
fixed cost of a group on small input can be told apart from the work.

Each repetition starts from Delta's log cache cleared (``DeltaLog.clearCache``), as a run-once
driver finds it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import configure, results_dir, session, stats, write_result

ROWS = 1_000


def measure(work: Path, reps: int) -> dict[str, Any]:
    from delta.tables import DeltaTable

    from sluice.delta.spark import SparkTables

    spark = session("sluice-bench-delta-commit")
    frame = spark.range(ROWS).selectExpr("id", "cast(id as string) AS s")
    jvm = spark._jvm  # type: ignore[attr-defined]

    def clear_cache() -> None:
        jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()

    def append(path: str, version: int | None = None) -> None:
        writer = frame.write.format("delta").mode("append")
        if version is not None:
            writer = writer.option("txnAppId", "bench").option("txnVersion", version)
        writer.save(path)

    def create_empty(path: str) -> None:
        DeltaTable.createIfNotExists(spark).location(path).addColumns(frame.schema).execute()

    def transactions(path: str) -> None:  # what SparkTables.warm does ahead of a commit
        SparkTables(spark).warm(path)

    steps: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        steps.setdefault(name, []).append(time.perf_counter() - t0)

    for rep in range(reps + 1):  # the first repetition warms the JVM up and is dropped
        folder = work / f"rep{rep}"
        plain, txn = str(folder / "plain"), str(folder / "txn")
        clear_cache()
        # A plain batch job's first write: it creates the table with its rows, no txn to read.
        timed("plain_create_with_rows_s", append, plain)
        # sluice's first group on a new table: created empty, state computed, then the commit.
        timed("create_empty_s", create_empty, txn)
        timed("txn_state_s", transactions, txn)
        timed("txn_append_state_loaded_s", append, txn, 1)
        # The next driver (a later group): the log cache is empty again.
        clear_cache()
        timed("plain_append_cold_s", append, plain)
        clear_cache()
        timed("txn_append_cold_s", append, txn, 2)
        shutil.rmtree(folder, ignore_errors=True)
    steps = {name: values[1:] for name, values in steps.items()}
    result: dict[str, Any] = {"rows": ROWS, "reps": reps, "steps": {k: stats(v) for k, v in steps.items()}}
    paired = [t - p for t, p in zip(steps["txn_append_cold_s"], steps["plain_append_cold_s"], strict=True)]
    result["txn_extra_per_table_s"] = stats(paired)  # what a txn adds to one table's commit
    first = [c + s + a - p for c, s, a, p in zip(steps["create_empty_s"], steps["txn_state_s"],
                                                  steps["txn_append_state_loaded_s"],
                                                  steps["plain_create_with_rows_s"], strict=True)]
    result["first_commit_extra_per_table_s"] = stats(first)  # a new table: empty create + txn state
    spark.stop()
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    s = {k: v["median"] for k, v in result["steps"].items()}
    bars = {
        "batch: first write (creates)": [("append", s["plain_create_with_rows_s"])],
        "sluice: first commit": [("create empty", s["create_empty_s"]), ("txn state", s["txn_state_s"]),
                                 ("append", s["txn_append_state_loaded_s"])],
        "batch: later write": [("append", s["plain_append_cold_s"])],
        "sluice: later commit": [("append + txn state", s["txn_append_cold_s"])],
    }
    colours: dict[str, Any] = {}
    for label, parts in bars.items():
        left = 0.0
        for name, value in parts:
            bar = ax.barh([label], [value], left=left, color=colours.get(name),
                          label=None if name in colours else name)
            colours.setdefault(name, bar.patches[0].get_facecolor())
            left += value
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds per table (median of {result['reps']}, {result['rows']} rows, local[2])")
    ax.set_title("one Delta table's commit: plain batch append vs sluice's exactly-once commit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    work = configure("delta_commit")
    result = measure(work / "tables", 5 if args.quick else 10)
    result["config"] = {"quick": args.quick, "spark": "local[2]"}
    write_result("delta_commit", result)
    plot(result, results_dir() / "delta_commit.png")
    print(json.dumps({k: v["median"] for k, v in result.items() if k.endswith("_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
