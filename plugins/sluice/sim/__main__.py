"""``python -m sluice.sim --schedules N --seed S``: run N schedules (seeds S, S+1, ...) on
``--workers`` processes; print each failing schedule's replay to stderr and, last, one JSON line
``{"schedules", "steps", "violations": {invariant: count}, "seed", "seconds"}``; exit 1 on any
violation."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

from sluice.sim.schedule import replay, run_seeds, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=None, help="the first seed (default: from the clock, printed)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--verbose", action="store_true", help="print every schedule's outcome and trace")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % 1_000_000_000
    print(f"sluice.sim: {args.schedules} schedules from seed {seed} on {args.workers} workers", file=sys.stderr)
    seeds = list(range(seed, seed + args.schedules))
    started = time.monotonic()
    workers = max(1, min(args.workers, len(seeds)))
    if workers == 1:
        outcomes = run_seeds(seeds)
    else:
        chunks = [seeds[i::workers] for i in range(workers)]
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            outcomes = [o for part in pool.map(run_seeds, chunks) for o in part]
    seconds = time.monotonic() - started
    for outcome in sorted(outcomes, key=lambda o: o.seed):
        if not outcome.ok or args.verbose:
            print(replay(outcome), file=sys.stderr)
    result = summary(outcomes, seconds, seed)
    print(json.dumps(result))
    return 1 if any(result["violations"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
