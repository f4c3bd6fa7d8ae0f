"""The pipeline DAGs load, and run end to end with ``dag.test()`` (in-process Airflow):
``ysb`` through spark-submit, ``ysb_clean`` with Spark inside the task."""

from __future__ import annotations

import pytest

from include.generators.ysb import parse_valid
from sluice import protocol
from sluice.protocol.run import PipelineRun
from sluice.spec import get_spec
from sluice.store import EpochStore
from tests.pipelines import assert_matches_oracle, land, landed, make_pipeline


def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag()


def authorized(dag_id: str, conf: dict) -> dict:
    """An operations DAG's conf, stamped as the action route and the command line stamp it
    (``sluice.airflow.actions``; ``dag.test()`` records its runs as triggered by ``dag_test``):
    its tasks refuse a run without."""
    from sluice.airflow.actions import stamp

    return stamp(dag_id, conf, "dag_test", via="test")


def test_every_spec_becomes_a_dag_without_import_errors():
    make_pipeline("dag_shape")
    make_pipeline("dag_no_triggerer", **{"control.sensor_mode": "reschedule"})
    bag = dagbag()
    sensor = bag.dags.get("dag_no_triggerer").get_task("wait_for_backlog")
    assert not sensor.deferrable and sensor.mode == "reschedule", "no triggerer: reschedule, no slot held"
    assert not bag.import_errors, bag.import_errors
    for name in ("ysb", "ysb_clean", "dag_shape"):
        dag = bag.dags.get(name)
        assert dag is not None, f"no DAG for pipeline {name}"
        assert dag.max_active_runs == 1
        assert [t.task_id for t in dag.topological_sort()] == [
            "wait_for_backlog", "plan_group", "run_group", "validate", "checkpoint", "more_to_drain",
            "drain_again"]
        assert [a.name for a in dag.get_task("checkpoint").outlets] == [
            f"sluice/{name}/{s.name}" for s in get_spec(name).sinks]
    for name, tasks in (("sluice_rollback", ["rollback", "recompute", "run_group", "validate", "checkpoint"]),
                        ("sluice_recover", ["plan_group", "run_group", "validate", "checkpoint"]),
                        ("sluice_rollback_preview", ["preview"])):
        dag = bag.dags.get(name)
        assert [t.task_id for t in dag.topological_sort()] == tasks
        assert {"ysb", "ysb_clean", "dag_shape"} <= set(dag.params.get_param("pipeline").schema["enum"])
    assert type(bag.dags.get("ysb").timetable).__name__ == "ContinuousTimetable"
    assert "*/10 * * * *" in repr(bag.dags.get("ysb_clean").timetable)
    sensor = bag.dags.get("ysb").get_task("wait_for_backlog")
    assert sensor.deferrable and sensor.soft_fail
    assert sensor.timeout == 6 * 3600, "@continuous: wait up to the spec's sensor_timeout_s"
    cron_sensor = bag.dags.get("ysb_clean").get_task("wait_for_backlog")
    assert cron_sensor.timeout == cron_sensor.poke_interval, "a scheduled run with no data skips after one poll"
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    submit = bag.dags.get("ysb").get_task("run_group")
    assert isinstance(submit, SparkSubmitOperator) and type(submit).__name__ == "RunGroupSubmitOperator"
    assert not submit.env_vars, "the store's URL is set at execute time, never a template field"
    for dag_id, task_id in (("sluice_rollback", "rollback"), ("sluice_rollback", "checkpoint"),
                            ("sluice_recover", "checkpoint")):  # they act on a pipeline chosen when triggered
        assert [type(o).__name__ for o in bag.dags.get(dag_id).get_task(task_id).outlets] == ["AssetAlias"]
    assert type(bag.dags.get("ysb_clean").get_task("run_group")).__name__ == "RunGroupOperator"


def test_a_broken_spec_is_an_import_error_naming_file_and_field(tmp_path, monkeypatch):
    from sluice.paths import pipelines_dir

    bad = pipelines_dir() / "broken_spec.yaml"
    bad.write_text((pipelines_dir() / "ysb.yaml").read_text().replace("name: ysb", "name: broken_spec")
                   .replace("epoch_files: 4", "epoch_files: -3"))
    try:
        bag = dagbag()
        errors = "\n".join(bag.import_errors.values())
        assert "broken_spec.yaml" in errors and "control.epoch_files" in errors, errors
        assert {"ysb", "ysb_clean"} <= set(bag.dags), "a broken spec must not hide the other pipelines"
    finally:
        bad.unlink()


# submit (~58 s) is a further variant: CI runs spark-submit under the real scheduler
# (test_real_airflow.py) and in test_logging.py, which `make test` runs too.
@pytest.mark.parametrize("mode", [pytest.param("submit", marks=pytest.mark.variant), "in_process"])
def test_dag_test_runs_one_group_per_dag_run(mode, spark):
    name = f"dagtest_{mode}"
    spec = make_pipeline(name, **{"control.epoch_files": 2, "control.group_epochs": 2, "spark.mode": mode})
    land(spec, files=6, malformed_fraction=0.02)
    dag = dagbag().dags.get(name)
    runs = []
    for _ in range(2):  # 6 files, 2 per epoch, 2 epochs per group: two DAG runs
        dr = dag.test(run_conf={"drain": False})
        runs.append({ti.task_id: ti.state for ti in dr.get_task_instances()})
        assert dr.state == "success", runs[-1]
        assert runs[-1]["checkpoint"] == "success", runs[-1]
        assert runs[-1]["more_to_drain"] == "success" and runs[-1]["drain_again"] == "skipped", runs[-1]
    log = EpochStore()
    epochs = log.epochs(name)
    assert [e.group_id for e in epochs] == [0, 0, 1]  # the second run planned the last 2 files
    assert {e.state for e in epochs} == {protocol.PUBLISHED}
    assert log.lease_holder(name) is None, "checkpoint must release the lease"
    assert_matches_oracle(spark, spec, log)
    assert sum(e.rows["rejected"] for e in epochs) == sum(
        1 for p in landed(spec) for line in p.read_text().splitlines() if line.strip() and parse_valid(line) is None)


def test_params_override_epoch_size_and_k(spark):
    spec = make_pipeline("dagtest_params", **{"spark.mode": "in_process"})
    land(spec, files=5)
    dr = dagbag().dags.get(spec.name).test(run_conf={"epoch_size": 1, "k": 5})
    assert dr.state == "success"
    epochs = EpochStore().epochs(spec.name)
    assert [(e.start, e.end) for e in epochs] == [(i, i + 1) for i in range(5)]
    assert_matches_oracle(spark, spec, EpochStore())


def test_drain_triggers_the_next_group_run_with_the_same_conf(spark):
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    spec = make_pipeline("dagtest_drain", **{"spark.mode": "in_process", "control.group_epochs": 1,
                                             "control.epoch_files": 2})
    land(spec, files=4)
    dr = dagbag().dags.get(spec.name).test(run_conf={"drain": True, "epoch_size": 1})
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert states["drain_again"] == "success", states
    with create_session() as session:
        runs = session.query(DagRun).filter(DagRun.dag_id == spec.name).all()
        triggered = [r for r in runs if r.run_id != dr.run_id]
        assert len(triggered) == 1 and triggered[0].conf == {"drain": True, "epoch_size": 1, "k": None}
    epochs = EpochStore().epochs(spec.name)
    assert [(e.start, e.end) for e in epochs] == [(0, 1)], "one group of k=1 epoch of 1 file per DAG run"


def test_sluice_skip_file_dag_records_who_when_why():
    """No Spark: the skip is recorded with this DAG run as who, and unpaused from the start."""
    spec = make_pipeline("dag_skip_file")
    path = land(spec, files=1)[0]
    log = EpochStore()
    log.register_files(spec.name, [(str(path), path.stat().st_size, path.stat().st_mtime)])
    dag = dagbag().dags.get("sluice_skip_file")
    assert dag.is_paused_upon_creation is False and "take_over" not in dag.params
    dr = dag.test(run_conf=authorized("sluice_skip_file", {"pipeline": spec.name, "file": path.name,
                                                         "reason": "truncated upload"}))
    assert dr.state == "success"
    skipped = log.manifest(spec.name)[0].skipped
    assert skipped.reason == "truncated upload" and skipped.by.startswith("airflow:sluice_skip_file:")
    dr = dag.test(run_conf=authorized("sluice_skip_file", {"pipeline": spec.name, "file": "never-landed.json",
                                                         "reason": "typo"}))
    assert dr.state == "failed", "a file that is not in the manifest is refused"
    log.close()


def test_trigger_form_params_are_validated():
    from airflow.sdk.definitions.param import ParamsDict

    dag = dagbag().dags.get("ysb")
    with pytest.raises(Exception, match="Invalid input for param k: 0 is less than the minimum of 1"):
        params = ParamsDict(dag.params)
        params.update({"k": 0})
        params.validate()
    ok = ParamsDict(dag.params)
    ok.update({"k": 5, "epoch_size": 2, "drain": True})
    assert ok.validate() == {"k": 5, "epoch_size": 2, "drain": True}


def test_halted_pipeline_then_sluice_rollback_and_sluice_recover_dags(spark):
    """Through the operations DAGs: a validation failure halts the pipeline DAG at `validate`;
    `sluice_recover` on the still-broken code fails again; `sluice_rollback` with the fixed
    code rolls back to the bad epoch and recomputes it: the table equals the oracle."""
    from sluice.errors import PipelineHaltedError
    from sluice.store import EpochStore

    overrides = {"spark.mode": "in_process", "control.epoch_files": 2, "control.group_epochs": 1}
    name = "dagtest_operations"
    spec = make_pipeline(name, **overrides)
    land(spec, files=4, seed=5)
    bag = dagbag()
    assert bag.dags[name].test().state == "success"  # epoch 0
    make_pipeline(name, transform="tests.integration.buggy_transforms.campaign_views_null_campaign", **overrides)
    dr = bag.dags[name].test()
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert states["run_group"] == "success" and states["validate"] == "failed", states
    assert states["checkpoint"] == "upstream_failed", states
    log = EpochStore()
    assert log.lease_holder(name) is None, "a failed run gives its lease up"
    with pytest.raises(PipelineHaltedError):
        PipelineRun(spec, log, "probe").plan()
    dr = bag.dags["sluice_recover"].test(run_conf=authorized("sluice_recover", {"pipeline": name}))
    assert {ti.task_id: ti.state for ti in dr.get_task_instances()}["validate"] == "failed"

    make_pipeline(name, **overrides)  # the fix
    dr = bag.dags["sluice_rollback"].test(run_conf=authorized("sluice_rollback", {
        "pipeline": name, "to_epoch": 1, "reason": "fixed transform", "recompute": True}))
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert set(states.values()) == {"success"}, states
    assert log.generation(name) == 1
    assert [(e.epoch_id, e.state) for e in log.epochs(name)] == [(0, "published"), (1, "published")]
    assert_matches_oracle(spark, spec, log)
    log.close()
