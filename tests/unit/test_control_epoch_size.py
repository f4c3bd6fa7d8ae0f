"""DyBBS epoch sizing: isotonic fit, smallest stable size, slow start, partition hill climb,
per-rate memory, catch-up, persistence and the ``plan_next`` entry point."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sluice.control import (
    ControlState,
    Decision,
    EpochSizeConfig,
    GroupResult,
    GroupSizeConfig,
    Observation,
    fire_reason,
    isotonic_fit,
    plan_next,
    predict,
    smallest_stable_group,
)

F = 10.0  # coordination per group (s)


def epoch_time(files: int, partitions: int, rate: float) -> float:
    """Reduce-like: 2 s per epoch + work spread over 2 cores, relieved by more partitions."""
    records = files * rate
    return 2.0 + 0.05 * partitions + 5e-4 * records * (1 + 0.5 * 2 / partitions) / min(partitions, 2)


def drive(state: ControlState, rates: list[float], backlog: int = 0) -> list[Decision]:
    """Run one group per rate through ``plan_next`` with the noise-free model (1 file/s)."""
    decisions, last = [], None
    for gid, rate in enumerate(rates):
        d = plan_next(state, Observation(rate, 1.0, backlog, last))
        decisions.append(d)
        times = tuple(epoch_time(d.epoch_size, d.partitions, rate) for _ in range(d.k))
        last = GroupResult(gid, (d.epoch_size,) * d.k, times, F, d.partitions, rate, 1.0, d.reason)
    return decisions


def test_isotonic_fit_is_monotone():
    rng = np.random.default_rng(1)
    xs = rng.integers(1, 50, 40).astype(float)
    ys = 2 + 0.3 * xs + rng.normal(0, 2, 40)
    fx, fy = isotonic_fit(xs, ys)
    assert np.all(np.diff(fx) >= 0) and np.all(np.diff(fy) >= -1e-12)
    grid = np.linspace(0, 100, 300)
    assert np.all(np.diff(predict((fx, fy), grid)) >= -1e-12)


def test_stable_size_on_a_linear_model_is_the_analytic_one():
    # p(x) = 2 + 0.5 x, F = 10 s, c = 2 s, 1 file/s: x >= 10 + 2 + 0.5 x + 2  ->  x = 28 with k = 1;
    # k = 2 needs x >= 16 (span 32), k = 3 needs x >= 12 (span 36): the smallest span is k = 1.
    xs = np.arange(1, 80, dtype=float)
    fit = isotonic_fit(xs, 2 + 0.5 * xs)
    assert smallest_stable_group(fit, 10.0, 1.0, 2.0, k_cap=1, max_files=200) == (28, 1)
    assert smallest_stable_group(fit, 10.0, 1.0, 2.0, k_cap=4, max_files=200) == (28, 1)
    assert smallest_stable_group(fit, 10.0, 1.0, 2.0, k_cap=4, max_files=20) == (16, 2)  # memory budget


def test_superlinear_model_gives_the_lower_stable_root():
    # p(x) = 2 + 0.05 x^2, no coordination, c = 1: x >= 3 + 0.05 x^2 holds for 3.7 <= x <= 16.3
    xs = np.arange(1, 40, dtype=float)
    fit = isotonic_fit(xs, 2 + 0.05 * xs**2)
    assert smallest_stable_group(fit, 0.0, 1.0, 1.0, k_cap=1, max_files=40) == (4, 1)


def test_gap_between_size_and_fitted_time_stays_about_c():
    for slope in (0.1, 0.5, 0.8):
        xs = np.arange(1, 400, dtype=float)
        fit = isotonic_fit(xs, 1 + slope * xs)
        x, _ = smallest_stable_group(fit, 0.0, 1.0, 2.0, k_cap=1, max_files=399)
        gap = x - float(predict(fit, x))
        assert 2.0 <= gap < 2.0 + 1.0  # c plus at most one grid step of slack


def test_slow_start_explores_five_sizes_then_uses_the_model():
    state = ControlState.new(EpochSizeConfig(initial_files=4, partitions=(2,), initial_partitions=2),
                             GroupSizeConfig(k0=1))
    decisions = drive(state, [1000.0] * 12)
    sizes = {d.epoch_size for d in decisions[:10]}
    assert len(sizes) >= 5
    assert any(d.reason.startswith("slow start") for d in decisions)
    assert decisions[-1].reason.startswith("stable")
    # analytic: x >= F + c + k * (2.1 + 0.375 x)  ->  x = ceil(14.1 / 0.625) = 23 with k = 1
    assert abs(decisions[-1].epoch_size - 23) <= 1 and decisions[-1].k == 1


def test_partition_hill_climb_reaches_the_best_partition_count():
    state = ControlState.new(EpochSizeConfig(partitions=(1, 2, 3, 4, 6, 8, 12, 16)), GroupSizeConfig(k0=1))
    decisions = drive(state, [1500.0] * 80)
    final = decisions[-1]
    # the model's latency at each P's own smallest stable size; the best is within one grid step
    grid = (1, 2, 3, 4, 6, 8, 12, 16)
    spans = {}
    for p in grid:
        xs = np.arange(1, 400)
        ok = xs >= F + 2.0 + np.array([epoch_time(int(x), p, 1500.0) for x in xs])
        spans[p] = int(xs[ok][0]) if ok.any() else 10**9
    best = min(spans, key=spans.__getitem__)
    assert abs(grid.index(final.partitions) - grid.index(best)) <= 1
    assert final.reason == "stable"


def test_recurring_rate_converges_faster_the_second_time():
    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2), GroupSizeConfig(k0=1))

    def groups_to_settle(rate: float) -> int:
        ds = drive(state, [rate] * 25)
        final = ds[-1].epoch_size
        return next(i for i, d in enumerate(ds) if all(e.epoch_size == final for e in ds[i:]))

    drive(state, [800.0] * 25)
    first = groups_to_settle(2400.0)
    drive(state, [800.0] * 25)
    second = groups_to_settle(2400.0)
    assert first >= 5 and second < first


def test_catch_up_uses_larger_epochs_then_returns_to_the_stable_size():
    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2, max_epoch_records=120_000),
                             GroupSizeConfig(k0=4))
    stable = drive(state, [1000.0] * 15)[-1]
    assert stable.reason.startswith("stable")
    catch = plan_next(state, Observation(1000.0, 1.0, backlog_files=1000))
    assert catch.reason == "catch-up" and catch.epoch_size > stable.epoch_size
    assert catch.epoch_size <= 120  # memory budget: 120,000 records at 1,000 records per file
    back = plan_next(state, Observation(1000.0, 1.0, backlog_files=5))
    assert back == stable


def test_round_trip_gives_the_same_decisions():
    state = ControlState.new()
    drive(state, [900.0] * 10 + [1900.0] * 10)
    blob = json.dumps(state.to_dict())
    restored = ControlState.from_dict(json.loads(blob))
    assert json.dumps(restored.to_dict()) == blob
    rates = [1900.0] * 5 + [900.0] * 5
    assert drive(restored, rates) == drive(state, rates)


def test_plan_next_is_idempotent_for_the_same_group():
    state = ControlState.new()
    d0 = plan_next(state, Observation(1000.0, 1.0, 0))
    result = GroupResult(7, (d0.epoch_size,) * d0.k, (5.0,) * d0.k, F, d0.partitions, 1000.0, 1.0, d0.reason)
    d1 = plan_next(state, Observation(1000.0, 1.0, 0, result))
    snapshot = json.dumps(state.to_dict())
    assert plan_next(state, Observation(1000.0, 1.0, 0, result)) == d1  # the sensor polls again
    assert json.dumps(state.to_dict()) == snapshot


def test_fire_reason():
    d = Decision(epoch_size=10, k=3, partitions=2, reason="stable", predicted_wall_s=40.0)
    from sluice.protocol import plan_ranges

    # The run plans from a backlog never more epochs than it holds.
    assert d.group_files == 30
    assert len(plan_ranges(0, 25, d.epoch_size, d.k)) == 3 and len(plan_ranges(0, 12, d.epoch_size, d.k)) == 2
    assert fire_reason(d, 30, 5.0, 300.0) == "efficient group"
    assert fire_reason(d, 5, 100.0, 300.0) is None
    assert fire_reason(d, 5, 261.0, 300.0) == "freshness"
    assert fire_reason(d, 0, 1000.0, 300.0) is None


def test_rejects_bad_config():
    with pytest.raises(ValueError):
        EpochSizeConfig(partitions=(4, 2))
    with pytest.raises(ValueError):
        EpochSizeConfig(initial_partitions=5)
