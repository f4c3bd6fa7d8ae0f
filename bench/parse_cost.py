"""What finding the fields a JSON record carries beyond the spec's schema costs the read.

``source.unknown_fields`` (reject, the default, or rescue) reads every record's top-level keys
(``json_object_keys``) besides parsing it into the schema (``from_json``); a record with unknown
keys is parsed once more, as a map, to keep them. ``ignore`` parses once and drops them. This
benchmark reads the same YSB files through the file source in each mode, each repetition the
three modes in turn (so a noisy neighbour hits all three alike), and forces the parse with an
aggregate over every column; a share of records carries an extra field (``--drift``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import configure, land_ysb, results_dir, session, stats, write_result, write_spec, ysb_spec_yaml

MODES = ("ignore", "reject", "rescue")


def add_drift(paths: list[Path], share: float, seed: int = 0) -> int:
    """Give ``share`` of the records an extra field; returns how many."""
    rnd, drifted = random.Random(seed), 0
    for path in paths:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("{") and line.endswith("}") and rnd.random() < share:
                lines[i] = line[:-1] + ', "campaign_hint": "spring"}'
                drifted += 1
        stat = path.stat()
        path.write_text("\n".join(lines) + "\n")
        os.utime(path, (stat.st_atime, stat.st_mtime))
    return drifted


def measure(work: Path, files: int, events_per_file: int, reps: int, share: float) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from sluice.sources import source_for
    from sluice.store import EpochStore

    landing = work / "landing"
    paths = land_ysb(landing, files, events_per_file)
    drifted = add_drift(paths, share)
    spark = session("sluice-bench-parse-cost")
    log = EpochStore()
    sources = {}
    for mode in MODES:
        raw = ysb_spec_yaml(f"parse_{mode}", landing, work / "tables" / mode)
        raw["source"]["unknown_fields"] = mode
        spec = write_spec(work / "pipelines", raw)
        source = source_for(spec, log)
        source.discover()
        sources[mode] = source
    times: dict[str, list[float]] = {m: [] for m in MODES}
    counts: dict[str, int] = {}
    for rep in range(reps + 1):  # the first repetition warms the JVM up and is dropped
        for mode in MODES:
            records = sources[mode].read(spark, 0, files)
            t0 = time.perf_counter()
            row = records.agg(*[F.count(F.col(c)).alias(c) for c in records.columns]).collect()[0]
            elapsed = time.perf_counter() - t0
            if rep:
                times[mode].append(elapsed)
            counts[mode] = int(row["_rescued_data"]) if "_rescued_data" in records.columns else 0
    spark.stop()
    result: dict[str, Any] = {
        "files": files, "records": files * events_per_file, "drifted_records": drifted, "reps": reps,
        "read_s": {m: stats(v) for m, v in times.items()}, "rescued_or_rejected": counts,
    }
    records = files * events_per_file
    for mode in ("reject", "rescue"):  # paired within each repetition
        ratios = [t / i for t, i in zip(times[mode], times["ignore"], strict=True)]
        result[f"ratio_{mode}_ignore"] = stats(ratios)
        extra = [(t - i) / records * 1e6 for t, i in zip(times[mode], times["ignore"], strict=True)]
        result[f"extra_us_per_record_{mode}"] = stats(extra)  # wall time on local[2], per record
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    read = result["read_s"]
    medians = [read[m]["median"] for m in MODES]
    errors = [[read[m]["median"] - read[m]["min"] for m in MODES], [read[m]["max"] - read[m]["median"] for m in MODES]]
    ax.bar(MODES, medians, yerr=errors, capsize=4, color=["#999999", "#4477aa", "#66aa55"])
    ax.set_ylabel("seconds to read and parse (median, min-max)")
    ax.set_title(f"{result['records']:,} JSON records, {result['drifted_records']:,} with an extra field")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--drift", type=float, default=0.01, help="share of records with an extra field")
    args = parser.parse_args(argv)
    work = configure("parse_cost")
    files, events, reps = (4, 50_000, 5) if args.quick else (8, 100_000, 7)
    result = measure(work, files, events, reps, args.drift)
    result["config"] = {"quick": args.quick, "spark": "local[2]", "drift": args.drift}
    write_result("parse_cost", result)
    plot(result, results_dir() / "parse_cost.png")
    print(json.dumps({k: v["median"] for k, v in result.items() if k.startswith("ratio_")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
