"""Across pipelines, the oldest backlog first: the plugin registers ``OldestBacklogFirst``, the
pipeline DAGs' tasks carry it through serialization (what the scheduler reads), and two
pipelines whose oldest unprocessed files differ in age get weights in that order."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from sluice.airflow import priority
from sluice.airflow.priority import OldestBacklogFirst
from tests.pipelines import land, make_pipeline


def test_plugin_registers_the_strategy_and_dags_keep_it_when_serialized():
    from airflow.serialization.serialized_objects import DagSerialization, _get_registered_priority_weight_strategy

    from sluice.airflow.dag_factory import build_dag

    assert _get_registered_priority_weight_strategy("sluice.airflow.priority.OldestBacklogFirst") is OldestBacklogFirst
    spec = make_pipeline("priority_dag")
    dag = DagSerialization.from_dict(DagSerialization.to_dict(build_dag(spec)))
    rules = {task.task_id: task.weight_rule for task in dag.tasks}
    assert all(isinstance(rule, OldestBacklogFirst) for rule in rules.values()), rules


def test_the_oldest_backlog_weighs_most():
    old, young, idle = (make_pipeline(f"priority_{n}") for n in ("old", "young", "idle"))
    now = time.time()
    for spec, age_s in ((old, 3 * 3600), (young, 10 * 60)):
        for i, path in enumerate(land(spec, files=2)):
            os.utime(path, (now - age_s + i, now - age_s + i))
    priority._ages.clear()
    strategy = OldestBacklogFirst()
    weights = {spec.name: strategy.get_weight(SimpleNamespace(dag_id=spec.name,
                                                              task=SimpleNamespace(priority_weight=1)))
               for spec in (old, young, idle)}
    assert weights == {old.name: 1 + 180, young.name: 1 + 10, idle.name: 1}, weights
    # Not a sluice pipeline: the static weight, no error.
    assert strategy.get_weight(SimpleNamespace(dag_id="not_a_pipeline", task=SimpleNamespace(priority_weight=7))) == 7
