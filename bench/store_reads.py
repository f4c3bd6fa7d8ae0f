"""What the epoch store's reads cost as a pipeline's epochs pile up (they are never pruned).

    python -m bench.store_reads [--epochs 1000,10000,30000] [--reps 5]   # ~2 min on SQLite

A store (SQLite, as ``make demo`` runs it) is filled with published epochs; at each count, each
read a group or a poll makes is timed ``--reps`` times (median, min, max in ms):

* ``plan_group``: a group's plan, in the store's write transaction (with nothing new to plan it
  still reads what it needs: the unpublished epochs, the last epoch's id);
* ``poll_history``: the poll's sizing reads (``adaptive.records_per_file``,
  ``adaptive.seconds_per_file``, ``sources.base.read_history``), a window of the last epochs;
* ``unpublished``: the freshness check's and the trigger's read;
* ``summary``: the console's pipeline list (``EpochStore.summary``, aggregated in SQL).

Writes ``bench/results/store_reads.json`` and ``store_reads.png``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ROOT, stats, write_result

PIPELINE = "p"


def _timed(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    values = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        values.append((time.perf_counter() - t) * 1000)
    return stats(values, 2)


def _fill(store: Any, count: int) -> None:
    """Published epochs up to ``count`` (8 a group, 10 offsets each), as a long-lived pipeline has."""
    from sluice.model import Epoch

    with store.transaction(PIPELINE) as tx:
        have = len(tx.epochs())
        gen = tx.state().generation
        for i in range(have, count):
            tx.insert_epoch(Epoch(PIPELINE, i, gen, i // 8, i * 10, i * 10 + 10, "published",
                                  rows={"input": 1000, "output": 10}, timings={"epoch_s": 1.0},
                                  delta_versions={"t": i}))


def measure(counts: list[int], reps: int) -> dict[str, Any]:
    from sluice import adaptive
    from sluice.model import UNPUBLISHED
    from sluice.protocol import planning
    from sluice.protocol.leases import acquire_lease
    from sluice.sources.base import read_history
    from sluice.store import EpochStore

    class Spec:  # what the history reads look at
        name = PIPELINE

    folder = Path(tempfile.mkdtemp(prefix="sluice-store-reads-"))
    store = EpochStore(f"sqlite:///{folder / 'store.db'}")
    with store.transaction(PIPELINE) as tx:
        tx.state()
    rows = []
    for count in counts:
        _fill(store, count)
        lease = acquire_lease(store, PIPELINE, "bench", ttl_s=600)
        row = {"epochs": count,
               "plan_group": _timed(lambda lease=lease: planning.plan_group(store, lease, epoch_size=8, k=2), reps),
               "poll_history": _timed(lambda: (adaptive.records_per_file(Spec, store),
                                               adaptive.seconds_per_file(Spec, store), read_history(Spec, store)),
                                      reps),
               "unpublished": _timed(lambda: store.epochs(PIPELINE, states=sorted(UNPUBLISHED)), reps),
               "summary": _timed(lambda: store.summary(PIPELINE), reps)}
        store.release_lease(lease)
        rows.append(row)
        print(count, {k: v["median"] for k, v in row.items() if isinstance(v, dict)}, "ms", flush=True)
    store.close()
    return {"store": "sqlite", "reps": reps, "unit": "ms", "by_epochs": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["by_epochs"]
    xs = [r["epochs"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("plan_group", "poll_history", "unpublished", "summary"):
        med = [r[key]["median"] for r in rows]
        lo = [r[key]["median"] - r[key]["min"] for r in rows]
        hi = [r[key]["max"] - r[key]["median"] for r in rows]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("epochs in the store (never pruned)")
    ax.set_ylabel("ms per read (median, min-max)")
    ax.set_title("Epoch store reads as epochs pile up (SQLite)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", default="1000,10000,30000")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    import sys

    for p in (ROOT / "plugins", ROOT):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    result = measure([int(c) for c in args.epochs.split(",")], args.reps)
    path = write_result("store_reads", result)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
