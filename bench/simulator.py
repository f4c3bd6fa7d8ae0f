"""Discrete-event simulator of sluice's run-once groups, for evaluating the adaptive control.

Model. Source files land at ``file_rate`` files/s (file ``i`` at ``(i + 1) / file_rate``), each
holding ``rate(t) / file_rate`` records, like ``make generate FILES_PER_SECOND=1``. A method plans
a group (epoch size in files, k, partitions); the sensor fires when the backlog holds the group
or when waiting longer would break the freshness SLA; the run plans its epochs exactly as
``sluice.protocol.plan_ranges`` does (never more than the backlog), pays the group's coordination
cost once and each epoch's processing time, and publishes everything at the end. A record's
latency is its arrival to the publish of its group; busy time is the sum of group wall times.
The next group is planned when the previous one has published (one active run per pipeline).

Processing-time models, parametrised from runs on this machine (2 cores, local[2]): a warm epoch
of 8,000 records (4 files x 2,000) took 4.3-5.8 s with the aggregate-merge sink, the first epoch
of an application 15-22 s, the Spark session ~6 s. So, per epoch of n records with P partitions,

    p(n, P) = a + tau * P + b * work(n) * (1 + h * C / P) / min(P, C)

with a = 2 s (Delta commit + job planning per epoch), tau = 0.05 s per task, C = 2 cores, h = 0.5
(skew/spill relief from more partitions: the U-shape DyBBS observed for blocks), work(n) = n for
Reduce-like and n^2 for Join-like work, b fitted so p(8000, 2) = 5.1 s. Per group: coordination
F = 20 s = Airflow scheduling ~3 s + Spark start ~6 s + first-epoch warm-up ~11 s (15-22 s first
epoch minus a ~5 s warm one). Times get lognormal noise (sigma 0.1 per epoch, 0.15 for F); a
capacity factor < 1 (the 25% cut) divides epoch times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import numpy as np

from sluice.control import ControlState, Decision, EpochSizeConfig, GroupResult, GroupSizeConfig, Observation
from sluice.control import plan_next as _plan_next
from sluice.protocol import plan_ranges


def _work(kind: str, n: np.ndarray) -> np.ndarray:
    if kind == "reduce":
        return n
    if kind == "join":
        return n * n
    return n * np.log2(np.maximum(n, 2.0))


@dataclass(frozen=True)
class Workload:
    """``kind`` is the shape of the per-epoch work in its records ``n``: ``reduce`` n, ``nlogn``
    n log2 n, ``join`` n^2. Beyond ``cliff_records`` (a memory cliff: the epoch no longer fits
    and spills) the work above the cliff costs ``cliff_factor`` times as much."""

    name: str
    kind: Literal["reduce", "join", "nlogn"]
    per_record: float
    per_epoch_s: float = 2.0
    per_partition_s: float = 0.05
    skew: float = 0.5
    cores: int = 2
    coordination_s: float = 20.0
    noise: float = 0.10
    coordination_noise: float = 0.15
    cliff_records: float = math.inf
    cliff_factor: float = 1.0

    def work(self, n: np.ndarray) -> np.ndarray:
        w = _work(self.kind, n)
        if self.cliff_factor != 1.0 and math.isfinite(self.cliff_records):
            w = w + (self.cliff_factor - 1) * np.maximum(0.0, w - _work(self.kind, np.float64(self.cliff_records)))
        return w

    def epoch_s(self, records: np.ndarray | float, partitions: np.ndarray | int, capacity: float = 1.0) -> np.ndarray:
        """Noise-free processing time of one epoch (seconds)."""
        n = np.asarray(records, float)
        p = np.asarray(partitions, float)
        spread = (1 + self.skew * self.cores / p) / np.minimum(p, self.cores)
        return (self.per_epoch_s + self.per_partition_s * p + self.per_record * self.work(n) * spread) / capacity


_SPREAD_2 = (1 + 0.5 * 2 / 2) / 2  # 0.75 at P = 2, C = 2
REDUCE = Workload("reduce", "reduce", per_record=3.0 / (8000 * _SPREAD_2))
JOIN = Workload("join", "join", per_record=3.0 / (8000**2 * _SPREAD_2))


@dataclass(frozen=True)
class Trace:
    """Arrival rate (records/s) and capacity factor as functions of time; labelled segments
    (rate regimes) are used to measure convergence."""

    name: str
    duration_s: float
    rate: Callable[[np.ndarray], np.ndarray]
    capacity: Callable[[float], float] = lambda t: 1.0
    segments: tuple[tuple[float, float, str], ...] = ()


def constant(rate: float, duration_s: float = 4 * 3600, name: str = "constant") -> Trace:
    return Trace(name, duration_s, lambda t: np.full(np.shape(t), rate, float), segments=((0, duration_s, "c"),))


def step(levels: tuple[float, ...], durations: tuple[float, ...], name: str = "step") -> Trace:
    edges = np.cumsum((0, *durations))
    lv = np.asarray(levels, float)

    def rate(t: np.ndarray) -> np.ndarray:
        return lv[np.clip(np.searchsorted(edges, t, side="right") - 1, 0, len(lv) - 1)]

    segs = tuple((float(edges[i]), float(edges[i + 1]), f"{levels[i]:g}") for i in range(len(levels)))
    return Trace(name, float(edges[-1]), rate, segments=segs)


def sinusoid(low: float, high: float, period_s: float, duration_s: float, name: str = "sinusoid") -> Trace:
    mid, amp = (low + high) / 2, (high - low) / 2
    n = int(duration_s // period_s)
    segs = tuple((i * period_s, (i + 1) * period_s, f"period {i}") for i in range(n))
    return Trace(name, duration_s, lambda t: mid + amp * np.sin(2 * np.pi * np.asarray(t) / period_s), segments=segs)


def markov(levels: tuple[float, ...], dwell_s: float, duration_s: float, seed: int, name: str = "markov") -> Trace:
    """A birth-death Markov chain over ``levels``: every ``dwell_s`` move one level up or down
    (probability 0.4 each, reflecting at the ends) or stay (0.2)."""
    rng = np.random.default_rng(seed)
    n = math.ceil(duration_s / dwell_s)
    states = [len(levels) // 2]
    for _ in range(n - 1):
        u, s = rng.random(), states[-1]
        s = s + 1 if u < 0.4 else s - 1 if u < 0.8 else s
        states.append(min(len(levels) - 1, max(0, s)))
    lv = np.asarray(levels, float)[states]
    segs = tuple((i * dwell_s, (i + 1) * dwell_s, f"{lv[i]:g}") for i in range(n))
    return Trace(name, duration_s, lambda t: lv[np.clip((np.asarray(t) // dwell_s).astype(int), 0, n - 1)],
                 segments=segs)


def bursts(base: float, peak: float, every_s: float, burst_s: float, duration_s: float,
           name: str = "bursts") -> Trace:
    """``base`` records/s with a burst at ``peak`` for ``burst_s`` at the start of every
    ``every_s`` (short bursts several times the base rate); one segment per cycle."""
    n = int(duration_s // every_s)
    segs = tuple((i * every_s, (i + 1) * every_s, f"cycle {i}") for i in range(n))
    return Trace(name, duration_s, lambda t: np.where(np.asarray(t) % every_s < burst_s, peak, base).astype(float),
                 segments=segs)


def on_off(rate: float, on_s: float, off_s: float, duration_s: float, name: str = "on_off") -> Trace:
    """``rate`` records/s for ``on_s``, then nothing for ``off_s`` (files still land, empty)."""
    cycle = on_s + off_s
    n = int(duration_s // cycle)
    segs = tuple((i * cycle, (i + 1) * cycle, f"cycle {i}") for i in range(n))
    return Trace(name, duration_s, lambda t: np.where(np.asarray(t) % cycle < on_s, rate, 0.0).astype(float),
                 segments=segs)


def capacity_cut(rate: float, cut_at_s: float, factor: float, duration_s: float, name: str = "capacity_cut") -> Trace:
    return Trace(name, duration_s, lambda t: np.full(np.shape(t), rate, float),
                 capacity=lambda t: factor if t >= cut_at_s else 1.0,
                 segments=((0, cut_at_s, "before"), (cut_at_s, duration_s, "after")))


# -- a family of traces from seeds ------------------------------------------------------------

FAMILY_SHAPES = ("sinusoid", "markov", "on_off", "diurnal_spikes", "ramp", "steps", "silences", "capacity_cut")
FAMILY_COSTS = ("linear", "nlogn", "join", "noisy", "fixed", "cliff")
#: What a static setting may be (FixBI's grid in ``bench.control``): the family's capacity is
#: what the best of them sustains, so "above capacity" means above every static setting.
_CAP_K = 12
_CAP_P = (1, 2, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class Member:
    """One trace of the family: its shape, cost model, workload and the figures it was drawn from."""

    seed: int
    shape: str
    cost: str
    workload: Workload
    trace: Trace
    capacity_rps: float  # the most records/s a static group sustains (noise-free, full capacity)
    load: float  # mean rate / capacity

    @property
    def name(self) -> str:
        return self.trace.name


def capacity_rps(wl: Workload, max_records: float = 400_000, k_max: int = _CAP_K,
                 partitions: tuple[int, ...] = _CAP_P) -> float:
    """The highest sustained records/s of any static group: ``k n / (F + k p(n, P))`` over epoch
    records ``n`` (up to the memory budget), ``k <= k_max`` and the partition grid."""
    n = np.geomspace(10, max_records, 400)
    best = 0.0
    for p in partitions:
        px = wl.epoch_s(n, p)
        for k in (1, 2, 3, 4, 6, 8, k_max):
            best = max(best, float(np.max(k * n / (wl.coordination_s + k * px))))
    return best


def _tabulated(name: str, values: np.ndarray, capacity: Callable[[float], float] = lambda t: 1.0) -> Trace:
    """A trace from one rate per second (``values[i]`` over ``[i, i + 1)``)."""
    v = np.asarray(values, float)

    def rate(t: np.ndarray) -> np.ndarray:
        return v[np.clip(np.asarray(t, float).astype(np.int64), 0, len(v) - 1)]

    return Trace(name, float(len(v)), rate, capacity, segments=((0.0, float(len(v)), "all"),))


def _full_capacity(t: float) -> float:
    return 1.0


def _pareto(rng: np.random.Generator, scale: float, alpha: float, cap: float) -> float:
    """Heavy-tailed duration: Pareto with minimum ``scale``, capped."""
    return float(min(cap, scale * (1 + rng.pareto(alpha))))


def _family_workload(cost: str, rng: np.random.Generator) -> Workload:
    """The cost model ``cost`` with drawn constants; the work of 8,000 records on 2 partitions is
    ``3 s`` times a factor in [0.5, 2] (the named workloads' calibration, scaled)."""
    scale = float(rng.uniform(0.5, 2.0))
    coordination = float(rng.uniform(5.0, 30.0))  # fixed cost per group: a Connect session to a JVM
    kind: Literal["reduce", "join", "nlogn"] = {"linear": "reduce", "nlogn": "nlogn", "join": "join",
                                                "fixed": "reduce", "cliff": "reduce"}.get(
        cost, "join" if rng.random() < 0.5 else "reduce")
    per_record = 3.0 * scale / (float(_work(kind, np.float64(8000))) * _SPREAD_2)
    wl = Workload(cost, kind, per_record=per_record, coordination_s=coordination)
    if cost == "noisy":
        wl = replace(wl, noise=float(rng.uniform(0.25, 0.4)), coordination_noise=float(rng.uniform(0.25, 0.4)))
    if cost == "fixed":  # a large fixed cost per epoch too (commit, planning, a slow metastore)
        wl = replace(wl, per_epoch_s=float(rng.uniform(5.0, 15.0)))
    return wl


def family_member(seed: int, duration_s: float = 4 * 3600) -> Member:
    """Trace ``seed`` of the family: shape and cost model cycle through every pair (48), the rest
    (levels, periods, fixed costs, the load against capacity) is drawn from ``seed``.

    The mean rate is 25-70% of the capacity (the best static setting's sustained rate), and every
    shape but the ramp reaches near or above it at its peaks: sinusoid (period 10-60 min), Markov
    levels (0.3-1.7x the mean, dwell 1-10 min), on/off with heavy-tailed (Pareto) periods at twice
    the mean, a diurnal curve (one "day" per trace) with 90 s spikes at 2-4x, ramps (triangles of
    20-120 min), steps (10-40 min), silences (rate 0 for 5-40 min, files still land empty) and a
    capacity cut to 50-80% (restored or not). The memory cliff sits at 20-80 s of the mean rate's
    records, past it the work costs 4-10x."""
    pairs = [(s, c) for s in FAMILY_SHAPES for c in FAMILY_COSTS]
    shape, cost = pairs[seed % len(pairs)]
    rng = np.random.default_rng([seed, 36])
    wl = _family_workload(cost, rng)
    load = float(rng.uniform(0.25, 0.7))
    if cost == "cliff":
        wl = replace(wl, cliff_records=float(rng.uniform(20, 80)) * load * capacity_rps(wl),
                     cliff_factor=float(rng.uniform(4.0, 10.0)))
    cap = capacity_rps(wl)
    mean = load * cap
    n = int(duration_s)
    t = np.arange(n) + 0.5
    capacity: Callable[[float], float] = _full_capacity
    if shape == "sinusoid":
        amp, period = rng.uniform(0.3, 0.8), rng.uniform(600, 3600)
        v = mean * (1 + amp * np.sin(2 * np.pi * t / period + rng.uniform(0, 2 * np.pi)))
    elif shape == "markov":
        levels = mean * np.linspace(0.3, 1.7, 5)
        dwell = int(rng.uniform(60, 600))
        state, out = 2, []
        for _ in range(math.ceil(n / dwell)):
            out.append(levels[state])
            u = rng.random()
            state = min(4, max(0, state + (1 if u < 0.4 else -1 if u < 0.8 else 0)))
        v = np.repeat(out, dwell)[:n]
    elif shape == "on_off":
        v, i, on = np.zeros(n), 0, True
        while i < n:
            d = int(_pareto(rng, 120.0, 1.5, n / 3))
            if on:
                v[i:i + d] = 2 * mean
            i, on = i + d, not on
    elif shape == "diurnal_spikes":
        amp = rng.uniform(0.4, 0.8)
        v = mean * (1 - amp * np.cos(2 * np.pi * t / n))
        at = 0.0
        while True:
            at += rng.exponential(rng.uniform(600, 1800))
            if at >= n:
                break
            v[int(at):int(at) + 90] *= rng.uniform(2.0, 4.0)
    elif shape == "ramp":
        period = rng.uniform(1200, 7200)
        phase = (t / period + rng.uniform(0, 1)) % 1.0
        v = mean * (0.2 + 1.6 * (1 - np.abs(2 * phase - 1)))
    elif shape == "steps":
        v, i = np.zeros(n), 0
        while i < n:
            d = int(rng.uniform(600, 2400))
            v[i:i + d] = mean * rng.uniform(0.3, 1.7)
            i += d
    elif shape == "silences":
        v, i, on = np.zeros(n), 0, True
        while i < n:
            d = int(rng.uniform(900, 3600) if on else rng.uniform(300, 2400))
            if on:
                v[i:i + d] = mean / 0.7 * (1 + 0.3 * np.sin(2 * np.pi * t[i:i + d] / 1200))
            i, on = i + d, not on
    else:  # capacity cut
        factor = rng.uniform(0.5, 0.8)
        cut_at = rng.uniform(0.2, 0.5) * n
        back_at = rng.uniform(0.6, 0.9) * n if rng.random() < 0.5 else math.inf
        v = np.full(n, mean) * (1 + 0.2 * np.sin(2 * np.pi * t / 1800))

        def capacity(t: float, f: float = factor, a: float = cut_at, b: float = back_at) -> float:
            return f if a <= t < b else 1.0
    name = f"{shape}-{cost}-{seed}"
    return Member(seed, shape, cost, wl, _tabulated(name, v, capacity), cap, load)


@dataclass(frozen=True)
class View:
    """What a method sees when planning (measured rate over the last minute, or over the backlog
    when nothing arrived in that minute; the backlog in files and records; the freshness SLA);
    ``true_*`` are for the oracle only."""

    t: float
    rate_rps: float
    file_rate: float
    backlog_files: int
    true_rate: float
    capacity: float
    backlog_records: float = 0.0
    freshness_sla_s: float = 300.0


#: What a fixed setting is shown (it reads nothing): saves building a view per group in FixBI's search.
_STATIC_VIEW = View(0.0, 0.0, 1.0, 0, 0.0, 1.0)


class Method(Protocol):
    name: str

    def decide(self, view: View) -> Decision: ...

    def record(self, result: GroupResult) -> None: ...


@dataclass
class Run:
    """One simulation: per-group log and record-weighted latency statistics."""

    method: str
    trace: str
    groups: list[dict] = field(default_factory=list)
    mean_latency_s: float = math.inf
    p95_latency_s: float = math.inf
    busy_s: float = math.inf
    records: int = 0
    processed_files: list[tuple[int, int]] = field(default_factory=list)
    aborted: bool = False

    @property
    def max_backlog_files(self) -> int:
        """The largest backlog a group started on (files)."""
        return max((g["backlog_files"] for g in self.groups), default=0)


class Simulator:
    def __init__(self, workload: Workload, trace: Trace, *, file_rate: float = 1.0, seed: int = 0,
                 freshness_sla_s: float = 300.0, rate_window_s: float = 60.0,
                 abort_backlog_files: int | None = None) -> None:
        self.wl, self.trace, self.f = workload, trace, file_rate
        self.seed, self.sla, self.window = seed, freshness_sla_s, rate_window_s
        self.abort = abort_backlog_files
        self.n_files = int(trace.duration_s * file_rate)
        arrival = (np.arange(self.n_files) + 1) / file_rate
        self.arrival = arrival
        self.records = np.maximum(0, np.rint(trace.rate(arrival - 0.5 / file_rate) / file_rate)).astype(np.int64)
        self.R = np.concatenate(([0], np.cumsum(self.records)))
        self.RA = np.concatenate(([0.0], np.cumsum(self.records * arrival)))

    def arrived(self, t: float) -> int:
        """Files landed by time ``t``."""
        return int(min(self.n_files, max(0, math.floor(t * self.f + 1e-9))))

    def measured_rate(self, t: float, next_file: int | None = None) -> float:
        """Records/s that landed over the last ``rate_window_s``; when none did but files wait
        (arrivals stopped, or a silence after a burst), over the backlog since its oldest file:
        a backlog always has a measured rate."""
        lo = max(0.0, t - self.window)
        if t <= lo:
            return 0.0
        rate = float(self.R[self.arrived(t)] - self.R[self.arrived(lo)]) / (t - lo)
        if rate <= 0 and next_file is not None and self.arrived(t) > next_file:
            since = self.arrival[next_file] - 1 / self.f
            rate = float(self.R[self.arrived(t)] - self.R[next_file]) / max(t - since, 1 / self.f)
        return rate

    def view(self, t: float, next_file: int, truth: bool = True) -> View:
        arrived = self.arrived(t)
        backlog = arrived - next_file
        return View(t, self.measured_rate(t, next_file), self.f, backlog,
                    float(self.trace.rate(np.array([t]))[0]) if truth else 0.0, self.trace.capacity(t),
                    float(self.R[arrived] - self.R[next_file]) if backlog > 0 else 0.0, self.sla)

    def file_latencies(self, run: Run) -> np.ndarray:
        """Each processed file's latency: its group's publish time less its landing time."""
        publish = np.repeat([g["publish"] for g in run.groups], [g["end"] - g["start"] for g in run.groups])
        return publish - self.arrival[: len(publish)]

    def mean_latency_since(self, run: Run, since_s: float) -> float:
        """``run``'s record-weighted mean latency over the files that landed at or after
        ``since_s`` (``run.mean_latency_s`` for 0): what a method does once its cold start is
        behind it."""
        lat = self.file_latencies(run)
        after = self.arrival[: len(lat)] >= since_s
        weights = self.records[: len(lat)][after].astype(float)
        if not weights.sum():
            return math.nan
        return float((lat[after] * weights).sum() / weights.sum())

    def fire_time(self, d: Decision, t: float, next_file: int) -> float:
        """When the sensor starts the group ``d`` plans: once the backlog holds it, or when
        waiting longer would break the freshness SLA (never before ``t`` or the first file)."""
        first = self.arrival[next_file]
        t_eff = min((next_file + d.group_files) / self.f, self.n_files / self.f)
        return float(max(t, first, min(t_eff, first + self.sla - d.predicted_wall_s)))

    def run(self, method: Method, abort_latency_s: float | None = None) -> Run:
        """Simulate ``method`` over the trace. ``abort_latency_s``: stop (``aborted``) as soon as
        the latency summed so far exceeds that mean over all records: it only grows, so the run
        cannot end below it (an exact prune for a search of the best static setting)."""
        rng = np.random.default_rng(self.seed)
        wl, f = self.wl, self.f
        out = Run(method.name, self.trace.name)
        t, nxt, gid = 0.0, 0, 0
        lat_sum, busy = 0.0, 0.0
        lat_bound = math.inf if abort_latency_s is None else abort_latency_s * float(self.R[-1])
        truth = getattr(method, "needs_truth", True)
        replan = getattr(method, "replan", True)
        static = not replan and not truth  # a fixed setting: it reads no view and learns nothing
        while nxt < self.n_files:
            view = _STATIC_VIEW if static else self.view(t, nxt, truth)
            d = method.decide(view)
            t_fire = self.fire_time(d, t, nxt)
            # The trigger polls: the plan that starts the group is made when it starts (a plan
            # made in a silence must not size the burst that follows it).
            for _ in range(3 if replan else 0):
                if t_fire <= view.t + 1e-9:
                    break
                view = self.view(t_fire, nxt, truth)
                d = method.decide(view)
                again = self.fire_time(d, t_fire, nxt)
                if again <= t_fire + 1e-9:
                    break
                t_fire = again
            t_eff = min((nxt + d.group_files) / f, self.n_files / f)
            backlog = self.arrived(t_fire) - nxt
            forced = backlog < d.group_files and t_eff > t_fire
            ranges = plan_ranges(nxt, nxt + backlog, d.epoch_size, d.k, first_size=d.first_size or None)
            cap = self.trace.capacity(t_fire)
            n = np.array([self.R[r.end] - self.R[r.start] for r in ranges], float)
            epoch_s = wl.epoch_s(n, d.partitions, cap) * rng.lognormal(0, wl.noise, len(ranges))
            coord = wl.coordination_s * float(rng.lognormal(0, wl.coordination_noise))
            wall = coord + float(epoch_s.sum())
            publish = t_fire + wall
            s, e = ranges[0].start, ranges[-1].end
            recs = float(self.R[e] - self.R[s])
            lat_sum += publish * recs - float(self.RA[e] - self.RA[s])
            busy += wall
            out.groups.append({
                "t_fire": t_fire, "publish": publish, "start": s, "end": e, "epoch_size": d.epoch_size,
                "first_size": d.first_size, "epochs": [(r.start, r.end) for r in ranges],
                "k": len(ranges), "partitions": d.partitions, "wall": wall, "coordination": coord,
                "backlog_files": backlog, "reason": "freshness" if forced else d.reason,
                "mean_latency": (publish * recs - float(self.RA[e] - self.RA[s])) / recs if recs else 0.0,
            })
            out.processed_files.append((s, e))
            if not static:
                method.record(GroupResult(gid, tuple(r.size for r in ranges), tuple(float(x) for x in epoch_s),
                                          coord, d.partitions, view.rate_rps, f, "freshness" if forced else d.reason,
                                          epoch_records=tuple(int(x) for x in n),
                                          predicted_wall_s=d.predicted_wall_s))
            gid += 1
            nxt, t = e, publish
            if (self.abort is not None and self.arrived(t) - nxt > self.abort) or lat_sum > lat_bound:
                out.aborted = True
                return out
        total = float(self.R[-1])
        out.records = int(total)
        out.mean_latency_s = lat_sum / total
        out.busy_s = busy
        lat = self.file_latencies(out)
        order = np.argsort(lat)
        cw = np.cumsum(self.records[order])
        out.p95_latency_s = float(lat[order][np.searchsorted(cw, 0.95 * cw[-1])])
        return out


# -- methods ----------------------------------------------------------------------------------

class Sluice:
    """DyBBS epoch sizing + AIMD group size through ``sluice.control.plan_next``; the state goes
    through ``to_dict``/``from_dict`` every ``persist_every`` groups, as the epoch store would."""

    name = "sluice"
    needs_truth = False

    def __init__(self, epoch: EpochSizeConfig | None = None, group: GroupSizeConfig | None = None,
                 persist_every: int = 0, backlog_records: bool = True) -> None:
        self.state = ControlState.new(epoch, group)
        self.last: GroupResult | None = None
        self.persist_every = persist_every
        # whether the controllers see the backlog's records, as every source tells them
        # (sluice.adaptive.backlog_records: Kafka's lag, files' bytes); False for an A/B
        self.backlog_records = backlog_records
        self.notes: list[str] = []

    def decide(self, view: View) -> Decision:
        d = _plan_next(self.state, Observation(view.rate_rps, view.file_rate, view.backlog_files, self.last,
                                               freshness_sla_s=view.freshness_sla_s,
                                               backlog_records=view.backlog_records if self.backlog_records else None))
        if self.last is not None and len(self.notes) <= self.last.group_id:
            self.notes.append(self.state.last_note)
            if self.persist_every and self.last.group_id % self.persist_every == 0:
                import json

                self.state = ControlState.from_dict(json.loads(json.dumps(self.state.to_dict())))
        return d

    def record(self, result: GroupResult) -> None:
        self.last = result


class FPI:
    """Fixed-point iteration of Das et al. (SoCC'14) as DyBBS §III-A describes it: only the last
    two batches, convergence relaxed by a ratio, ``processing = rho * interval``.

    It sizes epochs only (DyBBS's headline baseline is FPI with a fixed block): k and partitions
    stay at the spec defaults (3 epochs, 2 partitions = cores). A batch's processing time is the
    epoch's share of its group, ``wall / epochs``, and its interval ``x / file_rate``. Type I:
    ``x_{n+1} = omega(x_n) / rho``; Type II (both of the last two unstable and omega(x)/x rising with
    x, i.e. superlinear): ``x_{n+1} = (1 - r) * min(x_1, x_2)``. Epochs over the memory budget are
    split (k grows) so the group's span stays what FPI asked for.
    """

    name = "fpi"
    needs_truth = False

    def __init__(self, rho: float = 0.7, r: float = 0.25, k: int = 3, partitions: int = 2, initial_files: int = 4,
                 max_epoch_records: int = 400_000) -> None:
        self.rho, self.r, self.k, self.partitions = rho, r, k, partitions
        self.span_files = float(initial_files * k)
        self.max_records = max_epoch_records
        self.history: list[tuple[float, float]] = []  # (interval s, processing s) of the last two batches

    def decide(self, view: View) -> Decision:
        x = max(1, round(self.span_files / self.k))
        per_file = max(view.rate_rps / view.file_rate, 1e-9)
        cap = max(1, int(self.max_records // per_file))
        k = self.k
        if x > cap:
            k = math.ceil(x * self.k / cap)
            x = cap
        wall = self.history[-1][1] * k if self.history else 0.0
        return Decision(x, k, self.partitions, "fpi", wall)

    def record(self, result: GroupResult) -> None:
        epochs = len(result.epoch_files)
        interval = sum(result.epoch_files) / epochs / result.file_rate
        omega = result.wall_s / epochs
        self.history = [*self.history, (interval, omega)][-2:]
        nxt = omega / self.rho
        if len(self.history) == 2:
            (x1, w1), (x2, w2) = sorted(self.history)
            if x1 < x2 and w1 / x1 < w2 / x2 and w1 > self.rho * x1 and w2 > self.rho * x2:
                nxt = (1 - self.r) * min(x1, x2)
        self.span_files = max(float(self.k), nxt * result.file_rate * self.k)


class Fixed:
    """A static configuration (FixBI's candidates)."""

    needs_truth = False
    replan = False

    def __init__(self, epoch_size: int, k: int, partitions: int, name: str = "fixbi") -> None:
        self.d = Decision(epoch_size, k, partitions, "fixed", 0.0)
        self.name = name

    def decide(self, view: View) -> Decision:
        return self.d

    def record(self, result: GroupResult) -> None:
        pass


class Oracle:
    """Knows the true current rate, capacity and noise-free model: plans the stable group with the
    smallest span (margin ``c`` against noise) over all (x, k, partitions), or the
    highest-throughput group under backlog; the same memory budget as the others."""

    name = "oracle"

    def __init__(self, workload: Workload, margin_s: float = 2.0,
                 partitions: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16), k_max: int = 64,
                 max_epoch_records: int = 400_000, catchup_factor: float = 2.0) -> None:
        self.wl, self.c, self.parts, self.k_max = workload, margin_s, partitions, k_max
        self.max_records, self.catchup = max_epoch_records, catchup_factor
        self.cache: dict[tuple[float, float], tuple[Decision, np.ndarray, np.ndarray]] = {}

    def _table(self, rate: float, cap_factor: float, file_rate: float) -> tuple[Decision, np.ndarray, np.ndarray]:
        key = (round(rate, -1), cap_factor)
        if key not in self.cache:
            per_file = max(rate / file_rate, 1e-9)
            cap = max(1, min(2000, int(self.max_records // per_file)))
            xs = np.arange(1, cap + 1)
            ks = np.arange(1, self.k_max + 1)[:, None]
            best, best_span = None, math.inf
            thr = np.zeros((len(self.parts), cap))
            for i, p in enumerate(self.parts):
                px = self.wl.epoch_s(xs * per_file, p, cap_factor)
                ok = ks * xs / file_rate >= self.wl.coordination_s + ks * px + self.c
                span = np.where(ok, ks * xs, np.inf)
                j = np.unravel_index(np.argmin(span), span.shape)
                if span[j] < best_span:
                    best_span = span[j]
                    best = Decision(int(xs[j[1]]), int(ks[j[0], 0]), p, "oracle",
                                    float(self.wl.coordination_s + ks[j[0], 0] * px[j[1]]))
                thr[i] = px
            if best is None:
                best = Decision(cap, self.k_max, self.parts[-1], "oracle: overload", 0.0)
            self.cache[key] = (best, xs, thr)
        return self.cache[key]

    def decide(self, view: View) -> Decision:
        best, xs, px = self._table(view.true_rate, view.capacity, view.file_rate)
        if view.backlog_files <= self.catchup * best.group_files and not best.reason.endswith("overload"):
            return best
        if view.backlog_records > view.true_rate / view.file_rate * view.backlog_files:
            # the backlog holds more per file than the current rate (after a burst): size its
            # epochs by what it holds, as an oracle knows
            _, xs, px = self._table(view.backlog_records / view.backlog_files * view.file_rate, view.capacity,
                                    view.file_rate)
        ks = np.clip(max(view.backlog_files, 1) // xs, 1, self.k_max)
        thr = ks * xs / (self.wl.coordination_s + ks * px)
        i, j = np.unravel_index(np.argmax(thr), thr.shape)
        return Decision(int(xs[j]), int(ks[j]), self.parts[i], "catch-up",
                        float(self.wl.coordination_s + ks[j] * px[i, j]))

    def record(self, result: GroupResult) -> None:
        pass
