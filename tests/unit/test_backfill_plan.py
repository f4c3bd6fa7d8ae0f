"""A backfill run over data the pipeline never planned plans it (no Spark: planning only)."""

from __future__ import annotations

import os

from sluice import protocol
from sluice.protocol.run import GroupPlan, PipelineRun, PlannedRollback, SensedPlan
from sluice.store import EpochStore
from tests.pipelines import land, make_pipeline


def test_backfill_plans_never_planned_files_that_landed_before_its_interval_end(tmp_path):
    spec = make_pipeline("backfill_new_data", **{"control.epoch_files": 2, "control.group_epochs": 1})
    files = land(spec, files=5)
    for i, path in enumerate(files):  # landed at t = 1000, 1100, ... 1400
        os.utime(path, (1000 + 100 * i, 1000 + 100 * i))
    log = EpochStore(f"sqlite:///{tmp_path}/s.db")
    assert PipelineRun(spec, log, "airflow:d:backfill__0").plan(interval=(0.0, 1000.0)) is None, "nothing before t=1000"
    planned = PipelineRun(spec, log, "airflow:d:backfill__1").plan(interval=(1000.0, 1250.0))
    # Files at 1000, 1100, 1200 landed before the end: all of them now, whatever k says.
    assert [(e.start, e.end) for e in planned.epochs] == [(0, 2), (2, 3)]
    assert "never processed" in planned.plan["reason"]
    assert {e.state for e in log.epochs(spec.name)} == {protocol.PLANNED}
    log.close()


def test_a_group_plan_comes_back_from_xcom_as_it_went(tmp_path):
    """XCom stores JSON: the plan the next steps read is the plan the plan step made."""
    import json

    spec = make_pipeline("plan_through_xcom", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=3)
    log = EpochStore(f"sqlite:///{tmp_path}/s.db")
    planned = PipelineRun(spec, log, "airflow:d:scheduled__1").plan(extra={"partitions": 4})
    assert [(e.epoch_id, e.start, e.end, e.state) for e in planned.epochs] == [(0, 0, 2, "planned"),
                                                                              (1, 2, 3, "planned")]
    assert planned.plan["partitions"] == 4 and planned.rollback is None
    assert GroupPlan.from_xcom(json.loads(json.dumps(planned.as_xcom()))) == planned
    recorded = GroupPlan(spec.name, None, plan={"reason": "backfill"},
                                   rollback=PlannedRollback(to_epoch=1, through_epoch=3))
    assert GroupPlan.from_xcom(json.loads(json.dumps(recorded.as_xcom()))) == recorded
    log.close()


def test_the_sensors_plan_comes_back_from_xcom_and_the_runs_params_win():
    """The sensor's verdict reaches the plan step typed, through JSON; a run's ``epoch_size``
    param overrides the controllers' and says so in the reason; the controllers' figures are
    what the group records beside its reason."""
    import json

    verdict = {"epoch_size": 4, "k": 3, "partitions": 8, "reason": "efficient group: stable",
               "predicted_wall_s": 12.5, "rate_rps": 900.0, "file_rate": 0.5}
    sensed = SensedPlan.fired(verdict, {"files": 12}, {"epoch_size": 2})
    assert (sensed.epoch_size, sensed.k, sensed.partitions) == (2, 3, 8)
    assert sensed.reason == "efficient group: stable (epoch_size 2 from the run's params)"
    assert SensedPlan.from_xcom(json.loads(json.dumps(sensed.as_xcom()))) == sensed
    assert set(sensed.measured()) == {"partitions", "fired_at", "rate_rps", "file_rate", "predicted_wall_s"}
    assert SensedPlan.from_xcom(None) == SensedPlan(), "no sensor (a manual run)"
    assert SensedPlan.from_xcom(None).measured() == {}
