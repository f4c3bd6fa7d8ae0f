"""The control simulator: record conservation, latency accounting, baselines on toy models."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bench.simulator import FPI, REDUCE, Fixed, Oracle, Simulator, Sluice, Workload, constant, markov, step
from sluice.control import GroupSizeConfig

QUIET = Workload("toy", "reduce", per_record=5e-4, coordination_s=10.0, noise=0.0, coordination_noise=0.0)


def check_conservation(sim: Simulator, run) -> None:
    ranges = run.processed_files
    assert ranges[0][0] == 0 and ranges[-1][1] == sim.n_files
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous: no gap, no overlap
    assert all(s < e for s, e in ranges)
    assert run.records == int(sim.records.sum()) == sum(int(sim.R[e] - sim.R[s]) for s, e in ranges)


@pytest.mark.parametrize("method", [lambda: Fixed(7, 3, 2), lambda: FPI(), lambda: Sluice(), lambda: Oracle(REDUCE)])
def test_every_record_is_processed_exactly_once(method):
    sim = Simulator(REDUCE, markov((400.0, 900.0, 1400.0), 300, 3600, seed=3), seed=1)
    check_conservation(sim, sim.run(method()))


def test_latency_of_a_fixed_group_is_exact():
    # 1,000 records/s in 1 file/s, groups of 2 x 15 files at P = 2: every group fires when its
    # 30th file lands and takes F + 2 * p(15,000 records) < 30 s; mean latency = wall + 29/2 s.
    sim = Simulator(QUIET, constant(1000.0, 600), seed=0)
    run = sim.run(Fixed(15, 2, 2))
    wall = 10.0 + 2 * float(QUIET.epoch_s(15_000, 2))
    assert wall < 30 and len(run.groups) == 20
    assert all(g["wall"] == pytest.approx(wall) for g in run.groups)
    assert run.mean_latency_s == pytest.approx(wall + 14.5, rel=1e-6)
    assert run.busy_s == pytest.approx(wall * len(run.groups))


def test_mean_latency_since_counts_only_the_files_that_landed_after():
    # a rate that steps from 500 to 1,200 records/s at 300 s, groups of 2 x 15 files: every file
    # of group g (files 30g .. 30g + 29, landing at 30g + 1 .. 30g + 30 s) publishes at
    # 30(g + 1) + its wall, which grows with the group's records (oracle from the trace itself)
    sim = Simulator(QUIET, step((500.0, 1200.0), (300.0, 300.0)), seed=0)
    run = sim.run(Fixed(15, 2, 2))
    lat, weight = {0: 0.0, 300: 0.0}, {0: 0.0, 300: 0.0}
    for i in range(600):
        landed, rate = i + 1.0, 500.0 if i < 300 else 1200.0
        wall = 10.0 + 2 * float(QUIET.epoch_s(15 * rate, 2))
        assert wall < 30  # each group ends before the next one's files have landed
        for since in lat:
            if landed >= since:
                lat[since] += (30 * (i // 30 + 1) + wall - landed) * rate
                weight[since] += rate
    assert sim.mean_latency_since(run, 0.0) == pytest.approx(run.mean_latency_s, rel=1e-9)
    assert sim.mean_latency_since(run, 0.0) == pytest.approx(lat[0] / weight[0], rel=1e-9)
    assert sim.mean_latency_since(run, 300.0) == pytest.approx(lat[300] / weight[300], rel=1e-9)
    assert sim.mean_latency_since(run, 300.0) > sim.mean_latency_since(run, 0.0)


def test_fixbi_grid_search_finds_the_known_optimum():
    """On a noise-free constant rate, the best static configuration is the stable (x, k, P) with
    the lowest ``wall + (span - 1) / 2``; the simulated grid search must find exactly that one."""
    rate, f = 1000.0, 1.0
    sim = Simulator(QUIET, constant(rate, 1800), seed=0, abort_backlog_files=400)
    grid = list(itertools.product(range(4, 61, 4), (1, 2, 3), (1, 2, 4, 8)))
    simulated = {}
    for x, k, p in grid:
        run = sim.run(Fixed(x, k, p))
        if not run.aborted:
            simulated[(x, k, p)] = run.mean_latency_s
    analytic = {}
    for x, k, p in grid:
        wall = QUIET.coordination_s + k * float(QUIET.epoch_s(x * rate / f, p))
        if wall <= k * x / f:
            analytic[(x, k, p)] = wall + (k * x / f - 1 / f) / 2
    best = min(analytic, key=analytic.__getitem__)
    assert min(simulated, key=simulated.__getitem__) == best
    assert simulated[best] == pytest.approx(analytic[best], rel=0.02)


def test_fpi_converges_to_its_relaxed_fixed_point():
    # per-epoch share omega(x) = F/3 + p(x) must approach rho * x / f on a linear model
    sim = Simulator(QUIET, constant(1000.0, 3 * 3600), seed=0)
    fpi = FPI(rho=0.7)
    run = sim.run(fpi)
    last = run.groups[-5]
    omega = last["wall"] / last["k"]
    assert omega == pytest.approx(0.7 * last["epoch_size"], rel=0.08)


def test_sluice_beats_fpi_and_nears_the_oracle_on_a_constant_rate():
    sim = Simulator(REDUCE, constant(1200.0, 4 * 3600), seed=0)
    s = sim.run(Sluice(group=GroupSizeConfig(k0=3)))
    o = sim.run(Oracle(REDUCE))
    f = sim.run(FPI())
    assert s.mean_latency_s < f.mean_latency_s
    assert s.mean_latency_s < 1.3 * o.mean_latency_s


def test_sluice_state_survives_persistence():
    sim = Simulator(REDUCE, constant(900.0, 2 * 3600), seed=2)
    plain = sim.run(Sluice())
    persisted = sim.run(Sluice(persist_every=1))  # to_dict/from_dict after every group
    assert [g["epoch_size"] for g in plain.groups] == [g["epoch_size"] for g in persisted.groups]


def test_traces():
    tr = markov((1.0, 2.0, 3.0), 10.0, 1000.0, seed=0)
    rates = tr.rate(np.arange(0, 1000, 1.0))
    assert set(np.unique(rates)) <= {1.0, 2.0, 3.0}
    changes = np.nonzero(np.diff(rates))[0] + 1
    assert all(c % 10 == 0 for c in changes)
    st = step((1.0, 3.0, 1.0, 3.0), (10.0, 10.0, 10.0, 10.0))
    assert list(st.rate(np.array([5.0, 15.0, 25.0, 35.0]))) == [1.0, 3.0, 1.0, 3.0]
    assert st.duration_s == 40.0 and len(st.segments) == 4


def test_the_family_covers_every_shape_and_cost_model_and_is_reproducible():
    from bench.simulator import FAMILY_COSTS, FAMILY_SHAPES, capacity_rps, family_member

    members = [family_member(seed, 1800) for seed in range(48)]
    assert {(m.shape, m.cost) for m in members} == {(s, c) for s in FAMILY_SHAPES for c in FAMILY_COSTS}
    again = family_member(7, 1800)
    t = np.arange(0, 1800, 7.0)
    assert np.array_equal(again.trace.rate(t), members[7].trace.rate(t)) and again.workload == members[7].workload
    for m in members:
        rates = m.trace.rate(np.arange(0, 1800, 1.0))
        assert 5 <= m.workload.coordination_s <= 30 and 0.25 <= m.load <= 0.7
        assert m.capacity_rps == pytest.approx(capacity_rps(m.workload))
        assert rates.min() >= 0 and rates.max() > 0
    assert any(m.trace.rate(np.arange(0, 1800, 1.0)).max() > m.capacity_rps for m in members)  # above capacity
    cliff = next(m for m in members if m.cost == "cliff").workload
    below, above = cliff.cliff_records * 0.9, cliff.cliff_records * 1.1
    steep = (cliff.epoch_s(above * 1.1, 2) - cliff.epoch_s(above, 2)) / (0.1 * above)
    flat = (cliff.epoch_s(below, 2) - cliff.epoch_s(below / 1.1, 2)) / (below - below / 1.1)
    assert steep > 3 * flat  # past the cliff a record costs several times more


def test_the_pruned_fixbi_search_finds_the_exhaustive_optimum(monkeypatch):
    from bench import control

    grid = {"FIX_X": (2, 4, 6, 8, 12, 16, 24, 32, 48, 64), "FIX_K": (1, 2, 3, 4), "FIX_P": (1, 2, 4, 8)}
    for name, values in grid.items():  # a smaller grid, the search's own code
        monkeypatch.setattr(control, name, values)
    trace = markov((400.0, 900.0, 1400.0), 300, 1800, seed=3)
    run, cfg = control.fixbi(REDUCE, trace, seed=1)
    sim = Simulator(REDUCE, trace, seed=1, abort_backlog_files=3600)
    runs = {(x, k, p): sim.run(Fixed(x, k, p)) for p in grid["FIX_P"] for k in grid["FIX_K"] for x in grid["FIX_X"]}
    best = min((r.mean_latency_s, cfg) for cfg, r in runs.items() if not r.aborted)
    assert cfg == best[1] and run.mean_latency_s == pytest.approx(best[0])


def test_a_backlog_always_has_a_measured_rate():
    """After the last file landed (or in a silence) the rate over the last minute is 0, but the
    backlog's files hold records: the view measures them."""
    sim = Simulator(QUIET, step((1000.0, 0.0), (120.0, 600.0)), seed=0)
    assert sim.measured_rate(300.0) == 0.0
    assert sim.measured_rate(300.0, next_file=60) == pytest.approx(60 * 1000.0 / 240.0)
    view = sim.view(300.0, 60)
    assert view.rate_rps > 0 and view.backlog_records == 60 * 1000.0
