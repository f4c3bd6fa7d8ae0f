"""What the epoch store's reads cost as a pipeline's epochs pile up (they are never pruned).

    python -m bench.store_reads [--epochs 1000,10000,30000] [--reps 5]   # ~2 min on SQLite

A store (SQLite, as ``make demo`` runs it) is filled with published epochs; at each count, each
read a group or a poll makes is timed ``--reps`` times (median, min, max in ms):

* ``plan_group``: a group's plan, in the store's write transaction (with nothing new to plan it
  still reads what it needs: the unpublished epochs, the last epoch's id);
* ``poll_history``: the poll's sizing reads (``adaptive.records_per_file``,
  ``adaptive.seconds_per_file``, ``sources.base.read_history``), a window of the last epochs;
* ``unpublished``: the freshness check's and the trigger's read;
* ``summary``: the console's pipeline list (``EpochStore.summary``, aggregated in SQL);
* ``console_all``: what the console's pipeline page read before it read pages (every epoch of
  every generation, the manifest under them, every group with its epochs and plan);
* ``console_page``: what it reads now (``GET …/epochs?last=1000``, ``…/groups?since=G``).

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
    """Published epochs up to ``count`` (8 a group, 10 files each), their groups and their files
    in the manifest, as a long-lived pipeline has."""
    from sluice.model import Epoch

    with store.transaction(PIPELINE) as tx:
        have = len(tx.epochs())
    store.register_files(PIPELINE, [(f"/landing/f{j:08d}.json", 100, float(j)) for j in range(have * 10, count * 10)])
    with store.transaction(PIPELINE) as tx:
        gen = tx.state().generation
        for i in range(have, count):
            tx.insert_epoch(Epoch(PIPELINE, i, gen, i // 8, i * 10, i * 10 + 10, "published",
                                  rows={"input": 1000, "output": 10}, timings={"epoch_s": 1.0},
                                  delta_versions={"t": i}))
        for g in range(-(-have // 8), -(-count // 8)):
            tx.insert_group(g, owner="bench", fence=0, first_epoch=8 * g, last_epoch=min(count, 8 * g + 8) - 1,
                            state="published", plan={"epoch_size": 10, "k": 8}, finished=True)


def _console(store: Any, last: int | None) -> None:
    """The console page's store reads (``sluice.api.app``'s ``epochs`` and ``groups`` routes)."""
    history = store.epoch_history(PIPELINE, last=last)
    since = min(e.group_id for e in history) if last is not None else None
    store.manifest(PIPELINE, min(e.start for e in history), max(e.end for e in history))
    store.group_plans(PIPELINE, since=since)
    store.groups(PIPELINE, since=since)


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
               "summary": _timed(lambda: store.summary(PIPELINE), reps),
               "console_all": _timed(lambda: _console(store, None), reps),
               "console_page": _timed(lambda: _console(store, 1000), reps)}
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
    for key in ("plan_group", "poll_history", "unpublished", "summary", "console_all", "console_page"):
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
