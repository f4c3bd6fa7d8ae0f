"""``make bench-control``: sluice's adaptive control against FPI, FixBI and an oracle in the simulator.

Runs every named trace x method for several seeds (noise and Markov path), and a family of
traces generated from seeds (``bench.simulator.family_member``: shapes x cost models x rates near
and above capacity, four hours each) against FixBI and the oracle; prints a table of medians and
writes ``bench/results/control.json`` (the family under the key ``family``, per trace under
``family_traces``; each family trace again under ``--noise-replicates`` other noise seeds
against the static setting that was FixBI on its own, under ``family_noise``, with FixBI
searched again on those draws for the noise floor unless ``--no-hindsight``) and
``bench/results/control.png``. Pure Python; 5 minutes on 2 cores, about 13 with the noise floor.
``python -m bench.control [--seeds N] [--family N]`` from the repo root with
``PYTHONPATH=plugins:.``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.simulator import (
    FPI,
    JOIN,
    REDUCE,
    Fixed,
    Oracle,
    Run,
    Simulator,
    Sluice,
    Trace,
    Workload,
    bursts,
    capacity_cut,
    family_member,
    markov,
    on_off,
    sinusoid,
    step,
)
from sluice.control import GroupSizeConfig

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("sluice", "fpi", "fixbi", "oracle")
HOURS = 3600.0
# Rates: DyBBS swept Reduce 1.5-6.5 MB/s and Join 1-4 MB/s; here Reduce 400-1700 records/s and
# Join 125-500 records/s keep the peak below FPI's own stability limit at its fixed k and
# partitions (so FPI converges everywhere, as it did in the paper).
REDUCE_LEVELS = (400.0, 725.0, 1050.0, 1375.0, 1700.0)
JOIN_LEVELS = (125.0, 219.0, 312.0, 406.0, 500.0)
# FixBI's grid: every static (epoch files, k, partitions).
FIX_X = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 160, 200)
FIX_K = (1, 2, 3, 4, 6, 8, 12)
FIX_P = (1, 2, 4, 6, 8, 12, 16)
#: A static setting whose backlog exceeds this many files counts as unbounded (FixBI skips it);
#: sluice's backlog beyond it where some static setting stays within is a runaway.
UNBOUNDED_FILES = 3600
FAMILY_TRACES = 128
#: Other noise seeds each family trace is run under (``family_noise``).
NOISE_REPLICATES = 3
#: The controllers were tuned on family seeds 0-63 (issue 36); seeds from here on were first run
#: after that tuning, so their summary (``family_holdout``) is what the controllers do on traces
#: they have not seen.
HOLDOUT_FROM = 64
FAMILY_HOURS = 4.0
#: The family's figures once a cold start is behind: over the files that landed after this.
WARM_AFTER_S = 3600.0


def traces(seed: int) -> dict[str, tuple[Workload, Trace]]:
    """The six benchmark traces; ``seed`` only changes the Markov path."""
    dwell = 240.0  # about 5 groups of the converged controllers
    return {
        "sinusoid_reduce": (REDUCE, sinusoid(REDUCE_LEVELS[0], REDUCE_LEVELS[-1], 1800, 8 * HOURS, "sinusoid_reduce")),
        "markov_reduce": (REDUCE, markov(REDUCE_LEVELS, dwell, 8 * HOURS, seed, "markov_reduce")),
        "sinusoid_join": (JOIN, sinusoid(JOIN_LEVELS[0], JOIN_LEVELS[-1], 1800, 8 * HOURS, "sinusoid_join")),
        "markov_join": (JOIN, markov(JOIN_LEVELS, dwell, 8 * HOURS, seed, "markov_join")),
        "step_recurring": (REDUCE, step((500.0, 1500.0, 500.0, 1500.0), (1.5 * HOURS, HOURS, HOURS, HOURS),
                                        "step_recurring")),
        "capacity_cut": (REDUCE, capacity_cut(1200.0, 2 * HOURS, 0.75, 6 * HOURS, "capacity_cut")),
        # superlinear work under traces the papers do not have: 1-minute bursts at 4x the base
        # rate every 20 minutes, and 15 minutes on / 15 minutes off
        "bursts_join": (JOIN, bursts(125.0, 500.0, 1200.0, 60.0, 8 * HOURS, "bursts_join")),
        "on_off_join": (JOIN, on_off(400.0, 900.0, 900.0, 8 * HOURS, "on_off_join")),
    }


def segment_convergence(run: Run, trace: Trace, band: float = 0.15) -> list[int | None]:
    """Per rate segment: groups from its start until the group span (files per group, the
    decision) stays within ``band`` of the segment's steady span (median of its last quarter)
    for 3 groups in a row; ``None`` if never (as DyBBS Fig. 8 reads convergence off the interval)."""
    out: list[int | None] = []
    fires = np.array([g["t_fire"] for g in run.groups])
    span = np.array([g["end"] - g["start"] for g in run.groups], float)
    for start, end, _ in trace.segments:
        seg = span[(fires >= start) & (fires < end)]
        if len(seg) < 4:
            continue
        steady = float(np.median(seg[-max(2, len(seg) // 4):]))
        near = np.abs(seg - steady) <= band * steady
        run3 = np.convolve(near.astype(int), np.ones(3, int), mode="valid") == 3
        ok = np.nonzero(run3)[0]
        out.append(int(ok[0]) if ok.size else None)
    return out


def learning_groups(run: Run, trace: Trace, band: float = 0.15) -> int | None:
    """Periodic traces: groups before the first period whose mean latency is within ``band`` of
    the median of the last three periods (the learning phase)."""
    fires = np.array([g["t_fire"] for g in run.groups])
    lat = np.array([g["mean_latency"] for g in run.groups])
    means = [float(lat[(fires >= s) & (fires < e)].mean()) for s, e, _ in trace.segments]
    ref = statistics.median(means[-3:])
    for (s, _, _), m in zip(trace.segments, means, strict=True):
        if m <= (1 + band) * ref:
            return int(np.sum(fires < s))
    return None


def converge_metric(name: str, run: Run, trace: Trace) -> tuple[float | None, dict[str, Any]]:
    if name.startswith("sinusoid"):
        n = learning_groups(run, trace)
        return n, {"learning_groups": n}
    segs = segment_convergence(run, trace)
    known = [s for s in segs if s is not None]
    extra: dict[str, Any] = {"per_segment": segs if len(segs) <= 8 else None,
                             "never_converged_segments": sum(s is None for s in segs)}
    if name == "step_recurring" and len(segs) == 4:
        extra.update(first_visit_high=segs[1], second_visit_high=segs[3])
    if name == "capacity_cut":
        cut = trace.segments[1][0]
        after = [g for g in run.groups if g["t_fire"] >= cut]
        before = [g for g in run.groups if g["t_fire"] < cut]
        half = len(after) // 2
        extra.update(
            max_backlog_files_before=max(g["backlog_files"] for g in before),
            max_backlog_files_after=max(g["backlog_files"] for g in after),
            max_backlog_files_first_half_after=max(g["backlog_files"] for g in after[:half]),
            max_backlog_files_second_half_after=max(g["backlog_files"] for g in after[half:]),
            backlog_files_at_end=after[-1]["backlog_files"],
        )
        return (segs[1] if len(segs) > 1 else None), extra
    return (float(statistics.median(known)) if known else None), extra


def fixbi(wl: Workload, trace: Trace, seed: int) -> tuple[Run, tuple[int, int, int]]:
    """The best static (x, k, partitions) by exhaustive search on this very trace and seed.

    Exhaustive, but pruned exactly: a candidate's run stops once its summed latency shows it
    cannot beat the best so far (``Simulator.run(abort_latency_s=...)``), and the grid is walked
    from a first guess outwards so the bound is tight early. The result is the grid's minimum."""
    sim = Simulator(wl, trace, seed=seed, abort_backlog_files=UNBOUNDED_FILES)
    grid = [(x, k, p) for p in FIX_P for k in FIX_K for x in FIX_X if x * k <= 1000]
    # a good bound early: static settings near the smallest stable span at the mean rate first
    mean_rate = float(np.mean(trace.rate(np.arange(0.0, trace.duration_s, 10.0))))
    grid.sort(key=lambda c: abs(math.log(max(c[0] * c[1], 1) / _span_guess(wl, mean_rate))))
    best: tuple[Run, tuple[int, int, int]] | None = None
    for x, k, p in grid:
        run = sim.run(Fixed(x, k, p), abort_latency_s=best[0].mean_latency_s if best else None)
        if not run.aborted and (best is None or run.mean_latency_s < best[0].mean_latency_s):
            best = (run, (x, k, p))
    assert best is not None, "no stable static configuration"
    return best


def _span_guess(wl: Workload, rate: float) -> float:
    """Files per group that a static group at ``rate`` needs to keep up (k = 1, P = cores), for
    the search order only."""
    for span in FIX_X:
        if span >= wl.coordination_s + float(wl.epoch_s(span * rate, wl.cores)) + 2.0:
            return float(span)
    return float(FIX_X[-1])


def run_one(args: tuple[str, int]) -> dict[str, Any]:
    name, seed = args
    wl, trace = traces(seed)[name]
    sim = Simulator(wl, trace, seed=seed)
    runs: dict[str, Run] = {
        "sluice": sim.run(Sluice(group=GroupSizeConfig(k0=3), persist_every=25)),
        "fpi": sim.run(FPI()),
        "oracle": sim.run(Oracle(wl)),
    }
    runs["fixbi"], fix_cfg = fixbi(wl, trace, seed)
    out: dict[str, Any] = {"trace": name, "seed": seed, "methods": {}}
    for m, run in runs.items():
        conv, extra = converge_metric(name, run, trace)
        assert sorted(run.processed_files) == run.processed_files and run.processed_files[-1][1] == sim.n_files
        out["methods"][m] = {
            "mean_latency_s": run.mean_latency_s, "p95_latency_s": run.p95_latency_s, "busy_s": run.busy_s,
            "groups_to_converge": conv, "groups": len(run.groups), "convergence": extra,
        }
        if m == "fixbi":
            out["methods"][m]["config"] = {"epoch_files": fix_cfg[0], "k": fix_cfg[1], "partitions": fix_cfg[2]}
    if seed == 0:
        out["series"] = {m: [(g["t_fire"], g["mean_latency"], g["backlog_files"], g["end"] - g["start"])
                             for g in run.groups] for m, run in runs.items()}
    return out


def run_family(seed: int) -> dict[str, Any]:
    """Family trace ``seed``: sluice (the same settings as on the named traces), the oracle and
    FixBI (the best static setting on this very trace and seed; ``None`` if none keeps the
    backlog within ``UNBOUNDED_FILES``). A runaway: sluice's backlog beyond that bound where some
    static setting stays within it."""
    m = family_member(seed, FAMILY_HOURS * HOURS)
    sim = Simulator(m.workload, m.trace, seed=seed)
    sluice = sim.run(Sluice(group=GroupSizeConfig(k0=3), persist_every=25))
    oracle = sim.run(Oracle(m.workload))
    try:
        fix, cfg = fixbi(m.workload, m.trace, seed)
    except AssertionError:
        fix, cfg = None, None

    def row(run: Run) -> dict[str, float]:
        return {"mean_latency_s": run.mean_latency_s, "p95_latency_s": run.p95_latency_s,
                "max_backlog_files": run.max_backlog_files, "groups": len(run.groups),
                "mean_latency_after_1h_s": sim.mean_latency_since(run, WARM_AFTER_S)}

    out: dict[str, Any] = {
        "seed": seed, "trace": m.name, "shape": m.shape, "cost": m.cost, "load": round(m.load, 3),
        "capacity_rps": round(m.capacity_rps, 1), "coordination_s": round(m.workload.coordination_s, 1),
        "sluice": row(sluice), "oracle": row(oracle), "fixbi": None,
        "vs_oracle": sluice.mean_latency_s / oracle.mean_latency_s,
        "bounded_static": fix is not None,
        "runaway": fix is not None and sluice.max_backlog_files > UNBOUNDED_FILES,
    }
    if fix is not None and cfg is not None:
        out["fixbi"] = {**row(fix), "config": {"epoch_files": cfg[0], "k": cfg[1], "partitions": cfg[2]}}
        out["vs_fixbi"] = sluice.mean_latency_s / fix.mean_latency_s
        out["vs_fixbi_after_1h"] = out["sluice"]["mean_latency_after_1h_s"] / out["fixbi"]["mean_latency_after_1h_s"]
    return out


def noise_seed(seed: int, j: int) -> int:
    """Another noise seed of family trace ``seed``, replicate ``j`` (1, 2, ...): the same arrivals
    and cost model, other lognormal draws of every epoch's and group's time."""
    return seed + 1_000_003 * j


def run_noise_replicate(args: tuple[int, int, tuple[int, int, int], bool]) -> dict[str, Any]:
    """Family trace ``seed`` under noise replicate ``j``: sluice against the static setting that
    was FixBI on the trace's own noise (``config``), both under the same new draws. Where the
    family's figures compare with the best static setting for the very noise sluice met, this
    asks whether the controllers hold on noise no one looked at (the static setting is no longer
    the best in hindsight for it, which favours sluice slightly).

    With ``hindsight``, FixBI is also searched again on the new draws. The static setting's
    latency over that one's is what knowing the trace, but not its noise, costs: the noise floor
    of any method that has to plan before the draws."""
    seed, j, (x, k, p), hindsight = args
    m = family_member(seed, FAMILY_HOURS * HOURS)
    sim = Simulator(m.workload, m.trace, seed=noise_seed(seed, j))
    sluice = sim.run(Sluice(group=GroupSizeConfig(k0=3), persist_every=25))
    static = sim.run(Fixed(x, k, p))
    out = {"seed": seed, "replicate": j, "trace": m.name, "cost": m.cost, "shape": m.shape,
           "vs_fixbi_config": sluice.mean_latency_s / static.mean_latency_s,
           "sluice_max_backlog_files": sluice.max_backlog_files, "static_max_backlog_files": static.max_backlog_files,
           "runaway": static.max_backlog_files <= UNBOUNDED_FILES < sluice.max_backlog_files}
    try:
        best, cfg = fixbi(m.workload, m.trace, noise_seed(seed, j)) if hindsight else (None, None)
    except AssertionError:  # no static setting keeps these draws' backlog bounded: no floor to give
        best, cfg = None, None
    if best is not None and cfg is not None:
        out["static_vs_hindsight"] = static.mean_latency_s / best.mean_latency_s
        out["vs_fixbi_hindsight"] = sluice.mean_latency_s / best.mean_latency_s
        out["hindsight_config"] = {"epoch_files": cfg[0], "k": cfg[1], "partitions": cfg[2]}
    return out


def summarise_noise(rows: list[dict[str, Any]], replicates: int) -> dict[str, Any]:
    """``family_noise``: the replicates' sluice / static ratios as median, p90 and max, how many
    exceed 1.25, runaways, by cost model, and the worst runs (seed and replicate to rerun them)."""
    ratios = [r["vs_fixbi_config"] for r in rows]
    worst = sorted(rows, key=lambda r: -r["vs_fixbi_config"])[:8]
    out = {
        "replicates": replicates, "runs": len(rows), "fixbi_config": _spread(ratios),
        "over_1_25": sum(v > 1.25 for v in ratios), "runaway": sum(r["runaway"] for r in rows),
        "by_cost": {c: _spread([r["vs_fixbi_config"] for r in rows if r["cost"] == c])
                    for c in sorted({r["cost"] for r in rows})},
        "worst": [{"trace": r["trace"], "seed": r["seed"], "replicate": r["replicate"],
                   "noise_seed": noise_seed(r["seed"], r["replicate"]),
                   "vs_fixbi_config": round(r["vs_fixbi_config"], 3),
                   "sluice_max_backlog_files": r["sluice_max_backlog_files"]} for r in worst],
    }
    hind = [r for r in rows if "static_vs_hindsight" in r]
    if hind:
        # the noise floor: the static setting that was best on the trace's own noise, against the
        # best static setting on these draws (both know the arrivals; only one knows the draws)
        floor = [r["static_vs_hindsight"] for r in hind]
        vs = [r["vs_fixbi_hindsight"] for r in hind]
        out["static_vs_hindsight"] = {**_spread(floor), "over_1_25": sum(v > 1.25 for v in floor),
                                      "by_cost": {c: _spread([r["static_vs_hindsight"] for r in hind if r["cost"] == c])
                                                  for c in sorted({r["cost"] for r in hind})}}
        # sluice against FixBI searched on the very draws it met: the family's own measure, on
        # noise nobody tuned on
        out["fixbi_hindsight"] = {**_spread(vs), "over_1_25": sum(v > 1.25 for v in vs)}
        out["worst_static"] = [
            {"trace": r["trace"], "noise_seed": noise_seed(r["seed"], r["replicate"]),
             "static_vs_hindsight": round(r["static_vs_hindsight"], 3),
             "vs_fixbi_hindsight": round(r["vs_fixbi_hindsight"], 3), "hindsight_config": r["hindsight_config"]}
            for r in sorted(hind, key=lambda r: -r["static_vs_hindsight"])[:8]]
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(float(np.median(values)), 4), "p90": round(float(np.quantile(values, 0.9)), 4),
            "max": round(float(np.max(values)), 4)} if values else {"median": None, "p90": None, "max": None}


def summarise_family(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The family's figures: sluice's mean latency against FixBI (on the traces where some static
    setting is bounded) and against the oracle, as median, p90 and max over the traces."""
    rows = sorted(rows, key=lambda r: r["seed"])
    bounded = [r for r in rows if r["bounded_static"]]
    vs_fixbi = [r["vs_fixbi"] for r in bounded]
    vs_oracle = [r["vs_oracle"] for r in rows]
    backlog = [r["sluice"]["max_backlog_files"] / max(r["fixbi"]["max_backlog_files"], 1) for r in bounded]
    warm = [r["vs_fixbi_after_1h"] for r in bounded if "vs_fixbi_after_1h" in r]
    return {
        "traces": len(rows), "fixbi": _spread(vs_fixbi), "oracle": _spread(vs_oracle),
        "runaway": sum(r["runaway"] for r in rows),
        "bounded_static": len(bounded),
        "max_backlog_vs_fixbi": _spread(backlog),
        "hours": FAMILY_HOURS, "seeds": [r["seed"] for r in rows],
        "unbounded_files": UNBOUNDED_FILES,
        "by_cost": {c: _spread([r["vs_fixbi"] for r in bounded if r["cost"] == c])
                    for c in sorted({r["cost"] for r in rows})},
        "by_shape": {sh: _spread([r["vs_fixbi"] for r in bounded if r["shape"] == sh])
                     for sh in sorted({r["shape"] for r in rows})},
        # the files that landed after the first hour, against the same static setting (chosen on
        # the whole trace): the cold start's share of the tail
        "after_first_hour": {**_spread(warm), "over_1_25": sum(v > 1.25 for v in warm), "since_s": WARM_AFTER_S},
    }


def family_goals(fam: dict[str, Any]) -> dict[str, Any]:
    """Issue 36's bar on the family."""
    out: dict[str, Any] = {}
    for key, stat, bound in (("fixbi", "median", 1.05), ("fixbi", "p90", 1.15), ("fixbi", "max", 1.25),
                             ("oracle", "median", 1.10)):
        value = fam[key][stat]
        name = "FixBI" if key == "fixbi" else "the oracle"
        out[f"family: {stat} mean latency <= {bound:.2f}x {name}"] = {
            "measured": value, "met": value is not None and value <= bound}
    out["family: no runaway"] = {"measured": fam["runaway"], "met": fam["runaway"] == 0}
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(statistics.median(known)) if known else None


def summarise(results: list[dict[str, Any]], seeds: int) -> dict[str, Any]:
    names = list(traces(0))
    summary: dict[str, Any] = {"traces": {}, "seeds": seeds, "per_seed": {}}
    for name in names:
        rows = [r for r in results if r["trace"] == name]
        summary["traces"][name] = {}
        for m in METHODS:
            per = [r["methods"][m] for r in rows]
            summary["traces"][name][m] = {
                key: _median([p[key] for p in per])
                for key in ("mean_latency_s", "p95_latency_s", "busy_s", "groups_to_converge")
            }
        summary["per_seed"][name] = {m: [r["methods"][m] for r in sorted(rows, key=lambda r: r["seed"])]
                                     for m in METHODS}
    return summary


def goals(summary: dict[str, Any]) -> dict[str, Any]:
    t = summary["traces"]

    def vs(trace: str, other: str) -> float:
        return 1 - t[trace]["sluice"]["mean_latency_s"] / t[trace][other]["mean_latency_s"]

    out: dict[str, Any] = {}
    for trace, target in (("sinusoid_reduce", 0.35), ("markov_reduce", 0.48), ("sinusoid_join", 0.60),
                          ("markov_join", 0.60)):
        out[f"{trace}: latency below FPI by >= {target:.0%}"] = {"measured": round(vs(trace, "fpi"), 4),
                                                                "met": vs(trace, "fpi") >= target}
    for trace in t:
        gap = t[trace]["sluice"]["mean_latency_s"] / t[trace]["oracle"]["mean_latency_s"] - 1
        out[f"{trace}: within 15% of the oracle"] = {"measured": round(gap, 4), "met": gap <= 0.15}
    for trace in t:  # issue 17's bar: <= 1.05x the best static setting in hindsight, <= 1.10x the oracle
        vs_fixbi = t[trace]["sluice"]["mean_latency_s"] / t[trace]["fixbi"]["mean_latency_s"]
        vs_oracle = t[trace]["sluice"]["mean_latency_s"] / t[trace]["oracle"]["mean_latency_s"]
        out[f"{trace}: mean latency <= 1.05x FixBI"] = {"measured": round(vs_fixbi, 4), "met": vs_fixbi <= 1.05}
        out[f"{trace}: mean latency <= 1.10x the oracle"] = {"measured": round(vs_oracle, 4), "met": vs_oracle <= 1.10}
    step_runs = summary["per_seed"]["step_recurring"]["sluice"]
    first = _median([r["convergence"].get("first_visit_high") for r in step_runs])
    second = _median([r["convergence"].get("second_visit_high") for r in step_runs])
    out["step_recurring: second visit converges in fewer groups"] = {
        "measured": {"first_visit_groups": first, "second_visit_groups": second},
        "met": first is not None and second is not None and second < first}
    cut = [r["convergence"] for r in summary["per_seed"]["capacity_cut"]["sluice"]]
    bounded = all(c["max_backlog_files_second_half_after"] <= max(c["max_backlog_files_first_half_after"],
                                                                  2 * c["max_backlog_files_before"]) for c in cut)
    out["capacity_cut: backlog bounded after the cut"] = {
        "measured": {k: _median([c[k] for c in cut]) for k in cut[0] if k.startswith(("max_", "backlog"))},
        "met": bounded}
    return out


def plot(summary: dict[str, Any], series: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    family = summary.get("family_traces") or []
    rows = 3 if family else 2
    fig = plt.figure(figsize=(15, 4.5 * rows))
    grid = fig.add_gridspec(rows, 6)
    ax = fig.add_subplot(grid[0, :])
    names = list(summary["traces"])
    width = 0.2
    for i, m in enumerate(METHODS):
        vals = [summary["traces"][n][m]["mean_latency_s"] for n in names]
        ax.bar(np.arange(len(names)) + (i - 1.5) * width, vals, width, label=m)
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylabel("mean record latency (s)")
    ax.set_title(f"Mean latency, median of {summary['seeds']} seeds")
    ax.legend()
    panels = (("step_recurring", 1, "group mean latency (s)"), ("capacity_cut", 2, "backlog at group start (files)"),
              ("sinusoid_join", 3, "group span (files)"))
    for j, (name, col, label) in enumerate(panels):
        ax = fig.add_subplot(grid[1, 2 * j:2 * j + 2])
        for m in ("sluice", "fpi", "oracle"):
            s = np.array(series[name][m])
            ax.plot(s[:, 0] / HOURS, s[:, col], lw=0.8, label=m)
        ax.set_title(name)
        ax.set_xlabel("hours")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    if family:
        plot_family(fig.add_subplot(grid[2, :3]), fig.add_subplot(grid[2, 3:]), summary["family"], family)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_family(ax: Any, by_cost: Any, fam: dict[str, Any], traces: list[dict[str, Any]]) -> None:
    """The family's distribution: sluice's mean latency over FixBI's and over the oracle's per
    trace (sorted, so the curve reads as a distribution), over FixBI's on the files that landed
    after the first hour (the cold start behind), and over FixBI's per cost model."""
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    def ratio_axis(axis: Any) -> None:
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(FixedLocator([0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0]))
        axis.yaxis.set_major_formatter(ScalarFormatter())
        axis.yaxis.set_minor_formatter(NullFormatter())

    for key, label in (("vs_fixbi", "sluice / FixBI"), ("vs_oracle", "sluice / oracle"),
                       ("vs_fixbi_after_1h", "sluice / FixBI, files after the first hour")):
        values = np.sort([t[key] for t in traces if key in t])
        ax.step(np.arange(1, len(values) + 1) / len(values), values, where="post", label=label)
    for bound, style in ((1.05, ":"), (1.25, "--")):
        ax.axhline(bound, color="grey", linestyle=style, lw=0.8)
    ratio_axis(ax)
    ax.set_xlabel("fraction of traces")
    ax.set_ylabel("mean latency ratio")
    f = fam["fixbi"]
    ax.set_title(f"family of {fam['traces']} traces: vs FixBI median {f['median']:.2f}, p90 {f['p90']:.2f}, "
                 f"max {f['max']:.2f}; runaways {fam['runaway']}", fontsize=10)
    ax.legend(fontsize=8)
    ax = by_cost
    costs = sorted({t["cost"] for t in traces})
    for i, cost in enumerate(costs):
        values = [t["vs_fixbi"] for t in traces if t["cost"] == cost and "vs_fixbi" in t]
        ax.scatter(np.full(len(values), i) + np.linspace(-0.2, 0.2, len(values)), values, s=12)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(np.arange(len(costs)), costs)
    ratio_axis(ax)
    ax.set_ylabel("sluice / FixBI mean latency")
    ax.set_title("per cost model (each dot a trace)", fontsize=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--family", type=int, default=FAMILY_TRACES, help="traces of the seeded family (0: none)")
    ap.add_argument("--noise-replicates", type=int, default=NOISE_REPLICATES,
                    help="other noise seeds per family trace, against FixBI's setting (0: none)")
    ap.add_argument("--no-hindsight", dest="hindsight", action="store_false",
                    help="skip FixBI's search on each noise replicate (the noise floor: two thirds of the run)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where control.json and control.png go")
    args = ap.parse_args()
    started = time.time()
    jobs = [(name, seed) for seed in range(args.seeds) for name in traces(seed)]
    with ProcessPoolExecutor(args.workers) as pool:
        named = pool.map(run_one, jobs)  # the longest jobs (eight-hour traces) first
        family = list(pool.map(run_family, range(args.family)))
        results = list(named)
    summary = summarise(results, args.seeds)
    series = {r["trace"]: r["series"] for r in results if r["seed"] == 0}
    summary["goals"] = goals(summary)
    if family:
        summary["family"] = summarise_family(family)
        holdout = [r for r in family if r["seed"] >= HOLDOUT_FROM]
        if holdout:
            summary["family_holdout"] = summarise_family(holdout)
        summary["family_traces"] = sorted(family, key=lambda r: r["seed"])
        summary["goals"].update(family_goals(summary["family"]))
        configs = [(r["seed"], r["fixbi"]["config"]) for r in family if r["fixbi"] is not None]
        jobs_noise = [(seed, j, (c["epoch_files"], c["k"], c["partitions"]), args.hindsight)
                      for seed, c in configs for j in range(1, args.noise_replicates + 1)]
        if jobs_noise:
            with ProcessPoolExecutor(args.workers) as pool:
                noise = list(pool.map(run_noise_replicate, jobs_noise, chunksize=4))
            summary["family_noise"] = summarise_noise(noise, args.noise_replicates)
    summary["fixbi_configs"] = {n: [r["config"] for r in summary["per_seed"][n]["fixbi"]] for n in summary["traces"]}
    summary["model"] = {"unit": "epoch size in files (1 file/s), rates in records/s",
                        "reduce": REDUCE.__dict__, "join": JOIN.__dict__}
    summary["elapsed_s"] = round(time.time() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "control.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    plot(summary, series, args.out / "control.png")
    print(f"{'trace':16} {'method':7} {'mean_s':>8} {'p95_s':>8} {'busy_s':>8} {'conv':>6}")
    for name, row in summary["traces"].items():
        for m in METHODS:
            v = row[m]
            conv = "-" if v["groups_to_converge"] is None else f"{v['groups_to_converge']:.0f}"
            print(f"{name:16} {m:7} {v['mean_latency_s']:8.1f} {v['p95_latency_s']:8.1f} {v['busy_s']:8.0f} {conv:>6}")
    if family:
        fam = summary["family"]
        print(f"family of {fam['traces']} traces ({fam['bounded_static']} with a bounded static setting): "
              f"sluice / FixBI median {fam['fixbi']['median']}, p90 {fam['fixbi']['p90']}, max {fam['fixbi']['max']}; "
              f"/ oracle median {fam['oracle']['median']}, p90 {fam['oracle']['p90']}, max {fam['oracle']['max']}; "
              f"runaways {fam['runaway']}")
        if "family_holdout" in summary:
            h = summary["family_holdout"]
            print(f"  held out (seeds {HOLDOUT_FROM}+, {h['traces']} traces): "
                  f"sluice / FixBI median {h['fixbi']['median']}, p90 {h['fixbi']['p90']}, "
                  f"max {h['fixbi']['max']}; / oracle median {h['oracle']['median']}")
        worst = sorted((r for r in family if "vs_fixbi" in r), key=lambda r: -r["vs_fixbi"])[:5]
        print("  worst: " + ", ".join(f"{r['trace']} {r['vs_fixbi']:.2f}" for r in worst))
        if "family_noise" in summary:
            nz = summary["family_noise"]
            s = nz["fixbi_config"]
            print(f"  other noise ({nz['replicates']} seeds a trace, {nz['runs']} runs) / FixBI's setting: median "
                  f"{s['median']}, p90 {s['p90']}, max {s['max']}; over 1.25: {nz['over_1_25']}; "
                  f"runaways {nz['runaway']}")
            print("    worst: " + ", ".join(f"{w['trace']} noise {w['noise_seed']} {w['vs_fixbi_config']:.2f}"
                                          for w in nz["worst"][:5]))
            if "static_vs_hindsight" in nz:
                fl, fh = nz["static_vs_hindsight"], nz["fixbi_hindsight"]
                print(f"  noise floor: FixBI's setting / FixBI searched on the same draws: median {fl['median']}, "
                      f"p90 {fl['p90']}, max {fl['max']}, over 1.25: {fl['over_1_25']}; sluice / the latter: median "
                      f"{fh['median']}, p90 {fh['p90']}, max {fh['max']}, over 1.25: {fh['over_1_25']}")
        wa = fam["after_first_hour"]
        print(f"  after the first hour: sluice / FixBI median {wa['median']}, p90 {wa['p90']}, max {wa['max']}, "
              f"over 1.25: {wa['over_1_25']}")
    for goal, res in summary["goals"].items():
        print(f"{'MET ' if res['met'] else 'MISS'} {goal}: {res['measured']}")
    print(f"wrote {args.out / 'control.json'} and control.png in {summary['elapsed_s']} s")


if __name__ == "__main__":
    main()
