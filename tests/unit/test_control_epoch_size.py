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
    EpochSizeController,
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
        times = tuple(epoch_time(x, d.partitions, rate) for x in d.epoch_files())
        last = GroupResult(gid, d.epoch_files(), times, F, d.partitions, rate, 1.0, d.reason)
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


def unstable_groups(state: ControlState, rates: list[float], coordination_s: float) -> list[bool]:
    """Drive groups (1 file/s) and say, per group, whether its wall outran its data span: the
    backlog grew while it ran, so it and the groups after it miss the freshness they planned."""
    flags, last = [], None
    for gid, rate in enumerate(rates):
        d = plan_next(state, Observation(rate, 1.0, 0, last))
        times = tuple(epoch_time(x, d.partitions, rate) for x in d.epoch_files())
        flags.append(coordination_s + sum(times) > d.group_files)
        last = GroupResult(gid, d.epoch_files(), times, coordination_s, d.partitions, rate, 1.0, d.reason)
    return flags


def test_the_first_group_is_sized_from_the_fixed_cost_not_from_a_small_guess():
    state = ControlState.new(EpochSizeConfig(initial_files=4, partitions=(2,), initial_partitions=2),
                             GroupSizeConfig(k0=1))
    first = plan_next(state, Observation(1000.0, 1.0, 0))
    # nothing measured: F is the 20 s prior, no per-record cost: x/f >= 20 + c (2 s)
    assert (first.epoch_size, first.k) == (22, 1) and first.predicted_wall_s == 20.0
    assert "from the fixed cost 20.0 s" in first.reason
    # A group's fixed cost of 20 s against 4 files (the old start) made slow start double through
    # four unstable groups (4, 8, 16, 32 files). Now the first group can only miss by its
    # per-record work, which it measures: the second goes straight to a stable size, and the only
    # unstable groups after it are slow start's probes below the smallest stable size.
    flags = unstable_groups(state, [1000.0] * 12, coordination_s=20.0)
    assert not flags[1] and sum(flags) <= 3 and not any(flags[5:])


def test_a_new_rate_starts_from_the_measured_costs_within_the_size_limit():
    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2), GroupSizeConfig(k0=1))
    drive(state, [800.0] * 12)
    a, b = state.epoch.epoch_cost()
    assert a > 0 and b > 0
    # Three times the rate: a new rate bin, 90% of capacity, whose smallest stable size (141 files,
    # 338,000 records) is 20 times the largest epoch measured. The first group goes as far as the
    # size limit allows (4x the largest epoch on a linear curve, the first step of a probe that a
    # join or a memory cliff would stop), the next from what that measured, then the stable size.
    xs = np.arange(1, 400)
    true_stable = int(xs[xs >= F + 2.0 + np.array([epoch_time(int(x), 2, 2400.0) for x in xs])][0])
    limit = state.epoch.size_limit_records()
    assert limit == pytest.approx(4 * state.epoch.curve.largest())
    decisions = drive(state, [2400.0] * 6)
    assert decisions[0].epoch_size == int(limit // 2400.0)
    assert decisions[0].reason.startswith("overload")
    assert all(abs(d.epoch_size - true_stable) <= 1 and d.reason == "stable" for d in decisions[3:])
    assert abs(decisions[-1].predicted_wall_s - (F + epoch_time(true_stable, 2, 2400.0))) < 0.1 * F


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
    # the cost curve carries what 800 records/s measured to the new rate: a few groups the first
    # time (the size limit's steps), none the second
    assert 1 <= first <= 4 and second < first


def test_catch_up_takes_more_epochs_of_an_efficient_size_then_returns_to_the_stable_size():
    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2, max_epoch_records=120_000),
                             GroupSizeConfig(k0=4))
    stable = drive(state, [1000.0] * 15)[-1]
    assert stable.reason.startswith("stable")
    catch = plan_next(state, Observation(1000.0, 1.0, backlog_files=1000))
    # Reduce-like work: larger epochs amortise the fixed cost per epoch, so the drain may use
    # larger ones than the stable size, within the size limit, and many of them; one epoch of a
    # size not measured yet (the probe, first), the rest at a measured one
    largest = max(catch.epoch_files())
    assert catch.reason.startswith("catch-up") and largest > stable.epoch_size and catch.k > 1
    assert largest * 1000.0 <= state.epoch.size_limit_records()
    assert largest <= 120  # memory budget: 120,000 records at 1,000 records per file
    assert sum(x * 1000.0 > state.epoch.curve.largest() for x in catch.epoch_files()) <= 1, catch
    # a backlog a few files short of the stable group: the group waits for the rest, as before
    back = plan_next(state, Observation(1000.0, 1.0, backlog_files=stable.epoch_size * stable.k - 3))
    assert back == stable


def test_files_waiting_are_taken_now_rather_than_idle_longer_than_a_fixed_cost():
    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2), GroupSizeConfig(k0=4))
    stable = drive(state, [1000.0] * 15)[-1]
    span = stable.epoch_size * stable.k
    assert stable.reason == "stable" and span - 5 > F
    # 5 files wait and the stable group spans more than F seconds beyond them: waiting for the
    # rest would leave the engine idle longer than one more group's fixed cost, so the 5 go now
    now = plan_next(state, Observation(1000.0, 1.0, backlog_files=5))
    assert now.reason == "stable" and now.epoch_size * now.k == 5
    assert now.predicted_wall_s < stable.predicted_wall_s
    # within F of the stable span, or with nothing waiting, the stable group is planned as before
    assert plan_next(state, Observation(1000.0, 1.0, backlog_files=span - 3)) == stable
    assert plan_next(state, Observation(1000.0, 1.0, backlog_files=0)) == stable


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


def test_superlinear_work_under_a_burst_is_not_driven_into_ever_larger_epochs():
    """Join-like work (time quadratic in the records): catch-up must pick the size that drains
    fastest on the measured curve, not keep growing the epoch because larger amortises F."""

    def join_time(files: int) -> float:
        records = files * 1000.0
        return 1.0 + 2e-4 * records + 4e-9 * records**2

    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2, max_epoch_records=2_000_000),
                             GroupSizeConfig(k0=1))
    last, catch_up = None, []
    for gid in range(40):
        d = plan_next(state, Observation(1000.0, 1.0, 10 if gid < 12 else 3000, last))  # then a burst
        times = tuple(join_time(x) for x in d.epoch_files())
        last = GroupResult(gid, d.epoch_files(), times, F, d.partitions, 1000.0, 1.0, d.reason)
        if d.reason == "catch-up":
            catch_up.append((d.epoch_size, d.k, d.k * d.epoch_size / (F + sum(times))))
    assert len(catch_up) >= 20
    assert max(x for x, _, _ in catch_up) <= 4 * 22  # one probe at twice the largest size seen, no more
    xs = np.arange(1, 2000)
    for x, k, throughput in catch_up[-10:]:
        best = float(np.max(k * xs / (F + k * join_time(xs))))  # the fastest drain at this k
        assert throughput >= 0.9 * best, (x, k, throughput, best)


def test_slow_start_drains_a_backlog_with_more_epochs_of_its_probe():
    state = ControlState.new(EpochSizeConfig(partitions=(2,), initial_partitions=2), GroupSizeConfig(k0=8))
    d = plan_next(state, Observation(1000.0, 1.0, backlog_files=100))
    assert d.reason.startswith("slow start") and (d.epoch_size, d.k) == (22, 4)  # 100 // 22 epochs, k cap 8
    assert plan_next(state, Observation(1000.0, 1.0, backlog_files=30)).k == 1


def test_measured_memory_bounds_the_epoch_below_the_constant_ceiling():
    """Peak = 100 MB + 2 MB per 1,000 records against 1,000 MB of unified memory at a 0.5 share:
    (500 - 100) / 0.002 = 200,000 records, below the 400,000 ceiling."""
    ctl = EpochSizeController(EpochSizeConfig(max_epoch_records=400_000, memory_fraction=0.5))
    assert ctl.memory_limit_records() is None and ctl.max_records() == 400_000
    for records in (10_000, 50_000, 100_000):
        ctl.record_memory(records, 100 + 2 * records / 1000, 0.0, 1000.0, "epoch")
    assert ctl.memory_limit_records() == pytest.approx(200_000, abs=1)
    assert ctl.max_files(rate_rps=1000.0, file_rate=1.0) in (199, 200)  # 1,000 records a file
    # round trip through the store's JSON, and state saved before memory was measured
    again = EpochSizeController.from_dict(json.loads(json.dumps(ctl.to_dict())))
    assert again.memory_limit_records() == ctl.memory_limit_records()
    old = ctl.to_dict()
    del old["memory"]
    assert EpochSizeController.from_dict(old).max_records() == 400_000


def test_memory_that_does_not_grow_with_records_or_a_noisy_fit_does_not_shrink_epochs():
    ctl = EpochSizeController(EpochSizeConfig(memory_fraction=0.5))
    for records, peak in ((1_000, 300.0), (2_000, 250.0), (3_000, 280.0)):
        ctl.record_memory(records, peak, 0.0, 1000.0, "epoch")
    assert ctl.memory_limit_records() is None  # falls with records: nothing learned
    noisy = EpochSizeController(EpochSizeConfig(memory_fraction=0.5))
    for records, peak in ((100, 50.0), (200, 450.0), (300, 480.0)):  # steep, but every read fit
        noisy.record_memory(records, peak, 0.0, 1000.0, "epoch")
    assert noisy.memory_limit_records() == 300  # never below the largest read that stayed within


def test_a_read_that_spilled_counts_as_the_whole_budget_and_a_group_shares_it():
    ctl = EpochSizeController(EpochSizeConfig(memory_fraction=0.5))
    for records in (20_000, 40_000):
        ctl.record_memory(records, 100 + records / 1000, 0.0, 1000.0, "group")
    ctl.record_memory(60_000, 300.0, 50.0, 1000.0, "group")  # spilled: it needed more than it had
    limit = ctl.memory_limit_records()
    assert limit is not None and 40_000 <= limit < 60_000
    # one commit per group reads its epochs together: k * x stays within the bound
    files = ctl.max_files(1000.0, 1.0)
    assert files == limit // 1000
    plan = ctl.propose(1000.0, 1.0, 10.0, k_cap=8, backlog_files=10 * files)
    assert plan.k * plan.epoch_size <= files, plan


def test_busy_unstable_slow_start_tries_more_partitions_before_a_larger_epoch():
    """A first group whose epochs alone fill most of their span (here ~95 %): a larger epoch
    would amortise only the fixed cost and walks towards sizes never measured (a memory cliff);
    the next probe keeps the size and takes the next partition count up, and a group whose
    epochs leave room grows the epoch as before. The first group's miss (its prediction rests
    on priors alone) is no fallback."""
    cfg = EpochSizeConfig(partitions=(2, 4, 8), initial_partitions=2)
    state = ControlState.new(cfg, GroupSizeConfig(k0=1))
    rate = 1000.0
    first = plan_next(state, Observation(rate, 1.0, 0))
    busy = GroupResult(0, (first.epoch_size,), (0.95 * first.epoch_size,), 5.0, first.partitions, rate, 1.0,
                       first.reason, epoch_records=(int(first.epoch_size * rate),),
                       predicted_wall_s=first.predicted_wall_s / 10)
    second = plan_next(state, Observation(rate, 1.0, 0, busy))
    assert (second.epoch_size, second.partitions) == (first.epoch_size, 4), second
    assert "fallback" not in second.reason
    assert "busy" in state.last_note and "4 partitions" in state.last_note
    # the same group with its epochs at 30 % of their span (the fixed cost made it unstable)
    state = ControlState.new(cfg, GroupSizeConfig(k0=1))
    plan_next(state, Observation(rate, 1.0, 0))
    idle = GroupResult(0, (first.epoch_size,), (0.3 * first.epoch_size,), 30.0, first.partitions, rate, 1.0,
                       first.reason, epoch_records=(int(first.epoch_size * rate),),
                       predicted_wall_s=first.predicted_wall_s)
    third = plan_next(state, Observation(rate, 1.0, 0, idle))
    assert third.partitions == 2 and third.epoch_size > first.epoch_size, third


def test_an_overloaded_drain_probes_a_gap_in_the_cost_curve_and_settles_at_the_cheapest_size():
    """Join-like work measured only at 5,000 and 55,000 records (a first group, then a tiny
    fallback): the log-log chord between them overestimates everything in the gap, where the
    cheapest records lie (sqrt(a / c) = 10,000). Overloaded, the drain probes twice the cheapest
    size measured, then twice that, and once the gap is closed it plans the measured optimum."""

    def seconds(n: float) -> float:
        return 2.4 + 2.4e-8 * n * n

    ctl = EpochSizeController(EpochSizeConfig(partitions=(2,), initial_partitions=2))
    for n in (5_000, 55_000):
        for _ in range(3):
            ctl.curve.add(n, seconds(n), 2)
    rate, probes = 2_500.0, []
    for _ in range(4):
        cu = ctl._catch_up_context(rate, 1.0, 5.0, 64, 300.0, 600, None)
        plan = ctl._catch_up_plan(cu, "overload", probe=True)
        assert plan is not None and plan.k >= 1
        probes.append((plan.epoch_size, "gap" in plan.reason))
        for _ in range(3):
            ctl.curve.add(plan.epoch_size * rate, seconds(plan.epoch_size * rate), 2)
    # the curve's bins are log-spaced (their centres, not the exact sizes): ~10,000 then ~20,000
    (x1, gap1), (x2, gap2), *rest = probes
    assert gap1 and gap2 and 7_000 <= x1 * rate <= 10_000 and 1.8 * x1 <= x2 <= 2.2 * x1, probes
    # then no probe: the cheapest measured, near the true optimum of 10,000 records
    assert all(not gap and 7_000 <= x * rate <= 12_500 for x, gap in rest), probes
