"""Across pipelines: when worker slots are short, the pipeline with the oldest backlog first
(A-scheduler §III-B applies the same rule to batches within an application).

``OldestBacklogFirst`` is an Airflow ``PriorityWeightStrategy``, registered by sluice's plugin
and set as ``weight_rule`` on every task of a pipeline DAG. Airflow asks for the weight when
it creates a run's task instances, so each run is ranked by how old its unprocessed data was
when it started.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from airflow.task.priority_strategy import PriorityWeightStrategy

if TYPE_CHECKING:
    from airflow.models.taskinstance import TaskInstance

log = logging.getLogger("sluice.priority")

#: One weight point per minute of backlog age, capped: a day-old backlog is as urgent as it gets.
MAX_AGE_POINTS = 24 * 60
_CACHE_S = 10.0
_ages: dict[str, tuple[float, float | None]] = {}


def backlog_age_s(pipeline: str) -> float | None:
    """Age in seconds of the pipeline's oldest unprocessed file (cached for a few seconds:
    a scheduler loop creates many task instances at once)."""
    cached = _ages.get(pipeline)
    if cached and time.monotonic() - cached[0] < _CACHE_S:
        return cached[1]
    from sluice.sources import FileSource
    from sluice.spec import get_spec
    from sluice.store import EpochLog, store_url

    epoch_log = EpochLog(store_url())
    try:
        age = FileSource(get_spec(pipeline), epoch_log).backlog().oldest_age_s
    finally:
        epoch_log.close()
    _ages[pipeline] = (time.monotonic(), age)
    return age


def age_points(age_s: float | None) -> int:
    return 0 if not age_s or age_s <= 0 else min(MAX_AGE_POINTS, int(age_s // 60))


class OldestBacklogFirst(PriorityWeightStrategy):
    """The task's own ``priority_weight`` plus one point per minute its pipeline's oldest
    unprocessed file has waited (capped at a day). Never fails: on any error the task keeps
    its static weight."""

    def get_weight(self, ti: TaskInstance) -> int:
        base = ti.task.priority_weight if ti.task is not None else 1
        try:
            return base + age_points(backlog_age_s(ti.dag_id))
        except Exception as exc:  # a spec or store problem must not break scheduling
            log.warning("sluice priority for %s: %s; using the static weight", ti.dag_id, exc)
            return base
