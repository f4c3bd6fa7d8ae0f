"""One Airflow DAG per pipeline spec:

    wait_for_backlog -> plan_group -> run_group -> validate -> checkpoint -> more_to_drain -> drain_again

Clearing ``run_group`` (or ``plan_group``) of a past run rolls that group and every later one
back and recomputes their recorded ranges; a backfill run recomputes the epochs whose data
arrived in its data interval. ``sluice_rollback`` and ``sluice_recover`` are built here too.

``max_active_runs=1``: one group per pipeline in flight, and a new run of the DAG knows the
previous one has ended (which lets it take over a dead run's lease).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Asset, AssetAny, AssetWatcher, Param

from sluice.airflow.actions import authorize_task
from sluice.airflow.operators import (
    TABLE_CHANGES,
    CheckpointOperator,
    FreshnessAlertOperator,
    PlanGroupOperator,
    RollbackOperator,
    RunGroupOperator,
    ShadowPreviewOperator,
    SkipFileOperator,
    ValidateOperator,
    acknowledge_changes,
    freshness_asset,
    release_lease_on_failure,
    sink_asset,
)
from sluice.airflow.sensors import BacklogSensor
from sluice.airflow.triggers import BacklogEventTrigger
from sluice.model import LeaseOwner
from sluice.paths import JOBS_DIR, RUN_GROUP_APP, jars_dir
from sluice.spark import JAR_NAMES, remote_url, run_once_java_options, spark_conf
from sluice.spec import PipelineSpec


def _more_to_drain(**context: Any) -> bool:
    """Acknowledge the checkpoint's Asset events (it succeeded), then continue with another DAG
    run (another group) while draining and data is left."""
    acknowledge_changes(context, context["dag"].dag_id, "checkpoint", "published")
    return bool(context["params"]["drain"]) and context["ti"].xcom_pull(task_ids="checkpoint")["backlog"]["files"] > 0


def backlog_asset(spec: PipelineSpec) -> Asset:
    """What a ``@backlog`` pipeline's DAG is scheduled on: an Asset standing for its source's
    backlog, watched by ``BacklogEventTrigger`` in the triggerer."""
    trigger = BacklogEventTrigger(spec.name, spec.name, poll_interval=spec.control.poll_interval_s,
                                  settle_s=max(120.0, 10 * spec.control.poll_interval_s))
    return Asset(name=f"sluice/{spec.name}/backlog", uri=f"sluice://{spec.name}/backlog", group="sluice",
                 watchers=[AssetWatcher(name=f"sluice_{spec.name}_backlog", trigger=trigger)])


def build_dag(spec: PipelineSpec) -> DAG:
    params = {
        "epoch_size": Param(None, type=["null", "integer"], minimum=1, title="Epoch size (files)",
                            description=f"Override the spec's epoch size ({spec.control.epoch_files} files)."),
        "k": Param(None, type=["null", "integer"], minimum=1, maximum=1000, title="Epochs per group (k)",
                   description=f"Override the spec's group size ({spec.control.group_epochs})."),
        "drain": Param(False, type="boolean", title="Drain",
                       description="Keep running groups (one DAG run each) until the backlog is empty."),
    }
    dag = DAG(
        dag_id=spec.name,
        description=spec.description or f"sluice pipeline {spec.name}",
        schedule=[backlog_asset(spec)] if spec.schedule == "@backlog" else spec.schedule,
        start_date=pendulum.parse(spec.start_date, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        params=params,
        tags=["sluice", *spec.tags],
        doc_md=f"sluice pipeline **{spec.name}** (spec `{spec.path}`). {spec.description}",
        default_args={"retries": 1, "retry_delay": timedelta(seconds=10),
                      "on_failure_callback": release_lease_on_failure},
    )
    with dag:
        # @continuous: wait as long as the spec allows (a timed-out wait skips the run, and
        # the next run starts waiting). A scheduled run that finds nothing skips after one
        # poll instead, so it never blocks the next scheduled run (max_active_runs=1); so does
        # a run the backlog event created (@backlog: the trigger already waited).
        continuous = spec.schedule == "@continuous"
        wait = BacklogSensor(task_id="wait_for_backlog", pipeline=spec.name, continuous=continuous,
                             deferrable=spec.control.sensor_mode == "deferrable",
                             poke_interval=spec.control.poll_interval_s,
                             timeout=spec.control.sensor_timeout_s if continuous else spec.control.poll_interval_s,
                             soft_fail=True, retries=0)
        plan = PlanGroupOperator(task_id="plan_group", pipeline=spec.name)
        if spec.spark.mode == "submit" and not remote_url():  # no JVM per group with a Connect server
            from sluice.airflow.submit import RunGroupSubmitOperator

            jars = jars_dir()
            run = RunGroupSubmitOperator(
                task_id="run_group", pipeline=spec.name,
                application=str(RUN_GROUP_APP),
                application_args=["--pipeline", spec.name,
                                  "--group", "{{ ti.xcom_pull(task_ids='plan_group')['group_id'] }}",
                                  "--owner", str(LeaseOwner.dag_run("{{ dag.dag_id }}", "{{ run_id }}"))],
                conn_id=spec.spark.conn_id,
                conf=spark_conf({"spark.driver.extraJavaOptions": f"{run_once_java_options()} "
                                 f"-Dlog4j2.configurationFile=file:{JOBS_DIR / 'log4j2.properties'}",
                                 **spec.spark.conf}),
                jars=",".join(str(jars / name) for name in JAR_NAMES),
                name=f"sluice-{spec.name}",
            )
        else:
            run = RunGroupOperator(task_id="run_group", pipeline=spec.name)
        validate = ValidateOperator(task_id="validate", pipeline=spec.name)
        checkpoint = CheckpointOperator(task_id="checkpoint", pipeline=spec.name,
                                        outlets=[sink_asset(spec.name, s) for s in spec.sinks])
        more = ShortCircuitOperator(task_id="more_to_drain", python_callable=_more_to_drain)
        # A JSON string: the operator parses it after rendering, so integers stay integers.
        again = TriggerDagRunOperator(
            task_id="drain_again", trigger_dag_id=spec.name,
            conf='{"drain": true, "epoch_size": {{ params.epoch_size | tojson }}, "k": {{ params.k | tojson }}}',
        )
        wait >> plan >> run >> validate >> checkpoint >> more >> again
    return dag


def _operations_dag(dag_id: str, description: str, doc_md: str, specs: dict[str, PipelineSpec],
                    takes_lease: bool = True, **params: Param) -> DAG:
    """A manually triggered DAG acting on one pipeline chosen in the trigger form. Unpaused from
    the start: it runs only when an operator triggers it, and a paused one would leave that run
    queued without a word."""
    names = sorted(specs) or ["none"]
    take_over = {"take_over": Param(False, type="boolean", title="Take over the lease",
                                    description="Take the lease from the pipeline's own DAG runs; only when "
                                                "none runs.")} if takes_lease else {}
    return DAG(
        dag_id=dag_id, description=description, doc_md=doc_md,
        schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False,
        max_active_runs=1, tags=["sluice", "operations"], is_paused_upon_creation=False,
        params={"pipeline": Param(names[0], type="string", enum=names, title="Pipeline"), **params, **take_over},
        default_args={"retries": 0, "on_failure_callback": release_lease_on_failure},
    )


def rollback_approval_required() -> bool:
    """Whether ``sluice_rollback`` waits for a second person's approval: Airflow's setting
    ``[sluice] rollback_approval`` (``AIRFLOW__SLUICE__ROLLBACK_APPROVAL=True``)."""
    from airflow.configuration import conf

    return conf.getboolean("sluice", "rollback_approval", fallback=False)


def build_rollback_dag(specs: dict[str, PipelineSpec], approval: bool | None = None) -> DAG:
    """``sluice_rollback``: roll a pipeline back to an epoch, optionally recompute. With
    ``approval`` (default: ``rollback_approval_required()``) the run first waits in Airflow's
    human-in-the-loop ``ApprovalOperator`` ("Required Actions" in the UI); a rejection skips the
    rollback, and an approval by the user who triggered the run fails it, changing nothing."""
    if approval is None:
        approval = rollback_approval_required()
    with _operations_dag(
        "sluice_rollback", "Roll a sluice pipeline back to an epoch (RESTORE, generation bump, source rewind)",
        ROLLBACK_DOC, specs,
        to_epoch=Param(0, type="integer", minimum=0, title="Roll back to epoch",
                       description="This epoch and every later one are rolled back."),
        reason=Param("", type="string", minLength=3, title="Reason",
                     description="Recorded in the epoch log and the rollback record."),
        recompute=Param(True, type="boolean", title="Recompute",
                        description="Recompute the rolled-back epochs now, with their recorded ranges."),
    ) as dag:
        rollback = RollbackOperator(task_id="rollback", pipeline="{{ params.pipeline }}", outlets=[TABLE_CHANGES],
                                    approval_task_id="approve" if approval else None)
        if approval:
            from airflow.providers.standard.operators.hitl import ApprovalOperator

            ApprovalOperator(
                task_id="approve", subject="Roll {{ params.pipeline }} back to epoch {{ params.to_epoch }}?",
                body=ROLLBACK_APPROVAL_BODY, response_timeout=timedelta(hours=24),
            ) >> rollback
        recompute = ShortCircuitOperator(task_id="recompute", python_callable=_recompute)
        _group_steps(rollback, recompute, plan_task_id="rollback", change="recompute")
    return dag


def build_preview_dag(specs: dict[str, PipelineSpec]) -> DAG:
    """``sluice_rollback_preview``: what a rollback to an epoch with recompute would leave in
    each table, recomputed into shadow tables; nothing is changed."""
    with _operations_dag(
        "sluice_rollback_preview",
        "Preview a sluice rollback: recompute its epochs into shadow tables and diff them (changes nothing)",
        PREVIEW_DOC, specs, takes_lease=False,
        to_epoch=Param(0, type="integer", minimum=0, title="Roll back to epoch",
                       description="Preview a rollback of this epoch and every later one, with recompute."),
    ) as dag:
        ShadowPreviewOperator(task_id="preview", pipeline="{{ params.pipeline }}")
    return dag


PREVIEW_DOC = """Preview `sluice_rollback` to `to_epoch` with recompute, before anything is restored.

1. The rollback's plan and preconditions, as the rollback would check them (a refusal is reported).
2. Each sink's table as it was before `to_epoch` is copied into a shadow table under
   `<data>/previews/<pipeline>/<run id>/`; the rolled-back epochs' recorded ranges are recomputed
   with the current code (Great Expectations included) and written into it.
3. The shadow is compared with the published table: rows added, removed and changed (by the
   sink's keys), with a sample. The report is this task's return value and is shown in the
   pipeline's "sluice epochs" tab. The published tables, the epoch store and the source are only read.
"""


def build_recover_dag(specs: dict[str, PipelineSpec]) -> DAG:
    """``sluice_recover``: rerun a pipeline's failed or unfinished epochs with their ranges."""
    withdraw = Param(False, type="boolean", title="Withdraw a recorded rollback",
                     description="Withdraw a rollback whose restores never started, instead of finishing it")
    with _operations_dag("sluice_recover",
                         "Rerun a sluice pipeline's failed or half-done epochs with their recorded ranges",
                         RECOVER_DOC, specs, withdraw_rollback=withdraw) as dag:
        plan = PlanGroupOperator(task_id="plan_group", pipeline="{{ params.pipeline }}", recover=True)
        _group_steps(plan, None, plan_task_id="plan_group", change="recovery")
    return dag


def build_alerts_dag(specs: dict[str, PipelineSpec]) -> DAG | None:
    """``sluice_alerts``: scheduled on the freshness Assets of the pipelines with
    ``alerts.freshness``; each run is a change of one or more pipelines' freshness, and its task
    fails for a breach. None when no pipeline alerts."""
    watched = [freshness_asset(spec) for _, spec in sorted(specs.items()) if spec.alerts.freshness]
    if not watched:
        return None
    with DAG(dag_id="sluice_alerts", description="Freshness alerts of sluice pipelines (alerts.freshness)",
             doc_md=ALERTS_DOC, schedule=AssetAny(*watched), start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
             catchup=False, tags=["sluice", "alerts"], is_paused_upon_creation=False,
             # A try lost before it ran (its worker killed, the execution API not up yet: CI saw
             # the alert of a stale pipeline lost so while airflow standalone started) is tried
             # again; the alert's own failure (AirflowFailException) never is: raised once.
             default_args={"retries": 2, "retry_delay": timedelta(seconds=10)}) as dag:
        FreshnessAlertOperator(task_id="freshness")
    return dag


ALERTS_DOC = """\
Runs when a watched pipeline's freshness changes: its oldest unpublished data passed its
`control.freshness_sla_s` (the task **fails**, naming the pipeline, the age and the SLA, and is
not retried), or is back within it (the task logs the recovery). A try that failed for another
reason (its worker lost, the API unreachable) is retried twice, 10 s apart. Attach your channel
as this DAG's `on_failure_callback`, or per pipeline with `alerts.notifier` in its spec.
"""


def build_skip_file_dag(specs: dict[str, PipelineSpec]) -> DAG:
    """``sluice_skip_file``: leave a file that is gone or unreadable out of its epoch, recorded."""
    with _operations_dag(
        "sluice_skip_file", "Skip a file a sluice pipeline cannot read (gone, unreadable), on purpose and recorded",
        SKIP_FILE_DOC, specs, takes_lease=False,
        file=Param("", type="string", minLength=1, title="File",
                   description="Its path, as in the error (absolute) or relative to the landing folder."),
        reason=Param("", type="string", minLength=3, title="Reason",
                     description="Recorded with who (this run) and when; shown with the epoch's files."),
    ) as dag:
        SkipFileOperator(task_id="skip_file", pipeline="{{ params.pipeline }}")
    return dag


def _recompute(**context: Any) -> bool:
    """Acknowledge the rollback's Asset events (it succeeded); go on to the recompute if asked."""
    authorize_task(context)  # as every task of an operations DAG (``sluice.airflow.actions``)
    acknowledge_changes(context, context["params"]["pipeline"], "rollback", "changes")
    return bool(context["params"]["recompute"])


def _group_steps(head: Any, gate: Any, plan_task_id: str, change: str) -> None:
    """run_group -> validate -> checkpoint (in-process Spark) after ``head``."""
    run = RunGroupOperator(task_id="run_group", pipeline="{{ params.pipeline }}", plan_task_id=plan_task_id)
    validate = ValidateOperator(task_id="validate", pipeline="{{ params.pipeline }}", plan_task_id=plan_task_id)
    checkpoint = CheckpointOperator(task_id="checkpoint", pipeline="{{ params.pipeline }}",
                                    plan_task_id=plan_task_id, change=change, outlets=[TABLE_CHANGES])
    if gate is not None:
        head >> gate >> run
    else:
        head >> run
    run >> validate >> checkpoint


ROLLBACK_DOC = """Roll a pipeline back to `to_epoch` (Structured Streaming §7.2).

1. Preconditions: the source still holds every file of the rolled-back ranges, and the Delta
   version each table goes back to still exists (not vacuumed). Otherwise the run fails with
   what is missing and **nothing is changed**.
2. RESTORE every table of the pipeline (sinks, `_rejected`, `_quarantine`) to the version
   before `to_epoch`; bump the generation; epochs `>= to_epoch` become `rolled_back`; the source
   position rewinds to the start of `to_epoch`.
3. With `recompute`, the rolled-back ranges are recomputed now, validated and published.
"""

ROLLBACK_APPROVAL_BODY = """\
Requested by **{{ dag_run.triggering_user_name or "unknown" }}**: roll pipeline `{{ params.pipeline }}` back to
epoch {{ params.to_epoch }} (recompute: {{ params.recompute }}), because: {{ params.reason }}.

Every epoch from {{ params.to_epoch }} on is rolled back and its rows removed from the tables.
The pipeline's "sluice epochs" tab shows what goes (rollback preview). Approve only if you are
not the person who asked: the rollback refuses an approval by its requester.
"""

RECOVER_DOC = """Rerun a pipeline's failed or half-done epochs with their recorded ranges, even when
the pipeline is halted (an epoch failed validation, failed `control.max_attempts` times, or its
driver died `control.max_crashes` times). Fix the cause first (the transform, the spec's checks,
the data, the driver's memory); the run plans nothing new and counts attempts afresh.
`withdraw_rollback`: first withdraw a recorded rollback whose restores never started (a backfill's
or an operator's rollback that stopped before changing any table), instead of finishing it.
"""

SKIP_FILE_DOC = """Skip a file that is gone, unreadable or changed after it was planned, so the pipeline can go on
without it. The skip is recorded in the epoch store (who, when, why) and shown with the epoch's
files in `GET /sluice/pipelines/<name>/epochs`. Epochs holding the file read around it from then
on, reruns and rollback recomputes included; failed ones get fresh attempts, so a pipeline halted
on the file runs again by itself. Command line: `make skip-file PIPELINE= FILE= REASON=`.
"""


def pipeline_dags(specs: dict[str, PipelineSpec]) -> dict[str, DAG]:
    """One DAG per valid pipeline spec, by the name a DAG file gives it."""
    return {f"dag_{spec.name}": build_dag(spec) for spec in specs.values()}


def operations_dags(specs: dict[str, PipelineSpec]) -> dict[str, DAG]:
    """``sluice_rollback``, ``sluice_rollback_preview``, ``sluice_recover``, ``sluice_skip_file``,
    and ``sluice_alerts`` when a pipeline sets ``alerts.freshness``."""
    dags = {"dag_sluice_rollback": build_rollback_dag(specs), "dag_sluice_recover": build_recover_dag(specs),
            "dag_sluice_rollback_preview": build_preview_dag(specs),
            "dag_sluice_skip_file": build_skip_file_dag(specs), "dag_sluice_alerts": build_alerts_dag(specs)}
    return {name: dag for name, dag in dags.items() if dag is not None}


def all_dags() -> dict[str, DAG]:
    """The DAGs of a folder of pipeline specs (``sluice init``'s DAG file): the pipelines' and the
    operations'. Broken specs are left out here and reported by ``spec.raise_spec_errors``."""
    from sluice.spec import load_pipeline_specs

    specs, _ = load_pipeline_specs()
    return {**pipeline_dags(specs), **operations_dags(specs)}
