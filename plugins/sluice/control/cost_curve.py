"""The measured shape of an epoch's cost against its records: where the cost per record is
lowest, and where it turns steep (superlinear work such as a join, a memory cliff where an epoch
starts to spill). Pure Python, learned from measurements only: no functional form is assumed and
the workload's name is never consulted.

Every finished epoch adds ``(records, seconds, partitions)``. Records are binned geometrically
(``BIN_RATIO`` wide); each bin keeps, per partition count, an EWMA of the seconds per record, and
the curve takes the best partition count at each size (the lower envelope), so a partition hill
climb that measured small epochs at 16 partitions and larger ones at 1 does not read as a steep
curve. The epoch time ``T(n) = n * c(n)`` is made non-decreasing over the bins (isotonic), then
interpolated in log-log space; above the largest bin it grows at least linearly, and as fast as
a quadratic ``a + b n + c n^2`` fitted to the bins says when that is faster (the measured
curvature carries on).

``limit(ratio)``: the largest epoch (records) whose predicted cost per record stays within
``ratio`` times the best measured one, walking up from the best bin; ``inf`` while nothing
measured says the curve turns steep. Noise is not steepness: the spread of a group's epochs
about the curve is measured (``noise_var``), and the bound widens by two standard errors of a
bin's average (``tolerance``), so lognormal noise of 0.3-0.4 does not read as a steep part
while a memory cliff (4-10x) still does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Geometric width of a records bin.
BIN_RATIO = 1.25
#: How far one epoch's error moves the curve's level (log scale).
LEVEL_ALPHA = 0.15
#: A group's mean error beyond this many standard errors of the measured noise is a level shift
#: (a capacity cut or its end), followed at once: bins first measured while the level lagged
#: would keep the shift as their own shape (capacity_cut-cliff-47).
SHIFT_SIGMAS = 4.0
#: The spread of one epoch's error against the curve assumed at least (log sd).
SHIFT_FLOOR = 0.1
#: Groups whose mean errors are measured before a shift is told from their spread.
SHIFT_GROUPS = 5
#: Epochs a bin holds before an error at its size may tell a shift (one sample may be the outlier).
SHIFT_SAMPLES = 3
#: How fast the spread of groups' mean errors follows (per group).
SHIFT_ALPHA = 0.1
#: Epochs a partition count is tried for before its score is trusted (one epoch is one noisy sample).
EXPLORE_SAMPLES = 3
#: A partition count is judged, and tried, by its epochs within this factor of the planned size:
#: the best count moves with the size (per-task overhead rules small epochs, per-record work large ones).
NEAR_FACTOR = 4.0
#: How fast the measured noise follows (per group).
NOISE_ALPHA = 0.2
#: A curve whose largest size costs at most this much per record more than its cheapest is linear.
FLAT = 1.15
#: A curve whose ``tolerance`` is at least this is noisy: two bins' costs per record may differ by
#: 20 % by noise alone, as much as a drain's candidate sizes differ in throughput.
NOISY = 1.2


def _near(log_records: float, records: float) -> bool:
    """Whether a bin at ``log_records`` lies within ``NEAR_FACTOR`` of ``records``."""
    return abs(log_records - math.log(max(records, 1.0))) <= math.log(NEAR_FACTOR)


@dataclass
class CostCurve:
    alpha: float = 0.3
    #: bin -> partitions -> [EWMA log records, EWMA seconds per record, samples]
    bins: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    level: float = 1.0  # the bins' costs are relative to it (see ``add``)
    noise_var: float = 0.0  # EWMA of an epoch's squared log error against the curve (its measured noise)
    level_var: float = 0.0  # EWMA of a group's squared mean log error, per epoch (how far groups miss by noise)
    level_groups: int = 0  # groups in level_var
    _cache: tuple[int, tuple[np.ndarray, np.ndarray]] | None = field(default=None, repr=False, compare=False)
    _version: int = field(default=0, repr=False, compare=False)
    _at_cache: dict[int, tuple[int, dict[int, tuple[float, float]]]] = field(
        default_factory=dict, repr=False, compare=False)

    def add_group(self, records: list[float], seconds: list[float], partitions: int, *,
                  replace: bool = False) -> None:
        """Fold in a group's epochs (one partition count): the level moves on their mean error
        against the curve as it was before them, then each epoch goes to its bin. A mean error
        far beyond the noise at measured sizes moves it the whole way: a capacity cut seen first
        at a new size would otherwise stay in that size's bin as steepness once the level caught
        up, and drains would keep away from it."""
        errors, at_bins = [], []
        for n, s in zip(records, seconds, strict=True):
            if n >= 1 and s > 0 and (p := self._predict_at(partitions, n)) is not None and p > 0:
                errors.append(math.log(s / p))
                if self.bins.get(self._bin_of(n), {}).get(partitions, (0, 0, 0))[2] >= SHIFT_SAMPLES:
                    at_bins.append(errors[-1])
        if errors:
            mean = sum(errors) / len(errors)
            # A shift: the group's mean error where its sizes were measured (not interpolated
            # across a gap, where a cliff or a chord over convex work errs as much) beyond what
            # such errors spread by (measured over SHIFT_GROUPS groups first): followed at once.
            shifted = None
            if at_bins:
                m = sum(at_bins) / len(at_bins)
                # one epoch's squared error, were the group's errors noise: the epochs' own noise
                # averages out over the group, the bins' averages (EWMAs of a few epochs) do not
                z2 = m * m / (1 / len(at_bins) + self.alpha / (2 - self.alpha))
                spread = max(self.level_var, self.noise_var, SHIFT_FLOOR**2)  # the spread within groups too
                if self.level_groups >= SHIFT_GROUPS and z2 > SHIFT_SIGMAS**2 * spread:
                    shifted = m
                else:
                    self.level_var = z2 if not self.level_groups else (
                        SHIFT_ALPHA * z2 + (1 - SHIFT_ALPHA) * self.level_var)
                    self.level_groups += 1
            step = shifted if shifted is not None else LEVEL_ALPHA * max(-1.0, min(1.0, mean))
            self.level *= math.exp(max(-1.0, min(1.0, step)))
            if len(errors) >= 2:  # the spread within one group: noise, not a level shift
                var = sum((e - mean) ** 2 for e in errors) / (len(errors) - 1)
                self.noise_var = var if not self.noise_var else NOISE_ALPHA * var + (1 - NOISE_ALPHA) * self.noise_var
        for i, (n, s) in enumerate(zip(records, seconds, strict=True)):
            self._to_bin(n, s, partitions, replace=replace and i == 0)

    def add(self, records: float, seconds: float, partitions: int = 0, *, replace: bool = False) -> None:
        """Fold in one epoch; ``replace`` drops the bin's history at this partition count (a bad
        miss: conditions changed, the old average no longer describes this size).

        A level shift (capacity cut or restored, a slower cluster) moves every size at once, but
        a bin's average only follows where epochs run. So the curve is a shape times a level:
        the bins hold costs per record divided by ``level``, and every epoch that falls inside
        the measured range moves the level by ``LEVEL_ALPHA`` of its log error against the
        prediction (noise averages out; a shift is followed within a few groups, everywhere)."""
        if records < 1 or seconds <= 0 or not math.isfinite(seconds):
            return
        predicted = self._predict_at(partitions, records)
        if predicted is not None and predicted > 0:
            error = max(-1.0, min(1.0, math.log(seconds / predicted)))
            self.level *= math.exp(LEVEL_ALPHA * error)
        self._to_bin(records, seconds, partitions, replace=replace)

    @staticmethod
    def _bin_of(records: float) -> int:
        return math.floor(math.log(records) / math.log(BIN_RATIO))

    def _to_bin(self, records: float, seconds: float, partitions: int, *, replace: bool) -> None:
        if records < 1 or seconds <= 0 or not math.isfinite(seconds):
            return
        cell = self.bins.setdefault(self._bin_of(records), {})
        old = cell.get(partitions)
        per = seconds / records / self.level
        if old is None or replace:
            cell[partitions] = [math.log(records), per, 1]
        else:
            a = self.alpha
            cell[partitions] = [a * math.log(records) + (1 - a) * old[0], a * per + (1 - a) * old[1], old[2] + 1]
        self._version += 1

    def _predict_at(self, partitions: int, records: float) -> float | None:
        """The curve at ``partitions`` interpolated at ``records``, ``None`` outside its measured range."""
        n, t = self.at(partitions)
        if len(n) < 2 or not n[0] <= records <= n[-1]:
            return None
        return float(np.exp(np.interp(math.log(records), np.log(n), np.log(np.maximum(t, 1e-12)))))

    def __len__(self) -> int:
        return len(self.bins)

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """``(records, seconds)`` per bin, ascending, seconds non-decreasing (isotonic in the
        samples' weights): at each size the best partition count, each count's curve completed
        where it was not measured by scaling (``at``), so sizes measured at different counts
        compare like with like."""
        if self._cache and self._cache[0] == self._version:
            return self._cache[1]
        best: dict[int, tuple[float, float]] = {}
        for p in {p for cell in self.bins.values() for p in cell}:
            for b, (log_n, per) in self._rows(p).items():
                if b not in best or per < best[b][1]:
                    best[b] = (log_n, per)
        ns, ts, ws = [], [], []
        for b in sorted(best):
            n = math.exp(best[b][0])
            ns.append(n)
            ts.append(n * best[b][1])
            ws.append(min(sum(v[2] for v in self.bins[b].values()), 5.0))
        from scipy.optimize import isotonic_regression  # ~0.4 s to import: not in every task's DAG parse

        t = isotonic_regression(np.array(ts), weights=np.array(ws), increasing=True).x if ts else np.array([])
        out = (np.array(ns), np.asarray(t, float))
        self._cache = (self._version, out)
        return out

    def _affine(self) -> tuple[float, float]:
        """``(a, b) >= 0`` with ``T(n) = a + b n`` fitted (non-negative least squares, relative
        errors) to the bins: ``a`` is what an epoch costs whatever its records (commit, planning,
        task start), the floor of any epoch's time."""
        from scipy.optimize import nnls

        n, t = self.curve()
        u = n / n[-1]
        coef, _ = nnls(np.stack([np.ones_like(u), u], axis=1) / t[:, None], np.ones_like(t))
        return float(coef[0]), float(coef[1] / n[-1])

    def _quadratic(self) -> tuple[float, float, float] | None:
        """``(a, b, c) >= 0`` with ``T(n) = a + b n + c n^2`` fitted (non-negative least squares,
        relative errors) to the bins; ``None`` with fewer than 3. Its curvature is what the
        measurements say about the work's growth beyond them (0 for linear work)."""
        n, t = self.curve()
        if len(n) < 3:
            return None
        from scipy.optimize import nnls

        scale = n[-1]
        u = n / scale
        rows = np.stack([np.ones_like(u), u, u * u], axis=1) / t[:, None]
        coef, _ = nnls(rows, np.ones_like(t))
        return float(coef[0]), float(coef[1] / scale), float(coef[2] / scale**2)

    def affine_within_noise(self) -> tuple[float, float] | None:
        """``(a, b)`` of the affine fit (``_affine``) when the curve is noisy (``NOISY``) and every
        bin lies within that noise of the fit, else ``None``: the bins' differences are then noise,
        and a choice by the curve's argmax would follow it. A steep part or a cliff the bins show
        lies outside the noise and keeps the curve."""
        n, t = self.curve()
        tol = self.tolerance()
        if len(n) < 3 or tol < NOISY:
            return None
        a, b = self._affine()
        fit = a + b * n
        if not np.all(fit > 0):
            return None
        r = t / fit
        return (a, b) if bool(np.all((r <= tol) & (r >= 1 / tol))) else None

    def tolerance(self) -> float:
        """How far apart two bins' costs per record may lie by noise alone: two standard errors of
        a bin's EWMA of lognormal epoch times with the measured spread (1 for noise-free epochs)."""
        se = math.sqrt(min(self.noise_var, 1.0) * self.alpha / (2 - self.alpha))
        return math.exp(2 * se)

    def linear(self) -> bool:
        """Whether the measurements show no superlinearity: at least 3 bins, and the cost per
        record at the largest within ``FLAT`` of the lowest (noise: a quadratic fitted over a
        narrow range of sizes is easily fooled, the cost per record is not)."""
        n, t = self.curve()
        if len(n) < 3:
            return False
        c = t / n
        return bool(c[-1] <= FLAT * c.min())

    def _above(self, x: np.ndarray) -> np.ndarray:
        """Extrapolation above the largest bin. Linear work: the marginal cost of a record
        (``a + b n`` fitted to the bins) from the largest bin on, so the fixed part per epoch is
        amortised as it is; otherwise at least proportional growth, and the quadratic fit's when
        that is steeper (the measured curvature carries on)."""
        n, t = self.curve()
        if self.linear():
            return t[-1] + self._affine()[1] * (x - n[-1])
        out = t[-1] * x / n[-1]
        quad = self._quadratic()
        if quad is not None:
            _, b, c = quad
            out = np.maximum(out, t[-1] + b * (x - n[-1]) + c * (x * x - n[-1] ** 2))
        return out

    def seconds(self, records: float | np.ndarray) -> np.ndarray:
        """Predicted seconds of an epoch of ``records``: interpolated in log-log within the
        measured bins, extrapolated below and above them."""
        n, t = self.curve()
        x = np.maximum(np.asarray(records, float), 1.0)
        if not len(n):
            return np.full(np.shape(x), np.nan)
        if len(n) == 1:
            return np.where(x > n[0], t[0] * x / n[0], t[0])
        inside = np.exp(np.interp(np.log(x), np.log(n), np.log(np.maximum(t, 1e-12))))
        # below the smallest bin: the log-log slope of the first two bins carries on (0 to 2):
        # flat for a fixed cost per epoch, steeply down for superlinear work, whose cheaper
        # records lie there
        slope = min(2.0, max(0.0, math.log(t[1] / t[0]) / math.log(n[1] / n[0]))) if t[0] > 0 else 0.0
        # ... but never under the fixed part of an epoch the bins show (a + b n fitted): a cost
        # per epoch that does not shrink with its records (a slow commit) would otherwise read as
        # cheap tiny epochs, and a drain would plan dozens of them
        below = np.maximum(t[0] * (x / n[0]) ** slope, min(t[0], self._affine()[0]))
        return np.where(x > n[-1], self._above(x), np.where(x < n[0], below, inside))

    def best(self) -> tuple[float, float] | None:
        """``(records, seconds per record)`` of the bin with the lowest measured cost per record."""
        n, t = self.curve()
        if not len(n):
            return None
        c = t / n
        i = int(np.argmin(c))
        return float(n[i]), float(c[i])

    def at(self, partitions: int) -> tuple[np.ndarray, np.ndarray]:
        """``(records, seconds)`` at ``partitions``, ascending in records: the bins measured at it,
        and the bins measured only at other partition counts scaled by how those compare with it
        (the median ratio of its measured costs per record to theirs at the same sizes): one epoch
        at a new partition count tells how the whole curve moves. Empty if nothing was measured
        at it."""
        rows = self._rows(partitions)
        if not rows:
            return np.array([]), np.array([])
        log_n, per = np.array(sorted(rows.values())).T
        n = np.exp(log_n)
        return n, n * per

    def _rows(self, partitions: int) -> dict[int, tuple[float, float]]:
        """bin -> (log records, seconds per record) at ``partitions``, measured or scaled."""
        cached = self._at_cache.get(partitions)
        if cached and cached[0] == self._version:
            return cached[1]
        own = {b: cell[partitions] for b, cell in self.bins.items() if partitions in cell}
        rows = {b: (v[0], v[1]) for b, v in own.items()}
        if own:
            # how another count compares: this count's own epochs against the other's cost per
            # record at the same size (log-linear between its bins, its nearest bin beyond them)
            scale: dict[int, float] = {}
            own_log_n = np.array([v[0] for v in own.values()])
            own_per = np.array([v[1] for v in own.values()])
            for p in {p for cell in self.bins.values() for p in cell} - {partitions}:
                theirs = sorted((v[0], v[1]) for cell in self.bins.values() if (v := cell.get(p)) is not None)
                log_n, per = np.array(theirs).T
                scale[p] = float(np.median(own_per / np.exp(np.interp(own_log_n, log_n, np.log(per)))))
            for b, cell in self.bins.items():
                if b in rows:
                    continue
                scaled = [(v[0], v[1] * scale[p]) for p, v in cell.items() if p in scale]
                if scaled:
                    rows[b] = (sum(r[0] for r in scaled) / len(scaled), sum(r[1] for r in scaled) / len(scaled))
        rows = {b: (log_n, per * self.level) for b, (log_n, per) in rows.items()}
        self._at_cache[partitions] = (self._version, rows)
        return rows

    def choose_partitions(self, records: float, grid: tuple[int, ...], explore: bool = True,
                          downwards: bool = True) -> int | None:
        """The partition count for an epoch of ``records``: the one that is cheapest relative to
        the others (the median, over the bins it measured within a factor of 4 of ``records`` or
        else over all of them, of its cost per record against the curve's best at that size: a
        comparison over many epochs, not one lucky sample); with ``explore``, a neighbour of it
        in ``grid`` measured fewer than ``EXPLORE_SAMPLES`` epochs yet (a few epochs tell how its
        whole curve moves, so each count is tried once, as DyBBS's hill climb tries a block
        size), upwards first; a neighbour measured only at sizes beyond ``NEAR_FACTOR`` of
        ``records`` is tried again at this one
        (fewer partitions than cores is the risky direction: ``downwards=False`` never tries it).
        ``None`` before anything was measured."""
        if not self.bins or records < 1:
            return None
        n, t = self.curve()
        log_n, log_c = np.log(n), np.log(t / n)
        score: dict[int, float] = {}
        for p in {p for cell in self.bins.values() for p in cell}:
            own = [(v[0], v[1] * self.level) for cell in self.bins.values() if (v := cell.get(p)) is not None]
            near = [o for o in own if _near(o[0], records)] or own
            score[p] = float(np.median([math.log(per) - np.interp(ln, log_n, log_c) for ln, per in near]))
        best = min(score, key=score.__getitem__)
        if explore and best in grid:
            i = grid.index(best)
            for j in (i + 1, i - 1) if downwards else (i + 1,):
                if 0 <= j < len(grid) and self.samples(grid[j], near=records) < EXPLORE_SAMPLES:
                    return grid[j]
        return best

    def samples(self, partitions: int, near: float | None = None) -> int:
        """Epochs measured at ``partitions``: at all sizes, or within ``NEAR_FACTOR`` of ``near``
        records (a count tried only on small epochs is tried again on large ones)."""
        return int(sum(v[2] for cell in self.bins.values() if (v := cell.get(partitions)) is not None
                       and (near is None or _near(v[0], near))))

    @property
    def version(self) -> int:
        return self._version

    def partitions_at(self, records: float) -> int | None:
        """The partition count that measured the lowest cost per record in the bin nearest ``records``."""
        if not self.bins or records < 1:
            return None
        b = self._bin_of(records)
        near = min(self.bins, key=lambda o: (abs(o - b), -o))
        best = min(self.bins[near].items(), key=lambda kv: kv[1][1])[0]
        return best or None

    def rising(self, records: float) -> bool:
        """Whether the cost per record grows with the epoch near ``records`` (measured: the
        interpolated curve at ``records`` against two-thirds of it, both inside the bins)."""
        n, _ = self.curve()
        lo = records / 1.5
        if len(n) < 2 or lo < n[0] or records > n[-1] * BIN_RATIO:
            return False
        c_hi, c_lo = self.seconds(records) / records, self.seconds(lo) / lo
        return bool(c_hi > 1.05 * c_lo)

    def steep_at(self, records: float, ratio: float) -> bool:
        """Whether an epoch of ``records`` costs more than ``ratio`` times the best cost per record measured."""
        best = self.best()
        return best is not None and float(self.seconds(records)) / records > ratio * best[1]

    def efficient(self) -> float | None:
        """Where the quadratic fit's cost per record ``a/n + b + c n`` is lowest, ``sqrt(a/c)``
        (``None`` without curvature or fixed cost): the size a drain of superlinear work wants."""
        quad = self._quadratic()
        if quad is None or quad[0] <= 0 or quad[2] <= 0:
            return None
        return math.sqrt(quad[0] / quad[2])

    def smallest(self) -> float:
        n, _ = self.curve()
        return float(n[0]) if len(n) else 0.0

    def largest(self) -> float:
        """The largest epoch measured (records; 0 before any)."""
        n, _ = self.curve()
        return float(n[-1]) if len(n) else 0.0

    def limit(self, ratio: float, measured: bool = False) -> float:
        """The largest epoch (records) not in the steep part: from the best bin upwards, where the
        predicted cost per record first exceeds ``ratio`` times the best measured one (log-linear
        between bins, the extrapolation above them; at the bin below a jump steeper than quadratic
        work, a threshold); ``inf`` when the curve does not turn. ``measured``: only a
        steep part the bins show, crossed log-linearly (the bound for the densest files lately)."""
        n, t = self.curve()
        if len(n) < 2:
            return math.inf
        c = t / n
        i = int(np.argmin(c))
        bound = ratio * self.tolerance() * c[i]
        for j in range(i + 1, len(n)):
            if c[j] > bound:
                if not measured and len(n) >= 4 and c[j] / c[j - 1] > n[j] / n[j - 1]:
                    # the cost per record rising faster than the size (steeper than quadratic
                    # work): a threshold (a memory cliff, a spill) lies somewhere between the
                    # bins, where a chord would place the limit past it; the size limit stays at
                    # the last size measured below it (the bins of a few early groups are too
                    # few to tell a threshold from a noisy start)
                    return float(n[j - 1])
                # crossing between bins j - 1 and j, in log space
                lo, hi = math.log(c[j - 1]), math.log(c[j])
                frac = (math.log(bound) - lo) / (hi - lo) if hi > lo else 0.0
                return float(math.exp(math.log(n[j - 1]) + frac * (math.log(n[j]) - math.log(n[j - 1]))))
        if measured:  # only a steep part the bins show, not the extrapolation's
            return math.inf
        grid = n[-1] * np.geomspace(1.0, 1e4, 200)[1:]
        over = np.nonzero(self._above(grid) / grid > bound)[0]
        return float(grid[over[0] - 1]) if over.size and over[0] > 0 else (float(n[-1]) if over.size else math.inf)

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "level": self.level, "noise_var": self.noise_var,
                "level_var": self.level_var, "level_groups": self.level_groups,
                "bins": {str(b): {str(p): v for p, v in cell.items()} for b, cell in self.bins.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> CostCurve:
        if not data:
            return cls()
        return cls(alpha=float(data.get("alpha", 0.3)), level=float(data.get("level", 1.0)),
                   noise_var=float(data.get("noise_var", 0.0)), level_var=float(data.get("level_var", 0.0)),
                   level_groups=int(data.get("level_groups", 0)),
                   bins={int(b): {int(p): [float(v[0]), float(v[1]), int(v[2])] for p, v in cell.items()}
                         for b, cell in data.get("bins", {}).items()})
