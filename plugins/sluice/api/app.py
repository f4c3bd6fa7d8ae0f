"""Read-only epoch-log API, served by the Airflow api-server under ``/sluice``.

``GET /sluice/pipelines`` lists pipelines with a summary; ``GET /sluice/pipelines/{name}/epochs``
returns every epoch of every generation once (rolled-back ones included) with the generation
that wrote it, the one it lives in now, and its files; ``GET /sluice/pipelines/{name}/control``
the adaptive controllers' state and what the backlog sensor would decide now. (Plugin apps
are not behind Airflow's auth: this one only reads.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException

from sluice.errors import SluiceError
from sluice.spec import get_spec, load_specs
from sluice.store import EpochLog

app = FastAPI(title="sluice epoch log")


@app.get("/pipelines")
def pipelines() -> list[dict[str, Any]]:
    log = EpochLog()
    try:
        return [log.summary(name) for name in load_specs()]
    finally:
        log.close()


@app.get("/pipelines/{name}/epochs")
def epochs(name: str) -> list[dict[str, Any]]:
    try:
        get_spec(name)
    except SluiceError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    log = EpochLog()
    try:
        history = log.epoch_history(name)
        end = max((e.end for e in history), default=0)
        files = {f.position: f.as_record() for f in log.manifest(name, 0, end)}
        current = log.generation(name)
        return [dict(e.as_record(), generation=e.written_generation, live_generation=e.generation,
                     live=e.generation == current and e.state != "rolled_back",
                     files=[files[p] for p in range(e.start, e.end) if p in files])
                for e in history]
    finally:
        log.close()


@app.get("/pipelines/{name}/control")
def control(name: str) -> dict[str, Any]:
    from sluice import adaptive
    from sluice.sources import FileSource

    try:
        spec = get_spec(name)
    except SluiceError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    log = EpochLog()
    try:
        source = FileSource(spec, log)
        listing = source.list_folder()
        backlog = source.backlog(listing)
        verdict = adaptive.decide(spec, log, backlog.files, backlog.oldest_age_s, [f[2] for f in listing],
                                  continuous=spec.schedule == "@continuous")
        halted = log.halt_reason(name, spec.control.max_attempts)
        # A halted pipeline's sensor does not fire, whatever the controllers would plan.
        return {"pipeline": name, "adaptive": spec.control.adaptive, "backlog": backlog.as_dict(),
                "next": dict(verdict.plan(), fire=None if halted else verdict.fire),
                "state": log.control_state(name), "halted": halted}
    except SluiceError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    finally:
        log.close()
