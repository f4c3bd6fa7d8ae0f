"""Operator actions, authorized per pipeline.

The operations DAGs (``sluice_rollback``, ``sluice_rollback_preview``, ``sluice_recover``,
``sluice_skip_file``) act on a pipeline named in their run's conf, so Airflow's permission to
trigger one of them says nothing about the pipeline. An action is therefore started through
``POST /sluice/pipelines/<pipeline>/actions/<action>`` (``sluice.api.app``), which asks for
edit access to the pipeline's own DAG (its id is the pipeline's name) and creates the
operations DAG's run itself, or by the local command line (``sluice rollback``/``recover``,
``make rollback``/``recover``), which holds Airflow's configuration and so is trusted like the
scheduler.

Both stamp the run's conf (``STAMP_KEY``): an HMAC-SHA256 over the operations DAG's id, the
conf (the pipeline and every parameter of the action), the user and the time, keyed by a secret
every Airflow component shares (``[sluice] action_secret``, else ``[api_auth] jwt_secret``).
Every task of an operations DAG checks the stamp before it changes anything
(``authorize_task``): a run triggered on the operations DAG directly (the REST API, the UI's
trigger form, ``airflow dags trigger``) has none, or one that does not match its conf, its
triggering user or its creation time, and fails naming the pipeline and the way to act.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.errors import OperatorActionRequired

#: The conf key holding the stamp.
STAMP_KEY = "sluice_authorization"
#: How long a stamp may be older than the run it authorizes (the run is created right after it);
#: ``CLOCK_SKEW_S`` how much newer (the stamping host's clock may run ahead of the database's).
MAX_AGE_S = 600
CLOCK_SKEW_S = 120


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RollbackBody(_Body):
    """``sluice_rollback``: this epoch and every later one are rolled back."""

    to_epoch: int = Field(ge=0)
    reason: str = Field(min_length=3)
    recompute: bool = True
    take_over: bool = False


class RollbackPreviewBody(_Body):
    """``sluice_rollback_preview``: recompute a rollback's epochs into shadow tables and diff."""

    to_epoch: int = Field(ge=0)


class RecoverBody(_Body):
    """``sluice_recover``: rerun failed or unfinished epochs with their recorded ranges."""

    withdraw_rollback: bool = False
    take_over: bool = False


class SkipFileBody(_Body):
    """``sluice_skip_file``: skip a gone or unreadable file, recorded."""

    file: str = Field(min_length=1)
    reason: str = Field(min_length=3)


#: action (the route's last segment) -> (operations DAG, its body)
ACTIONS: dict[str, tuple[str, type[_Body]]] = {
    "rollback": ("sluice_rollback", RollbackBody),
    "rollback-preview": ("sluice_rollback_preview", RollbackPreviewBody),
    "recover": ("sluice_recover", RecoverBody),
    "skip-file": ("sluice_skip_file", SkipFileBody),
}
OPERATIONS_DAGS = {dag_id: action for action, (dag_id, _) in ACTIONS.items()}

Via = Literal["api", "cli", "test"]


class UnauthorizedRunError(OperatorActionRequired):
    """A run of an operations DAG that was not started through the per-pipeline route or the
    local command line; nothing was changed."""


def action_conf(action: str, pipeline: str, body: _Body) -> dict[str, Any]:
    """The operations DAG's run conf for an action on ``pipeline``."""
    return {"pipeline": pipeline, **body.model_dump()}


def _secret() -> bytes:
    from airflow.configuration import conf

    secret = (conf.get("sluice", "action_secret", fallback=None)
              or conf.get("api_auth", "jwt_secret", fallback=None))
    if not secret:
        raise UnauthorizedRunError("no secret to sign or check sluice's operator actions with: set [api_auth] "
                                   "jwt_secret (or [sluice] action_secret) alike for the api-server, the workers "
                                   "and the hosts that run the sluice command line")
    # A key of its own, derived from the shared secret: a stamp is never a valid JWT signature.
    return hmac.new(secret.encode(), b"sluice operator action stamp v1", hashlib.sha256).digest()


def _message(dag_id: str, conf: dict[str, Any], user: str | None, issued: float, via: str) -> bytes:
    body = {k: v for k, v in conf.items() if k != STAMP_KEY}
    return json.dumps({"dag_id": dag_id, "conf": body, "user": user or "", "issued": issued, "via": via},
                      sort_keys=True, separators=(",", ":"), default=str).encode()


def stamp(dag_id: str, conf: dict[str, Any], user: str | None, via: Via, now: float | None = None) -> dict[str, Any]:
    """``conf`` with a stamp authorizing ``user`` to run ``dag_id`` with exactly this conf,
    for a run created now (by this user, as Airflow records it in ``triggering_user_name``)."""
    body = {k: v for k, v in conf.items() if k != STAMP_KEY}
    issued = round(time.time() if now is None else now, 3)
    signature = hmac.new(_secret(), _message(dag_id, body, user, issued, via), hashlib.sha256).hexdigest()
    return {**body, STAMP_KEY: {"user": user or "", "issued": issued, "via": via, "signature": signature}}


def _how_to_act(dag_id: str, pipeline: str) -> str:
    action = OPERATIONS_DAGS.get(dag_id, "<action>")
    return (f"Act on pipeline {pipeline!r} through the sluice console (its 'sluice epochs' tab), "
            f"POST /sluice/pipelines/{pipeline}/actions/{action} with a user who may edit DAG {pipeline!r}, "
            f"or the command line on an Airflow host (sluice {action} --pipeline {pipeline} ...; make {action})")


def verify(dag_id: str, conf: dict[str, Any] | None, triggering_user: str | None,
           run_after: datetime | float | None) -> dict[str, Any]:
    """The stamp of a run of the operations DAG ``dag_id``, once it holds: signed with the
    shared secret over this very conf, for the user Airflow recorded as the run's triggering
    user, and made shortly before the run was created. Otherwise ``UnauthorizedRunError``."""
    conf = dict(conf or {})
    pipeline = conf.get("pipeline")
    name = pipeline if isinstance(pipeline, str) else "<not named>"
    refused = (f"pipeline {name!r}: this {dag_id} run was not started through sluice's per-pipeline "
               f"authorization, so nothing was changed")
    given = conf.get(STAMP_KEY)
    if not isinstance(pipeline, str) or not pipeline:
        raise UnauthorizedRunError(f"{refused}: its conf names no pipeline. {_how_to_act(dag_id, name)}")
    if not isinstance(given, dict) or not isinstance(given.get("signature"), str):
        raise UnauthorizedRunError(f"{refused} (it was triggered on {dag_id} directly, which any user who may "
                                   f"trigger {dag_id} can do for any pipeline). {_how_to_act(dag_id, pipeline)}")
    try:
        issued = float(given["issued"])
        expected = hmac.new(_secret(), _message(dag_id, conf, given.get("user"), issued, str(given.get("via"))),
                            hashlib.sha256).hexdigest()
    except (KeyError, TypeError, ValueError):
        expected = ""
    if not hmac.compare_digest(expected, given["signature"]):
        raise UnauthorizedRunError(f"{refused}: its authorization does not match its conf (another pipeline, other "
                                   f"parameters or another DAG than were authorized, or the api-server and the "
                                   f"workers do not share [api_auth] jwt_secret). {_how_to_act(dag_id, pipeline)}")
    if (given.get("user") or "") != (triggering_user or ""):
        raise UnauthorizedRunError(f"{refused}: it was authorized for user {given.get('user')!r} but triggered by "
                                   f"{triggering_user!r} (a copied conf). {_how_to_act(dag_id, pipeline)}")
    if run_after is not None:
        created = run_after.timestamp() if isinstance(run_after, datetime) else float(run_after)
        if not issued - CLOCK_SKEW_S <= created <= issued + MAX_AGE_S:
            raise UnauthorizedRunError(f"{refused}: its authorization was made at {issued:.0f}, not shortly before "
                                       f"the run was created ({created:.0f}; a copied conf). "
                                       f"{_how_to_act(dag_id, pipeline)}")
    return dict(given, pipeline=pipeline)


def authorize_task(context: Any) -> dict[str, Any] | None:
    """The check every task of an operations DAG makes before it changes anything (None for
    a task of another DAG)."""
    dag_id = context["dag"].dag_id
    if dag_id not in OPERATIONS_DAGS:
        return None
    run = context["dag_run"]
    return verify(dag_id, run.conf, getattr(run, "triggering_user_name", None), getattr(run, "run_after", None))
