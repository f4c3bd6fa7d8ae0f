"""``control.objective: cost``: the deadline plan waits as long as the freshness SLA allows and
then takes the whole backlog (pure, no Spark or Airflow)."""

from __future__ import annotations

import math

import pytest

from sluice.control import deadline_plan

MEASURED = {"max_epoch_files": 50, "max_k": 8, "partitions": 2, "coordination_s": 10.0, "seconds_per_file": 0.5}


@pytest.mark.parametrize("backlog,oldest", [(1, 0.0), (20, 30.0), (40, 29.0)])
def test_waits_while_the_sla_leaves_room(backlog, oldest):
    decision, fire = deadline_plan(backlog, oldest, 60.0, **MEASURED)
    wall = 10.0 + 0.5 * backlog
    assert decision.predicted_wall_s == pytest.approx(wall)
    assert oldest + wall < 60.0 and fire is None


def test_fires_when_waiting_longer_breaks_the_sla_counting_the_lead():
    # 30 files: predicted wall 10 + 15 = 25 s; with 5 s of lead the deadline is at age 30 s.
    assert deadline_plan(30, 29.9, 60.0, **MEASURED, lead_s=5.0)[1] is None
    assert deadline_plan(30, 30.0, 60.0, **MEASURED, lead_s=5.0)[1] == "freshness"
    assert deadline_plan(30, 35.0, 60.0, **MEASURED)[1] == "freshness"


@pytest.mark.parametrize("backlog", [1, 49, 50, 51, 230, 399])
def test_the_group_covers_the_whole_backlog_in_epochs_within_the_memory_budget(backlog):
    decision, _ = deadline_plan(backlog, 0.0, 60.0, **MEASURED)
    assert 1 <= decision.epoch_size <= 50
    assert decision.k == math.ceil(backlog / decision.epoch_size) <= 8
    assert decision.epoch_size * decision.k >= backlog
    assert decision.partitions == 2 and decision.reason.startswith("deadline")


def test_a_backlog_beyond_the_largest_group_fires_at_once_and_takes_the_largest_group():
    decision, fire = deadline_plan(400, 0.0, 600.0, **MEASURED)
    assert fire == "full group" and (decision.epoch_size, decision.k) == (50, 8)
    decision, fire = deadline_plan(1000, 0.0, 600.0, **MEASURED)
    assert fire == "full group" and (decision.epoch_size, decision.k) == (50, 8)
    assert decision.predicted_wall_s == pytest.approx(10.0 + 0.5 * 400)  # the group's files, not the backlog


def test_without_measurements_it_assumes_half_the_sla():
    unmeasured = {**MEASURED, "coordination_s": None}
    assert deadline_plan(5, 29.0, 60.0, **unmeasured)[1] is None
    decision, fire = deadline_plan(5, 30.0, 60.0, **unmeasured)
    assert fire == "freshness" and "nothing measured" in decision.reason
    assert deadline_plan(5, 30.0, 60.0, **{**MEASURED, "seconds_per_file": None})[1] == "freshness"


def test_nothing_to_do_never_fires():
    assert deadline_plan(0, 1e6, 60.0, **MEASURED)[1] is None
