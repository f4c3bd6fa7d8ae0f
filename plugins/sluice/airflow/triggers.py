"""The backlog triggers, in the triggerer: ``BacklogTrigger`` waits until a pipeline's next group
should start (the deferred sensor of a ``@continuous`` DAG run); ``BacklogEventTrigger`` creates
the DAG run itself then (``schedule: "@backlog"``, event-driven scheduling). ``FreshnessTrigger``
watches a pipeline's freshness; the two event triggers share one poll loop (``poll_forever``)
and one poll of the source (``poll_source``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent
from sqlalchemy import make_url

from sluice import protocol
from sluice.store import EpochStore

if TYPE_CHECKING:
    from sluice.sources import Backlog
    from sluice.spec import PipelineSpec

log = logging.getLogger(__name__)
T = TypeVar("T")


def poll_source(spec: PipelineSpec, store: EpochStore) -> Backlog:
    """The source's backlog: the one poll of the source that both the backlog triggers
    (``check_backlog``) and the freshness trigger (``measure_freshness``) make. Blocking."""
    from sluice.sources import source_for

    return source_for(spec, store).backlog()


async def poll_forever(pipeline: str, what: str, poll_interval: float,
                       poll: Callable[[EpochStore], T]) -> AsyncIterator[T]:
    """The event triggers' loop: every ``poll_interval`` seconds, ``poll`` (blocking) runs in a
    thread on one store (``$SLUICE_STORE_URL`` or the ``sluice_store`` connection, opened for
    the life of the loop) and its result is yielded. A poll that fails yields nothing: it is
    logged once per distinct error and retried. Iterate it under ``contextlib.aclosing``, so
    the store is closed as soon as the trigger stops."""
    reported: str | None = None
    store = await asyncio.to_thread(EpochStore)
    try:
        while True:
            try:
                result = await asyncio.to_thread(poll, store)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                if message != reported:  # once per distinct error, not at every poll
                    log.error("pipeline %s: the %s poll failed (retrying every %.0f s): %s",
                              pipeline, what, poll_interval, message)
                    reported = message
            else:
                reported = None
                yield result
            await asyncio.sleep(poll_interval)
    finally:
        store.close()


def check_backlog(pipeline: str, store_url: str | None, min_files: int = 1, store: EpochStore | None = None,
                  continuous: bool = True) -> dict[str, Any] | None:
    """One poll: ``{"backlog", "plan"}`` when a group should start, else ``None``.

    It starts when the backlog makes the planned group whole, or when waiting longer would
    break the freshness SLA (``continuous``); a scheduled run starts on any backlog. The plan
    (epoch size, k, partitions, reason) comes from the adaptive controllers
    (``sluice.adaptive``). Blocking (file listing, SQL): the trigger runs it in a thread.
    """
    from sluice import adaptive  # the controllers (numpy): not imported by every task's DAG parse
    from sluice.protocol.planning import halt_reason
    from sluice.spec import get_spec

    spec = get_spec(pipeline)
    opened = store or EpochStore(store_url)
    try:
        if halt_reason(opened, spec.name, spec.control.max_attempts, spec.control.max_crashes):
            return None  # a halted pipeline waits for an operator (recover, skip a file, roll back)
        backlog = poll_source(spec, opened)
        verdict = adaptive.decide_backlog(spec, opened, backlog, continuous=continuous)
        if backlog.files >= min_files and verdict.fire is not None:
            return {"backlog": backlog.as_dict(), "plan": verdict.plan()}
        # Epochs a failed run left behind (below max_attempts) are retried without new data;
        # not while a run holds the lease (it is working on them).
        leftovers = [e.epoch_id for e in opened.epochs(spec.name, states=protocol.UNPUBLISHED)]
        if leftovers and opened.lease_holder(spec.name) is None:
            plan = dict(verdict.plan(), reason=f"retry the unfinished epochs {leftovers}",
                        started=replace(verdict.started, rule="retry").as_record())
            return {"backlog": backlog.as_dict(), "plan": plan}
        return None
    finally:
        if store is None:
            opened.close()


#: A waiting run gives way to a queued run of its DAG (a cleared past run) after this long.
GIVE_WAY_AFTER_S = 15.0


def queued_runs(dag_id: str) -> int:
    """Runs of ``dag_id`` waiting to start, asked through the Task SDK (the triggerer's and a
    task's channel to Airflow; never its database). 0 when Airflow cannot be asked."""
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        return int(RuntimeTaskInstance.get_dr_count(dag_id=dag_id, states=["queued"]))
    except Exception:
        return 0


def should_give_way(waited_s: float, queued: int) -> bool:
    """A run that has waited a while for data ends (skipped) when another run of its DAG is
    queued: with ``max_active_runs=1`` that run, typically one an operator cleared to roll back,
    would otherwise wait as long as this one waits for data."""
    return queued > 0 and waited_s >= GIVE_WAY_AFTER_S


class BacklogTrigger(BaseTrigger):
    """Fires once the pipeline's next group should start (see ``check_backlog``), or gives way
    (``status: give_way``) to a queued run of its DAG.

    Holds no worker slot: it polls from the triggerer's event loop, the blocking listing in a
    thread. Errors (a missing landing folder, a broken spec) are sent back as an event, so
    the sensor fails with the message instead of the trigger dying silently.
    """

    def __init__(self, pipeline: str, store_url: str | None = None, poll_interval: float = 5.0,
                 min_files: int = 1, continuous: bool = True, dag_id: str | None = None) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.store_url = store_url
        self.poll_interval = poll_interval
        self.min_files = min_files
        self.continuous = continuous
        self.dag_id = dag_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("sluice.airflow.triggers.BacklogTrigger",
                {"pipeline": self.pipeline, "store_url": self.store_url, "poll_interval": self.poll_interval,
                 "min_files": self.min_files, "continuous": self.continuous, "dag_id": self.dag_id})

    def __repr__(self) -> str:
        # Airflow logs a trigger by its repr (the task's log, the triggerer's): the store's
        # password stays out of both; the kwargs themselves are stored encrypted.
        classpath, kwargs = self.serialize()
        if kwargs["store_url"]:
            kwargs["store_url"] = make_url(kwargs["store_url"]).render_as_string(hide_password=True)
        return self.repr(classpath, kwargs)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        polls = 0
        # One store connection pool for the life of the trigger (not one per poll).
        store = await asyncio.to_thread(EpochStore, self.store_url)
        try:
            while True:
                polls += 1
                try:
                    ready = await asyncio.to_thread(check_backlog, self.pipeline, self.store_url, self.min_files,
                                                    store, self.continuous)
                except Exception as exc:  # reported to the sensor, which fails with it
                    yield TriggerEvent({"status": "error", "pipeline": self.pipeline,
                                        "message": f"{type(exc).__name__}: {exc}"})
                    return
                waited = round(time.monotonic() - started, 3)
                if ready is None and polls == 1:  # once: the trigger is alive, and what it waits for
                    log.info("pipeline %s: no group to start yet; polling the backlog every %.0f s",
                             self.pipeline, self.poll_interval)
                if ready is not None:
                    yield TriggerEvent({"status": "ready", "pipeline": self.pipeline, **ready,
                                        "waited_s": waited, "polls": polls})
                    return
                if self.dag_id and waited >= GIVE_WAY_AFTER_S:
                    queued = await asyncio.to_thread(queued_runs, self.dag_id)
                    if should_give_way(waited, queued):
                        yield TriggerEvent({"status": "give_way", "pipeline": self.pipeline, "queued": queued,
                                            "waited_s": waited, "polls": polls})
                        return
                await asyncio.sleep(self.poll_interval)
        finally:
            store.close()


def active_runs(dag_id: str) -> int | None:
    """Runs of ``dag_id`` queued or running, asked through the Task SDK; None when Airflow
    cannot be asked (then the caller relies on its own memory of what it fired)."""
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        return int(RuntimeTaskInstance.get_dr_count(dag_id=dag_id, states=["queued", "running"]))
    except Exception:
        return None


def should_fire(ready: bool, active: int | None, next_offset: int, fired: tuple[int, float] | None, now: float,
                settle_s: float) -> bool:
    """Whether the event trigger creates a run now: data is ready, no run of the DAG is queued
    or running, and it did not fire for this same backlog (the same next unplanned offset) within
    ``settle_s``: a run it created may not be visible yet (the scheduler creates it a moment
    after the event), and until that run plans a group the backlog looks the same. A run that
    died before planning is retried once ``settle_s`` has passed."""
    if not ready or (active or 0) > 0:
        return False
    return fired is None or fired[0] != next_offset or now - fired[1] >= settle_s


class BacklogEventTrigger(BaseEventTrigger):
    """The backlog trigger as an event source: a pipeline with ``schedule: "@backlog"`` is
    scheduled on an Asset whose ``AssetWatcher`` runs this trigger in the triggerer, so a DAG
    run is created only when a group should start (``check_backlog``, the ``@continuous``
    rules) and no run sits waiting for data.

    It runs for as long as the DAG is active and fires at most once per backlog: not while a
    run of the DAG is queued or running, and not twice for the same unplanned offset within
    ``settle_s``. Its kwargs are part of the serialized DAG, so it carries no store URL: it
    resolves the store in the triggerer (``$SLUICE_STORE_URL`` or the ``sluice_store``
    connection). A poll that fails is logged and retried: an event would start a run that
    fails the same way, and the error shows in the triggerer's log and the control API.
    """

    def __init__(self, pipeline: str, dag_id: str, poll_interval: float = 5.0, settle_s: float = 120.0) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.dag_id = dag_id
        self.poll_interval = poll_interval
        self.settle_s = settle_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("sluice.airflow.triggers.BacklogEventTrigger",
                {"pipeline": self.pipeline, "dag_id": self.dag_id, "poll_interval": self.poll_interval,
                 "settle_s": self.settle_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        fired: tuple[int, float] | None = None
        polls = poll_forever(self.pipeline, "backlog", self.poll_interval,
                             lambda store: check_backlog(self.pipeline, None, 1, store, continuous=True))
        async with aclosing(polls):
            async for ready in polls:
                if ready is None:
                    continue
                offset = int(ready["backlog"]["next_offset"])
                active = await asyncio.to_thread(active_runs, self.dag_id)
                now = time.monotonic()
                if should_fire(True, active, offset, fired, now, self.settle_s):
                    fired = (offset, now)
                    yield TriggerEvent({"pipeline": self.pipeline, **ready})


def measure_freshness(pipeline: str, store: EpochStore) -> dict[str, Any]:
    """One observation of the pipeline's freshness (blocking: the source's backlog, SQL)."""
    from sluice import freshness
    from sluice.spec import get_spec

    spec = get_spec(pipeline)
    return freshness.measure(spec, store, poll_source(spec, store)).as_dict()


class FreshnessTrigger(BaseEventTrigger):
    """Watches a pipeline's freshness (``sluice.freshness``) for the ``sluice_alerts`` DAG: fires
    when its oldest unpublished data passes ``control.freshness_sla_s`` (``change: breached``)
    and when it is back within it (``change: recovered``), once per change. A failed poll is
    logged once per distinct error and retried."""

    def __init__(self, pipeline: str, poll_interval: float = 30.0) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("sluice.airflow.triggers.FreshnessTrigger",
                {"pipeline": self.pipeline, "poll_interval": self.poll_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from sluice.freshness import transition

        breached: bool | None = None
        polls = poll_forever(self.pipeline, "freshness", self.poll_interval,
                             lambda store: measure_freshness(self.pipeline, store))
        async with aclosing(polls):
            async for observed in polls:
                change = transition(breached, observed["breached"])
                breached = observed["breached"]
                if change:
                    yield TriggerEvent({"change": change, **observed})
