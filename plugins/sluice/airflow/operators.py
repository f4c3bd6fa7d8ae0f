"""Operators for the steps of one group: plan, run (in-process Spark), checkpoint.

The Spark step in ``submit`` mode is Airflow's own ``SparkSubmitOperator`` running
``jobs/run_group.py``; in ``in_process`` mode ``RunGroupOperator`` runs the same code inside
the task. Each step talks to the epoch store only, never to Airflow's metadata database.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from sluice import service
from sluice.spec import PipelineSpec, get_spec
from sluice.store import EpochLog, store_url


def lease_owner(dag_id: str, run_id: str) -> str:
    """Lease owner of one DAG run. Runs of one DAG share the prefix ``airflow:<dag_id>:``."""
    return f"airflow:{dag_id}:{run_id}"


class PlanGroupOperator(BaseOperator):
    """Reconcile and plan (write-ahead) the next group; skip the rest of the run if idle.

    Returns the group record (``group_id``, epochs with their ranges, the plan) and the store
    URL, which the Spark step needs.
    """

    template_fields: Sequence[str] = ("pipeline",)
    ui_color = "#e8f4d9"

    def __init__(self, *, pipeline: str, sensor_task_id: str = "wait_for_backlog", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.sensor_task_id = sensor_task_id

    def execute(self, context: Any) -> dict[str, Any]:
        spec = get_spec(self.pipeline)
        params = context["params"]
        sensed = context["ti"].xcom_pull(task_ids=self.sensor_task_id) or {}
        dag_id, run_id = context["dag"].dag_id, context["run_id"]
        url = store_url()
        log = EpochLog(url)
        try:
            group = service.plan(spec, log, lease_owner(dag_id, run_id),
                                 epoch_size=params.get("epoch_size") or sensed.get("epoch_size"),
                                 k=params.get("k") or sensed.get("k"), reason=sensed.get("reason", "manual"),
                                 take_over_prefix=f"airflow:{dag_id}:")
        finally:
            log.close()
        if group is None:
            raise AirflowSkipException(f"pipeline {spec.name!r}: no unplanned data, nothing to do")
        self.log.info("Planned group %s of %s:\n%s", group["group_id"], spec.name, _epoch_table(group["epochs"]))
        return dict(group, store_url=url)


class _PlannedGroupOperator(BaseOperator):
    """A step on the group ``plan_group`` planned in this DAG run, under this run's lease."""

    template_fields: Sequence[str] = ("pipeline",)

    def __init__(self, *, pipeline: str, plan_task_id: str = "plan_group", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.plan_task_id = plan_task_id

    def planned(self, context: Any) -> tuple[PipelineSpec, dict[str, Any], str]:
        """The spec, the planned group record, and this run's lease owner."""
        owner = lease_owner(context["dag"].dag_id, context["run_id"])
        return get_spec(self.pipeline), context["ti"].xcom_pull(task_ids=self.plan_task_id), owner


class RunGroupOperator(_PlannedGroupOperator):
    """Run the planned group in a SparkSession inside this task (``spark.mode: in_process``)."""

    ui_color = "#fce3c8"

    def execute(self, context: Any) -> dict[str, Any]:
        from pyspark.sql import SparkSession

        from sluice.spark import get_session

        spec, planned, owner = self.planned(context)
        log = EpochLog(planned["store_url"])
        reused = SparkSession.getActiveSession() is not None  # dag.test() in a process with Spark
        spark = get_session(f"sluice-{spec.name}", extra_conf=spec.spark.conf)
        try:
            group = service.run(spec, log, owner, planned["group_id"], spark)
        finally:
            if not reused:
                spark.stop()
            log.close()
        self.log.info("Group %s of %s:\n%s", group["group_id"], spec.name, _epoch_table(group["epochs"]))
        return {"group_id": group["group_id"], "epochs": [e["epoch_id"] for e in group["epochs"]]}


class CheckpointOperator(_PlannedGroupOperator):
    """Publish the group (its epochs become ``published``, JSON records are written next to
    each table) and release the lease. Returns the group and the remaining backlog."""

    ui_color = "#d9d2f4"

    def execute(self, context: Any) -> dict[str, Any]:
        spec, planned, owner = self.planned(context)
        log = EpochLog(planned["store_url"])
        try:
            result = service.checkpoint(spec, log, owner, planned["group_id"])
        finally:
            log.close()
        self.log.info("Published group %s of %s:\n%s\nBacklog left: %s", planned["group_id"], spec.name,
                      _epoch_table(result["group"]["epochs"]), json.dumps(result["backlog"]))
        return result


def _epoch_table(epochs: list[dict[str, Any]]) -> str:
    header = ("epoch", "gen", "range", "state", "input", "rejected", "output")
    lines = [f"{header[0]:>6} {header[1]:>4} {header[2]:>15} {header[3]:>10} {header[4]:>9} {header[5]:>9} "
             f"{header[6]:>8}  versions"]
    for e in epochs:
        rows = e.get("rows") or {}
        lines.append(f"{e['epoch_id']:>6} {e['generation']:>4} {[e['start'], e['end']]!s:>15} {e['state']:>10} "
                     f"{rows.get('input', '-'):>9} {rows.get('rejected', '-'):>9} {rows.get('output', '-'):>8}  "
                     f"{json.dumps(e.get('delta_versions') or {})}")
    return "\n".join(lines)
