"""Operators for the steps of one group: plan, run (in-process Spark), validate, checkpoint;
and for the operator actions: rollback.

The Spark step in ``submit`` mode is Airflow's own ``SparkSubmitOperator`` running
``sluice/jobs/run_group.py``; in ``in_process`` mode ``RunGroupOperator`` runs the same code inside
the task. Each step talks to the epoch store only, never to Airflow's metadata database.

The tasks that write the pipeline's tables (``run_group`` in both modes, ``rollback``) report
their datasets to OpenLineage through Airflow's OpenLineage provider
(``get_openlineage_facets_on_*``, ``sluice.airflow.lineage``), when it is configured.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from airflow.sdk import Asset, AssetAlias, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from sluice.airflow.actions import UnauthorizedRunError, authorize_task
from sluice.airflow.hooks import SluiceStoreHook
from sluice.errors import OperatorActionRequired, PipelineBusyError, SluiceError
from sluice.logs import quiet_libraries
from sluice.model import LeaseOwner
from sluice.protocol import operations
from sluice.protocol.leases import acquire_lease
from sluice.protocol.run import GroupPlan, PipelineRun, SensedPlan
from sluice.protocol.runtime import Runtime
from sluice.spec import PipelineSpec, SinkSpec, get_spec

#: How long plan_group waits between tries while another run of the pipeline holds its lease.
BUSY_WAIT_S = 15


def lease_owner(dag_id: str, run_id: str) -> str:
    """Lease owner of one DAG run. Runs of one DAG share the prefix ``airflow:<dag_id>:``."""
    return str(LeaseOwner.dag_run(dag_id, run_id))


def dag_run_alive(owner: str) -> bool:
    """Whether the DAG run behind a lease owner ``airflow:<dag_id>:<run_id>`` is still queued or
    running, asked through the Task SDK (a task never reads Airflow's database itself). When
    Airflow cannot say, the run counts as alive: the lease then only goes once it expires."""
    parsed = LeaseOwner.parse(owner)
    if parsed is None or parsed.kind != LeaseOwner.AIRFLOW:
        return False
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        state = RuntimeTaskInstance.get_dagrun_state(dag_id=parsed.scope, run_id=parsed.name)
    except Exception:
        return True
    return str(getattr(state, "value", state)) in ("queued", "running")


def sink_asset(pipeline: str, sink: SinkSpec) -> Asset:
    """The Airflow Asset of one sink table; ``checkpoint`` emits an event on it per group,
    with the epochs and the Delta version in its extra, so downstream DAGs can be scheduled
    on it (``schedule=[Asset("sluice/ysb/campaign_views")]``)."""
    return Asset(name=f"sluice/{pipeline}/{sink.name}", uri=f"file://{sink.path}", group="sluice")


#: The operator-action DAGs act on a pipeline chosen when triggered, so their tables' Assets are
#: not known when the DAG is parsed: their tasks emit through this alias, and a downstream DAG
#: scheduled on a sink's Asset receives those events like any other.
TABLE_CHANGES = AssetAlias("sluice/table-changes")


def emit_table_changes(task: BaseOperator, context: Any, spec: PipelineSpec,
                       extras: dict[str, dict[str, Any]]) -> None:
    """An Asset event per sink named in ``extras`` (with that extra, plus the pipeline, sink and
    table): on the sink's Asset when it is one of the task's outlets, else through
    ``TABLE_CHANGES``, so every change of a table (publish, rollback, recompute, recovery)
    reaches the DAGs scheduled on it."""
    outlet_events = context.get("outlet_events")
    if outlet_events is None:
        return
    for sink in spec.sinks:
        if sink.name not in extras:
            continue
        asset = sink_asset(spec.name, sink)
        extra = dict(extras[sink.name], pipeline=spec.name, sink=sink.name, table=sink.path)
        if asset in task.outlets:
            outlet_events[asset].extra = extra
        elif TABLE_CHANGES in task.outlets:
            outlet_events[TABLE_CHANGES].add(asset, extra=extra)


def backfill_interval(context: Any, schedule: str | None) -> tuple[Any, Any]:
    """The period a backfill run covers. Cron schedules in Airflow 3 use trigger timetables
    whose data interval is a point in time; their run then covers ``[logical date, next
    fire)``, as an Airflow 2 data interval did."""
    start, end = context["data_interval_start"], context["data_interval_end"]
    if start == end and schedule:
        from croniter import croniter

        end = croniter(schedule, start).get_next(type(start))
    return start, end


def pipeline_store() -> str:
    """The epoch store's URL as this task resolves it (``SluiceStoreHook``), its password masked
    in the task's logs. Every step resolves it the same way, so it never travels in XCom or in
    a rendered template field, where anyone who may read the DAG would see the password."""
    return SluiceStoreHook().get_url()


def release_lease_on_failure(context: Any) -> None:
    """``on_failure_callback`` of sluice's tasks: a run that failed for good gives its lease
    up, so an operator's rollback or recovery need not wait for it to expire."""
    params = context.get("params") or {}
    dag_id, run_id = context["dag"].dag_id, context["run_id"]
    try:
        spec = get_spec(params.get("pipeline") or dag_id)
    except SluiceError:
        return
    store = SluiceStoreHook().get_store()
    try:
        PipelineRun(spec, store, lease_owner(dag_id, run_id)).release()
    finally:
        store.close()


class _GroupLineage:
    """OpenLineage of a task that runs a group: the source as input, the sinks and ``_rejected``
    as outputs (``sluice.airflow.lineage``), and the ``sluice`` run facet with the group, its
    epochs and record counts once ``act`` recorded them in ``_lineage_run``. Airflow's
    OpenLineage provider calls these only when it is configured; each is a spec lookup and a
    few reads of the tables' ``_delta_log`` for their schemas, never Spark."""

    pipeline: str
    task_id: str
    _lineage_run: dict[str, Any] | None = None

    def _lineage(self, inputs: bool = True) -> Any:
        from sluice.airflow.lineage import operator_lineage

        return operator_lineage(get_spec(self.pipeline), inputs=inputs, run=self._lineage_run)

    def get_openlineage_facets_on_start(self) -> Any:
        return self._lineage()

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        return self._lineage()

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        return self._lineage()


class _SluiceOperator(BaseOperator):
    """A sluice task: a failure no retry can fix (``OperatorActionRequired``: halted, fenced,
    refused, failed validation) fails it at once, without its retries. Mapped here, once."""

    #: The failures that fail the task at once; an operator's own action widens it to every
    #: ``SluiceError`` (a refused rollback, a file not in the manifest: retrying changes nothing).
    fail_fast: tuple[type[Exception], ...] = (OperatorActionRequired,)

    def execute(self, context: Any) -> Any:
        quiet_libraries()  # the task log shows sluice's lines, not Great Expectations' import chatter
        try:
            self.authorize(context)
            return self.act(context)
        except self.fail_fast as exc:  # an UnauthorizedRunError is an OperatorActionRequired
            self.log.error("%s", exc)
            raise AirflowFailException(str(exc)) from None

    def authorize(self, context: Any) -> None:
        """In an operations DAG, before anything is changed: the run was started through the
        per-pipeline route or the local command line, for the pipeline this task acts on
        (``sluice.airflow.actions``); otherwise ``UnauthorizedRunError``."""
        stamped = authorize_task(context)
        pipeline = getattr(self, "pipeline", None)
        if stamped is not None and pipeline is not None and pipeline != stamped["pipeline"]:
            raise UnauthorizedRunError(f"pipeline {pipeline!r}: this task would act on {pipeline!r}, but its run "
                                       f"was authorized for {stamped['pipeline']!r}; nothing was changed")

    def act(self, context: Any) -> Any:
        raise NotImplementedError


class PlanGroupOperator(_SluiceOperator):
    """Reconcile and plan (write-ahead) the next group; skip the rest of the run if idle.

    Returns the plan (``GroupPlan.as_xcom()``: ``group_id``, epochs with their ranges, the
    controllers' plan, or a recorded rollback). The store's URL is not in it: each step
    resolves it itself (``pipeline_store``).
    """

    template_fields: Sequence[str] = ("pipeline",)
    ui_color = "#e8f4d9"

    def __init__(self, *, pipeline: str, sensor_task_id: str = "wait_for_backlog", recover: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.sensor_task_id = sensor_task_id
        self.recover = recover

    def act(self, context: Any) -> dict[str, Any]:
        spec = get_spec(self.pipeline)
        params = context["params"]
        sensed = SensedPlan.from_xcom(context["ti"].xcom_pull(task_ids=self.sensor_task_id))
        dag_id, run_id = context["dag"].dag_id, context["run_id"]
        store = SluiceStoreHook().get_store()
        dag_run = context["dag_run"]
        interval = None
        if str(getattr(dag_run.run_type, "value", dag_run.run_type)) == "backfill":
            start, end = backfill_interval(context, spec.schedule)
            interval = (start.timestamp(), end.timestamp())
            self.log.info("Backfill run: recomputing the epochs whose data arrived in [%s, %s)", start, end)
        take_over = LeaseOwner.runs_of(spec.name if self.recover and params.get("take_over") else dag_id)
        # An operator's take_over means "none of the pipeline's runs is going": no liveness check.
        alive = None if self.recover and params.get("take_over") else dag_run_alive
        waited = 0.0
        try:
            while True:
                try:
                    group = PipelineRun(spec, store, lease_owner(dag_id, run_id)).plan(
                        epoch_size=params.get("epoch_size") or sensed.epoch_size, k=params.get("k") or sensed.k,
                        first_size=sensed.first_size,  # None where the run's params set the sizes (fired)
                        reason=sensed.reason, take_over_prefix=take_over, recover=self.recover, interval=interval,
                        resume_own=True, extra=sensed.measured(), alive=alive,
                        withdraw_rollback=self.recover and bool(params.get("withdraw_rollback")))
                    break
                except PipelineBusyError as exc:
                    # Another run (a backfill beside a scheduled run) has the pipeline: wait for
                    # it, up to the lease's lifetime, rather than fail this run.
                    if waited >= spec.control.lease_ttl_s:
                        raise OperatorActionRequired(f"{exc} (waited {waited:.0f} s)") from None
                    self.log.info("%s; waiting %d s", exc, BUSY_WAIT_S)
                    time.sleep(BUSY_WAIT_S)
                    waited += BUSY_WAIT_S
        finally:
            store.close()
        if group is None:
            what = ("no failed or unfinished epochs" if self.recover
                    else "no epoch's data arrived in this interval" if interval else "no unplanned data")
            raise AirflowSkipException(f"pipeline {spec.name!r}: nothing to do ({what})")
        if group.rollback:
            self.log.info("Recorded rollback %s; run_group performs it", group.rollback)
        else:
            self.log.info("Planned group %s of %s:\n%s", group.group_id, spec.name,
                          _epoch_table([vars(e) for e in group.epochs]))
        return group.as_xcom()


class Planned(NamedTuple):
    """What a step after ``plan_group`` works from."""

    spec: PipelineSpec
    plan: GroupPlan
    owner: str  # this DAG run's lease owner
    store_url: str  # resolved by each task (``pipeline_store``), never handed on in XCom


class _PlannedGroupOperator(_SluiceOperator):
    """A step on the group ``plan_group`` planned in this DAG run, under this run's lease."""

    template_fields: Sequence[str] = ("pipeline",)

    def __init__(self, *, pipeline: str, plan_task_id: str = "plan_group", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.plan_task_id = plan_task_id

    def planned(self, context: Any) -> Planned:
        value = context["ti"].xcom_pull(task_ids=self.plan_task_id)
        return Planned(get_spec(self.pipeline), GroupPlan.from_xcom(value),
                       lease_owner(context["dag"].dag_id, context["run_id"]), pipeline_store())


class RunGroupOperator(_GroupLineage, _PlannedGroupOperator):
    """Run the planned group in a SparkSession inside this task (``spark.mode: in_process``)."""

    ui_color = "#fce3c8"

    def act(self, context: Any) -> dict[str, Any]:
        from pyspark.sql import SparkSession

        from sluice.airflow.lineage import group_run
        from sluice.spark import get_session, group_compiler

        spec, planned, owner, _ = self.planned(context)
        self._lineage_run = group_run(spec.name, self.task_id, [planned.as_xcom()])  # a failure reports the plan
        store = SluiceStoreHook().get_store()
        reused = SparkSession.getActiveSession() is not None  # dag.test() in a process with Spark
        runtime = Runtime.spark(lambda: get_session(f"sluice-{spec.name}", extra_conf=spec.spark.conf,
                                                    compiler=group_compiler(spec, store, planned.group_id)),
                                alive=dag_run_alive, stop=not reused)
        try:
            result = PipelineRun(spec, store, owner, runtime).process(planned.group_id)
        finally:
            runtime.close()
            store.close()
        for rollback in result["rollbacks"]:
            self.log.info("Rolled back to epoch %s (generation %s -> %s): %s", rollback["to_epoch"],
                          rollback["from_generation"], rollback["generation"], rollback["reason"])
        for group in result["groups"]:
            self.log.info("Group %s of %s:\n%s", group["group_id"], spec.name, _epoch_table(group["epochs"]))
        self._lineage_run = group_run(spec.name, self.task_id, result["groups"] or [planned.as_xcom()],
                                      rollback=result["rollbacks"][-1] if result["rollbacks"] else None)
        return {"groups": [g["group_id"] for g in result["groups"]],
                "epochs": [e["epoch_id"] for g in result["groups"] for e in g["epochs"]]}


class _PipelineOperator(_SluiceOperator):
    """An operator action on the pipeline chosen in the trigger form (``{{ params.pipeline }}``)."""

    template_fields: Sequence[str] = ("pipeline",)
    fail_fast = (SluiceError,)  # refused, busy, no such epoch or file: nothing was changed

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline


class ApprovalRefusedError(OperatorActionRequired):
    """A rollback that needs a second person's approval did not get one; nothing was changed."""


def require_second_person(pipeline: str, requester: str | None, approver: str | None) -> None:
    """Four eyes: the user who approves a rollback is not the one who asked for it. A run whose
    requester Airflow does not know (triggered without a user) cannot show that, so it is refused."""
    if not requester:
        raise ApprovalRefusedError(f"pipeline {pipeline!r}: the rollback run does not say who triggered it, so "
                                   "no approval can be told to come from a second person; nothing was changed. "
                                   "Roll back as a logged-in user: the sluice console, or POST "
                                   f"/sluice/pipelines/{pipeline}/actions/rollback with a user's token")
    if not approver:
        raise ApprovalRefusedError(f"pipeline {pipeline!r}: the rollback has no recorded approval; nothing was "
                                   "changed. Trigger sluice_rollback again and have a second person approve it")
    if approver == requester:
        raise ApprovalRefusedError(f"pipeline {pipeline!r}: the rollback was approved by {approver!r}, who asked "
                                   "for it; a second person must approve. Nothing was changed: trigger "
                                   "sluice_rollback again")


class RollbackOperator(_GroupLineage, _PipelineOperator):
    """Roll a pipeline back to an epoch (``sluice_rollback``): preconditions, RESTORE,
    generation bump, epoch states, source rewind; with ``recompute`` the rolled-back ranges are
    planned again as a group of this run, which the next tasks run, validate and publish.

    Params: ``to_epoch``, ``reason``, ``recompute``, ``take_over``. A refused rollback fails
    with what is missing and changes nothing.
    """

    ui_color = "#f4d9d9"

    def __init__(self, *, approval_task_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.approval_task_id = approval_task_id

    def _lineage(self, inputs: bool = False) -> Any:
        """A rollback RESTOREs the pipeline's tables (outputs); it reads no source."""
        return super()._lineage(inputs=False)

    def act(self, context: Any) -> dict[str, Any]:
        from pyspark.sql import SparkSession

        from sluice.spark import get_session

        params = context["params"]
        spec = get_spec(self.pipeline)
        if self.approval_task_id:
            answer = context["ti"].xcom_pull(task_ids=self.approval_task_id) or {}
            approver = (answer.get("responded_by_user") or {}).get("name")
            require_second_person(spec.name, context["dag_run"].triggering_user_name, approver)
        owner = lease_owner(context["dag"].dag_id, context["run_id"])
        store = SluiceStoreHook().get_store()
        reused = SparkSession.getActiveSession() is not None
        runtime = Runtime.spark(lambda: get_session(f"sluice-rollback-{spec.name}", extra_conf=spec.spark.conf),
                                stop=not reused)
        try:
            take_over = LeaseOwner.runs_of(spec.name) if params.get("take_over") else None
            lease = acquire_lease(store, spec.name, owner, ttl_s=spec.control.lease_ttl_s, take_over_prefix=take_over)
            try:
                report = operations.rollback(spec, store, runtime, lease, to_epoch=int(params["to_epoch"]),
                                             reason=params["reason"], recompute=bool(params["recompute"]))
            except BaseException:
                store.release_lease(lease)
                raise
            if not params["recompute"]:
                store.release_lease(lease)
            # The steps after this one run the recomputed group (none without recompute).
            recomputed = store.group(spec.name, report["group_id"]) if report["group_id"] is not None else None
            plan = GroupPlan.of(recomputed) if recomputed else GroupPlan(spec.name, None)
        finally:
            runtime.close()
            store.close()
        from sluice.airflow.lineage import group_run

        self._lineage_run = group_run(spec.name, self.task_id, [], rollback={
            "toEpoch": report["to_epoch"], "reason": report["reason"], "generation": report["generation"],
            "fromGeneration": report["from_generation"], "rolledBackEpochs": [r[0] for r in report["rolled_back"]],
            "restored": report["restored"], "recompute": bool(params["recompute"])})
        self.log.info("Rolled %s back to epoch %s: generation %s -> %s; restored %s; rolled back %s",
                      spec.name, report["to_epoch"], report["from_generation"], report["generation"],
                      json.dumps(report["restored"]), [r[0] for r in report["rolled_back"]])
        # Rows were removed: downstream DAGs learn it now, not only when a recompute publishes.
        emit_table_changes(self, context, spec, {
            sink.name: {"change": "rollback", "to_epoch": report["to_epoch"], "reason": report["reason"],
                        "generation": report["generation"], "from_generation": report["from_generation"],
                        "restored_to_version": report["restored"].get(sink.path),
                        "versions": report["changes"].get(sink.name, {}).get("versions"),
                        "rolled_back_epochs": [r[0] for r in report["rolled_back"]],
                        "recompute": bool(params["recompute"]), "by": report["by"]}
            for sink in spec.sinks})
        return dict(report, **plan.as_xcom())


class ShadowPreviewOperator(_PipelineOperator):
    """Recompute the epochs a rollback to ``to_epoch`` would recompute, with the current code,
    into shadow tables, and compare them with the published tables (``sluice.preview``). Reads
    the store, the source and the tables; changes none of them; takes no lease."""

    ui_color = "#e3ecf7"

    def act(self, context: Any) -> dict[str, Any]:
        from pyspark.sql import SparkSession

        from sluice.preview import shadow_preview
        from sluice.spark import get_session

        spec = get_spec(self.pipeline)
        store = SluiceStoreHook().get_store()
        reused = SparkSession.getActiveSession() is not None
        spark = None
        try:
            spark = get_session(f"sluice-preview-{spec.name}", extra_conf=spec.spark.conf)
            report = shadow_preview(spec, store, spark, int(context["params"]["to_epoch"]),
                                    preview_id=context["run_id"])
        finally:
            if spark is not None and not reused:
                spark.stop()
            store.close()
        for line in report.problems + report.notes:
            self.log.info("%s", line)
        for diff in report.sinks:
            self.log.info("sink %s: %s rows published, %s after the rollback: +%s added, -%s removed, ~%s changed "
                          "(shadow table %s)", diff.sink, diff.published_rows, diff.shadow_rows, diff.added,
                          diff.removed, diff.changed, diff.shadow_path)
        return report.as_dict()


class SkipFileOperator(_PipelineOperator):
    """Skip a file that is gone or unreadable (``sluice_skip_file``), recorded with who (this
    DAG run), when and why; its epoch reads around it from then on. No Spark."""

    ui_color = "#f4ecd9"

    def act(self, context: Any) -> dict[str, Any]:
        params = context["params"]
        spec = get_spec(self.pipeline)
        store = SluiceStoreHook().get_store()
        try:
            report = operations.skip_file(spec, store, params["file"], reason=params["reason"],
                                          by=lease_owner(context["dag"].dag_id, context["run_id"]))
        finally:
            store.close()
        self.log.info("Skipped %s (offset %s) of %s: %s; %s", report["file"], report["position"], spec.name,
                      params["reason"], report["note"])
        return report


class ValidateOperator(_PlannedGroupOperator):
    """The gate before publishing: shows each epoch's expectation results and fails (no
    retry) when one failed under the ``fail`` policy, which halts the pipeline."""

    ui_color = "#f7e1e1"

    def act(self, context: Any) -> dict[str, Any]:
        spec, _, owner, _ = self.planned(context)
        store = SluiceStoreHook().get_store()
        try:
            report = PipelineRun(spec, store, owner).validate()
        finally:
            store.close()
        self.log.info("Validation of %s (policy %s):\n%s", spec.name, spec.validation.policy,
                      _validation_table(report["epochs"]))
        return report


class CheckpointOperator(_PlannedGroupOperator):
    """Publish the group (its epochs become ``published``, JSON records are written next to
    each table) and release the lease. Returns the group and the remaining backlog.

    ``change``: what the Asset events say the group's rows are (``publish``; ``recompute``
    after a rollback, ``recovery`` in ``sluice_recover``); a backfill's redo is a recompute."""

    ui_color = "#d9d2f4"

    def __init__(self, *, change: str = "publish", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.change = change

    def act(self, context: Any) -> dict[str, Any]:
        from sluice.spark import get_session

        spec, planned, owner, _ = self.planned(context)
        store = SluiceStoreHook().get_store()
        runtime = Runtime.spark(lambda: get_session(f"sluice-{spec.name}", extra_conf=spec.spark.conf))
        try:
            result = PipelineRun(spec, store, owner, runtime).publish()  # no Spark: records are files
        finally:
            store.close()
        for group in result["groups"]:
            self.log.info("Published group %s of %s:\n%s", group["group_id"], spec.name,
                          _epoch_table(group["epochs"]))
        self.log.info("Backlog left: %s", json.dumps(result["backlog"]))
        # A backfill's or a cleared task's redo, and a rollback's recompute, are recomputes.
        change = "recompute" if planned.rollback or result["change"] == "recompute" else self.change
        emit_table_changes(self, context, spec, {
            sink.name: dict(result["published"][sink.name], change=change,
                            rollback=vars(planned.rollback) if planned.rollback else None)
            for sink in spec.sinks if result["published"][sink.name]["epochs"]})
        return result


def acknowledge_changes(context: Any, pipeline: str, task_id: str, key: str) -> None:
    """The task before this one emitted Asset events for the changes in its XCom's ``key``
    (it succeeded, or this one would not run): later events report from there on."""
    value = context["ti"].xcom_pull(task_ids=task_id) or {}
    changes = value.get(key) or {}
    if not changes:
        return
    store = SluiceStoreHook().get_store()
    try:
        PipelineRun(get_spec(pipeline), store, "acknowledge").acknowledge(changes)
    finally:
        store.close()


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


def _validation_table(epochs: list[dict[str, Any]]) -> str:
    lines = [f"{'epoch':>6} {'state':>10}  sink: result"]
    for e in epochs:
        results = e.get("validation") or {}
        if not results:
            lines.append(f"{e['epoch_id']:>6} {e['state']:>10}  (no expectation suite)")
        for sink, r in results.items():
            status = "ok" if r.get("success") else "FAILED " + "; ".join(
                f"{f['expectation']}({f.get('column') or ''}) unexpected={f.get('unexpected_count')}"
                for f in r.get("failed", []))
            quarantined = f", {r['quarantined']} rows quarantined" if r.get("quarantined") else ""
            lines.append(f"{e['epoch_id']:>6} {e['state']:>10}  {sink}: {status} "
                         f"({r.get('evaluated')} expectations{quarantined})")
    return "\n".join(lines)


def freshness_asset(spec: PipelineSpec) -> Asset:
    """The Asset standing for a pipeline's freshness: ``FreshnessTrigger`` watches it, and the
    ``sluice_alerts`` DAG (or a DAG of the user's) is scheduled on it."""
    from airflow.sdk import AssetWatcher

    from sluice.airflow.triggers import FreshnessTrigger

    trigger = FreshnessTrigger(spec.name, poll_interval=spec.control.poll_interval_s)
    return Asset(name=f"sluice/{spec.name}/freshness", uri=f"sluice://{spec.name}/freshness", group="sluice",
                 watchers=[AssetWatcher(name=f"sluice_{spec.name}_freshness", trigger=trigger)])


class FreshnessAlertOperator(BaseOperator):
    """The task of ``sluice_alerts``: for each freshness change that triggered the run, calls
    the pipeline's notifier (``alerts.notifier``), then fails naming every breached pipeline, its
    data's age and its SLA (so the DAG's ``on_failure_callback``, e-mail and the UI raise it); a
    recovery only logs."""

    def execute(self, context: Any) -> list[dict[str, Any]]:
        import importlib

        alerts = [dict(event.extra.get("payload") or {})
                  for events in context["triggering_asset_events"].values() for event in events]
        for alert in alerts:
            try:
                notifier = get_spec(alert["pipeline"]).alerts.notifier
                if notifier:
                    module, _, name = notifier.rpartition(".")
                    getattr(importlib.import_module(module), name)(alert)
            except Exception:  # the alert itself must still be raised
                self.log.exception("pipeline %s: the notifier failed", alert.get("pipeline"))
        for alert in alerts:
            if alert.get("change") == "recovered":
                self.log.info("pipeline %s is fresh again: its oldest unpublished data is %s s old (SLA %s s)",
                              alert["pipeline"], alert["age_s"], alert["sla_s"])
        breached = [a for a in alerts if a.get("change") == "breached"]
        if breached:
            raise AirflowFailException("; ".join(
                f"pipeline {a['pipeline']!r} is stale: its oldest unpublished data is {a['age_s']} s old, past its "
                f"freshness SLA of {a['sla_s']} s (control.freshness_sla_s)" for a in breached))
        return alerts


def __getattr__(name: str) -> Any:
    """``RunGroupSubmitOperator`` lives in ``sluice.airflow.submit``: Airflow's Spark provider
    costs ~0.3 s to import, paid by every task's parse of the DAG file, and only
    ``spark.mode: submit`` DAGs need it."""
    if name == "RunGroupSubmitOperator":
        from sluice.airflow.submit import RunGroupSubmitOperator

        return RunGroupSubmitOperator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
