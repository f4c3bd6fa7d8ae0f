"""Freshness: the age of a pipeline's oldest unpublished data against its SLA, and the alerts
its changes raise (epoch store on SQLite; no Spark, no Airflow)."""

from __future__ import annotations

from sluice import freshness
from sluice.paths import project_root
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.sources import Backlog
from sluice.spec import load_spec
from sluice.store import EpochStore
from tests.unit.test_epoch_store import commit_all


def backlog(oldest_age_s: float | None) -> Backlog:
    return Backlog(files=0 if oldest_age_s is None else 1, bytes=0, oldest_age_s=oldest_age_s, next_offset=0)


def test_alerts_on_entering_and_leaving_a_breach_once():
    assert freshness.transition(None, True) == freshness.BREACHED  # already stale when first seen
    assert freshness.transition(None, False) is None
    assert freshness.transition(False, True) == freshness.BREACHED
    assert freshness.transition(True, True) is None
    assert freshness.transition(True, False) == freshness.RECOVERED
    assert freshness.transition(False, False) is None


def test_age_of_the_oldest_unpublished_data_planned_or_waiting(tmp_path):
    spec = load_spec(project_root() / "include" / "pipelines" / "ysb.yaml")  # SLA 120 s
    log = EpochStore(f"sqlite:///{tmp_path}/s.db")
    now = 10_000.0
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, now - 500 + i) for i in range(4)])
    assert freshness.measure(spec, log, backlog(None), now).age_s is None  # registered, not planned: the backlog's
    lease = acquire_lease(log, spec.name, "run")
    group = plan_group(log, lease, epoch_size=2, k=1)  # files 0-1 planned, not published
    fresh = freshness.measure(spec, log, backlog(30.0), now)
    assert fresh.age_s == 500.0 and fresh.breached and fresh.as_dict()["sla_s"] == 120
    commit_all(log, lease, group)
    log.finish_group(lease, group.group_id)
    fresh = freshness.measure(spec, log, backlog(30.0), now)  # published: only the backlog is waiting
    assert fresh.age_s == 30.0 and not fresh.breached
    log.close()


def test_the_sla_floor_is_twice_the_median_group_wall_plus_a_poll():
    from datetime import datetime, timedelta

    from sluice.store import Epoch

    t0 = datetime(2026, 1, 1)

    def epoch(epoch_id: int, group_id: int, planned_s: float, published_s: float | None) -> Epoch:
        return Epoch("p", epoch_id, 0, group_id, epoch_id, epoch_id + 1, "published", planned_at=t0 + timedelta(
            seconds=planned_s), published_at=None if published_s is None else t0 + timedelta(seconds=published_s))

    # group 0: two epochs, 0 -> 30 s; group 1: 40 -> 60 s; group 2: 70 -> 150 s; group 3 unpublished
    epochs = [epoch(0, 0, 0, 20), epoch(1, 0, 1, 30), epoch(2, 1, 40, 60), epoch(3, 2, 70, 150), epoch(4, 3, 160, None)]
    assert freshness.group_walls(epochs) == [30.0, 20.0, 80.0]
    held = freshness.sla_floor(120, 5, epochs)
    assert (held.group_wall_s, held.floor_s, held.feasible, held.groups) == (30.0, 65.0, True, 3)
    missed = freshness.sla_floor(60, 5, epochs)
    assert missed.feasible is False and "raise control.freshness_sla_s to 80 s" in missed.explanation().lower()
    assert freshness.sla_floor(60, 5, epochs, groups=1).group_wall_s == 80.0  # only the last group
    nothing = freshness.sla_floor(60, 5, epochs[-1:])
    assert nothing.floor_s is None and nothing.feasible is None and nothing.as_dict()["feasible"] is None
