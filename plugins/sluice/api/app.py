"""Read-only epoch-log API, served by the Airflow api-server under ``/sluice``.

``GET /sluice/pipelines`` lists the pipelines the user may read, with a summary;
``GET /sluice/pipelines/{dag_id}/epochs`` returns every epoch of every generation once
(rolled-back ones included) with the generation that wrote it, the one it lives in now, and its
files; ``GET /sluice/pipelines/{dag_id}/control`` the adaptive controllers' state and what the
backlog sensor would decide now.

Behind Airflow's auth: plugin apps are mounted outside the core API, whose dependencies never
reach them, so every route here asks for the user itself (a Bearer JWT, or the UI's session
cookie) and for read access to the pipeline's DAG (its id is the pipeline's name), as the core
API's DAG routes do: 401 without a valid token, 403 without access. Reads only: no route
writes to the store.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Request

from sluice.errors import SluiceError
from sluice.spec import get_spec, load_pipeline_specs
from sluice.store import Epoch, EpochLog, ManifestEntry

app = FastAPI(title="sluice epoch log")

#: Read access to the DAG named by the route's ``dag_id`` (the pipeline).
CAN_READ = [Depends(requires_access_dag("GET"))]


def readable(request: Request, user: GetUserDep, name: str) -> bool:
    try:
        requires_access_dag("GET", param_dag_id=name)(request, user)
    except HTTPException:
        return False
    return True


@app.get("/pipelines")
def pipelines(request: Request, user: GetUserDep) -> list[dict[str, Any]]:
    """The pipelines whose DAG the user may read."""
    log = EpochLog()
    try:
        return [log.summary(name) for name in load_pipeline_specs()[0] if readable(request, user, name)]
    finally:
        log.close()


@app.get("/pipelines/{dag_id}/epochs", dependencies=CAN_READ)
def epochs(dag_id: str) -> list[dict[str, Any]]:
    name = dag_id  # a pipeline's DAG id is its name
    from sluice.sources import source_for

    try:
        spec = get_spec(name)
    except SluiceError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    log = EpochLog()
    try:
        history = log.epoch_history(name)
        end = max((e.end for e in history), default=0)
        entries = {f.position: f for f in log.manifest(name, 0, end)}
        current = log.generation(name)
        source = source_for(spec, log)

        def held(e: Epoch) -> list[ManifestEntry]:
            return [entries[p] for p in range(e.start, e.end) if p in entries]

        # ``files``: the manifest entries (files, or Kafka chunks); ``offsets``: what they hold in
        # the source's terms (per-partition Kafka offsets).
        return [dict(e.as_record(), generation=e.written_generation, live_generation=e.generation,
                     live=e.generation == current and e.state != "rolled_back",
                     files=[f.as_record() for f in held(e)], offsets=source.describe(held(e)))
                for e in history]
    finally:
        log.close()


@app.get("/pipelines/{dag_id}/control", dependencies=CAN_READ)
def control(dag_id: str) -> dict[str, Any]:
    name = dag_id  # a pipeline's DAG id is its name
    from sluice import adaptive, freshness
    from sluice.sources import source_for

    try:
        spec = get_spec(name)
    except SluiceError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    log = EpochLog()
    try:
        backlog = source_for(spec, log).backlog()
        verdict = adaptive.decide(spec, log, backlog.files, backlog.oldest_age_s, list(backlog.arrivals),
                                  continuous=spec.data_driven)
        fresh = freshness.measure(spec, log, backlog)
        halted = log.halt_reason(name, spec.control.max_attempts)
        # A halted pipeline's sensor does not fire, whatever the controllers would plan.
        return {"pipeline": name, "adaptive": spec.control.adaptive, "backlog": backlog.as_dict(),
                "freshness": dict(fresh.as_dict(), alerts=spec.alerts.freshness),
                "next": dict(verdict.plan(), fire=None if halted else verdict.fire),
                "state": log.control_state(name), "halted": halted}
    except SluiceError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    finally:
        log.close()
