"""The A-scheduler side, pure: dependency classes, pool weights, and the concurrency tuner on
synthetic throughput curves whose best level is known."""

from __future__ import annotations

import pytest

from sluice.control.concurrency import ConcurrencyConfig, ConcurrencyController, epoch_dependency, pool_weights


def test_only_append_pipelines_are_independent():
    assert epoch_dependency(["append"]) == "independent"
    assert epoch_dependency(["append", "append"]) == "independent"
    assert epoch_dependency(["append", "aggregate"]) == "dependent"
    assert epoch_dependency(["upsert"]) == "dependent"


def test_older_epochs_get_heavier_pools():
    weights = pool_weights([12, 10, 11, 13])
    assert [weights[e] for e in (10, 11, 12, 13)] == [8, 7, 6, 5]
    assert min(pool_weights(list(range(20))).values()) == 1


def drive(controller: ConcurrencyController, curve: dict[int, float], latency: dict[int, float],
          groups: int) -> list[int]:
    levels = []
    for _ in range(groups):
        level = controller.next_level()
        levels.append(level)
        controller.observe(level, curve[level], latency[level])
    return levels


@pytest.mark.parametrize("peak", [1, 2, 3, 4])
def test_hill_climb_settles_on_the_best_level(peak):
    curve = {lv: 1000 - 150 * abs(lv - peak) for lv in range(1, 5)}
    levels = drive(ConcurrencyController(ConcurrencyConfig(max_level=4, explore_every=100)), curve,
                   dict.fromkeys(curve, 10.0), 12)
    best = max(curve, key=curve.get)
    assert levels[-4:] == [best] * 4, levels


def test_hill_climb_backs_off_when_the_sla_breaks():
    curve = {1: 100.0, 2: 180.0, 3: 250.0, 4: 300.0}
    latency = {1: 10.0, 2: 20.0, 3: 70.0, 4: 90.0}  # levels 3 and 4 break a 60 s SLA
    levels = drive(ConcurrencyController(ConcurrencyConfig(max_level=4, latency_sla_s=60, explore_every=100)),
                   curve, latency, 12)
    assert 4 not in levels[-6:] and levels[-1] <= 3, levels
    assert levels.count(2) >= 4, levels


def test_hill_climb_reprobes_after_a_while():
    curve = {1: 100.0, 2: 200.0, 3: 150.0}
    levels = drive(ConcurrencyController(ConcurrencyConfig(max_level=3, explore_every=3)), curve,
                   dict.fromkeys(curve, 1.0), 20)
    assert levels.count(2) >= 12 and {1, 3} <= set(levels[4:]), levels


def test_sarsa_prefers_the_best_level():
    curve = {1: 300.0, 2: 1000.0, 3: 600.0, 4: 400.0}
    levels = drive(ConcurrencyController(ConcurrencyConfig(max_level=4, method="sarsa", epsilon=0.1, seed=3)),
                   curve, dict.fromkeys(curve, 1.0), 200)
    assert levels[-50:].count(2) >= 30, levels[-50:]


def test_state_round_trips():
    controller = ConcurrencyController(ConcurrencyConfig(max_level=3))
    controller.observe(1, 100.0, 5.0)
    controller.observe(2, 150.0, 5.0)
    again = ConcurrencyController.from_dict(controller.to_dict())
    assert again == controller and again.next_level() == controller.next_level() == 3
