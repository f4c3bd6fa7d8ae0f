"""AIMD group sizing (Drizzle §3.4): multiplicative increase, additive decrease, EWMA, backlog cap."""

from __future__ import annotations

import json

import pytest

from sluice.control import GroupSizeConfig, GroupSizeController


def test_increases_multiplicatively_above_the_band():
    g = GroupSizeController(GroupSizeConfig(k0=2))
    assert g.observe(coordination_s=5, wall_s=20, epochs_run=2) == 4  # 25% > 10%
    assert g.observe(coordination_s=5, wall_s=20, epochs_run=4) == 8


def test_decreases_additively_below_the_band():
    g = GroupSizeController(GroupSizeConfig(k0=10, k_max=64))
    assert g.observe(coordination_s=1, wall_s=100, epochs_run=10) == 9  # 1% < 5%
    assert g.observe(coordination_s=1, wall_s=100, epochs_run=9) == 8


def test_holds_inside_the_band():
    g = GroupSizeController(GroupSizeConfig(k0=6))
    for _ in range(5):
        assert g.observe(coordination_s=7, wall_s=100, epochs_run=6) == 6
    assert g.last_action == "hold: in band"


def test_never_more_epochs_than_the_backlog_holds():
    g = GroupSizeController(GroupSizeConfig(k0=16))
    assert g.limit(backlog_epochs=3) == 3
    assert g.limit(backlog_epochs=0) == 1
    assert g.limit(backlog_epochs=100) == 16


def test_no_increase_when_the_group_was_cut_short_by_the_backlog():
    g = GroupSizeController(GroupSizeConfig(k0=8))
    assert g.observe(coordination_s=10, wall_s=20, epochs_run=2) == 8
    assert g.last_action.startswith("hold: group limited")


def test_single_spike_is_smoothed():
    g = GroupSizeController(GroupSizeConfig(k0=6, alpha=0.3))
    for _ in range(10):
        g.observe(coordination_s=7, wall_s=100, epochs_run=6)
    g.observe(coordination_s=15, wall_s=100, epochs_run=6)  # one 15% group: alone it is above the band
    assert g.k == 6 and 0.05 <= g.overhead <= 0.10


def test_reproduces_drizzle_fig11_shape():
    """Overhead = F / (F + k * p) falls with k: climb x2 from k0 = 2 into the band; smaller epochs
    settle at a larger k; when epochs get heavier, k comes down additively into the band."""

    def run(g: GroupSizeController, p: float, groups: int) -> list[int]:
        ks = []
        for _ in range(groups):
            g.observe(coordination_s=1.0, wall_s=1.0 + g.k * p, epochs_run=g.k)
            ks.append(g.k)
        return ks

    small = GroupSizeController(GroupSizeConfig(k0=2, k_max=1024))
    ks = run(small, 0.1, 30)
    assert ks[:6] == [4, 8, 16, 32, 64, 128]
    assert 0.05 <= small.overhead <= 0.10
    big = GroupSizeController(GroupSizeConfig(k0=2, k_max=1024))
    run(big, 0.25, 30)
    assert big.k < small.k
    down = run(small, 0.3, 100)  # heavier epochs: overhead 1/(1+38) < 5%
    steps = [a - b for a, b in zip([128, *down], down, strict=False) if a != b]
    assert steps and set(steps) == {1}
    assert 0.05 <= 1 / (1 + small.k * 0.3) <= 0.10


def test_round_trip():
    g = GroupSizeController(GroupSizeConfig(k0=3, lower=0.02, upper=0.2))
    g.observe(coordination_s=10, wall_s=30, epochs_run=3)
    back = GroupSizeController.from_dict(json.loads(json.dumps(g.to_dict())))
    assert back == g
    assert back.observe(10, 30, back.k) == g.observe(10, 30, g.k)


@pytest.mark.parametrize("kwargs", [{"lower": 0.2, "upper": 0.1}, {"k0": 0}, {"increase": 1.0}, {"k0": 100}])
def test_rejects_bad_config(kwargs):
    with pytest.raises(ValueError):
        GroupSizeConfig(**kwargs)


def test_a_drain_group_updates_the_coordination_time_but_not_k():
    """A catch-up group's k is the backlog's: its low overhead must not walk AIMD's k down."""
    g = GroupSizeController(GroupSizeConfig(k0=6))
    assert g.observe(coordination_s=10, wall_s=1000, epochs_run=40, adjust=False) == 6
    assert g.coordination_s == 10 and g.last_action.startswith("hold")
    assert g.observe(coordination_s=10, wall_s=1000, epochs_run=6) == 5  # its own group: 1% < 5%
