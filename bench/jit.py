"""JIT by size: a run-once driver's CPU-seconds with C1 alone (``-XX:TieredStopAtLevel=1``) and
with C2 (the JVM's tiered default), for one group of YSB records of growing size, and the record
count above which C2 pays for its compilation (the break-even ``sluice.spark`` chooses by).

    python -m bench.jit [--quick] [--sizes 100000,300000,1000000,2000000] [--reps 2]

Each run is ``sluice run-group --plan`` as its own process (its own JVM, ``local[2]``, the class
data archive of ``make setup`` on both sides) over hard links to the same landed files, one epoch
holding them all, into a fresh table and store; the whole process tree is charged
(``bench.common.CpuMeter``). The runs of both compilers alternate, so a change in the machine's
load falls on both. Per compiler, ``cpu_s = fixed + per_record * records`` is fitted by least
squares; the break-even is where the two lines cross (``None`` when C2 never pays back: its
per-record cost is not lower). Writes ``bench/results/jit.json`` and ``jit.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    CpuMeter,
    configure,
    land_ysb,
    results_dir,
    run_group_args,
    stats,
    write_result,
    write_spec,
    ysb_spec_yaml,
)

EVENTS_PER_FILE = 100_000
C1 = "-XX:TieredStopAtLevel=1"
C2 = "-XX:+TieredCompilation"


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: ``(a, b)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def break_even(c1: tuple[float, float], c2: tuple[float, float]) -> float | None:
    """The record count where C2's line crosses below C1's, ``None`` if it never does."""
    (a1, b1), (a2, b2) = c1, c2
    if b2 >= b1:
        return None
    return max(0.0, (a2 - a1) / (b1 - b2))


def run_group(work: Path, tag: str, landing: Path, files: int, jit: str) -> dict[str, Any]:
    from sluice.jvm_archive import archive_options
    from sluice.paths import RUN_GROUP_APP
    from sluice.spark import RUN_ONCE_JAVA_OPTIONS
    from sluice.store import EpochStore

    root = work / tag
    raw = ysb_spec_yaml(f"jit_{tag}", landing, root / "tables" / "campaign_views", epoch_files=files, k=1)
    # The run-once options with the compiler flag replaced: the code cache and collector stay.
    base = RUN_ONCE_JAVA_OPTIONS.replace(C1, "").split()
    raw["spark"]["conf"] = {"spark.driver.extraJavaOptions": " ".join([jit, *base, archive_options()]).strip()}
    spec = write_spec(Path(os.environ["SLUICE_PIPELINES_DIR"]), raw)
    store_at = f"sqlite:///{root / 'sluice.db'}"
    started = time.monotonic()
    args = run_group_args(spec.name, store_at, epoch_size=files, k=1)
    proc = subprocess.Popen([sys.executable, str(RUN_GROUP_APP), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SLUICE_SPARK_MASTER": "local[2]"})
    meter = CpuMeter(proc.pid)
    _, err = proc.communicate()
    cpu = meter.stop()
    wall = time.monotonic() - started
    if proc.returncode:
        raise RuntimeError(f"{tag}: the group failed ({proc.returncode}): {err[-2000:]}")
    store = EpochStore(store_at)
    try:
        epochs = store.epochs(spec.name)
        records = sum(int(e.rows.get("input") or 0) for e in epochs)
        states = {e.state for e in epochs}
    finally:
        store.close()
    if states != {"published"} or records < files * EVENTS_PER_FILE * 0.99:
        raise RuntimeError(f"{tag}: expected one published epoch of ~{files * EVENTS_PER_FILE} records, "
                           f"got {states} with {records}")
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "records": records,
            "java_cpu_s": round(meter.by_name("java"), 2), "peak_rss_gib": round(meter.peak_rss_gib, 2)}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, colour in (("c1", "tab:blue"), ("c2", "tab:orange")):
        runs = result["runs"][name]
        ax.scatter([r["records"] / 1e6 for r in runs], [r["cpu_s"] for r in runs], color=colour, s=18,
                   label=f"{name.upper()} (measured)")
        a, b = result["fit"][name]["fixed_cpu_s"], result["fit"][name]["per_1000_records_cpu_s"] / 1000
        xs = [0, max(r["records"] for r in runs)]
        ax.plot([x / 1e6 for x in xs], [a + b * x for x in xs], color=colour, lw=1)
    if result["break_even_records"] is not None:
        ax.axvline(result["break_even_records"] / 1e6, color="grey", ls=":", label="break-even")
    ax.set_xlabel("records in the group (millions)")
    ax.set_ylabel("CPU-seconds of the run-once application")
    ax.set_title("run-once driver: C1 alone vs C2, YSB aggregate, local[2]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default=None, help="records per group, comma-separated (multiples of 100,000)")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else
             [100_000, 500_000] if args.quick else [100_000, 300_000, 1_000_000, 2_000_000])
    reps = args.reps or (1 if args.quick else 2)
    work = configure("jit")
    source = work / "landed"
    most = max(sizes) // EVENTS_PER_FILE
    paths = land_ysb(source, most, EVENTS_PER_FILE, seed=7, malformed_fraction=0.0)
    runs: dict[str, list[dict[str, Any]]] = {"c1": [], "c2": []}
    for rep in range(reps):
        for size in sizes:
            files = size // EVENTS_PER_FILE
            landing = work / f"landing-{files}"
            if not landing.exists():
                landing.mkdir()
                for path in paths[:files]:
                    os.link(path, landing / path.name)
                    os.utime(landing / path.name, (path.stat().st_mtime, path.stat().st_mtime))
            order = ("c1", "c2") if rep % 2 == 0 else ("c2", "c1")
            for name in order:
                run = run_group(work, f"{name}_{files}_{rep}", landing, files, C1 if name == "c1" else C2)
                runs[name].append(run)
                print(json.dumps({"jit": name, "rep": rep, **run}), flush=True)
    fits = {name: fit([(r["records"], r["cpu_s"]) for r in rs]) for name, rs in runs.items()}
    even = break_even(fits["c1"], fits["c2"])
    by_size = {}
    for size in sizes:
        files = size // EVENTS_PER_FILE
        c1 = [r["cpu_s"] for r in runs["c1"] if r["records"] // EVENTS_PER_FILE == files]
        c2 = [r["cpu_s"] for r in runs["c2"] if r["records"] // EVENTS_PER_FILE == files]
        by_size[str(size)] = {"c1_cpu_s": stats(c1, 2), "c2_cpu_s": stats(c2, 2),
                              "c2_over_c1": round(sorted(c2)[len(c2) // 2] / sorted(c1)[len(c1) // 2], 3)}
    result = {
        "sizes": sizes, "reps": reps, "events_per_file": EVENTS_PER_FILE, "runs": runs, "by_size": by_size,
        "fit": {name: {"fixed_cpu_s": round(a, 2), "per_1000_records_cpu_s": round(b * 1000, 4)}
                for name, (a, b) in fits.items()},
        "break_even_records": None if even is None else int(even),
        "config": {"quick": args.quick, "spark": "local[2]", "workload": "YSB aggregate (ysb.yaml), one epoch",
                   "c1": C1, "c2": C2, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    write_result("jit", result)
    plot(result, results_dir() / "jit.png")
    print(json.dumps({"fit": result["fit"], "break_even_records": result["break_even_records"],
                      "by_size": {k: v["c2_over_c1"] for k, v in by_size.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
