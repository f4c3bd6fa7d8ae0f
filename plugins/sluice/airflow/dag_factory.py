"""One Airflow DAG per pipeline spec:

    wait_for_backlog -> plan_group -> run_group -> checkpoint -> more_to_drain -> drain_again

``max_active_runs=1``: one group per pipeline in flight, and a new run of the DAG knows the
previous one has ended (which lets it take over a dead run's lease).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Param

from sluice.airflow.operators import CheckpointOperator, PlanGroupOperator, RunGroupOperator
from sluice.airflow.sensors import BacklogSensor
from sluice.paths import jars_dir, project_root
from sluice.spark import DELTA_JAR_NAMES, spark_conf
from sluice.spec import PipelineSpec


def _more_to_drain(ti: Any, params: dict[str, Any]) -> bool:
    """Continue with another DAG run (another group) while draining and data is left."""
    return bool(params["drain"]) and ti.xcom_pull(task_ids="checkpoint")["backlog"]["files"] > 0


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
        schedule=spec.schedule,
        start_date=pendulum.parse(spec.start_date, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        params=params,
        tags=["sluice", *spec.tags],
        doc_md=f"sluice pipeline **{spec.name}** (spec `{spec.path}`). {spec.description}",
        default_args={"retries": 1, "retry_delay": timedelta(seconds=10)},
    )
    with dag:
        # @continuous: wait as long as the spec allows (a timed-out wait skips the run, and
        # the next run starts waiting). A scheduled run that finds nothing skips after one
        # poll instead, so it never blocks the next scheduled run (max_active_runs=1).
        continuous = spec.schedule == "@continuous"
        wait = BacklogSensor(task_id="wait_for_backlog", pipeline=spec.name,
                             poke_interval=spec.control.poll_interval_s,
                             timeout=spec.control.sensor_timeout_s if continuous else spec.control.poll_interval_s,
                             soft_fail=True, retries=0)
        plan = PlanGroupOperator(task_id="plan_group", pipeline=spec.name)
        if spec.spark.mode == "submit":
            jars = jars_dir()
            run = SparkSubmitOperator(
                task_id="run_group",
                application=str(project_root() / "jobs" / "run_group.py"),
                application_args=["--pipeline", spec.name,
                                  "--group", "{{ ti.xcom_pull(task_ids='plan_group')['group_id'] }}",
                                  "--owner", "airflow:{{ dag.dag_id }}:{{ run_id }}"],
                conn_id=spec.spark.conn_id,
                conf=spark_conf({"spark.driver.extraJavaOptions":
                                 f"-Dlog4j2.configurationFile=file:{project_root() / 'jobs' / 'log4j2.properties'}",
                                 **spec.spark.conf}),
                jars=",".join(str(jars / name) for name in DELTA_JAR_NAMES),
                env_vars={"SLUICE_STORE_URL": "{{ ti.xcom_pull(task_ids='plan_group')['store_url'] }}"},
                name=f"sluice-{spec.name}",
            )
        else:
            run = RunGroupOperator(task_id="run_group", pipeline=spec.name)
        checkpoint = CheckpointOperator(task_id="checkpoint", pipeline=spec.name)
        more = ShortCircuitOperator(task_id="more_to_drain", python_callable=_more_to_drain)
        # A JSON string: the operator parses it after rendering, so integers stay integers.
        again = TriggerDagRunOperator(
            task_id="drain_again", trigger_dag_id=spec.name,
            conf='{"drain": true, "epoch_size": {{ params.epoch_size | tojson }}, "k": {{ params.k | tojson }}}',
        )
        wait >> plan >> run >> checkpoint >> more >> again
    return dag
