"""Freshness: the age of a pipeline's oldest unpublished data against its SLA, and the alerts
its changes raise (epoch store on SQLite; no Spark, no Airflow)."""

from __future__ import annotations

from sluice import freshness
from sluice.paths import project_root
from sluice.sources import Backlog
from sluice.spec import load_spec
from sluice.store import EpochLog
from tests.unit.test_epoch_log import commit_all


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
    log = EpochLog(f"sqlite:///{tmp_path}/s.db")
    now = 10_000.0
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, now - 500 + i) for i in range(4)])
    assert freshness.measure(spec, log, backlog(None), now).age_s is None  # registered, not planned: the backlog's
    lease = log.acquire_lease(spec.name, "run")
    group = log.plan_group(lease, epoch_size=2, k=1)  # files 0-1 planned, not published
    fresh = freshness.measure(spec, log, backlog(30.0), now)
    assert fresh.age_s == 500.0 and fresh.breached and fresh.as_dict()["sla_s"] == 120
    commit_all(log, lease, group)
    log.finish_group(lease, group.group_id, "published")
    fresh = freshness.measure(spec, log, backlog(30.0), now)  # published: only the backlog is waiting
    assert fresh.age_s == 30.0 and not fresh.breached
    log.close()
