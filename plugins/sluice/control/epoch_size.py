"""Epoch size and partition count: DyBBS (Zhang et al., ICAC 2016, Alg. 1) for run-once groups,
on a cost curve learned from every epoch, under safety bounds that hold on any input.

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
* slow start while a cell has fewer than 5 distinct sizes and nothing else can stand in;
* a hill climb on the partition count (DyBBS's block interval): each neighbour of the best count
  is tried, and the best is kept; never below the configured count (the cores), where cores sit
  idle and a probe costs several times its plan.

What run-once groups add: a group of ``k`` epochs pays the coordination cost ``F`` once, so the
stability test is on the group, ``k * x / file_rate >= F + k * IsoR(x) + c``; among ``k <= k_cap``
(the AIMD cap, see ``group_size``) the plan is the stable group with the smallest data span, which
is the one with the lowest freshness. With ``k = 1`` this is exactly DyBBS's rule. A stable group
waits for its files; when fewer wait than it spans and the rest would leave the engine idle longer
than the fixed cost ``F``, the group takes what waits instead: a group more costs ``F``, less than
the wait it saves each waiting file (unless the group's epochs are larger than any measured: it
is then also the probe that widens the cost curve).
In a steady state the wait is about ``c`` and nothing changes; when the rate rises, the smallest
stable span jumps (near capacity it grows as ``F / (1 - utilisation)``), and waiting idle for it
would put the whole jump on top of a backlog that grows while the rate is high (issue 36).

The cost curve (``cost_curve.CostCurve``): seconds against an epoch's *records*, per partition
count, pooled over every rate bin. A cell's fit takes the curve's sizes (converted to files at
today's records per file) where it has none of its own, so a new rate is planned from what
other rates measured instead of a slow start; the partition counts are compared on it; and it
gives the shape the safety bounds need.

Safety before optimality (each holds whatever the trace; ``tests/unit/test_control_bounds.py``):

* never into the steep part of the cost curve: an epoch's records stay below where the predicted
  cost per record exceeds ``steep_ratio`` times the best measured one, and below
  ``probe_growth`` times the largest epoch measured (twice that for work the curve shows to be
  linear), so a superlinear workload or a memory cliff is met one bounded step at a time; where
  the bins show a steep part, the limit holds for the densest files of the last epochs (a
  backlog that holds a burst's files would otherwise carry its epochs into it), and the steep
  test allows for the noise measured (``CostCurve.tolerance``: noise alone is no steep part);
* catch-up with more epochs, not a bigger one: a backlog (catch-up, a freshness-forced group, a
  drain) is taken in epochs of a measured, efficient size, ``k`` up to ``k_max`` (Drizzle); for
  linear work at most ``probe_growth`` times the largest measured (outside overload); in
  overload on a noisy curve whose bins all lie within the noise of ``a + b n``, the sizes
  measured are ranked by that fit, not by the noise (``CostCurve.affine_within_noise``);
* a backlog always has a rate: with nothing measured lately the backlog's records per file, else
  the last rate measured, never the idle plan;
* a group that took more than ``miss_ratio`` times its predicted wall sends the next group back
  to the last size that was stable (in records); a prediction from priors alone (the first
  group's) is no miss; a fallback whose own group missed forgets that size, and the next one
  takes the most efficient size measured;
* overloaded, with no size measured within ``GAP`` times above the cheapest per record, one group
  probes twice that size: a chord over the gap overestimates convex work, so a drain would
  otherwise never leave the smallest sizes;
* every group's predicted wall is within the freshness SLA (or ``max_group_wall_s``): k is cut,
  and a single epoch shrunk, to fit.

Where slow start begins: not at an arbitrary small size. A group pays a fixed cost ``F``
(Spark start or Connect session, warm-up, commit: tens of seconds for a JVM per group) that
DyBBS's one-second batches never had, so the first cell starts at the smallest size the linear
cost model calls stable, ``x/f >= F + c + a + x * b_f`` (``F`` the measured coordination, a
prior before the first group; ``a + b * records`` fitted to the last epochs). Slow start then
doubles while unstable (the epoch, or k when the cost per record grows with size, and it halves
the epoch and doubles k in the steep part), and probes around the smallest stable size. An
unstable group whose epochs alone fill ``busy_ratio`` of their span first tries the next
partition count up at the same size: a larger epoch would amortise only the fixed cost.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import isotonic_regression

from sluice.control.cost_curve import EXPLORE_SAMPLES, CostCurve

#: A gap in the measured cost curve wider than this (records, next size over the cheapest) is probed in overload.
GAP = 2.5

#: Epochs the linear cost model is fitted to: a few groups' worth, so it follows changed conditions.
COST_SAMPLES = 32


@dataclass(frozen=True)
class EpochSizeConfig:
    """DyBBS used c = 50 ms on ~1 s batches; sluice groups last tens of seconds, hence c = 2 s.
    ``initial_files`` is a floor for the first size of a cell; ``initial_coordination_s`` the
    fixed cost assumed until a group has measured one (a JVM per group: 20-25 s measured in
    ``bench/results/cost.json``). ``max_epoch_records`` is the ceiling before memory is measured;
    then what a read may hold is ``memory_fraction`` of Spark's unified memory (see
    ``memory_limit_records``).

    The safety bounds (``size_limit_records``, ``_guard``, see the module's docstring):
    ``steep_ratio`` (cost per record against the best measured), ``probe_growth`` (records
    against the largest epoch measured), ``max_group_wall_s`` (a group's predicted wall when no
    freshness SLA is given), ``miss_ratio`` (a miss that sends the next group back to the last
    stable size)."""

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
    slow_step_ratio: float = 0.2
    steep_ratio: float = 1.5
    probe_growth: float = 2.0
    max_group_wall_s: float = 600.0
    miss_ratio: float = 2.0
    busy_ratio: float = 0.6

    def __post_init__(self) -> None:
        if self.initial_partitions not in self.partitions:
            raise ValueError(f"initial_partitions {self.initial_partitions} is not in {self.partitions}")
        if list(self.partitions) != sorted(set(self.partitions)) or self.partitions[0] < 1:
            raise ValueError(f"partitions must be increasing and >= 1 (got {self.partitions})")
        if (self.margin_s < 0 or self.min_points < 2 or not 0 < self.alpha <= 1 or self.rate_bin_ratio <= 0
                or self.initial_coordination_s < 0 or self.steep_ratio <= 1 or self.probe_growth <= 1
                or self.max_group_wall_s <= 0 or self.miss_ratio <= 1):
            raise ValueError("bad epoch-size configuration")


@dataclass(frozen=True)
class EpochPlan:
    """``k`` epochs of ``epoch_size`` files, the first of ``first_size`` when given (a probe
    of one epoch at a size not measured yet, the rest of the group at a measured one)."""

    epoch_size: int
    k: int
    partitions: int
    reason: str
    predicted_wall_s: float
    first_size: int = 0


@dataclass(frozen=True)
class CatchUp:
    """What bounds a plan and sizes a drain: records per file (the larger of the rate's and the
    backlog's), the fixed cost, the largest k, the wall bound, the backlog, the size limit in files."""

    per_file: float
    rate_per_file: float
    fixed: float
    k_max: int
    wall_cap: float
    backlog_files: int
    x_bound: int
    partitions: int


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
    """One rate bin: the partition count last planned at it, the size last run, its cells."""

    partitions: int
    last_x: int = 0  # size of the last group run at this rate
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


def _drain_throughput(xs: np.ndarray, per_epoch: np.ndarray, cu: CatchUp) -> tuple[np.ndarray, np.ndarray]:
    """``(k, files per second)`` for each candidate epoch size: as many epochs as the backlog
    holds, never more than ``k_max`` or than fit the wall bound. A group drains the backlog (what
    it plans beyond it only waits for files); with nothing waiting (overload at a new rate) the
    group is for the files to come and counts as full."""
    k_wall = np.maximum(1, np.floor((cu.wall_cap - cu.fixed) / np.maximum(per_epoch, 1e-9)))
    ks = np.clip(np.ceil(max(cu.backlog_files, 1) / xs), 1, np.minimum(cu.k_max, k_wall))
    files = np.minimum(ks * xs, cu.backlog_files) if cu.backlog_files > 0 else ks * xs
    return ks, files / (cu.fixed + ks * per_epoch)


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
        self.curve = CostCurve(alpha=self.config.alpha)  # seconds against records, every epoch of every cell
        self.last_rate: tuple[float, float] | None = None  # (records/s, files/s) of the last group planned
        self.stable_records = 0.0  # records per epoch of the last group that kept up with arrivals
        self.stable_partitions = 0
        self.fallback: str | None = None  # why the next group goes back to the last stable size
        self.last_per_file = 0.0  # records per file of the last epoch run
        self.per_file_samples: list[float] = []  # records per file of the last epochs (COST_SAMPLES)
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
        """A new rate bin starts at the partition count the cost curve finds cheapest (the
        configured one before anything was measured)."""
        start = self.curve.choose_partitions(max(self.stable_records, 1.0), self.config.partitions, explore=False)
        return _Bin(partitions=start or self.config.initial_partitions)

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

    def _fit(self, b: int, partitions: int, cell: _Cell, per_file: float) -> tuple[np.ndarray, np.ndarray]:
        """The cell's isotonic fit over its own sizes and, where it has none, the sizes the cost
        curve measured at this partition count at other rates (converted to files at today's
        records per file): what one rate learned, every rate knows, so a new rate bin needs no
        slow start once the curve covers it."""
        key = (id(cell), cell.version, self.curve.version, round(math.log(max(per_file, 1e-9)), 3))
        cached = self._fits.get((b, partitions))
        if cached and cached[0] == key:
            return cached[1]
        xs, ys = self._points(cell, partitions, per_file)
        fit = isotonic_fit(xs, ys)
        self._fits[(b, partitions)] = (key, fit)
        return fit

    def _points(self, cell: _Cell, partitions: int, per_file: float) -> tuple[np.ndarray, np.ndarray]:
        own = {int(x): v[0] for x, v in cell.points.items()}
        n, t = self.curve.at(partitions)
        if len(n) and per_file > 0:
            for x, sec in zip(np.maximum(1, np.rint(n / per_file)).astype(int), t, strict=True):
                own.setdefault(int(x), float(sec))
        xs = np.array(sorted(own), float)
        return xs, np.array([own[int(x)] for x in xs])

    def _learning(self, cell: _Cell, partitions: int, per_file: float) -> bool:
        """Slow start while the cell's fit has fewer than ``min_points`` sizes, unless the cost
        curve already measured 3 sizes at this partition count (or scaled to it): then the model
        plans, and its exploration (twice the largest size in the fit, the probes of a drain)
        widens the curve where it is needed."""
        if len(cell.points) >= self.config.min_points:
            return False
        if len(self.curve.at(partitions)[0]) >= 3:
            return False
        return len(self._points(cell, partitions, per_file)[0]) < self.config.min_points

    def _model_plan(self, b: int, bs: _Bin, cell: _Cell, file_rate: float, coord: float, k_cap: int,
                    cap: int, backlog_files: int, cu: CatchUp) -> EpochPlan:
        """DyBBS's smallest stable group at the partition count the cost curve finds cheapest
        (one not measured yet, next to it, is tried in a stable group: the hill climb); catch-up
        beyond a backlog of ``catchup_factor`` groups; overload when nothing is stable."""
        cfg, rpf = self.config, cu.rate_per_file
        P = self.curve.choose_partitions(max(self.stable_records, rpf), cfg.partitions, explore=False)
        c = cell if P in (None, bs.partitions) else (bs.cells.get(P) or _Cell())
        if P is None or (P != bs.partitions and self._learning(c, P, rpf)):
            P, c = bs.partitions, cell
        fit = self._fit(b, P, c, rpf)
        limit = max(1, min(cap, int(cfg.explore_factor * fit[0][-1]), cu.x_bound))
        stable = smallest_stable_group(fit, coord, file_rate, cfg.margin_s, k_cap, limit)
        if stable is not None and backlog_files <= cfg.catchup_factor * stable[0] * stable[1]:
            x, k = stable
            if backlog_files > x * k:
                # take what waits: the files beyond the stable group would otherwise age a whole
                # group more; its epochs grow to hold them (within the size limit, so never into
                # the steep part; beyond catchup_factor groups the catch-up plan drains instead)
                x = max(x, min(limit, backlog_files // k))
            elif (0 < backlog_files < x * k and (x * k - backlog_files) / file_rate > coord
                  and x * rpf <= self.curve.largest() * 1.0001):
                # fewer files wait than the group spans, and the rest would keep the engine idle
                # longer than a group's fixed cost: take what waits now (one more fixed cost is
                # less than the wait it saves every file waiting); a rate that rose makes the
                # smallest stable span jump, and the idle wait would otherwise come on top of it.
                # Not an epoch larger than any measured: that group is also the size limit's
                # probe, and cutting it would keep the curve, and a later drain, at small sizes.
                k = max(1, math.ceil(backlog_files / x))
                x = math.ceil(backlog_files / k)
            wall = float(coord + k * predict(fit, x))
            explore = self.curve.choose_partitions(x * rpf, cfg.partitions)
            # never explore below the configured count (the cores): fewer partitions than cores
            # leave cores idle, and a probe there costs several times the planned wall
            if (explore is not None and explore != P and explore >= cfg.initial_partitions
                    and self.curve.samples(explore, near=x * rpf) < EXPLORE_SAMPLES):
                return EpochPlan(x, k, explore, "stable, exploring partitions", wall)
            return EpochPlan(x, k, P, "stable", wall)
        if stable is not None:
            return self._catch_up_plan(cu, "catch-up") or self._cell_catch_up(fit, P, limit, cu, "catch-up")
        # nothing stable within the size limit: probe up to it (the limit grows with what is
        # measured, never into the steep part), more epochs where the backlog holds them
        reason = "overload: no stable size within the size limit"
        return self._catch_up_plan(cu, reason, probe=True) or self._cell_catch_up(fit, P, limit, cu, reason)

    @staticmethod
    def _cell_catch_up(fit: tuple[np.ndarray, np.ndarray], partitions: int, limit: int, cu: CatchUp,
                       reason: str) -> EpochPlan:
        """The cell's best modelled throughput up to ``limit`` files, k as many epochs as the
        backlog holds within the wall bound (before the cost curve has any epoch's records)."""
        xs = np.arange(1, limit + 1)
        px = predict(fit, xs)
        ks, throughput = _drain_throughput(xs, px, cu)
        i = int(np.argmax(throughput))
        return EpochPlan(int(xs[i]), int(ks[i]), partitions, reason, float(cu.fixed + ks[i] * px[i]))

    def _catch_up_plan(self, cu: CatchUp, reason: str, probe: bool = False) -> EpochPlan | None:
        """Drain a backlog with more epochs of a measured, efficient size (Drizzle: k up), never
        one larger epoch: among the epoch sizes measured (cost-curve bins) within the size limit
        (and, with ``probe``, the size limit itself: overload needs larger epochs than measured),
        the one whose group drains the backlog fastest, ``k`` as many epochs as the backlog holds
        within the wall bound; partitions by the hill climb per size (``choose_partitions``)."""
        n, _ = self.curve.curve()
        if not len(n) or cu.per_file <= 0:
            return None
        bound = self.size_limit_records()
        gap = self._gap_size(n, bound, cu) if probe else None
        if gap is not None:  # the one size to try; planned as any drain's
            xs = np.array([float(gap)])
            reason = "overload: probing twice the cheapest size measured (a gap in the cost curve)"
        else:
            xs = self._drain_sizes(n, bound, cu, probe)
        records = xs * cu.per_file
        per_epoch = self.curve.seconds(records)
        smooth = self.curve.affine_within_noise() if probe else None
        if smooth is not None:
            # overload on a noisy curve: throughput near capacity decides, and the curve's bins
            # differ by noise (diurnal_spikes-noisy-69: 22-file epochs predicted at 21 s, 30 files
            # at 36 s; the drain ran 13 epochs of 22 where 2 of 128 drained 14 % faster). The
            # sizes measured are ranked by the affine fit, the probe above them keeps the curve's
            a, b = smooth
            per_epoch = np.where(records <= self.curve.largest() * 1.0001, a + b * records, per_epoch)
        ks, throughput = _drain_throughput(xs, per_epoch, cu)
        i = int(np.argmax(throughput))
        x, k = int(xs[i]), int(ks[i])
        # a drain explores only towards more partitions (one epoch at a new count tells its whole curve)
        P = self.curve.choose_partitions(x * cu.per_file, self.config.partitions, downwards=False) or cu.partitions
        return EpochPlan(x, k, P, reason, float(cu.fixed + k * per_epoch[i]))

    def _drain_sizes(self, n: np.ndarray, bound: float, cu: CatchUp, probe: bool) -> np.ndarray:
        """A drain's candidate epoch sizes (files): the measured bins within the size limit, the
        limit itself in overload, ``probe_growth`` times the largest epoch measured for linear work,
        and below the smallest bin where the cheapest records may lie."""
        sizes = np.floor(n[n <= bound * 1.0001] / cu.per_file)
        if probe:  # overload: larger epochs than measured (within the limit) may be needed to keep up
            sizes = np.append(sizes, cu.x_bound)
        elif self.curve.linear():
            # linear work drains faster in larger epochs, but linear only as far as it was
            # measured: not the size limit's 2 x probe_growth, which carried a drain's epochs past
            # an unmeasured memory cliff (markov-cliff-11: 438k records against 152k measured, a
            # cliff at 157k; 811 s against 196 s predicted, then an 800-file backlog)
            sizes = np.append(sizes, min(cu.x_bound, math.floor(self.config.probe_growth * self.curve.largest()
                                                                  / cu.per_file)))
        best = self.curve.best()
        if best is not None and best[0] <= self.curve.smallest() * 1.0001 and self.curve.rising(best[0] * 1.5):
            # the cheapest records are at the smallest size measured: the efficient size may lie below
            sizes = np.append(sizes, math.floor(best[0] / 2 / cu.per_file))
        efficient = self.curve.efficient()
        if efficient is not None and self.curve.smallest() / 4 <= efficient <= bound:
            sizes = np.append(sizes, math.floor(efficient / cu.per_file))
        xs = np.unique(np.clip(sizes, 1, cu.x_bound))
        if not len(xs):
            xs = np.array([max(1.0, min(float(cu.x_bound), math.floor(n[0] / cu.per_file)))])
        return xs

    def _gap_size(self, n: np.ndarray, bound: float, cu: CatchUp) -> int | None:
        """Overload with nothing measured between the cheapest size per record and the next
        size up more than ``GAP`` times larger: the curve there is a chord between two points,
        which overestimates convex work (a join's cheapest records lie in such a gap), so a
        drain would never try it. Returns twice the cheapest size in files (within the size
        limit), else ``None``; once measured, the gap is closed or moves."""
        best = self.curve.best()
        if best is None:
            return None
        above = n[n > best[0] * 1.0001]
        target = 2 * best[0]
        # above the largest size measured, the overload probe to the size limit already reaches
        if not len(above) or above[0] <= GAP * best[0] or target > bound:
            return None
        x = max(1, min(cu.x_bound, math.floor(target / cu.per_file)))
        return x if x * cu.per_file > best[0] * 1.2 else None

    # -- safety bounds ----------------------------------------------------------------------
    def size_limit_records(self) -> float:
        """The largest epoch (records) a plan may have: not in the steep part of the measured
        cost curve (``steep_ratio``) and at most ``probe_growth`` times the largest epoch measured
        (a probe into unmeasured superlinear work, or past a memory cliff, then misses by about
        ``probe_growth`` for quadratic work); ``inf`` before any epoch was measured (the start
        size is sized from the fixed cost)."""
        if not len(self.curve):
            return math.inf
        growth = self.config.probe_growth * (2.0 if self.curve.linear() else 1.0)
        return min(self.curve.limit(self.config.steep_ratio), growth * self.curve.largest())

    def wall_cap(self, max_wall_s: float | None) -> float:
        """A group's predicted wall is bounded by the freshness SLA (when given) and by ``max_group_wall_s``."""
        cap = self.config.max_group_wall_s
        return cap if max_wall_s is None or max_wall_s <= 0 else min(cap, max_wall_s)

    def _guard(self, plan: EpochPlan, cu: CatchUp) -> EpochPlan:
        """Enforce the bounds on any plan: an epoch beyond the size limit is split into more
        epochs of the largest allowed size (the same files, k up); k is cut to what fits the wall
        bound (at least one epoch). The prediction is the plan's own unless the guard changed the
        size; the wall bound uses the larger of it and the cost curve's."""
        x, k, notes = plan.epoch_size, plan.k, []
        per_epoch = max(0.0, (plan.predicted_wall_s - cu.fixed) / max(plan.k, 1))
        if x > cu.x_bound:
            x = cu.x_bound
            k = max(1, min(cu.k_max, math.ceil(plan.epoch_size * plan.k / x)))
            notes.append(f"epoch {plan.epoch_size} -> {x} files (size limit "
                         f"{self.size_limit_records():.0f} records)")
            measured = float(self.curve.seconds(x * cu.per_file)) if len(self.curve) else math.nan
            per_epoch = measured if math.isfinite(measured) else per_epoch * x / plan.epoch_size
        bound_epoch = per_epoch
        if len(self.curve):
            measured = float(self.curve.seconds(x * cu.per_file))
            if math.isfinite(measured):
                bound_epoch = max(per_epoch, measured)
        if k > 1 and cu.fixed + k * bound_epoch > cu.wall_cap:
            k_new = max(1, int((cu.wall_cap - cu.fixed) // max(bound_epoch, 1e-9)))
            if k_new < k:
                notes.append(f"k {k} -> {k_new} (wall bound {cu.wall_cap:.0f} s)")
                k = k_new
        if k == 1 and x > 1 and len(self.curve) and cu.fixed + bound_epoch > cu.wall_cap:
            # one epoch alone over the bound: the largest epoch whose predicted time fits
            xs = np.arange(1, x)
            fits = np.nonzero(cu.fixed + self.curve.seconds(xs * cu.per_file) <= cu.wall_cap)[0]
            x_new = int(xs[fits[-1]]) if fits.size else 1
            per_epoch = float(self.curve.seconds(x_new * cu.per_file))
            notes.append(f"epoch {x} -> {x_new} files (wall bound {cu.wall_cap:.0f} s)")
            x = x_new
        if not notes:
            return plan
        return EpochPlan(x, k, plan.partitions, f"{plan.reason}; {'; '.join(notes)}", cu.fixed + k * per_epoch)

    def _one_probe(self, plan: EpochPlan, cu: CatchUp) -> EpochPlan:
        """At most one epoch of a group at a size larger than any measured, once the backlog
        holds two of it: the probe is the group's first epoch, the files behind it go in epochs
        of the measured size that drains them fastest. A rising rate opens a new rate bin whose
        slow start begins at the linear model's stable size; near capacity that is far beyond
        anything measured, and k epochs of it made a group a 200-300 s probe into a join or past
        a memory cliff (ramp-join-74: 1.51 x FixBI, 1.17 with one probe epoch). A backlog of
        less than two probes keeps the plan: its group waits for files, and the probe sizes it."""
        x = plan.epoch_size
        if (plan.k < 2 or plan.first_size or not len(self.curve) or cu.backlog_files < 2 * x
                or x * cu.per_file <= self.curve.largest() * 1.0001):
            return plan
        n, _ = self.curve.curve()
        ys = np.unique(np.clip(np.floor(n / max(cu.per_file, 1e-9)), 1, None))
        ys = ys[(ys < x) & (ys <= cu.x_bound)]
        if not len(ys):
            return plan
        probe_s = max(0.0, (plan.predicted_wall_s - cu.fixed) / plan.k)
        per_epoch = self.curve.seconds(ys * cu.per_file)
        behind = CatchUp(cu.per_file, cu.rate_per_file, cu.fixed + probe_s, max(1, cu.k_max - 1), cu.wall_cap,
                         min(cu.backlog_files, x * plan.k) - x, cu.x_bound, cu.partitions)
        ks, throughput = _drain_throughput(ys, per_epoch, behind)
        i = int(np.argmax(throughput))
        y, k = int(ys[i]), int(ks[i])
        return EpochPlan(y, 1 + k, plan.partitions,
                         f"{plan.reason}; one probe epoch of {x} files, then {k} of {y} (a size measured)",
                         cu.fixed + probe_s + k * float(per_epoch[i]), x)

    def _fallback_plan(self, cu: CatchUp) -> EpochPlan:
        """After a bad miss: the last size that was stable (in records, at today's records per
        file), else the most efficient size measured; the backlog in more epochs of it."""
        records = self.stable_records or (self.curve.best() or (cu.per_file * self.last_x, 0.0))[0]
        x = max(1, min(cu.x_bound, int(records // max(cu.per_file, 1e-9))))
        per_epoch = float(self.curve.seconds(x * cu.per_file)) if len(self.curve) else 0.0
        per_epoch = per_epoch if math.isfinite(per_epoch) else 0.0
        k_wall = max(1, int((cu.wall_cap - cu.fixed) // max(per_epoch, 1e-9)))
        k = max(1, min(cu.k_max, k_wall, math.ceil(max(cu.backlog_files, 1) / x)))
        return EpochPlan(x, k, self.stable_partitions or cu.partitions, f"fallback: {self.fallback}",
                         cu.fixed + k * per_epoch)

    # -- API ---------------------------------------------------------------------------------
    def propose(self, rate_rps: float, file_rate: float, coordination_s: float | None, k_cap: int,
                backlog_files: int, *, k_max: int | None = None, max_wall_s: float | None = None,
                backlog_records: float | None = None) -> EpochPlan:
        """The next group's epoch size, k (<= k_cap for a stable group, <= ``k_max`` to drain a
        backlog) and partitions; does not change state. ``coordination_s``: the measured fixed
        cost per group, ``None`` before the first group; ``max_wall_s``: the freshness SLA;
        ``backlog_records``: what the backlog holds, when the source can say."""
        drain = ""
        if rate_rps <= 0 or file_rate <= 0:
            if backlog_files <= 0:  # the idle plan; max_files needs both rates
                return EpochPlan(self.last_x, 1, self.config.initial_partitions, "idle: no arrivals measured", 0.0)
            # a backlog always has a rate: what it holds, else the last one measured
            rate_rps, file_rate, drain = self._backlog_rate(file_rate, backlog_files, backlog_records)
        k_max = max(k_cap, k_max or k_cap)
        cu = self._catch_up_context(rate_rps, file_rate, coordination_s, k_max, max_wall_s, backlog_files,
                                    backlog_records)
        if self.fallback:
            plan = self._fallback_plan(cu)
        else:
            plan = self._propose(rate_rps, file_rate, coordination_s, k_cap, backlog_files, cu)
        if drain:
            plan = EpochPlan(plan.epoch_size, plan.k, plan.partitions, f"{drain}; {plan.reason}",
                             plan.predicted_wall_s)
        plan = self._one_probe(self._guard(plan, cu), cu)
        fit = self.epochs_in_memory(max(plan.epoch_size, plan.first_size), self.max_files(rate_rps, file_rate))
        if plan.k <= fit:
            return plan
        per_epoch = (plan.predicted_wall_s - self.fixed_cost(coordination_s)) / plan.k
        return EpochPlan(plan.epoch_size, fit, plan.partitions,
                         f"{plan.reason}; k {plan.k} -> {fit}: the group's reads fit the measured memory",
                         self.fixed_cost(coordination_s) + fit * per_epoch, plan.first_size)

    def _backlog_rate(self, file_rate: float, backlog_files: int,
                      backlog_records: float | None) -> tuple[float, float, str]:
        """Rates to size a backlog by when no arrivals were measured (arrivals stopped, or a
        silence): the records the backlog holds per file, else the last rate measured."""
        f = file_rate if file_rate > 0 else (self.last_rate[1] if self.last_rate else 1.0)
        if backlog_records is not None and backlog_records > 0:
            return backlog_records / backlog_files * f, f, "drain: no arrivals measured, sized by the backlog's records"
        if self.last_rate:
            r, f0 = self.last_rate
            return r / f0 * f, f, f"drain: no arrivals measured, sized at the last measured rate ({r:.0f} records/s)"
        return f, f, "drain: no arrivals ever measured, one record a file assumed"

    def _catch_up_context(self, rate_rps: float, file_rate: float, coordination_s: float | None, k_max: int,
                          max_wall_s: float | None, backlog_files: int, backlog_records: float | None) -> CatchUp:
        # The next files are the backlog's oldest: they follow the last epoch run, and may hold
        # more than today's rate says (a burst that ended, arrivals that paused): size by the largest.
        per_file = max(rate_rps / file_rate, self.last_per_file)
        backlog_pf = backlog_records / backlog_files if backlog_records and backlog_files > 0 else 0.0
        per_file = max(per_file, backlog_pf)
        limit = self.size_limit_records()
        cap = self.max_files(rate_rps, file_rate)
        x_bound = cap if not math.isfinite(limit) else max(1, min(cap, int(limit // max(per_file, 1e-9))))
        steep = self.curve.limit(self.config.steep_ratio, measured=True) if len(self.curve) else math.inf
        if math.isfinite(steep):
            # the steep part is kept clear for the densest files measured lately, not only
            # today's: a backlog that holds a burst's files would otherwise carry its epochs into it
            bound_pf = max([per_file, *self.per_file_samples])
            x_bound = max(1, min(x_bound, int(steep // max(bound_pf, 1e-9))))
        b = rate_bin(rate_rps, self.config.rate_bin_ratio)
        bs = self.bins.get(b)
        return CatchUp(per_file=per_file, rate_per_file=max(rate_rps / file_rate, backlog_pf),
                       fixed=self.fixed_cost(coordination_s), k_max=k_max, wall_cap=self.wall_cap(max_wall_s),
                       backlog_files=backlog_files, x_bound=x_bound,
                       partitions=bs.partitions if bs else self.config.initial_partitions)

    def _propose(self, rate_rps: float, file_rate: float, coordination_s: float | None, k_cap: int,
                 backlog_files: int, cu: CatchUp) -> EpochPlan:
        b = rate_bin(rate_rps, self.config.rate_bin_ratio)
        bs = self.bins.get(b) or self._new_bin(b)
        cap = self.max_files(rate_rps, file_rate)
        cell = bs.cells.get(bs.partitions) or self._new_cell(bs, self.start_size(rate_rps, file_rate,
                                                                                 coordination_s, cap))
        fixed = self.fixed_cost(coordination_s)
        if self._learning(cell, bs.partitions, rate_rps / file_rate):
            # the probe is the epoch size; a backlog beyond one group is drained with more epochs
            # of it under the same fixed cost, rather than left to age behind a group of one
            x = min(cell.slow_x, cap)
            k = min(max(cell.slow_k, backlog_files // x), max(cu.k_max, cell.slow_k))
            seen = cell.points.get(x)
            per_epoch = seen[0] if seen else self.epoch_seconds(x, rate_rps, file_rate)
            start = "" if cell.points else f", from the fixed cost {fixed:.1f} s"
            return EpochPlan(x, k, bs.partitions,
                             f"slow start ({len(cell.points)}/{self.config.min_points} sizes{start})",
                             fixed + k * per_epoch)
        return self._model_plan(b, bs, cell, file_rate, fixed, k_cap, cap, backlog_files, cu)

    def record(self, *, rate_rps: float, file_rate: float, partitions: int, epoch_files: list[int],
               epoch_s: list[float], coordination_s: float, coordination_ewma_s: float, k_cap: int,
               adaptive: bool = True, epoch_records: list[int] | None = None,
               predicted_wall_s: float = 0.0, k_max: int | None = None) -> str:
        """Fold in a finished group; ``adaptive=False`` (catch-up or freshness-forced groups) only
        adds samples. ``epoch_records``: the records each epoch read (else estimated from the
        rate, which before the first group is a guess). ``predicted_wall_s``: what its plan
        predicted (0: unknown); a wall beyond ``miss_ratio`` times it sends the next group back to
        the last size that was stable. Returns what the controller did, for the log."""
        cfg = self.config
        if not epoch_files:
            return "ignored: no epochs"
        wall = coordination_s + sum(epoch_s)
        # a miss counts only against a prediction from measured costs: the first group's rests on priors
        missed = predicted_wall_s > 0 and wall > cfg.miss_ratio * predicted_wall_s and bool(self.cost_samples)
        if epoch_records:
            self.last_per_file = epoch_records[-1] / max(epoch_files[-1], 1)
            self.per_file_samples += [n / max(x, 1) for n, x in zip(epoch_records, epoch_files, strict=False)]
            del self.per_file_samples[:-COST_SAMPLES]
        if rate_rps <= 0 and epoch_records:  # the cost curve is in records: it learns without a rate
            self.curve.add_group([float(n) for n in epoch_records], [float(t) for t in epoch_s], partitions,
                                 replace=missed)
        if missed and self.fallback:
            # the fallback's own group missed: the size it went back to is no longer stable, and
            # going back to it again would repeat the miss every group (on_off-noisy-15: 1-file
            # epochs, 210 s against 60 s predicted, 60 groups in a row); the next fallback takes
            # the most efficient size on the curve this group just corrected
            self.stable_records, self.stable_partitions = 0.0, 0
        self.fallback = (f"the last group took {wall:.0f} s against {predicted_wall_s:.0f} s predicted"
                         if missed else None)
        if rate_rps <= 0:
            return "ignored: no rate"
        self.last_rate = (float(rate_rps), float(file_rate))
        b = rate_bin(rate_rps, cfg.rate_bin_ratio)
        bs = self._bin(b)
        cap = self.max_files(rate_rps, file_rate)
        cell = self._cell(bs, partitions, self.start_size(rate_rps, file_rate, coordination_ewma_s, cap))
        per_file = rate_rps / file_rate
        learning_before = self._learning(cell, partitions, per_file)
        records = epoch_records or [x * rate_rps / file_rate for x in epoch_files]
        for x, s, n in zip(epoch_files, epoch_s, records, strict=True):
            if missed:  # conditions changed: the old average no longer describes this size
                cell.points.pop(int(x), None)
            cell.add(int(x), float(s), cfg.alpha)
            self.cost_samples.append((float(n), float(s)))
        del self.cost_samples[:-COST_SAMPLES]
        self.curve.add_group([float(n) for n in records], [float(t) for t in epoch_s], partitions, replace=missed)
        full = [x for x in epoch_files if x == epoch_files[0]]
        x, k = int(epoch_files[0]), len(full)
        self.last_x = bs.last_x = x
        span = sum(epoch_files) / file_rate
        stable = wall <= span  # for slow start; a learned point is only "unstable" beyond the margin
        if stable and not missed:
            self.stable_records = float(np.mean(records[:len(full)]))
            self.stable_partitions = partitions
        if not adaptive:
            return "samples only" + ("; missed: falling back to the last stable size" if missed else "")
        if partitions != bs.partitions:  # the model moved to another partition count: the bin follows
            bs.partitions = partitions
            cell = self._cell(bs, partitions, self.start_size(rate_rps, file_rate, coordination_ewma_s, cap))
            learning_before = self._learning(cell, partitions, per_file)
        if learning_before:
            busy = sum(epoch_s) / max(span, 1e-9)
            wider = [p for p in cfg.partitions if p > partitions and p not in bs.cells]
            if not stable and busy >= cfg.busy_ratio and wider:
                # the epochs' own work fills most of their span: a larger epoch amortises only the
                # fixed cost, and walks towards a steep part not yet measured; more partitions
                # cut the work itself (DyBBS's block interval), so that is tried first
                bs.partitions = wider[0]
                self._cell(bs, wider[0], x)
                return (f"slow start: unstable with the epochs busy {busy:.0%} of their span, "
                        f"trying {wider[0]} partitions")
            model_x = self.start_size(rate_rps, file_rate, coordination_ewma_s, cap)  # with this group's costs
            # k beyond the probe's own was drained backlog, not a probe of k
            return self._slow_start_step(cell, x, min(k, max(cell.slow_k, 1)), stable, cap, k_cap, model_x,
                                         float(np.mean(records[:len(full)])), k_max or k_cap)
        return "stable" if wall <= span + cfg.margin_s else "over the margin"

    def _slow_start_step(self, cell: _Cell, x: int, k: int, stable: bool, cap: int, k_cap: int,
                         model_x: int, records: float = 0.0, k_max: int = 0) -> str:
        """TCP-like: grow the group until it is stable (to ``model_x``, the size the costs just
        measured call stable, when that is larger; else double), then probe sizes around the
        smallest stable one (bisecting towards the largest unstable one, else stepping additively).
        An unstable probe in the steep part of the measured cost curve halves the epoch and
        doubles k instead (superlinear work: smaller epochs cost less per record)."""
        if stable:
            cell.stable_min = x if not cell.stable_min else min(cell.stable_min, x)
        else:
            cell.unstable_max = max(cell.unstable_max, x)
        if not cell.stable_min:
            sizes = sorted(cell.points)
            superlinear = records > 0 and self.curve.rising(records)
            if len(sizes) >= 2:
                lo, hi = sizes[-2], sizes[-1]
                superlinear = superlinear or cell.points[hi][0] / hi > 1.05 * cell.points[lo][0] / lo
            if superlinear and x > 1 and records > 0 and self.curve.steep_at(records, self.config.steep_ratio):
                cell.slow_x, cell.slow_k = max(1, x // 2), min(max(k_max, k_cap), 2 * k)
                cell.unstable_max = 0  # sizes above are unstable for being too large, not too small
                return "slow start: unstable in the steep part, half the epoch, twice the epochs"
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
            "curve": self.curve.to_dict(),
            "last_rate": list(self.last_rate) if self.last_rate else None,
            "stable": {"records": self.stable_records, "partitions": self.stable_partitions},
            "fallback": self.fallback,
            "last_per_file": self.last_per_file,
            "per_file_samples": list(self.per_file_samples),
            "bins": {
                str(b): {
                    "partitions": s.partitions, "last_x": s.last_x,
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
        # settings that no longer exist (saved by an older version) are dropped
        cfg = {k: v for k, v in data["config"].items() if k in EpochSizeConfig.__dataclass_fields__}
        cfg["partitions"] = tuple(cfg["partitions"])
        ctl = cls(EpochSizeConfig(**cfg))
        ctl.last_x = int(data["last_x"])
        # absent in state saved by older versions: the cost model starts empty, as for a new pipeline
        ctl.cost_samples = [(float(r), float(t)) for r, t in data.get("cost_samples", [])]
        memory = data.get("memory", {})  # absent before memory was measured: the constant ceiling only
        ctl.memory_samples = [(float(r), float(m)) for r, m in memory.get("samples", [])]
        ctl.memory_budget_mb, ctl.memory_unit = memory.get("budget_mb"), memory.get("unit", "epoch")
        # absent before the safety bounds: nothing measured yet, as for a new pipeline
        ctl.curve = CostCurve.from_dict(data.get("curve"))
        ctl.last_rate = tuple(data["last_rate"]) if data.get("last_rate") else None  # type: ignore[assignment]
        stable = data.get("stable") or {}
        ctl.stable_records, ctl.stable_partitions = float(stable.get("records", 0.0)), int(stable.get("partitions", 0))
        ctl.fallback = data.get("fallback")
        ctl.last_per_file = float(data.get("last_per_file", 0.0))
        ctl.per_file_samples = [float(v) for v in data.get("per_file_samples", [])]
        for b, s in data["bins"].items():
            bs = _Bin(partitions=int(s["partitions"]), last_x=int(s["last_x"]))
            for p, c in s["cells"].items():
                bs.cells[int(p)] = _Cell(points={int(x): [float(v[0]), int(v[1])] for x, v in c["points"].items()},
                                         slow_x=int(c["slow_x"]), slow_k=int(c["slow_k"]),
                                         slow_step=int(c["slow_step"]), stable_min=int(c["stable_min"]),
                                         unstable_max=int(c["unstable_max"]))
            ctl.bins[int(b)] = bs
        return ctl
