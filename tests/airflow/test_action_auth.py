"""Operator actions are authorized per pipeline (issue 37 item 5), on a real ``airflow
api-server`` with the FAB auth manager (per-DAG permissions; ``tests/airflow/fab.py``).

Users: ``viewer`` (FAB's Viewer: may read every DAG), ``editor_a`` (may read and edit DAG
``authz_a`` only, and create DAG runs), ``ops`` (may read every DAG and trigger the operations
DAGs, but edit no pipeline's DAG: who could act on any pipeline before), ``admin``. Every
action (rollback, rollback-preview, recover, skip-file) on pipelines A and B, through

* the console's route, ``POST /sluice/pipelines/<p>/actions/<action>``: allowed for a user who
  may edit the pipeline's DAG (``editor_a`` on A, ``admin``), 403 for the others;
* Airflow's REST API on the operations DAG directly: 403 unless the user may trigger it
  (``ops``, ``admin``), and then the run is refused by its task before it changes anything
  (the real operator's ``execute`` on the run's real conf, triggering user and creation time;
  no scheduler runs here);
* the command line's API mode (``sluice <action> --api-url``): as the route;
* the local command line (``sluice recover``, what ``make recover`` runs): a stamped run its
  task accepts.

An allowed action leaves a queued run of the operations DAG with its conf and the user as its
triggering user; a 403 leaves no new run; the epoch store is the same after all of it (no
scheduler runs the runs). Then the operator check itself: the direct run of skip-file is
refused by ``SkipFileOperator.execute`` and the store is unchanged, while the route's run of
the same action passes and does skip the file (the check, not something else, refused).

Measured cost: 54-62 s in all on the 2-core machine shared with other work (the server's
set-up and start 27-31 s: DAGs serialized and FAB's users made in one process, then the
api-server; the matrix 11-18 s, 64 requests and 32 command lines in-process, each logging in;
the local command line 8-9 s; the operator's check under 2 s; the stop 3-5 s). No scheduler:
the runs are checked, not executed."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sluice.airflow.actions import ACTIONS, STAMP_KEY, UnauthorizedRunError, verify
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.store import EpochStore
from tests.airflow import fab, standalone
from tests.pipelines import make_pipeline

A, B = "authz_a", "authz_b"
OPS = sorted(dag_id for dag_id, _ in ACTIONS.values())
USERS: dict[str, dict[str, Any]] = {
    "admin": {"role": "Admin"},
    "viewer": {"role": "Viewer"},
    "editor_a": {"role": "edit_authz_a", "permissions": [
        ["can_read", f"DAG:{A}"], ["can_edit", f"DAG:{A}"], ["can_create", "DAG Runs"], ["can_read", "DAG Runs"]]},
    "ops": {"role": "operations", "permissions": [
        ["can_read", "DAGs"], ["can_create", "DAG Runs"], ["can_read", "DAG Runs"],
        *[["can_edit", f"DAG:{dag_id}"] for dag_id in OPS]]},
}
#: the body of each action, on a file the pipelines registered (so a skip would change the store)
BODIES = {"rollback": {"to_epoch": 0, "reason": "a bad release"}, "rollback-preview": {"to_epoch": 0},
          "recover": {}, "skip-file": {"file": "a.json", "reason": "truncated upload"}}
CLI = {"rollback": ["rollback", "--to-epoch", "0", "--reason", "a bad release"],
       "rollback-preview": ["preview-rollback", "--to-epoch", "0"], "recover": ["recover"],
       "skip-file": ["skip-file", "--file", "a.json", "--reason", "truncated upload"]}


def may_edit(user: str, pipeline: str) -> bool:
    return user == "admin" or (user == "editor_a" and pipeline == A)


def may_trigger_operations(user: str) -> bool:
    return user in ("admin", "ops")


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[tuple[standalone.Server, dict[str, str], dict[str, str]]]:
    """Pipelines A and B with a planned epoch each, then the api-server (FAB) with the users.
    The server and this process share ``[api_auth] jwt_secret`` (it keys sluice's stamps), as an
    Airflow deployment's components do."""
    for name in (A, B):
        spec = make_pipeline(name)
        store = EpochStore()
        landed = spec.landing_dir / "a.json"
        landed.write_text("{}\n")
        lease = acquire_lease(store, name, "t")
        store.register_files(name, [(str(landed), landed.stat().st_size, landed.stat().st_mtime)])
        plan_group(store, lease, epoch_size=1, k=1)
        store.release_lease(lease)
        store.close()
    secret = secrets.token_urlsafe(24)
    before = os.environ.get("AIRFLOW__API_AUTH__JWT_SECRET")
    os.environ["AIRFLOW__API_AUTH__JWT_SECRET"] = secret
    home = tmp_path_factory.mktemp("action_auth") / "airflow"
    home.mkdir(parents=True)
    passwords = {user: secrets.token_urlsafe(12) for user in USERS}
    server = fab.start(home, secret, {u: dict(spec, password=passwords[u]) for u, spec in USERS.items()})
    try:
        def token(user: str) -> str | None:
            try:
                with httpx.Client(base_url=server.url, timeout=30.0) as c:
                    r = c.post("/auth/token", json={"username": user, "password": passwords[user]})
            except httpx.TransportError:
                return None
            assert r.status_code in (200, 201), r.text
            return r.json()["access_token"]

        tokens = {"admin": standalone.wait_for(lambda: token("admin"), 180, "a token", server=server)}
        tokens.update({user: token(user) for user in USERS if user != "admin"})
        yield server, tokens, passwords
    finally:
        standalone.stop(server)
        if before is None:
            os.environ.pop("AIRFLOW__API_AUTH__JWT_SECRET", None)
        else:
            os.environ["AIRFLOW__API_AUTH__JWT_SECRET"] = before


def as_user(server: standalone.Server, token: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30.0, headers={"Authorization": f"Bearer {token}"})


def store_state() -> Any:
    """What an action would change: every epoch of A and B, their files (with skips), the generation."""
    store = EpochStore()
    try:
        return {name: (repr(store.epoch_history(name)), [f.as_record() for f in store.manifest(name, 0, 10)],
                       store.generation(name), store.pending_rollback(name)) for name in (A, B)}
    finally:
        store.close()


def runs(client: httpx.Client, dag_id: str) -> dict[str, dict[str, Any]]:
    r = client.get(f"/api/v2/dags/{dag_id}/dagRuns", params={"limit": 100})
    r.raise_for_status()
    return {run["dag_run_id"]: run for run in r.json()["dag_runs"]}


def params(conf: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in conf.items() if k != STAMP_KEY}


def as_created(run: dict[str, Any]) -> tuple[Any, ...]:
    """What the task checks, from the run as Airflow holds it."""
    return (run["dag_id"], run["conf"], run["triggering_user_name"], datetime.fromisoformat(run["run_after"]))


def test_every_action_is_authorized_on_the_pipeline_dag(api, monkeypatch, capsys):
    from sluice.cli import main

    server, tokens, passwords = api
    before = store_state()
    admin = as_user(server, tokens["admin"])
    seen = {dag_id: set(runs(admin, dag_id)) for dag_id in OPS}

    def new_runs(dag_id: str) -> list[dict[str, Any]]:
        now = runs(admin, dag_id)
        fresh = [now[r] for r in set(now) - seen[dag_id]]
        seen[dag_id].update(now)
        return fresh

    def allowed(answer: dict[str, Any], user: str, pipeline: str, action: str) -> None:
        """The one new run is the one answered, queued, with the conf and the user; its task goes on."""
        dag_id = ACTIONS[action][0]
        assert answer["dag_id"] == dag_id and answer["triggering_user_name"] == user, answer
        [run] = new_runs(dag_id)
        assert run["dag_run_id"] == answer["dag_run_id"] and run["state"] == "queued", run
        assert run["triggering_user_name"] == user, run
        assert params(run["conf"]) == {"pipeline": pipeline, **ACTIONS[action][1](**BODIES[action]).model_dump()}
        assert verify(*as_created(run))["pipeline"] == pipeline

    def refused(status: int, dag_id: str, what: str) -> None:
        assert status == 403, what
        assert new_runs(dag_id) == [], f"{what}: a 403 created a run"

    direct_runs = []
    for user in USERS:
        client = as_user(server, tokens[user])
        monkeypatch.setenv("SLUICE_API_USER", user)
        monkeypatch.setenv("SLUICE_API_PASSWORD", passwords[user])
        for action, (dag_id, _) in ACTIONS.items():
            for pipeline in (A, B):
                what = f"{user} {action} {pipeline}"
                # the console's route
                r = client.post(f"/sluice/pipelines/{pipeline}/actions/{action}", json=BODIES[action])
                if may_edit(user, pipeline):
                    assert r.status_code == 200, (what, r.text)
                    allowed(r.json(), user, pipeline, action)
                else:
                    refused(r.status_code, dag_id, f"route: {what}")
                # Airflow's REST API on the operations DAG
                conf = {"pipeline": pipeline, **BODIES[action]}
                r = client.post(f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
                if may_trigger_operations(user):
                    assert r.status_code == 200, (what, r.text)
                    [run] = new_runs(dag_id)
                    with pytest.raises(UnauthorizedRunError) as no:  # what its first task checks
                        verify(*as_created(run))
                    assert f"pipeline {pipeline!r}" in str(no.value)
                    assert f"/sluice/pipelines/{pipeline}/actions/{action}" in str(no.value)
                    direct_runs.append(run)
                else:
                    refused(r.status_code, dag_id, f"REST: {what}")
                # the command line, through the api-server
                capsys.readouterr()
                code = main([*CLI[action], "--pipeline", pipeline, "--api-url", server.url])
                out, err = capsys.readouterr()
                if may_edit(user, pipeline):
                    assert code == 0, (what, err)
                    allowed(json.loads(out.strip().splitlines()[-1]), user, pipeline, action)
                else:
                    assert code == 2 and "HTTP 403" in err, (what, code, err)
                    refused(403, dag_id, f"CLI: {what}")
        client.close()

    # Answers before an action: no login 401, an unknown pipeline 404, a bad body 422; each creates no run.
    assert httpx.post(f"{server.url}/sluice/pipelines/{A}/actions/recover", json={}).status_code == 401
    assert admin.post("/sluice/pipelines/no_such_pipeline/actions/recover", json={}).status_code == 404
    for action, body in [("rollback", {"to_epoch": 0, "reason": "x"}), ("rollback", {"to_epoch": -1, "reason": "why"}),
                         ("skip-file", {"reason": "no file"}), ("recover", {"pipeline": B}),
                         ("rollback-preview", {"to_epoch": "one"})]:
        r = admin.post(f"/sluice/pipelines/{A}/actions/{action}", json=body)
        assert r.status_code == 422, (action, body, r.status_code, r.text)
    with as_user(server, tokens["viewer"]) as v:
        assert v.post(f"/sluice/pipelines/{A}/actions/rollback", json={"to_epoch": "bad"}).status_code == 403
    assert all(new_runs(dag_id) == [] for dag_id in OPS)
    assert {(r["dag_id"], r["triggering_user_name"]) for r in direct_runs} == {
        (dag_id, user) for dag_id in OPS for user in ("admin", "ops")}
    assert store_state() == before  # nothing changed
    admin.close()


def test_the_local_command_line_stamps_its_runs(api):
    """``sluice recover`` (``make recover``) on a host with Airflow's configuration: ``airflow
    dags trigger`` with a stamped conf; the run's task accepts it (triggering user: the OS user)."""
    server, tokens, _ = api
    env = {**standalone.server_env(server.home, server.port), **fab.env(os.environ["AIRFLOW__API_AUTH__JWT_SECRET"]),
           **fab.python_path()}
    done = subprocess.run([sys.executable, "-m", "sluice", "recover", "--pipeline", A], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert STAMP_KEY not in json.loads(done.stdout.strip().splitlines()[-1])["conf"]  # not shown
    with as_user(server, tokens["admin"]) as c:
        cli_runs = [r for r in runs(c, "sluice_recover").values()
                    if (r["conf"].get(STAMP_KEY) or {}).get("via") == "cli"]
    assert len(cli_runs) == 1, cli_runs
    assert verify(*as_created(cli_runs[0]))["pipeline"] == A
    assert params(cli_runs[0]["conf"]) == {"pipeline": A, "withdraw_rollback": False, "take_over": False}


def test_a_direct_run_is_refused_by_its_task_and_changes_nothing(api):
    """The real ``SkipFileOperator`` of ``sluice_skip_file`` on a run ``ops`` triggered directly:
    it fails naming the pipeline and the route, and the store is as it was. The run the route
    created for ``editor_a``, the same action, passes the same check and skips the file."""
    from airflow.sdk.exceptions import AirflowFailException

    from sluice.airflow.dag_factory import build_skip_file_dag
    from sluice.spec import load_pipeline_specs

    server, tokens, _ = api
    task = build_skip_file_dag(load_pipeline_specs()[0]).get_task("skip_file")

    def execute(run: dict[str, Any]) -> Any:
        task.pipeline = run["conf"]["pipeline"]  # what rendering ``{{ params.pipeline }}`` gives
        dag_run = SimpleNamespace(conf=run["conf"], triggering_user_name=run["triggering_user_name"],
                                  run_after=datetime.fromisoformat(run["run_after"]))
        return task.execute({"dag": task.dag, "dag_run": dag_run, "params": dict(run["conf"]),
                             "run_id": run["dag_run_id"]})

    body = {"file": "a.json", "reason": "truncated upload"}
    with as_user(server, tokens["ops"]) as c:
        r = c.post("/api/v2/dags/sluice_skip_file/dagRuns",
                   json={"logical_date": None, "conf": {"pipeline": A, **body}})
        assert r.status_code == 200, r.text
        direct = r.json()
    before = store_state()
    with pytest.raises(AirflowFailException) as refused:
        execute(direct)
    assert f"pipeline {A!r}" in str(refused.value) and f"/sluice/pipelines/{A}/actions/skip-file" in str(refused.value)
    assert store_state() == before

    with as_user(server, tokens["editor_a"]) as c:
        r = c.post(f"/sluice/pipelines/{A}/actions/skip-file", json=body)
        assert r.status_code == 200, r.text
    with as_user(server, tokens["admin"]) as c:
        run = c.get(f"/api/v2/dags/sluice_skip_file/dagRuns/{r.json()['dag_run_id']}").json()
    report = execute(run)
    assert report["file"].endswith("a.json"), report
    assert store_state() != before  # the check let it through, and the skip was recorded
