"""The adaptive controllers on real Spark: YSB events land at a sinusoidal rate, the backlog
trigger's decision (``sluice.adaptive.decide``) starts each group as its own run-once Spark
application (``sluice run-group``, a fresh JVM each time, as under Airflow), and the epoch
log gives epoch size, k, partitions and freshness per group.

    python -m bench.control_e2e [--workload ysb|join] [--duration 720] [--period 360]
                                [--mean-rate 1500] [--burst-at 480] [--burst-s 30] [--burst-factor 3]

``--workload join`` runs a transform whose cost grows with the square of the epoch
(``jobs/transforms/ysb_join.py``: a band self-join of the epoch's views per campaign) instead
of YSB's aggregation, and writes ``control_e2e_join.*``.

On top of the sinusoid, a burst: ``--burst-factor`` times the rate for ``--burst-s`` seconds
from ``--burst-at`` (``--burst-s 0``: none). The goals read off the summary: the first group's
freshness within the SLA (``first_group_within_sla``), after the first 2 groups at most 1
group in 20 over it (``sla_violations_after_warmup``, ``sla_violation_rate_after_warmup``), and
for the burst (``burst``): no group's application over 3x the median group's
(``max_group_wall_over_median``), and the SLA held again within 5 groups after the burst ends
(``groups_until_sla_after_burst``).

Writes ``bench/results/control_e2e.json`` and ``control_e2e.png``. Airflow's own scheduling
delay (a few seconds per group) is not in this loop; the Spark application start is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

import yaml

from bench.common import configure as bench_configure
from bench.common import run_group_args

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "var" / "bench" / "control_e2e"
NAME = "bench_control_e2e"
WARMUP_GROUPS = 2  # the goal counts SLA misses after these
BURST_WALL_RATIO = 3.0  # no group's application over this many times the median group's
BURST_RECOVERY_GROUPS = 5  # the SLA holds again within this many groups after the burst


def configure(workload: str = "ysb") -> str:
    """An isolated data folder, store and pipelines folder (set before sluice is imported) and
    the benchmark's pipeline spec; returns the pipeline's name. ``join``: the same source and
    control settings, the superlinear transform, an append sink."""
    name = NAME if workload == "ysb" else f"{NAME}_{workload}"
    work = bench_configure(name.removeprefix("bench_"))
    raw = yaml.safe_load((ROOT / "include" / "pipelines" / "ysb.yaml").read_text())
    raw.update(name=name, description=f"adaptive-control end-to-end benchmark ({workload})")
    raw["source"]["path"] = "${SLUICE_DATA_DIR}/landing"
    raw["sinks"][0]["path"] = "${SLUICE_DATA_DIR}/tables/campaign_views"
    if workload == "join":
        raw["transform"] = "ysb_join.campaign_coviews"
        raw["sinks"] = [{"name": "campaign_coviews", "mode": "append",
                         "path": "${SLUICE_DATA_DIR}/tables/campaign_coviews"}]
    raw["control"].update(adaptive=True, epoch_files=4, group_epochs=2, freshness_sla_s=60, poll_interval_s=2)
    raw["spark"]["mode"] = "in_process"
    (work / "pipelines" / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return name


@dataclass(frozen=True)
class Burst:
    at_s: float
    seconds: float
    factor: float

    def factor_at(self, t: float) -> float:
        return self.factor if self.at_s <= t < self.at_s + self.seconds else 1.0


def rate_at(t: float, mean: float, period: float, burst: Burst | None = None, amplitude: float = 0.6) -> float:
    return mean * (1 + amplitude * math.sin(2 * math.pi * t / period)) * (burst.factor_at(t) if burst else 1.0)


def land(landing: Path, stop: threading.Event, duration: float, period: float, mean: float, burst: Burst,
         sent: list[tuple[float, int]]) -> None:
    """One file per second of events at the sinusoidal rate, landed atomically (rename)."""
    from include.generators.ysb import generate

    staging = landing.parent / "staging"
    start = time.time()
    second = 0
    while not stop.is_set() and second < duration:
        rate = rate_at(second, mean, period, burst)
        for path in generate(staging, rate=rate, duration=1, files_per_second=1, seed=second,
                             start_ms=int((start + second) * 1000), prefix=f"e{second:06d}"):
            os.replace(path, landing / path.name)
        sent.append((time.time(), int(rate)))
        second += 1
        time.sleep(max(0.0, start + second - time.time()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=720, help="seconds of arrivals")
    parser.add_argument("--period", type=float, default=360, help="sinusoid period, seconds")
    parser.add_argument("--mean-rate", type=float, default=1500, help="mean events per second")
    parser.add_argument("--burst-at", type=float, default=480, help="second the burst starts")
    parser.add_argument("--burst-s", type=float, default=30, help="burst length, seconds (0: none)")
    parser.add_argument("--burst-factor", type=float, default=3, help="rate multiplier during the burst")
    parser.add_argument("--connect", action="store_true",
                        help="every group a client of one warm Spark Connect server (control_e2e_connect.*)")
    parser.add_argument("--workload", choices=("ysb", "join"), default="ysb",
                        help="join: a transform whose cost grows with the square of the epoch (control_e2e_join.*)")
    args = parser.parse_args(argv)
    burst = Burst(args.burst_at, args.burst_s, args.burst_factor)
    pipeline = configure(args.workload)
    from sluice.sources import FileSource
    from sluice.spec import get_spec
    from sluice.store import EpochStore

    spec = get_spec(pipeline)
    spec.landing_dir.mkdir(parents=True, exist_ok=True)
    store = EpochStore()
    source = FileSource(spec, store)
    env, server = dict(os.environ), None
    if args.connect:
        from bench.overhead import start_connect_server

        server, env["SLUICE_SPARK_REMOTE"] = start_connect_server(WORK.parent / pipeline.removeprefix("bench_"))
    stop, sent = threading.Event(), []
    lander = threading.Thread(target=land, args=(spec.landing_dir, stop, args.duration, args.period,
                                                 args.mean_rate, burst, sent), daemon=True)
    started = time.time()
    lander.start()
    groups = []
    try:
        run_groups(spec, store, source, lander, started, groups, env)
    finally:
        stop.set()
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    result = summarise(spec, store, groups, started, args)
    result["config"]["spark"] = "a warm Spark Connect server" if args.connect else "a JVM per group"
    result["config"]["workload"] = args.workload
    name = "".join(("control_e2e", "" if args.workload == "ysb" else f"_{args.workload}",
                    "_connect" if args.connect else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{name}.png")
    print(json.dumps(result["summary"], indent=2))
    return 0


def run_groups(spec: Any, store: Any, source: Any, lander: threading.Thread, started: float,
               groups: list[dict[str, Any]], env: dict[str, str]) -> None:
    """The backlog trigger's loop: decide, and run each group as its own application."""
    from sluice import adaptive
    from sluice.paths import RUN_GROUP_APP

    while lander.is_alive() or source.backlog().files:
        backlog = source.backlog()
        verdict = adaptive.decide_backlog(spec, store, backlog, continuous=lander.is_alive())
        if not verdict.fire:
            time.sleep(spec.control.poll_interval_s)
            continue
        plan = dict(verdict.plan(), fired_at=time.time())
        t0 = time.time()
        proc = subprocess.run([sys.executable, str(RUN_GROUP_APP), *run_group_args(spec.name, plan=plan)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"group failed (exit {proc.returncode})")
        groups.append({"at_s": round(t0 - started, 1), "app_s": round(time.time() - t0, 1), **plan})
        print(f"[{t0 - started:6.0f} s] group {len(groups) - 1}: backlog {backlog.files} files, "
              f"{plan['reason']}, epoch {plan['epoch_size']} x k {plan['k']}, partitions {plan['partitions']}, "
              f"rate {plan['rate_rps']:.0f}/s; app {time.time() - t0:.1f} s", flush=True)


def summarise(spec, store, groups: list[dict], started: float, args: argparse.Namespace) -> dict:
    """Per group, from the epoch log: sizes, k, partitions and the freshness of its records
    (publish time minus landing time of each file: mean and max)."""
    by_group: dict[int, list] = {}
    for e in store.epochs(spec.name):
        by_group.setdefault(e.group_id, []).append(e)
    rows = []
    for i, (group_id, epochs) in enumerate(sorted(by_group.items())):
        files = store.manifest(spec.name, epochs[0].start, epochs[-1].end)
        published = epochs[-1].published_at.replace(tzinfo=UTC).timestamp() if epochs[-1].published_at else None
        lat = [published - f.mtime for f in files] if published else []
        plan = groups[i] if i < len(groups) else {}
        rows.append({
            "group_id": group_id, "at_s": plan.get("at_s"), "epoch_size": epochs[0].end - epochs[0].start,
            "k": len(epochs), "partitions": plan.get("partitions"), "reason": plan.get("reason"),
            "rate_rps": plan.get("rate_rps"), "app_s": plan.get("app_s"),
            "epoch_s": [e.timings.get("epoch_s") for e in epochs],
            "records": sum(e.rows.get("input", 0) for e in epochs),
            "mean_latency_s": round(sum(lat) / len(lat), 2) if lat else None,
            "max_latency_s": round(max(lat), 2) if lat else None})
    lat = [r["mean_latency_s"] for r in rows if r["mean_latency_s"] is not None]
    sla = spec.control.freshness_sla_s
    after = [r for r in rows[WARMUP_GROUPS:] if r["max_latency_s"] is not None]
    late = sum(1 for r in after if r["max_latency_s"] > sla)
    return {"config": {"duration_s": args.duration, "period_s": args.period, "mean_rate": args.mean_rate,
                       "freshness_sla_s": sla, "burst": {"at_s": args.burst_at, "seconds": args.burst_s,
                                                         "factor": args.burst_factor}},
            "groups": rows,
            "summary": {"groups": len(rows), "elapsed_s": round(time.time() - started, 1),
                        "records": sum(r["records"] for r in rows),
                        "mean_latency_s_median": sorted(lat)[len(lat) // 2] if lat else None,
                        "max_latency_s": max((r["max_latency_s"] or 0) for r in rows) if rows else None,
                        "sla_violations": sum(1 for r in rows
                                              if (r["max_latency_s"] or 0) > spec.control.freshness_sla_s),
                        "first_group_max_latency_s": rows[0]["max_latency_s"] if rows else None,
                        "first_group_within_sla": bool(rows) and (rows[0]["max_latency_s"] or 0) <= sla,
                        "sla_violations_after_warmup": late,
                        "sla_violation_rate_after_warmup": round(late / len(after), 4) if after else None,
                        "goal_met": bool(rows) and (rows[0]["max_latency_s"] or 0) <= sla
                        and bool(after) and late / len(after) <= 1 / 20},
            "burst": burst_summary(rows, args.burst_at + args.burst_s if args.burst_s > 0 else None, sla)}


def burst_summary(rows: list[dict[str, Any]], burst_end_s: float | None, sla: float) -> dict[str, Any]:
    """What a burst did to the groups: the largest group's application against the median
    group's (``max_group_wall_over_median``, goal <= ``BURST_WALL_RATIO``: catch-up in more
    epochs of an efficient size, never one long group), and how many groups after the burst
    ended until one met the SLA again (``groups_until_sla_after_burst``, 1 = the first; goal <=
    ``BURST_RECOVERY_GROUPS``)."""
    walls = sorted(r["app_s"] for r in rows if r.get("app_s") is not None)
    if not walls:
        return {}
    median = walls[len(walls) // 2]
    out: dict[str, Any] = {"median_group_wall_s": median, "max_group_wall_s": walls[-1],
                           "max_group_wall_over_median": round(walls[-1] / median, 3),
                           "groups_over_3x_median_wall": sum(w > BURST_WALL_RATIO * median for w in walls)}
    recovered = None
    if burst_end_s is not None:
        after = [r for r in rows if r.get("at_s") is not None and r["at_s"] >= burst_end_s]
        recovered = next((i + 1 for i, r in enumerate(after) if (r["max_latency_s"] or 0) <= sla), None)
        out.update(burst_end_s=burst_end_s, groups_after_burst=len(after))
    out["groups_until_sla_after_burst"] = recovered
    out["goal_met"] = (walls[-1] <= BURST_WALL_RATIO * median
                       and (burst_end_s is None or (recovered is not None and recovered <= BURST_RECOVERY_GROUPS)))
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["groups"]
    x = [r["at_s"] or 0 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    cfg = result["config"]
    t = list(range(int(cfg["duration_s"])))
    burst = Burst(**{k: v for k, v in cfg.get("burst", {"at_s": 0, "seconds": 0, "factor": 1}).items()})
    axes[0].plot(t, [rate_at(s, cfg["mean_rate"], cfg["period_s"], burst) for s in t], color="grey")
    axes[0].set_ylabel("arrival rate (events/s)")
    axes[1].step(x, [r["epoch_size"] for r in rows], where="post", label="epoch size (files)")
    axes[1].step(x, [r["partitions"] or 0 for r in rows], where="post", label="partitions")
    axes[1].legend()
    axes[2].step(x, [r["k"] for r in rows], where="post", color="tab:green")
    axes[2].set_ylabel("k (epochs per group)")
    axes[3].plot(x, [r["mean_latency_s"] for r in rows], "o-", label="mean")
    axes[3].plot(x, [r["max_latency_s"] for r in rows], "x--", label="max")
    axes[3].axhline(cfg["freshness_sla_s"], color="red", linestyle=":", label="freshness SLA")
    axes[3].set_ylabel("freshness latency (s)")
    axes[3].set_xlabel("seconds since the first arrival (group start)")
    axes[3].legend()
    what = "YSB" if cfg.get("workload", "ysb") == "ysb" else "a YSB band self-join (cost ~ epoch^2)"
    fig.suptitle(f"sluice adaptive control on Spark ({cfg.get('spark', 'a JVM per group')}): {what} at a "
                 f"sinusoidal rate with a {cfg['burst']['factor']:g}x burst")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
