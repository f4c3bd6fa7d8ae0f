"""YSB over Kafka: a sluice group against Structured Streaming ``availableNow`` on the same topic,
with the same offsets per batch, in the same SparkSession, in the same run.

    python -m bench.ysb_kafka [--quick] [--records 320000] [--reps 2] [--sizes 16000,64000,160000]

A real broker (``include/kafka/broker.py``, one KRaft node on a free port, data under
``var/bench/ysb_kafka``) holds one topic of YSB events (``include.generators.ysb.produce``, 0.1%
malformed), spread round-robin over 4 partitions, so every partition holds the same number of
records. For each epoch size of ``R`` records:

(a) **sluice**: ``PipelineRun.run_once`` (the shipped ``ysb_kafka`` pipeline, in-process, fixed
    sizes, no GX suite) discovers the topic (chunks of ``source.chunk_records`` = 1,000 records
    of a partition, the shipped value), plans one group of the whole topic at ``R / 1000``
    chunks per epoch (``control.epoch_max_records = R``), reads it in one scan (exact
    ``startingOffsets``/``endingOffsets``), writes each table once (``commit: group``),
    publishes and writes epoch records.
(b) **Structured Streaming**: ``readStream.format("kafka")`` of the topic, ``startingOffsets =
    earliest``, ``maxOffsetsPerTrigger = R``, ``trigger(availableNow=True)``, ``foreachBatch``
    writing the same tables with the same ``PipelineTable`` code
    (``txnAppId``/``txnVersion = batchId`` MERGE), its checkpoint on the same disk.

Same offsets: Spark prorates ``maxOffsetsPerTrigger`` over the partitions by their remaining
records, so with equal partitions each micro-batch takes ``R / 4`` offsets of each. sluice
registers chunks oldest first (by their first record's timestamp; round-robin production makes
that chunk index major, partition minor), so an epoch of ``R / 1000`` chunks (a multiple of 4)
is ``R / 4`` offsets of each partition too. Both are recorded, not assumed: each sluice epoch's
per-partition range (``KafkaSource.describe`` of its manifest entries) and each micro-batch's
(its progress' ``startOffset``/``endOffset``), compared batch by batch (``same_offsets``).

Both parse the values with the same code: the Kafka source's numbered lines (``_file`` =
``kafka://topic/partition``, ``_line`` = offset, ``_text`` = the value; the three-column
select of ``KafkaSource._read``, which is not a function of its own) through
``KafkaSource.parse_lines``; then the same reject split and transform. Every run's tables are
checked against an oracle computed from the topic with a plain consumer (``consume``,
``classify``, ``window_counts``): the views per window and the set of rejected records. Runs
are interleaved (sluice and SS alternating first per repetition, epoch sizes in a rotating
order) after an untimed warm-up of each. sluice's time is split into its phases (discovery,
planning, the group's read and transform, its commits, publishing) by timing the functions
``run_once`` calls. Writes ``bench/results/ysb_kafka.json`` and ``ysb_kafka.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    ROOT,
    configure,
    foreach_batch_writer,
    results_dir,
    session,
    stats,
    write_result,
    write_spec,
)

PARTITIONS = 4
CHUNK_RECORDS = 1000  # include/pipelines/ysb_kafka.yaml's source.chunk_records
EPOCH_RECORDS = (16_000, 64_000, 160_000)  # R: multiples of PARTITIONS * CHUNK_RECORDS
TOPIC = "ysb"
START_MS = 1_700_000_000_000


def ysb_kafka_spec_yaml(name: str, bootstrap: str, table: Path, *, records_per_epoch: int, k: int) -> dict[str, Any]:
    """The shipped ``ysb_kafka`` pipeline with fixed sizes, in-process, reading ``TOPIC`` on
    ``bootstrap`` and writing ``table``; without its GX suite."""
    raw = yaml.safe_load((ROOT / "include" / "pipelines" / "ysb_kafka.yaml").read_text())
    raw.update(name=name, description="benchmark copy of ysb_kafka", schedule=None)
    raw["source"].update(bootstrap_servers=bootstrap, topic=TOPIC, chunk_records=CHUNK_RECORDS)
    sink = raw["sinks"][0]
    sink["path"] = str(table)
    sink.pop("expectations", None)
    raw["control"].update(adaptive=False, epoch_files=records_per_epoch // CHUNK_RECORDS,
                          epoch_max_records=records_per_epoch, group_epochs=k)
    raw["spark"]["mode"] = "in_process"
    return raw


class PhaseTimer:
    """Wall time spent in the functions ``PipelineRun.run_once`` calls (patched while a sluice run
    lasts): where a group's time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def patched(self) -> Any:
        from sluice.compute import SparkCompute
        from sluice.protocol.group import GroupJob
        from sluice.protocol.run import PipelineRun
        from sluice.sources.kafka import KafkaSource

        targets = [(PipelineRun, "plan", "plan"), (PipelineRun, "process", "run"),
                   (PipelineRun, "validate", "validate"), (PipelineRun, "publish", "publish"),
                   (KafkaSource, "discover", "plan.discover"),
                   (KafkaSource, "check_retained", "run.check_retained"),
                   (SparkCompute, "prepare_group", "run.read_transform"), (GroupJob, "commit_group", "run.commit"),
                   (KafkaSource, "backlog", "publish.backlog")]
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
        for owner, attr, label in targets:
            setattr(owner, attr, self._timed(getattr(owner, attr), label))
        try:
            yield self
        finally:
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)

    def _timed(self, fn: Any, label: str) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[label] += time.perf_counter() - t0
        return wrapper


class Bench:
    def __init__(self, work: Path, bootstrap: str, records: int) -> None:
        from include.generators.ysb import classify, consume, produce, window_counts

        self.work = work
        self.bootstrap = bootstrap
        t0 = time.perf_counter()
        sent = produce(bootstrap, TOPIC, partitions=PARTITIONS, rate=records / 16, duration=16, seed=0,
                       start_ms=START_MS, malformed_fraction=0.001)
        assert sent == records, f"produced {sent} records, not {records}"
        self.produce_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        raw = consume(bootstrap, TOPIC)
        events = list(classify(raw))
        self.records = len(raw)
        self.per_partition = Counter(where for where, _, _ in raw)
        self.oracle = window_counts(events)
        self.oracle_rejected = {(where, n) for where, n, event in events if event is None}
        self.oracle_s = time.perf_counter() - t0
        assert self.records == records and len(set(self.per_partition.values())) == 1, self.per_partition
        self.spark = session("sluice-bench-ysb-kafka")
        # every micro-batch's progress (its offsets) is kept, not the last 100
        self.spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "10000")
        self.runs = 0
        self.offsets: dict[tuple[str, int], list[list[dict[str, list[int]]]]] = defaultdict(list)
        self.phases: dict[int, list[dict[str, float]]] = defaultdict(list)

    def epochs(self, r: int) -> int:
        return -(-self.records // r)

    def _spec(self, tag: str, r: int) -> tuple[Any, Path]:
        self.runs += 1
        root = self.work / "runs" / f"{tag}{self.runs}"
        raw = ysb_kafka_spec_yaml(f"bench_{tag}", self.bootstrap, root / "campaign_views", records_per_epoch=r,
                                  k=self.epochs(r))
        return write_spec(root, raw), root

    # (a) ---------------------------------------------------------------------------------------
    def sluice(self, r: int) -> tuple[float, Any]:
        from sluice.protocol.run import run_once
        from sluice.sources.kafka import KafkaSource
        from sluice.store import EpochStore

        spec, root = self._spec("sluice", r)
        store = EpochStore(f"sqlite:///{root / 'sluice.db'}")
        timer = PhaseTimer()
        with timer.patched():
            t0 = time.perf_counter()
            done = run_once(spec, store, self.spark, epoch_size=spec.control.epoch_files,
                                      k=self.epochs(r))
            elapsed = time.perf_counter() - t0
        epochs = [e for g in done for e in g["group"]["epochs"]]
        assert len(done) == 1 and len(epochs) == self.epochs(r), f"sluice ran {len(epochs)} epochs"
        source = KafkaSource(spec, store)
        ranges = [source.describe(store.manifest(spec.name, e.start, e.end))["partitions"]
                  for e in sorted(store.epochs(spec.name), key=lambda e: e.epoch_id)]
        self.offsets[("sluice", r)].append(ranges)
        self.phases[r].append({k: round(v, 3) for k, v in timer.seconds.items()})
        store.engine.dispose()
        return elapsed, spec

    # (b) ---------------------------------------------------------------------------------------
    def structured_streaming(self, r: int) -> tuple[float, Any]:
        from sluice.sources.kafka import KafkaSource

        spec, root = self._spec("ss", r)
        source = KafkaSource(spec, None)
        batches: list[int] = []
        write_batch = foreach_batch_writer(self.spark, spec, batches)

        t0 = time.perf_counter()
        stream = (self.spark.readStream.format("kafka")
                  .option("kafka.bootstrap.servers", self.bootstrap).option("subscribe", TOPIC)
                  .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", r)
                  .option("failOnDataLoss", "true").load())
        # the source's own numbered lines and parse
        query = (source.parse_lines(source.numbered_lines(stream)).writeStream.foreachBatch(write_batch)
                 .option("checkpointLocation", str(root / "checkpoint"))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        elapsed = time.perf_counter() - t0
        if query.exception():
            raise RuntimeError(f"structured streaming failed: {query.exception()}")
        assert len(batches) == self.epochs(r), f"structured streaming ran {len(batches)} batches"
        self.offsets[("ss", r)].append(self._progress_ranges(query))
        return elapsed, spec

    @staticmethod
    def _progress_ranges(query: Any) -> list[dict[str, list[int]]]:
        """Per micro-batch with data, per partition ``[start, end)``, from its progress."""
        ranges, last = [], None
        for p in sorted(query.recentProgress, key=lambda p: p.batchId):
            if not p.numInputRows:
                continue
            src = p.sources[0]
            end = json.loads(src.endOffset)[TOPIC]
            # the first batch's start is "earliest" (no offsets): the topic starts at 0 here
            start = (json.loads(src.startOffset or "null") or {}).get(TOPIC) or last or {q: 0 for q in end}
            ranges.append({q: [int(start.get(q, 0)), int(end[q])] for q in sorted(end, key=int)
                           if int(end[q]) > int(start.get(q, 0))})
            last = end
        return ranges

    def check(self, spec: Any, what: str) -> None:
        """The aggregate equals the oracle's, and the rejected records are exactly the oracle's
        bad ones, each once."""
        got: Counter = Counter()
        for row in self.spark.read.format("delta").load(spec.sinks[0].path).collect():
            got[(row["campaign_id"], int(row["window_start"].timestamp() * 1000))] += row["views"]
        if got != self.oracle:
            raise AssertionError(f"{what}: table differs from the oracle in {len(set(got) ^ set(self.oracle))} "
                                 f"windows (total {sum(got.values())} vs {sum(self.oracle.values())})")
        bad = [(row["file"], row["line"]) for row in
               self.spark.read.format("delta").load(spec.rejected_table).select("file", "line").collect()]
        if len(bad) != len(set(bad)) or set(bad) != self.oracle_rejected:
            raise AssertionError(f"{what}: {len(bad)} rejected records ({len(set(bad))} distinct), the oracle "
                                 f"rejects {len(self.oracle_rejected)}")

    def cleanup(self, spec: Any) -> None:
        shutil.rmtree(Path(spec.sinks[0].path).parent, ignore_errors=True)


def compare_offsets(a: list[dict[str, list[int]]], b: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Batch by batch: identical per-partition ranges? Else the first difference and how many
    batches differ."""
    differ = [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]
    found: dict[str, Any] = {"identical": not differ, "batches": [len(a), len(b)], "batches_differing": len(differ)}
    if differ:
        i = differ[0]
        found["first_difference"] = {"batch": i, "sluice": a[i] if i < len(a) else None,
                                     "ss": b[i] if i < len(b) else None}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller topic, 2 repetitions (bench-quick)")
    parser.add_argument("--records", type=int, help="records in the topic (320,000; 160,000 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (2; 1 with --quick)")
    parser.add_argument("--sizes", help="records per epoch, comma-separated (16000,64000,160000)")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 2)
    records = args.records or (160_000 if args.quick else 320_000)
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else EPOCH_RECORDS
    unit = PARTITIONS * CHUNK_RECORDS
    if records % unit or any(r % unit for r in sizes):
        parser.error(f"--records and the epoch sizes must be multiples of {unit} (partitions x chunk_records)")
    work = configure("ysb_kafka")

    from include.kafka.broker import start

    t_start = time.perf_counter()
    broker = start(work / "kafka")
    bench = None
    try:
        bench = Bench(work, broker.bootstrap, records)
        print(f"ysb_kafka: {bench.records} records in {PARTITIONS} partitions on {broker.bootstrap} "
              f"(produced in {bench.produce_s:.1f} s, oracle {bench.oracle_s:.1f} s); epochs of {sizes} records; "
              f"reps {reps}", flush=True)

        def timed(what: str, fn: Any, r: int) -> float:
            elapsed, spec = fn(r)
            bench.check(spec, what)
            bench.cleanup(spec)
            extra = ""
            if fn == bench.sluice:
                extra = "  " + " ".join(f"{k}={v:.2f}" for k, v in sorted(bench.phases[r][-1].items()))
            print(f"  {what}: {elapsed:.2f} s, {bench.records / elapsed:,.0f} records/s{extra}", flush=True)
            return elapsed

        print("warm-up (untimed)", flush=True)
        warm = sizes[len(sizes) // 2]
        timed(f"warm-up sluice R={warm}", bench.sluice, warm)
        timed(f"warm-up ss R={warm}", bench.structured_streaming, warm)
        for key in list(bench.offsets):  # the warm-up's offsets are not compared
            bench.offsets[key].clear()
        bench.phases.clear()
        times: dict[tuple[str, int], list[float]] = {}
        for rep in range(reps):
            order = sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]
            print(f"repetition {rep + 1}/{reps}", flush=True)
            for r in order:
                systems = [("sluice", bench.sluice), ("ss", bench.structured_streaming)]
                for name, fn in (systems if rep % 2 == 0 else systems[::-1]):
                    times.setdefault((name, r), []).append(timed(f"{name} R={r}", fn, r))
        result = summarize(bench, times, sizes, reps, args.quick, broker.bootstrap)
        result["config"]["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    finally:
        if bench is not None:
            bench.spark.stop()
        broker.stop()
    write_result("ysb_kafka", result)
    plot(result, results_dir() / "ysb_kafka.png")
    print({k: v for k, v in result.items() if k.startswith("ratio") or k == "same_offsets"})
    return 0


def summarize(bench: Bench, times: dict[tuple[str, int], list[float]], sizes: tuple[int, ...], reps: int,
              quick: bool, bootstrap: str) -> dict[str, Any]:
    def rps(key: tuple[str, int]) -> dict[str, Any]:
        return stats([bench.records / t for t in times[key]], digits=0)

    runs = []
    for r in sizes:
        a, b = times[("sluice", r)], times[("ss", r)]
        sluice_offsets, ss_offsets = bench.offsets[("sluice", r)], bench.offsets[("ss", r)]
        # every run of a system must read the same ranges, and each sluice run the same as each SS run
        comparisons = [compare_offsets(x, y) for x in sluice_offsets for y in ss_offsets]
        stable = all(x == sluice_offsets[0] for x in sluice_offsets) and all(y == ss_offsets[0] for y in ss_offsets)
        phase_keys = sorted({k for p in bench.phases[r] for k in p})
        runs.append({
            "records_per_epoch": r, "records_per_partition_per_epoch": r // PARTITIONS,
            "epoch_chunks": r // CHUNK_RECORDS, "epochs": bench.epochs(r),
            "sluice_rps": rps(("sluice", r))["median"], "ss_rps": rps(("ss", r))["median"],
            "sluice_rps_range": rps(("sluice", r)), "ss_rps_range": rps(("ss", r)),
            # paired per repetition: the two ran back to back
            "ratio_sluice_ss_per_rep": [round(tb / ta, 3) for ta, tb in zip(a, b, strict=True)],
            "ratio_sluice_ss": round(statistics.median(b) / statistics.median(a), 3),
            "sluice_s": stats(a), "ss_s": stats(b),
            "same_offsets": stable and all(c["identical"] for c in comparisons),
            "offsets": {"sluice_epochs": len(sluice_offsets[0]), "ss_batches": len(ss_offsets[0]),
                        "runs_compared": len(comparisons), "each_system_stable_across_runs": stable,
                        "comparison": comparisons[0], "first_batch": {"sluice": sluice_offsets[0][0],
                                                                      "ss": ss_offsets[0][0]}},
            "sluice_phases_s": {k: stats([p.get(k, 0.0) for p in bench.phases[r]]) for k in phase_keys},
        })
    return {
        "runs": runs,
        "ratio_sluice_ss_min": round(min(r["ratio_sluice_ss"] for r in runs), 3),
        "ratio_sluice_ss_per_rep_min": min(x for r in runs for x in r["ratio_sluice_ss_per_rep"]),
        "same_offsets": all(r["same_offsets"] for r in runs),
        "config": {
            "records": bench.records, "partitions": PARTITIONS,
            "records_per_partition": sorted(set(bench.per_partition.values())),
            "chunk_records": CHUNK_RECORDS, "reps": reps, "quick": quick,
            "spark": "local[2], one session; driver JVM C1-only with a 240 MB code cache (RUN_ONCE_JAVA_OPTIONS)",
            "broker": "one KRaft node (include/kafka/broker.py), same machine", "bootstrap": bootstrap,
            "malformed_fraction": 0.001, "oracle_rejected": len(bench.oracle_rejected), "validation": False,
            "produce_s": round(bench.produce_s, 1), "oracle_s": round(bench.oracle_s, 1),
            "sluice": "PipelineRun.run_once: one group of the whole topic, epoch_files = R / chunk_records, "
                      "epoch_max_records = R, commit: group, in_process, adaptive off; timed from discovery "
                      "to published",
            "ss": "readStream kafka, subscribe, startingOffsets earliest, maxOffsetsPerTrigger = R, "
                  "trigger availableNow, foreachBatch with sluice's PipelineTable MERGE (txn ids)",
            "offsets_recorded": "sluice: KafkaSource.describe of each epoch's manifest entries; SS: each "
                                "micro-batch's progress startOffset/endOffset; compared batch by batch",
            "same_work": "same topic and offsets, KafkaSource.parse_lines on the same numbered lines, reject "
                         "split, transform and Delta MERGE with txn ids",
            "checked": "every run: views per window equal the oracle's (consume + classify + window_counts) "
                       "and the _rejected records are exactly the oracle's bad ones, once each",
        },
    }


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
    for j, r in enumerate(runs):
        top = max(r["sluice_rps_range"]["max"], r["ss_rps_range"]["max"])
        ax.annotate(f"{r['ratio_sluice_ss']:.2f}x" + ("" if r["same_offsets"] else " (offsets differ)"),
                    (j, top), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=9)
    ax.set_xticks(list(x), [f"{r['records_per_epoch']:,} records/epoch\n({r['epochs']} epochs)" for r in runs])
    ax.set_ylabel("records / s (median, min-max)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)
    cfg = result["config"]
    ax.set_title(f"YSB over Kafka, {cfg['records']:,} records in {cfg['partitions']} partitions, local[2]")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
