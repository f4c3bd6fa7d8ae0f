"""``RunGroupSubmitOperator``: Airflow's ``SparkSubmitOperator`` for ``spark.mode: submit``, in
a module of its own so that a DAG without it (a Connect server, ``in_process``) does not import
the Spark provider (~0.3 s) at every task's parse of the DAG file."""

from __future__ import annotations

from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from sluice.airflow.hooks import SluiceStoreHook
from sluice.airflow.operators import _GroupLineage, pipeline_store
from sluice.errors import SluiceError
from sluice.spec import get_spec


class RunGroupSubmitOperator(_GroupLineage, SparkSubmitOperator):
    """Airflow's ``SparkSubmitOperator`` running ``sluice/jobs/run_group.py`` (``spark.mode: submit``).
    The job learns the epoch store's URL from its environment, set here at execute time: a
    template field would be rendered, and shown, before ``execute``. The Python code executors
    may run (sluice, the transforms) ships with it as ``--py-files``, built here too rather than
    at every parse of the DAG file."""

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def _choose_compiler(self, spec: Any, context: Any) -> None:
        """The driver's JIT by the planned group's records (``sluice.control.jit``): the DAG's
        options name C1; a group at or above the break-even gets C2's. A spec's own
        ``spark.driver.extraJavaOptions`` is left as it is."""
        from sluice.spark import RUN_ONCE_C2_JAVA_OPTIONS, RUN_ONCE_JAVA_OPTIONS, group_compiler

        options = (self.conf or {}).get("spark.driver.extraJavaOptions", "")
        if RUN_ONCE_JAVA_OPTIONS not in options:
            return
        plan = context["ti"].xcom_pull(task_ids="plan_group") or {}
        if plan.get("group_id") is None:
            return
        store = SluiceStoreHook().get_store()
        try:
            compiler = group_compiler(spec, store, plan["group_id"])
        finally:
            store.close()
        if compiler == "c2":
            self.conf = {**self.conf, "spark.driver.extraJavaOptions": options.replace(RUN_ONCE_JAVA_OPTIONS,
                                                                                       RUN_ONCE_C2_JAVA_OPTIONS)}

    def execute(self, context: Any) -> Any:
        from sluice.paths import project_root
        from sluice.spark import python_files

        # SLUICE_HOME: the job finds the project's files (specs, suites) by it, whichever copy
        # of sluice it imports.
        self.env_vars = {**(self.env_vars or {}), "SLUICE_STORE_URL": pipeline_store(),
                         "SLUICE_HOME": str(project_root())}
        spec = get_spec(self.pipeline)
        self.py_files = python_files(spec.transform_function)
        self._choose_compiler(spec, context)
        connection = getattr(spec.source, "connection", None)
        if connection:  # the job runs outside this task: it resolves the Kafka connection from its environment
            from sluice.airflow.hooks import kafka_connection_env

            self.env_vars.update(kafka_connection_env(connection))
        from sluice.airflow import lineage

        if not lineage.enabled():
            return super().execute(context)
        # OpenLineage is configured: its run facet names the planned group (also when the job
        # fails), then the epochs' counts as the job recorded them.
        plan = context["ti"].xcom_pull(task_ids="plan_group") or {}
        self._lineage_run = lineage.group_run(self.pipeline, self.task_id, [plan] if plan.get("group_id") is not None
                                              else [])
        result = super().execute(context)
        if plan.get("group_id") is not None:
            store = SluiceStoreHook().get_store()
            try:
                group = store.group(self.pipeline, plan["group_id"])
                self._lineage_run = lineage.group_run(self.pipeline, self.task_id, [
                    {"group_id": group.group_id, "epochs": [e.as_record() for e in group.epochs]}])
            except SluiceError as exc:
                self.log.warning("OpenLineage: group %s not read back: %s", plan["group_id"], exc)
            finally:
                store.close()
        return result
