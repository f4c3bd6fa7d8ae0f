"""Epoch size and partition count by DyBBS (Zhang et al., ICAC 2016, Alg. 1), for run-once groups.

Unit: an epoch size ``x`` is a number of source *files* (``control.epoch_files``), the data rate
is in records/s and the file rate in files/s, so ``x`` files span ``x / file_rate`` seconds of
arrivals: with time-sliced files this is DyBBS's batch interval, and the rate bins play the role
of its discretised data rate (records per file grow with the rate).

What is kept from the paper:

* statistics per (rate bin, partition count): a sliding (EWMA, alpha 0.3) processing time per
  epoch size, fitted by isotonic regression (``scipy.optimize.isotonic_regression``), which
  assumes no functional form, so one model covers Reduce-like and Join-like work;
* the decision is the smallest *stable* size with a constant margin ``c`` (not a ratio, so no
  over-estimation at large sizes);
* slow start while fewer than 5 distinct sizes are known for the (bin, partitions) pair;
* a hill climb on the partition count (DyBBS's block interval) per rate bin, which records every
  local optimum and, when conditions change, restarts from the best one recorded.

What run-once groups add: a group of ``k`` epochs pays the coordination cost ``F`` once, so the
stability test is on the group, ``k * x / file_rate >= F + k * IsoR(x) + c``; among ``k <= k_cap``
(the AIMD cap, see ``group_size``) the plan is the stable group with the smallest data span, which
is the one with the lowest freshness (mean latency is about 1.5 spans at the stable point). With
``k = 1`` this is exactly DyBBS's rule. Under backlog the plan switches to catch-up: the epoch
size with the highest modelled throughput under the memory budget (for Reduce-like work the
largest), then back to the stable size once the backlog is gone.

Where slow start begins: not at an arbitrary small size. A group pays a fixed cost ``F``
(Spark start or Connect session, warm-up, commit: tens of seconds for a JVM per group) that
DyBBS's one-second batches never had, so a first group of a few files is unstable, the backlog
grows while slow start doubles its way up, and every group of that climb misses the SLA. A new
(rate bin, partitions) cell therefore starts at the smallest size the linear cost model calls
stable, ``x/f >= F + c + a + x * b_f``: ``F`` the measured coordination (a prior before the
first group), ``a + b * records`` an epoch's time fitted by least squares to the last epochs of
every cell (``b`` alone, through the origin, while they all had one size), ``b_f = b`` times the
records per file at this rate. Its prediction is also the planned wall time until the cell has
samples of its own, so a freshness-forced start comes in time; and when a slow-start group turns
out unstable, the next one goes to the size the costs it just measured call stable rather than
only doubling.

Gaps the paper leaves open and how they are filled (see notes §1.6): slow start doubles the
group while unstable (the epoch size, or k when the per-file cost grows with size, a sign of
superlinear work), then probes around the smallest stable size (bisecting towards the largest
unstable one, else stepping additively); the search never goes beyond twice the largest size
observed, above which the fit is extrapolated proportionally; the partition grid doubles
(1, 2, 4, 8, 16) so the climb costs few slow starts; a new rate bin starts at the best partition
count of the nearest learned bin, a new cell at the size last run in its bin (another partition
count at the same rate) or else at the modelled stable size above; after 3
consecutive groups over the margin at a learned point, the bin is relearned (conditions changed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import isotonic_regression

#: Epochs the linear cost model is fitted to: a few groups' worth, so it follows changed conditions.
COST_SAMPLES = 32


@dataclass(frozen=True)
class EpochSizeConfig:
    """DyBBS used c = 50 ms on ~1 s batches; sluice groups last tens of seconds, hence c = 2 s.
    ``initial_files`` is a floor for the first size of a cell; ``initial_coordination_s`` the
    fixed cost assumed until a group has measured one (a JVM per group: 20-25 s measured in
    ``bench/results/cost.json``). ``max_epoch_records`` is the ceiling before memory is measured;
    then what a read may hold is ``memory_fraction`` of Spark's unified memory (see
    ``memory_limit_records``)."""

    margin_s: float = 2.0
    min_points: int = 5
    alpha: float = 0.3
    rate_bin_ratio: float = 0.15
    initial_files: int = 4
    initial_coordination_s: float = 20.0
    max_epoch_records: int = 400_000
    memory_fraction: float = 0.5
    partitions: tuple[int, ...] = (1, 2, 4, 8, 16)
    initial_partitions: int = 2
    catchup_factor: float = 2.0
    explore_factor: float = 2.0
    unstable_limit: int = 3
    slow_step_ratio: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_partitions not in self.partitions:
            raise ValueError(f"initial_partitions {self.initial_partitions} is not in {self.partitions}")
        if list(self.partitions) != sorted(set(self.partitions)) or self.partitions[0] < 1:
            raise ValueError(f"partitions must be increasing and >= 1 (got {self.partitions})")
        if (self.margin_s < 0 or self.min_points < 2 or not 0 < self.alpha <= 1 or self.rate_bin_ratio <= 0
                or self.initial_coordination_s < 0):
            raise ValueError("bad epoch-size configuration")


@dataclass(frozen=True)
class EpochPlan:
    epoch_size: int
    k: int
    partitions: int
    reason: str
    predicted_wall_s: float


@dataclass
class _Cell:
    """Statistics and slow-start state of one (rate bin, partition count)."""

    points: dict[int, list[float]] = field(default_factory=dict)  # x -> [EWMA seconds, samples]
    slow_x: int = 0
    slow_k: int = 1
    slow_step: int = 0
    stable_min: int = 0  # smallest size seen stable during slow start (0: none yet)
    unstable_max: int = 0  # largest size seen unstable during slow start
    version: int = 0

    def add(self, x: int, seconds: float, alpha: float) -> None:
        old = self.points.get(x)
        self.points[x] = [seconds, 1] if old is None else [alpha * seconds + (1 - alpha) * old[0], old[1] + 1]
        self.version += 1


@dataclass
class _Bin:
    """Hill-climb state of one rate bin: current partitions, local optima, settled flag."""

    partitions: int
    last_x: int = 0  # size of the last group run at this rate
    local_opt: dict[int, float] = field(default_factory=dict)  # partitions -> predicted latency (s)
    settled: bool = False
    unstable: int = 0
    cells: dict[int, _Cell] = field(default_factory=dict)


def isotonic_fit(xs: np.ndarray, ys: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Non-decreasing least-squares fit of ``ys`` on ``xs``; returns sorted unique xs and fitted ys."""
    order = np.argsort(xs, kind="stable")
    xs, ys = np.asarray(xs, float)[order], np.asarray(ys, float)[order]
    w = np.ones_like(ys) if weights is None else np.asarray(weights, float)[order]
    fitted = isotonic_regression(ys, weights=w, increasing=True).x
    return xs, fitted


def predict(fit: tuple[np.ndarray, np.ndarray], x: np.ndarray | float) -> np.ndarray:
    """Monotone interpolation of the fit; below the data clip, above it scale proportionally."""
    xs, ys = fit
    x = np.asarray(x, float)
    inside = np.interp(x, xs, ys)
    return np.where(x > xs[-1], ys[-1] * x / xs[-1], inside)


def smallest_stable_group(fit: tuple[np.ndarray, np.ndarray], coordination_s: float, file_rate: float,
                          margin_s: float, k_cap: int, max_files: int) -> tuple[int, int] | None:
    """The stable (x, k) with the smallest data span ``k * x``: ``k*x/f >= F + k*IsoR(x) + c``.

    Ties go to the smaller k (fewer epochs, less per-epoch overhead); ``None`` if nothing with
    ``x <= max_files`` and ``k <= k_cap`` is stable.
    """
    xs = np.arange(1, max_files + 1)
    p = predict(fit, xs)
    best: tuple[int, int] | None = None
    for k in range(1, k_cap + 1):
        ok = np.nonzero(k * xs / file_rate >= coordination_s + k * p + margin_s)[0]
        if ok.size and (best is None or k * int(xs[ok[0]]) < best[0] * best[1]):
            best = (int(xs[ok[0]]), k)
    return best


def rate_bin(rate_rps: float, ratio: float) -> int:
    """Geometric rate bins ``ratio`` wide, so the discretisation needs no per-cluster retuning."""
    return math.floor(math.log(max(rate_rps, 1e-9)) / math.log1p(ratio))


class EpochSizeController:
    """DyBBS state for one pipeline; ``propose`` is pure, ``record`` folds in a finished group."""

    def __init__(self, config: EpochSizeConfig | None = None) -> None:
        self.config = config or EpochSizeConfig()
        self.bins: dict[int, _Bin] = {}
        self.last_x = self.config.initial_files
        self.cost_samples: list[tuple[float, float]] = []  # (records, seconds) of the last epochs, all cells
        self.memory_samples: list[tuple[float, float]] = []  # (records read together, peak MB held)
        self.memory_budget_mb: float | None = None  # Spark's unified memory, as last measured
        self.memory_unit = "epoch"  # what one read holds: an "epoch", or a "group" (one commit per group)
        self._fits: dict[tuple[int, int], tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]]] = {}

    # -- helpers -----------------------------------------------------------------------------
    def max_records(self) -> int:
        """The most records one read may hold: ``max_epoch_records``, or less where measured memory says so."""
        limit = self.memory_limit_records()
        return self.config.max_epoch_records if limit is None else min(self.config.max_epoch_records, limit)

    def max_files(self, rate_rps: float, file_rate: float) -> int:
        """The memory budget per epoch, in files at the current records per file."""
        per_file = max(rate_rps / file_rate, 1e-9)
        return max(1, min(100_000, int(self.max_records() // per_file)))

    def epochs_in_memory(self, epoch_size: int, max_files: int) -> int:
        """How many epochs of ``epoch_size`` files one group may hold: unbounded, unless the
        group's epochs are read together (one commit per group) and measured memory, not the
        constant ceiling, bounds a read; then the group shares that bound (``max_files``)."""
        limit = self.memory_limit_records()
        if self.memory_unit != "group" or limit is None or limit >= self.config.max_epoch_records:
            return 1 << 30
        return max(1, max_files // max(1, epoch_size))

    def record_memory(self, records: float, peak_mb: float, spilled_mb: float, budget_mb: float, unit: str) -> None:
        """Fold in what one read (an epoch, or a group under one commit per group) held at its peak
        in Spark's memory. A read that spilled needed more than it got: it counts as the budget."""
        if records <= 0 or budget_mb <= 0:
            return
        self.memory_samples.append((float(records), max(peak_mb, budget_mb if spilled_mb > 0 else 0.0)))
        del self.memory_samples[:-COST_SAMPLES]
        self.memory_budget_mb, self.memory_unit = float(budget_mb), unit

    def memory_limit_records(self) -> int | None:
        """The records one read may hold within ``memory_fraction`` of the measured unified memory:
        ``peak = m0 + m1 * records`` fitted to the recent reads (least squares), solved for the
        allowed peak; ``None`` while the fit cannot say (fewer than 3 reads, one size only, or
        memory that does not grow with records). Never below the largest read that stayed within
        the allowance: a noisy fit cannot shrink epochs below a size that measured fine."""
        if len(self.memory_samples) < 3 or not self.memory_budget_mb:
            return None
        records, peaks = np.array(self.memory_samples, float).T
        allowed = self.config.memory_fraction * self.memory_budget_mb
        if np.ptp(records) <= 0:
            return None
        m1, m0 = np.polyfit(records, peaks, 1)
        if m1 <= 0:
            return None
        fine = records[peaks <= allowed]
        floor = int(fine.max()) if fine.size else 1
        return max(floor, int((allowed - max(m0, 0.0)) / m1))

    def _new_bin(self, b: int) -> _Bin:
        near = sorted((abs(o - b), o) for o, s in self.bins.items() if s.local_opt)
        start = self.config.initial_partitions
        if near:  # start where the nearest learned bin ended up (its best point)
            nb = self.bins[near[0][1]]
            start = min(nb.local_opt, key=nb.local_opt.__getitem__)
        return _Bin(partitions=start)

    def epoch_cost(self) -> tuple[float, float]:
        """``(a, b)``: an epoch takes ``a + b * records`` seconds, fitted to the recent epochs of
        every cell, both >= 0; ``(0, 0)`` before any ran."""
        if not self.cost_samples:
            return 0.0, 0.0
        records, seconds = np.array(self.cost_samples, float).T
        if np.ptp(records) > 0:
            b, a = np.polyfit(records, seconds, 1)
            if a >= 0 and b > 0:
                return float(a), float(b)
        return 0.0, float(seconds.sum() / max(records.sum(), 1.0))  # one size seen: through the origin

    def epoch_seconds(self, x: int, rate_rps: float, file_rate: float) -> float:
        """The linear model's time for an epoch of ``x`` files at this rate."""
        a, b = self.epoch_cost()
        return a + b * x * rate_rps / file_rate

    def fixed_cost(self, coordination_s: float | None) -> float:
        """A group's fixed cost: the measured coordination, or the prior before any group."""
        return self.config.initial_coordination_s if coordination_s is None else coordination_s

    def start_size(self, rate_rps: float, file_rate: float, coordination_s: float | None, cap: int) -> int:
        """The smallest size the linear model calls stable, ``x/f >= F + c + a + x * b_f`` (k = 1),
        at least ``initial_files``; the memory budget when per-record work alone outruns arrivals."""
        fixed = self.fixed_cost(coordination_s)
        a, b = self.epoch_cost()
        spare = 1.0 / file_rate - b * rate_rps / file_rate  # seconds of each file's span left over
        if spare <= 0:
            return cap
        need = (fixed + self.config.margin_s + a) / spare
        return max(1, min(cap, max(self.config.initial_files, math.ceil(need))))

    def _new_cell(self, bs: _Bin, start_x: int) -> _Cell:
        """Slow start begins at the size last run in this bin (at other partitions), else at ``start_x``."""
        return _Cell(slow_x=max(1, bs.last_x or start_x), slow_k=1)

    def _bin(self, b: int) -> _Bin:
        return self.bins.setdefault(b, self._new_bin(b))

    def _cell(self, bs: _Bin, partitions: int, start_x: int) -> _Cell:
        if partitions not in bs.cells:
            bs.cells[partitions] = self._new_cell(bs, start_x)
        return bs.cells[partitions]

    def _fit(self, b: int, partitions: int, cell: _Cell) -> tuple[np.ndarray, np.ndarray]:
        cached = self._fits.get((b, partitions))
        if cached and cached[0] == (id(cell), cell.version):
            return cached[1]
        xs = np.array(sorted(cell.points), float)
        ys = np.array([cell.points[int(x)][0] for x in xs])
        fit = isotonic_fit(xs, ys)
        self._fits[(b, partitions)] = ((id(cell), cell.version), fit)
        return fit

    def _learning(self, cell: _Cell) -> bool:
        return len(cell.points) < self.config.min_points

    def _model_plan(self, b: int, bs: _Bin, cell: _Cell, file_rate: float, coord: float, k_cap: int,
                    cap: int, backlog_files: int) -> EpochPlan:
        cfg, P = self.config, bs.partitions
        fit = self._fit(b, P, cell)
        limit = max(1, min(cap, int(self.config.explore_factor * fit[0][-1])))
        stable = smallest_stable_group(fit, coord, file_rate, cfg.margin_s, k_cap, limit)
        if stable is not None and backlog_files <= cfg.catchup_factor * stable[0] * stable[1]:
            x, k = stable
            return EpochPlan(x, k, P, "stable" if bs.settled else "stable, exploring partitions",
                             float(coord + k * predict(fit, x)))
        # catch-up (or overload): the epoch size with the best modelled throughput
        xs = np.arange(1, limit + 1)
        ks = np.clip(np.maximum(backlog_files, 1) // xs, 1, k_cap)
        throughput = ks * xs / (coord + ks * predict(fit, xs))
        i = int(np.argmax(throughput))
        reason = "catch-up" if stable is not None else "overload: no stable size under the memory budget"
        return EpochPlan(int(xs[i]), int(ks[i]), P, reason, float(coord + ks[i] * predict(fit, xs[i])))

    # -- API ---------------------------------------------------------------------------------
    def propose(self, rate_rps: float, file_rate: float, coordination_s: float | None, k_cap: int,
                backlog_files: int) -> EpochPlan:
        """The next group's epoch size, k (<= k_cap) and partitions; does not change state.
        ``coordination_s``: the measured fixed cost per group, ``None`` before the first group."""
        plan = self._propose(rate_rps, file_rate, coordination_s, k_cap, backlog_files)
        if rate_rps <= 0 or file_rate <= 0:  # the idle plan; max_files needs both rates
            return plan
        fit = self.epochs_in_memory(plan.epoch_size, self.max_files(rate_rps, file_rate))
        if plan.k <= fit:
            return plan
        per_epoch = (plan.predicted_wall_s - self.fixed_cost(coordination_s)) / plan.k
        return EpochPlan(plan.epoch_size, fit, plan.partitions,
                         f"{plan.reason}; k {plan.k} -> {fit}: the group's reads fit the measured memory",
                         self.fixed_cost(coordination_s) + fit * per_epoch)

    def _propose(self, rate_rps: float, file_rate: float, coordination_s: float | None, k_cap: int,
                 backlog_files: int) -> EpochPlan:
        if rate_rps <= 0 or file_rate <= 0:
            return EpochPlan(self.last_x, 1, self.config.initial_partitions, "idle: no arrivals measured", 0.0)
        b = rate_bin(rate_rps, self.config.rate_bin_ratio)
        bs = self.bins.get(b) or self._new_bin(b)
        cap = self.max_files(rate_rps, file_rate)
        cell = bs.cells.get(bs.partitions) or self._new_cell(bs, self.start_size(rate_rps, file_rate,
                                                                                 coordination_s, cap))
        fixed = self.fixed_cost(coordination_s)
        if self._learning(cell):
            # the probe is the epoch size; a backlog beyond one group is drained with more epochs
            # of it under the same fixed cost, rather than left to age behind a group of one
            x = min(cell.slow_x, cap)
            k = min(max(cell.slow_k, backlog_files // x), max(k_cap, cell.slow_k))
            seen = cell.points.get(x)
            per_epoch = seen[0] if seen else self.epoch_seconds(x, rate_rps, file_rate)
            start = "" if cell.points else f", from the fixed cost {fixed:.1f} s"
            return EpochPlan(x, k, bs.partitions,
                             f"slow start ({len(cell.points)}/{self.config.min_points} sizes{start})",
                             fixed + k * per_epoch)
        return self._model_plan(b, bs, cell, file_rate, fixed, k_cap, cap, backlog_files)

    def record(self, *, rate_rps: float, file_rate: float, partitions: int, epoch_files: list[int],
               epoch_s: list[float], coordination_s: float, coordination_ewma_s: float, k_cap: int,
               adaptive: bool = True, epoch_records: list[int] | None = None) -> str:
        """Fold in a finished group; ``adaptive=False`` (catch-up or freshness-forced groups) only
        adds samples. ``epoch_records``: the records each epoch read (else estimated from the
        rate, which before the first group is a guess). Returns what the controller did, for the log."""
        cfg = self.config
        if rate_rps <= 0 or not epoch_files:
            return "ignored: no rate"
        b = rate_bin(rate_rps, cfg.rate_bin_ratio)
        bs = self._bin(b)
        cap = self.max_files(rate_rps, file_rate)
        cell = self._cell(bs, partitions, self.start_size(rate_rps, file_rate, coordination_ewma_s, cap))
        learning_before = self._learning(cell)
        records = epoch_records or [x * rate_rps / file_rate for x in epoch_files]
        for x, s, n in zip(epoch_files, epoch_s, records, strict=True):
            cell.add(int(x), float(s), cfg.alpha)
            self.cost_samples.append((float(n), float(s)))
        del self.cost_samples[:-COST_SAMPLES]
        full = [x for x in epoch_files if x == epoch_files[0]]
        x, k = int(epoch_files[0]), len(full)
        self.last_x = bs.last_x = x
        if not adaptive or partitions != bs.partitions:
            return "samples only"
        span = sum(epoch_files) / file_rate
        wall = coordination_s + sum(epoch_s)
        stable = wall <= span  # for slow start; a learned point is only "unstable" beyond the margin
        if learning_before:
            model_x = self.start_size(rate_rps, file_rate, coordination_ewma_s, cap)  # with this group's costs
            # k beyond the probe's own was drained backlog, not a probe of k
            return self._slow_start_step(cell, x, min(k, max(cell.slow_k, 1)), stable, cap, k_cap, model_x)
        bs.unstable = 0 if wall <= span + cfg.margin_s else bs.unstable + 1
        if bs.unstable >= cfg.unstable_limit:  # operating conditions changed: relearn this bin
            bs.unstable, bs.settled = 0, False
            bs.local_opt.clear()
            bs.cells = {partitions: _Cell(slow_x=min(cap, 2 * x), slow_k=k)}
            return "conditions changed: relearning from a larger size"
        if bs.settled or self._learning(cell):
            return "settled" if bs.settled else "learning"
        # Alg. 1 lines 4-8: is the measured time at the model's new size stable with margin?
        fit = self._fit(b, partitions, cell)
        limit = max(1, min(cap, int(cfg.explore_factor * fit[0][-1])))
        best = smallest_stable_group(fit, coordination_ewma_s, file_rate, cfg.margin_s, k_cap, limit)
        if best is None or best[0] not in cell.points:
            return "converging"
        bx, bk = best
        measured = coordination_ewma_s + bk * cell.points[bx][0]
        if measured + cfg.margin_s > bk * bx / file_rate:
            return "converging"
        bs.local_opt[partitions] = bk * bx / file_rate / 2 + measured  # mean latency at this local optimum
        best_p = min(bs.local_opt, key=bs.local_opt.__getitem__)
        if best_p == partitions:
            i = cfg.partitions.index(partitions)
            if i + 1 < len(cfg.partitions) and cfg.partitions[i + 1] not in bs.local_opt:
                bs.partitions = cfg.partitions[i + 1]
                return f"local optimum at {partitions} partitions; trying {bs.partitions}"
        bs.partitions, bs.settled = best_p, True
        return f"settled at {best_p} partitions"

    def _slow_start_step(self, cell: _Cell, x: int, k: int, stable: bool, cap: int, k_cap: int,
                         model_x: int) -> str:
        """TCP-like: grow the group until it is stable (to ``model_x``, the size the costs just
        measured call stable, when that is larger; else double), then probe sizes around the
        smallest stable one (bisecting towards the largest unstable one, else stepping additively)."""
        if stable:
            cell.stable_min = x if not cell.stable_min else min(cell.stable_min, x)
        else:
            cell.unstable_max = max(cell.unstable_max, x)
        if not cell.stable_min:
            sizes = sorted(cell.points)
            superlinear = False
            if len(sizes) >= 2:
                lo, hi = sizes[-2], sizes[-1]
                superlinear = cell.points[hi][0] / hi > 1.05 * cell.points[lo][0] / lo
            if (superlinear or x >= cap) and k < k_cap:
                cell.slow_x, cell.slow_k = x, min(k_cap, 2 * k)
                return "slow start: unstable, doubling k"
            if model_x > x and not superlinear:
                cell.slow_x, cell.slow_k = model_x, k
                return "slow start: unstable, to the size the measured costs call stable"
            cell.slow_x, cell.slow_k = min(cap, 2 * x), k
            return "slow start: unstable, doubling the epoch size"
        if not cell.slow_step:
            cell.slow_step = max(1, round(self.config.slow_step_ratio * cell.stable_min))
        lo = cell.unstable_max if cell.unstable_max < cell.stable_min else 0
        if lo:
            mid = (lo + cell.stable_min) // 2
            if mid not in cell.points and lo < mid < cell.stable_min:
                cell.slow_x, cell.slow_k = mid, k
                return "slow start: bisecting towards the stability limit"
        else:
            nxt = cell.stable_min - cell.slow_step
            if nxt >= 1 and nxt not in cell.points:
                cell.slow_x, cell.slow_k = nxt, k
                return "slow start: stable, probing a smaller size"
        nxt = cell.stable_min + cell.slow_step
        while nxt in cell.points:
            nxt += cell.slow_step
        cell.slow_x, cell.slow_k = min(cap, nxt), k
        return "slow start: probing a larger size"

    # -- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg["partitions"] = list(cfg["partitions"])
        return {
            "config": cfg,
            "last_x": self.last_x,
            "cost_samples": [list(sample) for sample in self.cost_samples],
            "memory": {"samples": [list(sample) for sample in self.memory_samples],
                       "budget_mb": self.memory_budget_mb, "unit": self.memory_unit},
            "bins": {
                str(b): {
                    "partitions": s.partitions, "settled": s.settled, "unstable": s.unstable, "last_x": s.last_x,
                    "local_opt": {str(p): v for p, v in s.local_opt.items()},
                    "cells": {str(p): {"points": {str(x): v for x, v in c.points.items()},
                                       "slow_x": c.slow_x, "slow_k": c.slow_k, "slow_step": c.slow_step,
                                       "stable_min": c.stable_min, "unstable_max": c.unstable_max}
                              for p, c in s.cells.items()},
                }
                for b, s in self.bins.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochSizeController:
        cfg = dict(data["config"])
        cfg["partitions"] = tuple(cfg["partitions"])
        ctl = cls(EpochSizeConfig(**cfg))
        ctl.last_x = int(data["last_x"])
        # absent in state saved by older versions: the cost model starts empty, as for a new pipeline
        ctl.cost_samples = [(float(r), float(t)) for r, t in data.get("cost_samples", [])]
        memory = data.get("memory", {})  # absent before memory was measured: the constant ceiling only
        ctl.memory_samples = [(float(r), float(m)) for r, m in memory.get("samples", [])]
        ctl.memory_budget_mb, ctl.memory_unit = memory.get("budget_mb"), memory.get("unit", "epoch")
        for b, s in data["bins"].items():
            bs = _Bin(partitions=int(s["partitions"]), settled=bool(s["settled"]), unstable=int(s["unstable"]),
                      last_x=int(s["last_x"]),
                      local_opt={int(p): float(v) for p, v in s["local_opt"].items()})
            for p, c in s["cells"].items():
                bs.cells[int(p)] = _Cell(points={int(x): [float(v[0]), int(v[1])] for x, v in c["points"].items()},
                                         slow_x=int(c["slow_x"]), slow_k=int(c["slow_k"]),
                                         slow_step=int(c["slow_step"]), stable_min=int(c["stable_min"]),
                                         unstable_max=int(c["unstable_max"]))
            ctl.bins[int(b)] = bs
        return ctl
