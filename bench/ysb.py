"""YSB throughput: a sluice group against Structured Streaming ``availableNow`` and against one
plain Spark batch job, over the same files, in the same SparkSession, in the same run.

    python -m bench.ysb [--quick] [--files 16] [--events-per-file 40000] [--reps 3]

(a) **sluice**: ``PipelineRun.run_once`` plans one group of all files at ``n`` files per epoch
    (epoch log, manifest, lease), then runs it (one scan, one Delta commit per table for the
    whole group: ``commit: group``), publishes and writes epoch records.
(b) **Structured Streaming**: ``readStream`` of the same folder, ``maxFilesPerTrigger = n``,
    ``trigger(availableNow=True)``, ``foreachBatch`` writing the same tables the same way
    (``txnAppId``/``txnVersion = batchId`` MERGE), with its checkpoint on the same disk.
(c) **batch**: one job over all files, one append of the aggregate: the limit of this query
    on this hardware.

All three parse the records with the same ``FileSource`` code (whole-file reads split into
numbered lines for (b) and (c); (a) reads files above ``WHOLE_FILE_MAX_BYTES``, as these 10 MB
ones, line by line, numbered without a shuffle), split off malformed records into a
``_rejected`` table, and run the same transform; so the difference is the bookkeeping and the
epoch boundaries. GX validation is off here (``overhead.py`` reports its cost). Every run's
table is checked against the oracle computed from the raw files. Runs are interleaved (a, b, c
per repetition, epoch sizes in a rotating order) after one untimed warm-up of each, so drift in
the shared machine hits all.
Writes ``bench/results/ysb.json`` and ``ysb.png``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import (
    configure,
    foreach_batch_writer,
    land_ysb,
    results_dir,
    session,
    stats,
    write_result,
    write_spec,
    ysb_spec_yaml,
)

EPOCH_SIZES = (1, 4, 16)


class Bench:
    def __init__(self, work: Path, files: int, events_per_file: int) -> None:
        self.work = work
        self.landing = work / "landing"
        self.paths = land_ysb(self.landing, files, events_per_file)
        self.files = files
        self.records = sum(1 for p in self.paths for line in p.read_text().splitlines() if line.strip())
        from include.generators.ysb import expected_window_counts

        self.oracle = expected_window_counts(self.paths)
        self.spark = session("sluice-bench-ysb")
        self.runs = 0

    def _spec(self, tag: str, n: int) -> Any:
        self.runs += 1
        root = self.work / "runs" / f"{tag}{self.runs}"
        raw = ysb_spec_yaml(f"bench_{tag}", self.landing, root / "campaign_views", epoch_files=n,
                            k=math.ceil(self.files / n))
        spec = write_spec(root, raw)
        return spec, root

    # (a) ---------------------------------------------------------------------------------------
    def sluice(self, n: int) -> tuple[float, Any]:
        from sluice.protocol.run import run_once
        from sluice.store import EpochStore

        spec, root = self._spec("sluice", n)
        store = EpochStore(f"sqlite:///{root / 'sluice.db'}")
        t0 = time.perf_counter()
        done = run_once(spec, store, self.spark, epoch_size=n, k=math.ceil(self.files / n))
        elapsed = time.perf_counter() - t0
        epochs = [e for g in done for e in g["group"]["epochs"]]
        assert len(epochs) == math.ceil(self.files / n), f"sluice ran {len(epochs)} epochs"
        store.engine.dispose()
        return elapsed, spec

    # (b) ---------------------------------------------------------------------------------------
    def structured_streaming(self, n: int) -> tuple[float, Any]:
        from sluice.sources import FileSource

        spec, root = self._spec("ss", n)
        source = FileSource(spec, None)
        batches: list[int] = []
        write_batch = foreach_batch_writer(self.spark, spec, batches)

        t0 = time.perf_counter()
        stream = (self.spark.readStream.format("text").option("wholetext", True)
                  .option("maxFilesPerTrigger", n).option("pathGlobFilter", spec.source.pattern)
                  .load(str(self.landing)))
        query = (source.parse(stream).writeStream.foreachBatch(write_batch)
                 .option("checkpointLocation", str(root / "checkpoint"))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        elapsed = time.perf_counter() - t0
        if query.exception():
            raise RuntimeError(f"structured streaming failed: {query.exception()}")
        assert len(batches) == math.ceil(self.files / n), f"structured streaming ran {len(batches)} batches"
        return elapsed, spec

    # (c) ---------------------------------------------------------------------------------------
    def batch(self) -> tuple[float, Any]:
        from pyspark.sql import functions as F

        from sluice.compute import load_reference, split_rejected, transform_for
        from sluice.sources import FileSource

        spec, _ = self._spec("batch", self.files)
        t0 = time.perf_counter()
        records = FileSource(spec, None).parse(self.spark.read.text([str(p) for p in self.paths], wholetext=True))
        valid, bad = split_rejected(records, spec, 0, 0)
        output = transform_for(spec)(valid, load_reference(self.spark, spec))
        sink = spec.sinks[0]
        records = records.persist()
        bad.write.format("delta").mode("append").save(spec.rejected_table)
        (output.groupBy(*sink.keys).agg(*[F.sum(c).alias(c) for c in sink.sums])
         .write.format("delta").mode("append").save(sink.path))
        records.unpersist()
        return time.perf_counter() - t0, spec

    def check(self, spec: Any, what: str) -> None:
        """The table equals the oracle from the raw files (no loss, no duplicate)."""
        got: Counter = Counter()
        for r in self.spark.read.format("delta").load(spec.sinks[0].path).collect():
            got[(r["campaign_id"], int(r["window_start"].timestamp() * 1000))] += r["views"]
        if got != self.oracle:
            raise AssertionError(f"{what}: table differs from the oracle in {len(set(got) ^ set(self.oracle))} "
                                 f"windows (total {sum(got.values())} vs {sum(self.oracle.values())})")

    def cleanup(self, spec: Any) -> None:
        shutil.rmtree(Path(spec.sinks[0].path).parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller files (bench-quick)")
    parser.add_argument("--files", type=int)
    parser.add_argument("--events-per-file", type=int)
    parser.add_argument("--reps", type=int, default=None, help="repetitions (3; 2 with --quick)")
    args = parser.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 3)
    files = args.files or (4 if args.quick else 16)
    per_file = args.events_per_file or (30_000 if args.quick else 40_000)
    work = configure("ysb")
    bench = Bench(work, files, per_file)
    print(f"ysb: {files} files x {per_file} events = {bench.records} records; reps {args.reps}", flush=True)

    def timed(what: str, fn: Any, *a: Any) -> float:
        elapsed, spec = fn(*a)
        bench.check(spec, what)
        bench.cleanup(spec)
        print(f"  {what}: {elapsed:.2f} s, {bench.records / elapsed:,.0f} records/s", flush=True)
        return elapsed

    print("warm-up (untimed)", flush=True)
    timed("warm-up sluice n=4", bench.sluice, 4)
    timed("warm-up ss n=4", bench.structured_streaming, 4)
    timed("warm-up batch", bench.batch)
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        order = EPOCH_SIZES[rep % 3:] + EPOCH_SIZES[: rep % 3]
        print(f"repetition {rep + 1}/{args.reps}", flush=True)
        times.setdefault(("batch", 0), []).append(timed("batch", bench.batch))
        for n in order:
            systems = [("sluice", bench.sluice), ("ss", bench.structured_streaming)]
            for name, fn in (systems if rep % 2 == 0 else systems[::-1]):
                times.setdefault((name, n), []).append(timed(f"{name} n={n}", fn, n))

    def rps(key: tuple[str, int]) -> dict[str, Any]:
        return stats([bench.records / t for t in times[key]], digits=0)

    batch = rps(("batch", 0))
    runs = []
    for n in EPOCH_SIZES:
        a, b = times[("sluice", n)], times[("ss", n)]
        runs.append({"files_per_epoch": n, "sluice_rps": rps(("sluice", n))["median"],
                     "ss_rps": rps(("ss", n))["median"], "batch_rps": batch["median"],
                     "sluice_rps_range": rps(("sluice", n)), "ss_rps_range": rps(("ss", n)),
                     "batch_rps_range": batch,
                     # paired per repetition: a and b ran back to back
                     "ratio_sluice_ss_per_rep": [round(tb / ta, 3) for ta, tb in zip(a, b, strict=True)],
                     "sluice_s": stats(a), "ss_s": stats(b)})
    result = {
        "runs": runs,
        "ratio_sluice_ss_min": round(min(r["sluice_rps"] / r["ss_rps"] for r in runs), 3),
        "ratio_sluice_batch_at16": round(runs[-1]["sluice_rps"] / batch["median"], 3),
        "ratio_sluice_batch_min": round(min(r["sluice_rps"] for r in runs) / batch["median"], 3),
        "config": {"files": files, "events_per_file": per_file, "records": bench.records, "reps": args.reps,
                   "spark": "local[2]", "quick": args.quick, "validation": False,
                   "same_work": "same files, parse, reject split, transform and Delta MERGE with txn ids"},
    }
    write_result("ysb", result)
    plot(result, results_dir() / "ysb.png")
    print({k: v for k, v in result.items() if k.startswith("ratio")})
    bench.spark.stop()
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (key, label) in enumerate((("sluice", "sluice group"), ("ss", "Structured Streaming availableNow"))):
        med = [r[f"{key}_rps"] for r in runs]
        lo = [r[f"{key}_rps"] - r[f"{key}_rps_range"]["min"] for r in runs]
        hi = [r[f"{key}_rps_range"]["max"] - r[f"{key}_rps"] for r in runs]
        ax.bar([j + (i - 0.5) * 0.38 for j in x], med, 0.38, yerr=[lo, hi], capsize=4, label=label)
    ax.axhline(runs[0]["batch_rps"], color="black", linestyle="--", label="one batch job over all files")
    ax.set_xticks(list(x), [f"{r['files_per_epoch']} files/epoch" for r in runs])
    ax.set_ylabel("records / s (median, min-max)")
    cfg = result["config"]
    ax.set_title(f"YSB throughput, {cfg['records']:,} records, local[2]")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
