"""Read-only epoch-store API, served by the Airflow api-server under ``/sluice``.

``GET /sluice/pipelines`` lists the pipelines the user may read, with a summary;
``GET /sluice/pipelines/{dag_id}/epochs`` returns every epoch of every generation once
(rolled-back ones included) with the generation that wrote it, the one it lives in now, and its
files (``?last=N&before=E``: a page of them); ``GET /sluice/pipelines/{dag_id}/control`` the
adaptive controllers' state and what the backlog sensor would decide now;
``GET /sluice/pipelines/{dag_id}/groups`` each group with the DAG run that planned it
(``?since=G``: from group G on); ``GET /sluice/pipelines/{dag_id}/rollback-preview?to_epoch=N``
what a rollback to epoch N would remove and restore, and what blocks it, read from the store and
the source only (the rollback task checks the Delta tables again before it changes anything);
``GET /sluice/pipelines/{dag_id}/shadow-previews`` the kept reports of ``sluice_rollback_preview``
(the rollback's epochs recomputed into shadow tables and compared with the published ones).

Operator actions: ``POST /sluice/pipelines/{dag_id}/actions/{action}`` (``rollback``,
``rollback-preview``, ``recover``, ``skip-file``; a JSON body of the action's parameters,
``sluice.airflow.actions``) asks for **edit** access to the pipeline's own DAG and creates a run
of the operations DAG (``sluice_rollback``, ``sluice_rollback_preview``, ``sluice_recover``,
``sluice_skip_file``) itself, recorded as triggered by the user, its conf stamped so that its
tasks know it was authorized for this pipeline: a run triggered on an operations DAG directly
is refused by its tasks before they change anything. Answers ``{dag_id, dag_run_id}`` as
Airflow's own trigger route does.

The console, pages the Airflow UI shows in a frame (``external_views`` in ``sluice_plugin``):
``GET /sluice/ui`` lists the pipelines, ``GET /sluice/ui/{dag_id}`` is a pipeline's page. The
page reads the routes above and starts operator actions through the action routes.

Behind Airflow's auth: plugin apps are mounted outside the core API, whose dependencies never
reach them, so every route here asks for the user itself (a Bearer JWT, or the UI's session
cookie) and for read access to the pipeline's DAG (its id is the pipeline's name), edit access
for an action, as the core API's DAG routes do: 401 without a valid token, 403 without access.
No route writes to the store; an action's run does, once its tasks run.
"""

from __future__ import annotations

import json
import time
from datetime import UTC
from pathlib import Path
from typing import Annotated, Any

from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from sluice import protocol
from sluice.airflow.actions import (
    ACTIONS,
    STAMP_KEY,
    RecoverBody,
    RollbackBody,
    RollbackPreviewBody,
    SkipFileBody,
    UnauthorizedRunError,
    action_conf,
    stamp,
)
from sluice.errors import SluiceError
from sluice.model import RollbackIntent
from sluice.spec import get_spec, load_pipeline_specs
from sluice.store import Epoch, EpochStore, ManifestEntry

app = FastAPI(title="sluice epoch store")

#: The largest id or count a page parameter takes (a signed 64-bit integer in either store).
ID_MAX = 2**63 - 1
#: Read access to the DAG named by the route's ``dag_id`` (the pipeline).
CAN_READ = [Depends(requires_access_dag("GET"))]
#: Edit access to it: what an operator action on the pipeline asks for.
CAN_EDIT = [Depends(requires_access_dag("PUT"))]


def readable(request: Request, user: GetUserDep, name: str) -> bool:
    try:
        requires_access_dag("GET", param_dag_id=name)(request, user)
    except HTTPException:
        return False
    return True


@app.get("/pipelines")
def pipelines(request: Request, user: GetUserDep) -> list[dict[str, Any]]:
    """The pipelines whose DAG the user may read."""
    store = EpochStore()
    try:
        return [store.summary(name) for name in load_pipeline_specs()[0] if readable(request, user, name)]
    finally:
        store.close()


@app.get("/pipelines/{dag_id}/epochs", dependencies=CAN_READ)
def epochs(dag_id: str, last: Annotated[int | None, Query(ge=0, le=ID_MAX)] = None,
           before: Annotated[int | None, Query(ge=0, le=ID_MAX)] = None) -> list[dict[str, Any]]:
    """Every epoch of every generation once; a page of them with ``last`` (the ``last`` highest
    epoch ids, each with all its generations) and ``before`` (epoch ids below it): a pipeline's
    epochs are never pruned, so a console reads pages (the next older one: ``before`` the
    lowest ``epoch_id`` of the page)."""
    name = dag_id  # a pipeline's DAG id is its name
    from sluice.sources import source_for

    spec = _spec_or_404(name)
    store = EpochStore()
    try:
        history = store.epoch_history(name, last=last, before=before)
        start = min((e.start for e in history), default=0)
        end = max((e.end for e in history), default=0)
        entries = {f.position: f for f in store.manifest(name, start, end)}
        current = store.generation(name)
        source = source_for(spec, store)

        plans = store.group_plans(name, since=min((e.group_id for e in history), default=None))

        def held(e: Epoch) -> list[ManifestEntry]:
            return [entries[p] for p in range(e.start, e.end) if p in entries]

        # ``files``: the manifest entries (files, or Kafka chunks); ``offsets``: what they hold in
        # the source's terms (per-partition Kafka offsets); ``group_reason`` and ``started``: why
        # the group that ran the epoch started when it did (``adaptive.StartReason``; None for a
        # run the sensor did not start: manual, backfill, rollback); ``rows_out``, ``commit``,
        # ``own_timings``, ``validation_outcome``: what is the epoch's own (``epoch_view``; the
        # console reads these). ``rows`` and ``timings`` are the store's record as is.
        return [dict(e.as_record(), generation=e.written_generation, live_generation=e.generation,
                     live=e.generation == current and e.state != "rolled_back",
                     files=[f.as_record() for f in held(e)], offsets=source.describe(held(e)),
                     group_reason=plans.get(e.group_id, {}).get("reason"),
                     started=plans.get(e.group_id, {}).get("started"), **epoch_view(e))
                for e in history]
    finally:
        store.close()


def shared_commit(e: Epoch) -> bool:
    """Whether the epoch was committed in one Delta commit with other epochs (its group's): its
    output rows and timings are then the commit's, recorded on the commit's last epoch (output)
    and copied to each (timings); nothing of them is the epoch's own."""
    span = e.commit_span
    return span is not None and span[0] != span[1]


def validation_outcome(e: Epoch) -> str | None:
    """``passed`` (every sink's suite passed), ``failed`` (one failed, whatever the policy did
    with it next), or None (not validated: no suite, or not run yet)."""
    if not e.validation:
        return None
    return "passed" if all(r.get("success") is not False for r in e.validation.values()) else "failed"


def epoch_view(e: Epoch) -> dict[str, Any]:
    """What of an epoch's record is its own, for the console. Output rows are counted by Delta
    per commit, and a group commits its epochs together: the store keeps the commit's count on
    its last epoch and 0 on the others, and the group's timings on each. No per-epoch count
    exists, so ``rows_out`` is None for an epoch of a shared commit (the group shows the count
    once, ``group_view``), and ``own_timings`` holds only timings measured for this epoch."""
    shared = shared_commit(e)
    span = e.commit_span
    return {"rows_out": None if shared else e.rows.get("output"),
            "commit": {"first": span[0], "last": span[1]} if shared and span else None,
            "own_timings": {} if shared else dict(e.timings),
            "validation_outcome": validation_outcome(e)}


def _ts(moment: Any) -> float | None:
    return None if moment is None else moment.replace(tzinfo=UTC).timestamp()


def group_view(epochs: list[Epoch]) -> dict[str, Any]:
    """A group's output, wall time and timings, each once: ``rows_out`` the sum of its commits'
    counts (a shared commit's count sits on its last epoch, the others hold 0); ``timings`` the
    group commit's (None when its epochs committed one by one: each epoch's ``own_timings``
    then); ``wall_s`` first planned to last published (or committed); ``processing_s`` the time
    spent reading, computing and writing (``compute_s`` runs from the start of the read, so it
    holds ``read_s``), the rest of the wall being coordination."""
    outputs = [e.rows["output"] for e in epochs if e.rows.get("output") is not None]
    shared = [e for e in epochs if shared_commit(e)]
    timings = None
    if shared:
        last = max(shared, key=lambda e: e.epoch_id)
        # ``epoch_s`` is the group's wall shared out by files (for the controllers), not a timing
        timings = {k: v for k, v in last.timings.items() if k != "epoch_s"}
    starts = [t for e in epochs if (t := _ts(e.planned_at)) is not None]
    ends = [t for e in epochs if (t := _ts(e.published_at or e.committed_at)) is not None]
    wall = max(0.0, max(ends) - min(starts)) if starts and ends else None

    def processing(t: dict[str, Any]) -> float:
        return float(t.get("compute_s", t.get("read_s")) or 0.0) + sum(
            float(v) for k, v in t.items() if k.startswith("write_") and k.endswith("_s"))

    spent = processing(timings) if timings is not None else sum(processing(e.timings) for e in epochs)
    if wall is not None:
        spent = min(spent, wall)
    return {"rows_out": sum(outputs) if outputs else None, "timings": timings,
            "wall_s": None if wall is None else round(wall, 3),
            "processing_s": None if wall is None else round(spent, 3),
            "coordination_s": None if wall is None else round(wall - spent, 3)}


def controllers_now(halted: str | None, verdict: Any) -> dict[str, Any]:
    """What the controllers would do now, from the one ``halted`` the payload carries: ``mode``
    halted, start or wait, and ``reason`` in words (never a Python ``None``)."""
    plan = verdict.plan()  # its reason: "<rule>: <decision>", or "waiting: <decision>"
    reason = plan["reason"]
    if halted:
        mode, fire = "halted", None
        reason = f"halted: {halted}; the sensor starts nothing until an operator acts"
    else:
        mode, fire = ("start", verdict.fire) if verdict.fire else ("wait", None)
    started = dict(plan["started"])
    if halted:
        started.update(rule=None, explanation=reason)
    return dict(plan, fire=fire, mode=mode, reason=reason, decision_reason=verdict.decision.reason, started=started)


@app.get("/pipelines/{dag_id}/control", dependencies=CAN_READ)
def control(dag_id: str) -> dict[str, Any]:
    name = dag_id  # a pipeline's DAG id is its name
    from sluice import adaptive, freshness
    from sluice.sources import source_for

    spec = _spec_or_404(name)
    store = EpochStore()
    try:
        backlog = source_for(spec, store).backlog()
        verdict = adaptive.decide_backlog(spec, store, backlog, continuous=spec.data_driven)
        now = time.time()
        fresh = freshness.measure(spec, store, backlog, now)
        current = store.epochs(name)
        floor = freshness.sla_floor(spec.control.freshness_sla_s, spec.control.poll_interval_s, current)
        stale = freshness.staleness(spec.control.freshness_sla_s, current, fresh.age_s, now)
        from sluice.protocol.planning import halt_reason

        # The one halted state of the payload: ``halted`` (why, or None) and ``next.mode`` both
        # come from this read. A halted pipeline's sensor does not fire, whatever the controllers
        # would plan.
        halted = halt_reason(store, name, spec.control.max_attempts, spec.control.max_crashes)
        lease = store.lease_holder(name) if store.has_pipeline(name) else None
        # ``freshness``: ``age_s``/``breached`` the oldest unpublished data (what alerts use);
        # ``stale``/``last_publish_age_s`` the last publish, both against ``sla_s``.
        return {"pipeline": name, "adaptive": spec.control.adaptive, "backlog": backlog.as_dict(), "now": now,
                "freshness": dict(fresh.as_dict(), **stale.as_dict(), alerts=spec.alerts.freshness),
                "sla_floor": floor.as_dict(), "next": controllers_now(halted, verdict),
                "state": store.control_state(name), "halted": halted,
                "lease_holder": lease, "lease_run": _dag_run(lease)}
    except SluiceError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    finally:
        store.close()


def _dag_run(owner: str | None) -> dict[str, str] | None:
    """The DAG run a lease owner or group owner names, for links into the Airflow UI."""
    parsed = protocol.LeaseOwner.parse(owner)
    if parsed is None or parsed.kind != protocol.LeaseOwner.AIRFLOW:
        return None
    return {"dag_id": parsed.scope, "run_id": parsed.name}


def _spec_or_404(name: str) -> Any:
    try:
        return get_spec(name)
    except SluiceError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None


@app.get("/pipelines/{dag_id}/groups", dependencies=CAN_READ)
def groups(dag_id: str, since: Annotated[int | None, Query(ge=0, le=ID_MAX)] = None) -> list[dict[str, Any]]:
    """Every group of the pipeline (all generations; from group ``since`` on), with the DAG run
    that planned it, and its output rows, wall time and timings once (``group_view``)."""
    name = dag_id
    _spec_or_404(name)
    store = EpochStore()
    try:
        if not store.has_pipeline(name):
            return []
        return [{"group_id": g.group_id, "state": g.state, "plan": g.plan, "reprocessing": g.reprocessing,
                 "epoch_ids": g.epoch_ids, "owner": g.owner, "dag_run": _dag_run(g.owner),
                 "generation": max((e.generation for e in g.epochs), default=None), **group_view(list(g.epochs))}
                for g in store.groups(name, since=since)]
    finally:
        store.close()


@app.get("/pipelines/{dag_id}/rollback-preview", dependencies=CAN_READ)
def rollback_preview(dag_id: str, to_epoch: int = Query(ge=0)) -> dict[str, Any]:
    """What ``sluice_rollback`` to ``to_epoch`` would do, from the store and the source: the
    epochs rolled back (their ranges and the rows they wrote), the table versions each sink
    goes back to, and the problems that would refuse it. Nothing is changed."""
    name = dag_id
    spec = _spec_or_404(name)
    store = EpochStore()
    try:
        if not store.has_pipeline(name):
            raise HTTPException(status_code=404, detail=f"pipeline {name!r} has no epochs yet")
        from sluice.protocol.operations import group_rollback_plan, restore_target, shared_commit_note, source_problems

        notes = []
        try:
            plan, shared = group_rollback_plan(store, name, to_epoch)  # as ``operations.rollback`` plans it
            if shared:
                notes.append(shared_commit_note(shared, to_epoch))
        except SluiceError as exc:
            return {"pipeline": name, "to_epoch": to_epoch, "allowed": False, "problems": [str(exc)], "notes": [],
                    "rolled_back": [], "kept": 0, "restore_to": {}, "rows_removed": {}}
        problems = source_problems(spec, store, plan)
        pending = store.pending_rollback(name)
        if pending is not None and not pending.continues(RollbackIntent(plan.to_epoch, "", "",
                                                                        requested_to_epoch=to_epoch)):
            problems.append(f"a rollback to epoch {pending.asked} is unfinished; finish it first")
        keys = sorted({k for e in plan.rolled_back for k in e.delta_versions})
        restore_to = {k: restore_target(plan, [k]) for k in keys}
        rows_removed = {key: sum(e.rows.get(key, 0) for e in plan.rolled_back if e.state not in protocol.UNFINISHED)
                        for key in ("input", "output", "rejected")}
        return {"pipeline": name, "to_epoch": to_epoch, "restored_to_epoch": plan.to_epoch,
                "generation": plan.generation, "allowed": not problems, "problems": problems, "notes": notes,
                "rolled_back": [{"epoch_id": e.epoch_id, "start": e.start, "end": e.end, "state": e.state,
                                 "rows": e.rows, "delta_versions": e.delta_versions} for e in plan.rolled_back],
                "kept": len(plan.kept), "restore_to": restore_to, "rows_removed": rows_removed,
                "checked_later": "the rollback task checks each Delta table again (vacuumed versions, other "
                                 "writers since) and refuses with nothing changed"}
    finally:
        store.close()


@app.get("/pipelines/{dag_id}/shadow-previews", dependencies=CAN_READ)
def shadow_previews(dag_id: str) -> list[dict[str, Any]]:
    """The kept shadow previews of rollbacks (``sluice_rollback_preview``), newest first: per
    sink the rows a rollback with recompute would add, remove and change, with a sample."""
    from sluice.preview import saved_previews

    _spec_or_404(dag_id)
    return saved_previews(dag_id)


_PAGE = Path(__file__).with_name("console.html")


def _page(dag_id: str | None) -> HTMLResponse:
    # The page is static; the pipeline's name reaches its script as JSON, never as markup.
    html = _PAGE.read_text().replace("__SLUICE_PIPELINE__", json.dumps(dag_id).replace("<", "\\u003c"))
    return HTMLResponse(html, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})


@app.get("/ui", response_class=HTMLResponse)
def console_list(user: GetUserDep) -> HTMLResponse:
    """The console's list of pipelines (the Airflow UI shows it under Browse)."""
    return _page(None)


@app.get("/ui/{dag_id}", response_class=HTMLResponse, dependencies=CAN_READ)
def console_page(dag_id: str) -> HTMLResponse:
    """A pipeline's console page (the Airflow UI shows it as a tab of the pipeline's DAG)."""
    return _page(dag_id)


# -- operator actions ------------------------------------------------------------------------


def start_action(request: Request, user: Any, pipeline: str, action: str, body: Any) -> dict[str, Any]:
    """Create the run of the action's operations DAG, as the user, its conf stamped
    (``sluice.airflow.actions``). The caller's dependencies checked edit access to ``pipeline``."""
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.exceptions import DagNotFound, DagRunAlreadyExists
    from airflow.utils.types import DagRunTriggeredByType

    _spec_or_404(pipeline)
    dag_id = ACTIONS[action][0]
    name = user.get_name()
    try:
        conf = stamp(dag_id, action_conf(action, pipeline, body), name, via="api")
    except UnauthorizedRunError as exc:  # no secret configured
        raise HTTPException(status_code=503, detail=str(exc)) from None
    by = DagRunTriggeredByType.UI if request.headers.get("referer") else DagRunTriggeredByType.REST_API
    try:
        run = trigger_dag(dag_id, triggered_by=by, triggering_user_name=name, conf=conf,
                          note=f"{action} of {pipeline}, by {name} through sluice (edit access to DAG {pipeline})")
    except DagNotFound:
        raise HTTPException(status_code=503, detail=f"the operations DAG {dag_id} is not parsed yet (is "
                                                    f"dags/sluice_operations.py in the DAGs folder?)") from None
    except DagRunAlreadyExists as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    except ValueError as exc:  # ParamValidationError: e.g. a pipeline the operations DAG was not parsed with yet
        raise HTTPException(status_code=409, detail=f"{dag_id} refused the run: {exc}") from None
    return {"dag_id": run.dag_id, "dag_run_id": run.run_id, "pipeline": pipeline, "action": action,
            "state": str(getattr(run.state, "value", run.state)), "triggering_user_name": run.triggering_user_name,
            "conf": {k: v for k, v in (run.conf or {}).items() if k != STAMP_KEY}}


@app.post("/pipelines/{dag_id}/actions/rollback", dependencies=CAN_EDIT)
def act_rollback(dag_id: str, body: RollbackBody, request: Request, user: GetUserDep) -> dict[str, Any]:
    """Roll the pipeline back to ``to_epoch`` (``sluice_rollback``)."""
    return start_action(request, user, dag_id, "rollback", body)


@app.post("/pipelines/{dag_id}/actions/rollback-preview", dependencies=CAN_EDIT)
def act_rollback_preview(dag_id: str, body: RollbackPreviewBody, request: Request,
                         user: GetUserDep) -> dict[str, Any]:
    """Recompute a rollback's epochs into shadow tables and diff (``sluice_rollback_preview``)."""
    return start_action(request, user, dag_id, "rollback-preview", body)


@app.post("/pipelines/{dag_id}/actions/recover", dependencies=CAN_EDIT)
def act_recover(dag_id: str, body: RecoverBody, request: Request, user: GetUserDep) -> dict[str, Any]:
    """Rerun failed or unfinished epochs with their recorded ranges (``sluice_recover``)."""
    return start_action(request, user, dag_id, "recover", body)


@app.post("/pipelines/{dag_id}/actions/skip-file", dependencies=CAN_EDIT)
def act_skip_file(dag_id: str, body: SkipFileBody, request: Request, user: GetUserDep) -> dict[str, Any]:
    """Skip a gone or unreadable file, recorded (``sluice_skip_file``)."""
    return start_action(request, user, dag_id, "skip-file", body)
