"""``BacklogSensor``: the head of every pipeline DAG; hands the group's plan to the run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from sluice.airflow.triggers import BacklogTrigger, check_backlog, queued_runs, should_give_way
from sluice.protocol.run import SensedPlan


def plan_from(ready: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The group's plan, as XCom: the trigger's verdict, overridden by the run's params."""
    return SensedPlan.fired(ready["plan"], ready["backlog"], params).as_xcom()


class BacklogSensor(BaseSensorOperator):
    """Waits until the pipeline's next group should start: the backlog makes an efficient
    group, or waiting longer would break the freshness SLA (a scheduled run: any backlog).
    Returns the plan ``{epoch_size, k, partitions, reason, ...}``.

    Deferrable by default (no worker slot while waiting); with ``deferrable=False`` it pokes
    in ``reschedule`` mode, for deployments without a triggerer.
    """

    template_fields: Sequence[str] = ("pipeline",)
    ui_color = "#cde6f7"

    def __init__(self, *, pipeline: str, deferrable: bool = True, min_files: int = 1, continuous: bool = True,
                 **kwargs: Any) -> None:
        kwargs.setdefault("mode", "poke" if deferrable else "reschedule")
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.deferrable = deferrable
        self.min_files = min_files
        self.continuous = continuous

    def _store_url(self) -> str:  # handed to the trigger, whose kwargs Airflow stores encrypted
        from sluice.airflow.operators import pipeline_store

        return pipeline_store()

    def poke(self, context: Any) -> PokeReturnValue:
        ready = check_backlog(self.pipeline, self._store_url(), self.min_files, continuous=self.continuous)
        if ready is None:
            started = context["ti"].start_date
            waited = (time.time() - started.timestamp()) if started else 0.0
            dag_id = context["dag"].dag_id
            if self.continuous and should_give_way(waited, queued_runs(dag_id)):
                self._give_way(dag_id)
            return PokeReturnValue(False)
        return PokeReturnValue(True, plan_from(ready, context["params"]))

    def execute(self, context: Any) -> Any:
        dag_run = context["dag_run"]
        if str(getattr(dag_run.run_type, "value", dag_run.run_type)) == "backfill":
            # A backfill run recomputes past epochs: it does not wait for new data.
            return SensedPlan(reason="backfill", fired_at=time.time()).as_xcom()
        if not self.deferrable:
            return super().execute(context)
        # Fire at once if the backlog is already there: no round trip through the triggerer.
        ready = self.poke(context)
        if ready:
            return ready.xcom_value
        self.defer(trigger=BacklogTrigger(self.pipeline, self._store_url(), float(self.poke_interval),
                                          self.min_files, self.continuous,
                                          context["dag"].dag_id if self.continuous else None),
                   method_name="execute_complete", timeout=timedelta(seconds=self.timeout))

    def _give_way(self, dag_id: str) -> None:
        raise AirflowSkipException(f"pipeline {self.pipeline!r}: another run of {dag_id} is queued (a cleared "
                                   "run, say): this run gives way without waiting for data")

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        if event and event.get("status") == "give_way":
            self._give_way(context["dag"].dag_id)
        if not event or event.get("status") != "ready":
            message = (event or {}).get("message", "no event")
            raise AirflowException(f"pipeline {self.pipeline!r}: backlog trigger failed: {message}")
        self.log.info("pipeline %s: backlog %s after %s polls (%.1f s)", self.pipeline, event["backlog"],
                      event["polls"], event["waited_s"])
        return plan_from(event, context["params"])
