"""The stamp that authorizes a run of an operations DAG for one pipeline (issue 37 item 5,
``sluice.airflow.actions``): the per-pipeline route and the local command line make it, every
task of an operations DAG checks it before it changes anything. A run triggered on the
operations DAG directly, or one whose conf was changed or copied, is refused naming the
pipeline and the way to act. Pure functions: no Airflow server (<1 s)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from sluice.airflow.actions import (
    ACTIONS,
    MAX_AGE_S,
    OPERATIONS_DAGS,
    STAMP_KEY,
    RollbackBody,
    UnauthorizedRunError,
    action_conf,
    authorize_task,
    stamp,
    verify,
)

DAG = "sluice_rollback"
CONF = {"pipeline": "a", "to_epoch": 3, "reason": "bad release", "recompute": True, "take_over": False}


def stamped(user: str | None = "alice", **kw) -> dict:
    return stamp(DAG, CONF, user, via="api", **kw)


def test_a_stamped_run_is_authorized_for_its_pipeline_and_user():
    conf = stamped()
    assert {k: v for k, v in conf.items() if k != STAMP_KEY} == CONF
    got = verify(DAG, conf, "alice", datetime.now(UTC))
    assert got["pipeline"] == "a" and got["user"] == "alice" and got["via"] == "api"
    assert verify(DAG, conf, "alice", None)["pipeline"] == "a"  # no creation time known (dag.test)


@pytest.mark.parametrize("change", [
    {"to_epoch": 0},  # other parameters than were authorized
    {"reason": "something else"},
    {"recompute": False},
    {"take_over": True},
    {"pipeline": "b"},  # the authorization of pipeline a, used for pipeline b
    {"extra": 1},
])
def test_a_tampered_conf_is_refused(change):
    conf = {**stamped(), **change}
    with pytest.raises(UnauthorizedRunError, match="does not match its conf") as refused:
        verify(DAG, conf, "alice", datetime.now(UTC))
    assert f"pipeline {conf['pipeline']!r}" in str(refused.value)
    assert f"/sluice/pipelines/{conf['pipeline']}/actions/rollback" in str(refused.value)


def test_a_stamp_for_another_operations_dag_is_refused():
    conf = stamp("sluice_rollback_preview", {"pipeline": "a", "to_epoch": 3}, "alice", via="api")
    with pytest.raises(UnauthorizedRunError, match="does not match"):
        verify(DAG, {**CONF, STAMP_KEY: conf[STAMP_KEY]}, "alice", None)
    with pytest.raises(UnauthorizedRunError, match="does not match"):
        verify("sluice_recover", conf, "alice", None)


@pytest.mark.parametrize("conf", [dict(CONF), {**CONF, STAMP_KEY: None}, {**CONF, STAMP_KEY: {"user": "alice"}}])
def test_a_direct_trigger_without_a_stamp_is_refused_naming_the_pipeline_and_the_way(conf):
    with pytest.raises(UnauthorizedRunError) as refused:
        verify(DAG, conf, "alice", datetime.now(UTC))
    text = str(refused.value)
    assert "pipeline 'a'" in text and "triggered on sluice_rollback directly" in text and "nothing was changed" in text
    assert "POST /sluice/pipelines/a/actions/rollback" in text and "console" in text and "sluice rollback" in text


def test_a_run_naming_no_pipeline_is_refused():
    with pytest.raises(UnauthorizedRunError, match="names no pipeline"):
        verify(DAG, {"to_epoch": 1}, "alice", None)
    with pytest.raises(UnauthorizedRunError, match="names no pipeline"):
        verify(DAG, None, "alice", None)


def test_a_copied_conf_is_refused_for_another_user_and_later():
    conf = stamped("alice")
    with pytest.raises(UnauthorizedRunError, match="authorized for user 'alice' but triggered by 'mallory'"):
        verify(DAG, conf, "mallory", datetime.now(UTC))
    with pytest.raises(UnauthorizedRunError, match="authorized for user 'alice'"):
        verify(DAG, conf, None, None)
    # the same user, replaying an old conf: the run was created long after the stamp
    old = stamp(DAG, CONF, "alice", via="api", now=time.time() - MAX_AGE_S - 60)
    with pytest.raises(UnauthorizedRunError, match="not shortly before"):
        verify(DAG, old, "alice", datetime.now(UTC))


def test_a_forged_signature_or_another_secret_is_refused(monkeypatch):
    conf = stamped()
    forged = {**conf, STAMP_KEY: dict(conf[STAMP_KEY], signature="0" * 64)}
    with pytest.raises(UnauthorizedRunError, match="does not match"):
        verify(DAG, forged, "alice", None)
    monkeypatch.setenv("AIRFLOW__SLUICE__ACTION_SECRET", "another secret")  # a component with another secret
    with pytest.raises(UnauthorizedRunError, match="jwt_secret"):
        verify(DAG, conf, "alice", None)
    assert verify(DAG, stamped(), "alice", None)  # stamped and checked with the same one


def test_authorize_task_checks_only_the_operations_dags():
    assert set(OPERATIONS_DAGS) == {"sluice_rollback", "sluice_rollback_preview", "sluice_recover", "sluice_skip_file"}
    now = datetime.now(UTC)
    direct = SimpleNamespace(conf=dict(CONF), triggering_user_name="alice", run_after=now)
    assert authorize_task({"dag": SimpleNamespace(dag_id="a"), "dag_run": direct}) is None  # the pipeline's own DAG
    with pytest.raises(UnauthorizedRunError):
        authorize_task({"dag": SimpleNamespace(dag_id=DAG), "dag_run": direct})
    ok = SimpleNamespace(conf=stamped(), triggering_user_name="alice", run_after=now)
    assert authorize_task({"dag": SimpleNamespace(dag_id=DAG), "dag_run": ok})["pipeline"] == "a"


def test_action_conf_and_bodies():
    assert action_conf("rollback", "a", RollbackBody(to_epoch=3, reason="bad release")) == CONF
    assert set(ACTIONS) == {"rollback", "rollback-preview", "recover", "skip-file"}
    for _, body in ACTIONS.values():
        with pytest.raises(ValueError):
            body.model_validate({"pipeline": "b", "to_epoch": 1, "file": "f", "reason": "why not"})  # no pipeline field


def test_an_operations_task_refuses_a_run_authorized_for_another_pipeline():
    """The task acts on ``params.pipeline``; should it differ from the stamped pipeline (a conf
    that does not override the params), it refuses."""
    from airflow.sdk.exceptions import AirflowFailException

    from sluice.airflow.operators import SkipFileOperator

    task = SkipFileOperator(task_id="skip_file", pipeline="b")
    run = SimpleNamespace(conf=stamp("sluice_skip_file", {"pipeline": "a", "file": "x", "reason": "gone"}, "alice",
                                     via="api"), triggering_user_name="alice", run_after=datetime.now(UTC))
    with pytest.raises(AirflowFailException, match="authorized for 'a'"):
        task.execute({"dag": SimpleNamespace(dag_id="sluice_skip_file"), "dag_run": run, "params": {}, "run_id": "r"})


def test_the_local_command_line_stamps_what_it_triggers(monkeypatch, capsys):
    """``sluice rollback``/``recover`` (``make rollback``/``recover``) run ``airflow dags
    trigger`` with a stamped conf, for the OS user that command records as the triggering user."""
    import getpass
    import json

    from sluice.cli import main

    calls = []
    monkeypatch.setattr("sluice.cli.subprocess.run",
                        lambda cmd, **kw: calls.append(cmd) or SimpleNamespace(returncode=0, stdout="[]", stderr=""))
    assert main(["rollback", "--pipeline", "a", "--to-epoch", "3", "--reason", "bad release"]) == 0
    assert main(["recover", "--pipeline", "a", "--withdraw-rollback"]) == 0
    assert STAMP_KEY not in capsys.readouterr().out  # the printed conf leaves the stamp out
    (rollback, recover) = [(cmd[cmd.index("trigger") + 1], json.loads(cmd[cmd.index("--conf") + 1])) for cmd in calls]
    assert rollback[0] == "sluice_rollback" and recover[0] == "sluice_recover"
    assert {k: v for k, v in rollback[1].items() if k != STAMP_KEY} == CONF
    assert {k: v for k, v in recover[1].items() if k != STAMP_KEY} == {"pipeline": "a", "withdraw_rollback": True,
                                                                       "take_over": False}
    for dag_id, conf in (rollback, recover):
        assert verify(dag_id, conf, getpass.getuser(), datetime.now(UTC))["via"] == "cli"
