"""Scheduling inside a group: concurrent epochs (A-scheduler) and skew-aware partitioning (Prompt).

    python -m bench.sched [--quick]

(i) **Concurrent epochs.** The stateless ``ysb_clean`` pipeline (append: independent epochs)
    over the same files, one file per epoch, one group of all of them, at concurrency 1 (one
    epoch after the other), 2, 3 and 4, interleaved over repetitions in one SparkSession;
    then ``concurrent_epochs: auto`` over successive groups, to show where the hill climber
    settles. Every run's table is checked against the oracle (row count of view events).
(ii) **Prompt partitioning** on a skewed keyed workload: ``bench.skew`` (see its docstring
    for the workload chosen and why).

Writes ``bench/results/sched.json`` and ``sched.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import configure, land_ysb, results_dir, session, stats, write_result, write_spec, ysb_spec_yaml

LEVELS = (1, 2, 3, 4)


def oracle_views(paths: list[Path]) -> int:
    from include.generators.ysb import parse_valid

    return sum(1 for p in paths for line in p.read_text().splitlines()
               if line.strip() and (e := parse_valid(line)) and e["event_type"] == "view")


def run_group(spark: Any, work: Path, landing: Path, files: int, level: int | str, tag: str) -> tuple[float, Any]:
    """One group of ``files`` one-file epochs at a concurrency level; returns seconds and spec."""
    from sluice.protocol.run import run_once
    from sluice.store import EpochStore

    root = work / "runs" / tag
    raw = ysb_spec_yaml(f"bench_sched_{tag.replace('-', '_')}", landing, root / "view_events", epoch_files=1,
                        k=files, mode="append")
    if level == "group":  # one Delta commit per table for the whole group (the default)
        raw["commit"] = "group"
    else:  # A-scheduler: a Delta commit per epoch, up to ``level`` epochs computed at once
        raw["commit"] = "epoch"
        raw["control"]["concurrent_epochs"] = level
    spec = write_spec(root, raw)
    store = EpochStore(f"sqlite:///{root / 'sluice.db'}")
    t0 = time.perf_counter()
    run_once(spec, store, spark, epoch_size=1, k=files)
    elapsed = time.perf_counter() - t0
    store.engine.dispose()
    return elapsed, spec


def concurrency(spark: Any, work: Path, files: int, per_file: int, reps: int) -> dict[str, Any]:
    landing = work / "landing"
    paths = land_ysb(landing, files, per_file)
    records = sum(1 for p in paths for line in p.read_text().splitlines() if line.strip())
    expected = oracle_views(paths)

    def timed(level: int | str, tag: str) -> float:
        elapsed, spec = run_group(spark, work, landing, files, level, tag)
        got = spark.read.format("delta").load(spec.sinks[0].path).count()
        if got != expected:
            raise AssertionError(f"concurrency {level}: {got} rows in the table, the oracle says {expected}")
        shutil.rmtree(Path(spec.sinks[0].path).parent, ignore_errors=True)
        print(f"  concurrency {level}: {elapsed:.2f} s, {records / elapsed:,.0f} records/s", flush=True)
        return elapsed

    timed(2, "warm-up")
    systems: tuple[int | str, ...] = (*LEVELS, "group")
    times: dict[int | str, list[float]] = {level: [] for level in systems}
    for rep in range(reps):
        order = systems if rep % 2 == 0 else systems[::-1]
        for level in order:
            times[level].append(timed(level, f"l{level}-r{rep}"))
    rps = {level: stats([records / t for t in ts], 0) for level, ts in times.items() if level != "group"}
    group = stats([records / t for t in times["group"]], 0)
    best = max((lv for lv in LEVELS if lv > 1), key=lambda lv: rps[lv]["median"])
    return {"files": files, "events_per_file": per_file, "records": records, "rps": rps,
            "best_level": best, "concurrency_gain": round(rps[best]["median"] / rps[1]["median"], 3),
            "gain_per_level": {lv: round(rps[lv]["median"] / rps[1]["median"], 3) for lv in LEVELS},
            "paired_gain_best": [round(a / b, 3) for a, b in zip(times[1], times[best], strict=True)],
            # commit: group (one Delta commit per table for the group) against a commit per epoch
            "group_commit_rps": group, "group_commit_gain": round(group["median"] / rps[1]["median"], 3),
            "group_commit_vs_best_concurrency": round(group["median"] / rps[best]["median"], 3),
            "paired_group_commit_gain": [round(a / b, 3) for a, b in zip(times[1], times["group"], strict=True)]}


def auto_tuning(spark: Any, work: Path, groups: int, files: int, per_file: int) -> list[dict[str, Any]]:
    """Successive groups of one pipeline with ``concurrent_epochs: auto``: the level the
    controller picks for each, and the throughput it saw."""
    from sluice.protocol.run import run_once
    from sluice.store import EpochStore

    root = work / "auto"
    landing = root / "landing"
    raw = ysb_spec_yaml("bench_sched_auto", landing, root / "view_events", epoch_files=1, k=files, mode="append")
    raw["control"]["concurrent_epochs"] = "auto"
    raw["commit"] = "epoch"
    spec = write_spec(root, raw)
    store = EpochStore(f"sqlite:///{root / 'sluice.db'}")
    rows = []
    for g in range(groups):
        if g == 0:
            land_ysb(landing, files, per_file, seed=100)
        else:
            _land_more(landing, files, per_file, g)
        t0 = time.perf_counter()
        done = run_once(spec, store, spark, epoch_size=1, k=files)
        elapsed = time.perf_counter() - t0
        epochs = done[0]["group"]["epochs"]
        level = max(int(e["timings"].get("concurrency", 1)) for e in epochs)
        records = sum(e["rows"]["input"] for e in epochs)
        rows.append({"group": g, "level": level, "seconds": round(elapsed, 2), "rps": round(records / elapsed)})
        print(f"  auto group {g}: concurrency {level}, {records / elapsed:,.0f} records/s", flush=True)
    store.engine.dispose()
    return rows


def _land_more(landing: Path, files: int, per_file: int, g: int) -> None:
    from include.generators.ysb import generate

    generate(landing, rate=per_file, duration=files, files_per_second=1, seed=100 + g,
             start_ms=1_700_000_000_000 + g * 10_000_000, prefix=f"g{g:03d}",
             malformed_fraction=0.001)  # as land_ysb: every group pays the same two commits per epoch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    work = configure("sched")
    spark = session("sluice-bench-sched", ui=True)  # task metrics for bench.skew
    files, per_file = (8, 5_000) if args.quick else (16, 10_000)
    print(f"concurrent epochs: {files} files x {per_file} events, levels {LEVELS}", flush=True)
    result: dict[str, Any] = {"concurrency": concurrency(spark, work, files, per_file, args.reps)}
    result["concurrency_gain"] = result["concurrency"]["concurrency_gain"]
    print("auto tuning", flush=True)
    result["auto"] = auto_tuning(spark, work, 4 if args.quick else 8, files, per_file)
    try:
        from bench import skew
    except ImportError:  # Prompt's Spark side is not in this release yet (issue 6)
        skewed: dict[str, Any] = {"skipped": "bench/skew.py (Prompt partitioning on Spark) is not in this release"}
    else:
        print("skew (Prompt)", flush=True)
        skewed = skew.run(spark, quick=args.quick)
    result["skew"] = skewed
    for z, row in skewed.get("per_z", {}).items():
        for key in ("imbalance_prompt", "imbalance_hash", "throughput_ratio_prompt_hash"):
            if key in row:
                result.setdefault(key, {})[str(z)] = row[key]
    result["config"] = {"quick": args.quick, "spark": "local[2]", "reps": args.reps}
    write_result("sched", result)
    plot(result, results_dir() / "sched.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("concurrency", "auto", "skew")}))
    spark.stop()
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(13, 9))
    axes = grid.ravel()
    rps = result["concurrency"]["rps"]
    levels = sorted(rps, key=int)
    med = [rps[lv]["median"] for lv in levels]
    err = [[rps[lv]["median"] - rps[lv]["min"] for lv in levels], [rps[lv]["max"] - rps[lv]["median"] for lv in levels]]
    axes[0].bar([str(lv) for lv in levels], med, yerr=err, capsize=4)
    axes[0].set_xlabel("epochs computed at once")
    axes[0].set_ylabel("records / s (median, min-max)")
    axes[0].set_title(f"independent epochs: gain x{result['concurrency_gain']}")
    auto = result["auto"]
    axes[1].plot([r["group"] for r in auto], [r["level"] for r in auto], "o-", label="level")
    ax2 = axes[1].twinx()
    ax2.plot([r["group"] for r in auto], [r["rps"] for r in auto], "x--", color="tab:orange", label="records/s")
    axes[1].set_xlabel("group")
    axes[1].set_ylabel("concurrency chosen")
    ax2.set_ylabel("records / s")
    axes[1].set_title("concurrent_epochs: auto")
    zs = sorted(result.get("imbalance_prompt", {}), key=float)
    if zs:
        width = 0.27
        for i, (key, label) in enumerate((("imbalance_hash", "hash"), ("imbalance_prompt", "Prompt"))):
            axes[2].bar([j + (i - 0.5) * width for j in range(len(zs))], [result[key][z] for z in zs], width,
                        label=label)
        aqe = [result["skew"]["per_z"][z].get("imbalance_aqe") for z in zs]
        if all(a is not None for a in aqe):
            axes[2].bar([j + 1.5 * width for j in range(len(zs))], aqe, width, label="AQE")
        axes[2].set_xticks(range(len(zs)), [f"z={z}" for z in zs])
        axes[2].axhline(1.1, color="red", linestyle=":")
        axes[2].set_ylabel("partition imbalance (max / mean)")
        axes[2].legend()
        axes[2].set_title("skewed keys (Zipf): write-stage partition imbalance")
        per_z = result["skew"]["per_z"]
        for key, label in (("throughput_ratio_prompt_hash", "Prompt / hash"),
                           ("throughput_ratio_aqe_hash", "AQE rebalance / hash"),
                           ("throughput_bound", "bound on 2 cores (perfect balance)"),
                           ("sum_ratio_prompt_hash", "per-key sums: Prompt / hash")):
            axes[3].plot([float(z) for z in zs], [per_z[z][key] for z in zs], "o-", label=label)
        axes[3].axhline(1.0, color="grey", linestyle=":")
        axes[3].set_xlabel("Zipf z")
        axes[3].set_ylabel("throughput ratio (median)")
        axes[3].legend()
        axes[3].set_title("throughput against hash partitioning")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
