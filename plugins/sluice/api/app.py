"""Read-only epoch-log API, served by the Airflow api-server under ``/sluice``.

``GET /sluice/pipelines`` lists pipelines with a summary; ``GET /sluice/pipelines/{name}/epochs``
returns the epochs of the current generation. (Plugin apps are not behind Airflow's auth:
this one only reads.)
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
        return [e.as_record() for e in log.epochs(name)]
    finally:
        log.close()
