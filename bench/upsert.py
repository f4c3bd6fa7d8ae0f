"""An upsert sink's write against a plain Spark batch MERGE of the same changes.

The table holds ``--keys`` live rows; a batch of ``--changes`` change records (30% new keys,
10% deletes, sequences in random order, several changes per key) is MERGEd into it, from the
same Parquet file, on the same session, alternately (ABBA) so that neither side always runs
warm:

* **sluice**: ``PipelineTable.write`` with the upsert shape, what a group commit calls: the
  reduction to the greatest change per key (``sluice.delta.upsert``), one MERGE with
  ``txnAppId``/``txnVersion`` and the epochs' ``userMetadata``, the commit looked up in the log;
* **plain**: what a batch job would write by hand: ``row_number()`` over the key by sequence,
  then ``MERGE ... WHEN MATCHED AND s.seq > t.seq AND s.op = 'd' THEN DELETE WHEN MATCHED AND
  s.seq > t.seq THEN UPDATE SET * WHEN NOT MATCHED AND s.op <> 'd' THEN INSERT *`` (no
  tombstones, no txn).

Before each repetition both tables are RESTOREd to their starting version (not timed). The
live rows of both are compared after the run (sluice's ``NOT _deleted``). Records/s = change
records / seconds of the write; the ratio is sluice / plain per repetition, its median reported.

    python -m bench.upsert [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import configure, results_dir, session, stats, write_result


def make_data(spark: Any, work: Path, keys: int, changes: int, seed: int) -> tuple[str, str]:
    """The starting rows (``keys`` live keys, sequence 0) and the batch of changes, as Parquet."""
    from pyspark.sql import functions as F

    base = str(work / "base.parquet")
    batch = str(work / "changes.parquet")
    (spark.range(keys).select(F.format_string("k%09d", "id").alias("id"), F.lit(0).cast("long").alias("seq"),
                              F.lit("u").alias("op"), (F.col("id") % 1000).alias("val"))
     .write.mode("overwrite").parquet(base))
    key = F.floor(F.rand(seed) * keys * 1.3).cast("long")  # ~30% of the changes are of new keys
    (spark.range(changes).select(
        F.format_string("k%09d", key).alias("id"),
        (F.lit(1) + (F.col("id") * 7_919) % changes).cast("long").alias("seq"),  # unique, out of order
        F.when(F.rand(seed + 1) < 0.1, "d").otherwise("u").alias("op"),
        (F.rand(seed + 2) * 1000).cast("long").alias("val"))
     .write.mode("overwrite").parquet(batch))
    return base, batch


def measure(work: Path, keys: int, changes: int, reps: int, seed: int) -> dict[str, Any]:
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from sluice.delta.spark import SparkTables
    from sluice.model import EpochRange
    from sluice.protocol.tables import PipelineTable
    from sluice.spec import SinkSpec

    spark = session("sluice-bench-upsert")
    spark.conf.set("spark.sql.shuffle.partitions", "4")
    base, batch = make_data(spark, work, keys, changes, seed)
    tables = SparkTables(spark)
    sink = SinkSpec.model_validate({"name": "current", "mode": "upsert", "path": str(work / "sluice"),
                                    "keys": ["id"], "sequence_by": "seq", "delete_when": "op = 'd'"})
    table = PipelineTable("bench", sink)
    table.create(tables, spark.read.parquet(base).limit(0), generation=0, token=1)
    table.write(tables, spark.read.parquet(base), epochs=[EpochRange(0, 0, 1)], generation=0, token=1)
    plain = str(work / "plain")
    spark.read.parquet(base).write.format("delta").save(plain)
    start = {"sluice": tables.version(sink.path), "plain": tables.version(plain)}

    def sluice_write(rep: int) -> None:
        table.write(tables, spark.read.parquet(batch), epochs=[EpochRange(rep + 1, rep + 1, rep + 2)],
                    generation=0, token=1)

    def plain_merge(rep: int) -> None:
        latest = Window.partitionBy("id").orderBy(F.col("seq").desc())
        source = (spark.read.parquet(batch).withColumn("_rn", F.row_number().over(latest))
                  .where("_rn = 1").drop("_rn"))
        (DeltaTable.forPath(spark, plain).alias("t").merge(source.alias("s"), "t.id = s.id")
         .whenMatchedDelete(condition="s.seq > t.seq AND s.op = 'd'")
         .whenMatchedUpdateAll(condition="s.seq > t.seq")
         .whenNotMatchedInsertAll(condition="s.op <> 'd'").execute())

    sides = {"sluice": (sink.path, sluice_write), "plain": (plain, plain_merge)}
    seconds: dict[str, list[float]] = {"sluice": [], "plain": []}
    for rep in range(reps + 1):  # the first repetition warms the JVM up and is dropped
        order = ["sluice", "plain"] if rep % 2 == 0 else ["plain", "sluice"]
        for name in order:
            path, write = sides[name]
            DeltaTable.forPath(spark, path).restoreToVersion(start[name])
            t0 = time.perf_counter()
            write(rep)
            elapsed = time.perf_counter() - t0
            if rep:
                seconds[name].append(elapsed)
    live_sluice = spark.read.format("delta").load(sink.path).where("NOT _deleted").drop("_deleted")
    live_plain = spark.read.format("delta").load(plain)
    differ = live_sluice.exceptAll(live_plain).count() + live_plain.exceptAll(live_sluice).count()
    rates = {name: [changes / s for s in values] for name, values in seconds.items()}
    ratios = [s / p for s, p in zip(rates["sluice"], rates["plain"], strict=True)]
    spark.stop()
    return {"keys": keys, "changes": changes, "reps": reps, "seed": seed,
            "seconds": {k: stats(v) for k, v in seconds.items()},
            "records_per_s": {k: stats(v, 0) for k, v in rates.items()},
            "ratio_sluice_to_plain": stats(ratios), "live_rows_differ": differ}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    names = ["plain", "sluice"]
    labels = ["plain batch MERGE\n(row_number + MERGE)", "sluice upsert sink\n(reduce + MERGE + txn)"]
    r = result["records_per_s"]
    med = [r[n]["median"] for n in names]
    err = [[m - r[n]["min"] for n, m in zip(names, med, strict=True)],
           [r[n]["max"] - m for n, m in zip(names, med, strict=True)]]
    ax.barh(labels, med, xerr=err, capsize=4, color=["#999999", "#3b75af"])
    ratio = result["ratio_sluice_to_plain"]
    ax.set_xlabel(f"change records/s (median, min-max of {result['reps']})\n{result['changes']:,} changes "
                  f"MERGEd into {result['keys']:,} keys, local[2]")
    ax.set_title(f"upsert: sluice / plain = {ratio['median']:.2f}x (min {ratio['min']:.2f}, max {ratio['max']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repetitions")
    parser.add_argument("--keys", type=int, default=None)
    parser.add_argument("--changes", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    work = configure("upsert")
    keys = args.keys or (100_000 if args.quick else 1_000_000)
    changes = args.changes or (100_000 if args.quick else 1_000_000)
    result = measure(work / "tables", keys, changes, args.reps or (3 if args.quick else 6), args.seed)
    result["config"] = {"quick": args.quick, "spark": "local[2]", "shuffle_partitions": 4}
    write_result("upsert", result)
    plot(result, results_dir() / "upsert.png")
    print(json.dumps({"records_per_s": {k: v["median"] for k, v in result["records_per_s"].items()},
                      "ratio": result["ratio_sluice_to_plain"], "live_rows_differ": result["live_rows_differ"]}))
    return 0 if result["live_rows_differ"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
