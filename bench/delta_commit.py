"""What one table's commit costs sluice and a plain batch job, step by step (Delta alone).

Every group commits each table it writes with a Delta ``txnAppId``/``txnVersion`` (exactly once,
and the fence of the commit path). To read the txn version Delta computes the table's whole
snapshot state (``Snapshot.transactions`` → ``computedState``: a Spark job over the log, even
though the checksum file holds the set transactions), once per table per driver; a plain batch
append never does. A new table is also created empty first (a rollback can RESTORE to the
version before the first commit). This benchmark measures those steps on tiny tables, so the
fixed cost of a group on small input can be told apart from the work, and what helps within
Delta 4.4.0 (issue 39): a warm server's kept log cache, two tables committed at once, a group
without a ``_rejected`` commit, Delta's checkpoint interval on a longer log (not with ``--quick``).

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


def measure(work: Path, reps: int, long_logs: bool = True) -> dict[str, Any]:
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

    def serial(writes: list[tuple[str, int]]) -> None:
        for path, version in writes:
            append(path, version)

    def parallel(writes: list[tuple[str, int]]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(writes)) as pool:
            for done in [pool.submit(append, path, version) for path, version in writes]:
                done.result()

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
        # A warm server's next group: Delta's log cache is kept, but the snapshot the last commit
        # made has no state computed yet.
        timed("plain_append_warm_s", append, plain)
        timed("txn_append_warm_s", append, txn, 3)
        # A group's two tables (the sink and `_rejected`), both later commits on a new driver:
        # one after the other (what sluice does), or in two threads at once (Spark runs the jobs
        # of several threads together); one table alone is a group whose `_rejected` is empty.
        other = str(folder / "other")
        append(other, 1)
        clear_cache()
        timed("two_tables_serial_s", serial, [(txn, 4), (other, 2)])
        clear_cache()
        timed("two_tables_parallel_s", parallel, [(txn, 5), (other, 3)])
        # The txn lookup on a longer log: 30 commits with Delta's checkpoint every 10 (the
        # default) or none (interval 100): the state is read from a checkpoint's Parquet or
        # replayed from every JSON commit.
        for interval in (10, 100) if long_logs else ():
            long = str(folder / f"long{interval}")
            create_empty(long)
            spark.sql(f"ALTER TABLE delta.`{long}` SET TBLPROPERTIES "
                      f"('delta.checkpointInterval' = '{interval}')")
            for v in range(1, 31):
                append(long, v)
            clear_cache()
            timed(f"txn_append_cold_30_commits_checkpoint_{interval}_s", append, long, 31)
        shutil.rmtree(folder, ignore_errors=True)
    steps = {name: values[1:] for name, values in steps.items()}
    result: dict[str, Any] = {"rows": ROWS, "reps": reps, "steps": {k: stats(v) for k, v in steps.items()}}
    paired = [t - p for t, p in zip(steps["txn_append_cold_s"], steps["plain_append_cold_s"], strict=True)]
    result["txn_extra_per_table_s"] = stats(paired)  # what a txn adds to one table's commit
    first = [c + s + a - p for c, s, a, p in zip(steps["create_empty_s"], steps["txn_state_s"],
                                                  steps["txn_append_state_loaded_s"],
                                                  steps["plain_create_with_rows_s"], strict=True)]
    result["first_commit_extra_per_table_s"] = stats(first)  # a new table: empty create + txn state
    warm = [t - p for t, p in zip(steps["txn_append_warm_s"], steps["plain_append_warm_s"], strict=True)]
    # the same with the log cache kept (a warm server's next group): the snapshot the last commit
    # made has no state yet, and the txn lookup computes it again
    result["txn_extra_per_table_warm_s"] = stats(warm)
    saved = [s - p for s, p in zip(steps["two_tables_serial_s"], steps["two_tables_parallel_s"], strict=True)]
    result["two_tables_parallel_saves_s"] = stats(saved)  # paired: serial minus parallel
    alone = [s - c for s, c in zip(steps["two_tables_serial_s"], steps["txn_append_cold_s"], strict=True)]
    result["rejected_empty_saves_s"] = stats(alone)  # a group with no `_rejected` commit: one table fewer
    spark.stop()
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.4))
    s = {k: v["median"] for k, v in result["steps"].items()}
    bars = {
        "batch: first write (creates)": [("append", s["plain_create_with_rows_s"])],
        "sluice: first commit": [("create empty", s["create_empty_s"]), ("txn state", s["txn_state_s"]),
                                 ("append", s["txn_append_state_loaded_s"])],
        "batch: later write": [("append", s["plain_append_cold_s"])],
        "sluice: later commit": [("append + txn state", s["txn_append_cold_s"])],
        "batch: warm server's write": [("append", s["plain_append_warm_s"])],
        "sluice: warm server's commit": [("append + txn state", s["txn_append_warm_s"])],
        "sluice: 2 tables, one by one": [("append + txn state", s["two_tables_serial_s"])],
        "sluice: 2 tables at once": [("append + txn state", s["two_tables_parallel_s"])],
    }
    bars.update({f"sluice: commit 31, checkpoint every {i}": [("append + txn state", s[key])]
                 for i in (10, 100) if (key := f"txn_append_cold_30_commits_checkpoint_{i}_s") in s})
    colours: dict[str, Any] = {}
    for label, parts in bars.items():
        left = 0.0
        for name, value in parts:
            bar = ax.barh([label], [value], left=left, color=colours.get(name),
                          label=None if name in colours else name)
            colours.setdefault(name, bar.patches[0].get_facecolor())
            left += value
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds (median of {result['reps']}, {result['rows']} rows, local[2])")
    ax.set_title("Delta commits: a plain batch append vs sluice's exactly-once commit", fontsize=11)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    work = configure("delta_commit")
    result = measure(work / "tables", 5 if args.quick else 10, long_logs=not args.quick)
    result["config"] = {"quick": args.quick, "spark": "local[2]"}
    write_result("delta_commit", result)
    plot(result, results_dir() / "delta_commit.png")
    print(json.dumps({k: v["median"] for k, v in result.items() if k.endswith("_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
