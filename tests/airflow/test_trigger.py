"""The backlog trigger: serialisable to a class path the triggerer can import, fires on a
backlog, and reports source errors as an event instead of dying."""

from __future__ import annotations

import asyncio
import importlib
import os
import time

from sluice.airflow.triggers import BacklogTrigger, check_backlog
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import halt_reason, plan_group
from sluice.store import EpochStore
from tests.pipelines import land, landed, make_pipeline

#: Only a guard against a hang: every wait below ends on an event (a trigger event, a poll).
GUARD_S = 120.0


def first_event(trigger: BacklogTrigger, timeout: float = GUARD_S) -> dict:
    async def take() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("trigger ended without an event")

    return asyncio.run(asyncio.wait_for(take(), timeout))


def count_polls(monkeypatch) -> list[object]:
    """Record what each of the trigger's polls (``check_backlog``) returned."""
    from sluice.airflow import triggers

    polls: list[object] = []
    check = triggers.check_backlog

    def counted(*args, **kwargs):
        result = check(*args, **kwargs)
        polls.append(result)
        return result

    monkeypatch.setattr(triggers, "check_backlog", counted)
    return polls


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {GUARD_S:.0f} s"
        await asyncio.sleep(0.05)


def test_serialize_round_trips_through_its_class_path():
    trigger = BacklogTrigger("ysb", "sqlite:///x.db", poll_interval=2.0, min_files=3)
    path, kwargs = trigger.serialize()
    module, _, name = path.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)
    assert path.startswith("sluice."), "the triggerer imports it from the plugins folder"


def test_fires_once_files_land(monkeypatch):
    spec = make_pipeline("trigger_fires", **{"control.epoch_files": 1, "control.group_epochs": 2})
    trigger = BacklogTrigger(spec.name, poll_interval=0.2)
    polls = count_polls(monkeypatch)

    async def land_later() -> dict:
        async def writer() -> None:
            await until(lambda: len(polls) >= 2, "two polls of the empty folder")
            land(spec, files=2)

        task = asyncio.create_task(writer())
        async for event in trigger.run():
            await task
            return event.payload
        raise AssertionError("no event")

    payload = asyncio.run(asyncio.wait_for(land_later(), GUARD_S))
    assert payload["status"] == "ready" and payload["backlog"]["files"] == 2
    assert payload["plan"]["reason"].startswith("efficient group"), payload
    assert (payload["plan"]["epoch_size"], payload["plan"]["k"]) == (1, 2)
    assert payload["polls"] >= 3 and polls[:2] == [None, None], "it must have polled an empty folder first"


def test_missing_landing_folder_is_an_error_event_naming_folder_and_pipeline():
    spec = make_pipeline("trigger_missing")
    spec.landing_dir.rmdir()
    payload = first_event(BacklogTrigger(spec.name, poll_interval=0.1))
    assert payload["status"] == "error"
    assert str(spec.landing_dir) in payload["message"] and "'trigger_missing'" in payload["message"]


def test_waits_for_an_efficient_group_or_the_freshness_sla():
    """Epochs of 2 files, k = 2: one fresh file is not worth a Spark application yet; it is
    once it gets close to the freshness SLA (5 s here), or once 4 files wait."""
    spec = make_pipeline("trigger_rules", **{"control.epoch_files": 2, "control.group_epochs": 2})
    log = EpochStore()
    land(spec, files=1, seed=1)
    assert check_backlog(spec.name, None, store=log) is None
    scheduled = check_backlog(spec.name, None, store=log, continuous=False)
    assert scheduled["plan"]["reason"].startswith("scheduled"), "a cron run takes any backlog"
    old = time.time() - 6
    os.utime(landed(spec)[0], (old, old))
    ready = check_backlog(spec.name, None, store=log)
    assert ready["plan"]["reason"].startswith("freshness") and ready["backlog"]["files"] == 1, ready
    land(spec, files=3, seed=2)
    ready = check_backlog(spec.name, None, store=log)
    assert ready["plan"]["reason"].startswith("efficient group") and ready["backlog"]["files"] == 4, ready
    log.close()


def test_retries_unfinished_epochs_without_new_data_but_not_when_halted_or_held():
    spec = make_pipeline("trigger_retry", **{"control.epoch_files": 1, "control.group_epochs": 1,
                                             "control.max_attempts": 2})
    log = EpochStore()
    land(spec, files=1)
    lease = acquire_lease(log, spec.name, "run-1")
    log.register_files(spec.name, [(str(p), p.stat().st_size, p.stat().st_mtime) for p in landed(spec)])
    epoch = plan_group(log, lease, epoch_size=1, k=1).epochs[0]
    assert check_backlog(spec.name, None, store=log) is None, "a run holds the lease: it is on it"
    log.start_attempt(lease, [epoch])
    log.mark_failed(lease, [epoch], "boom")
    log.release_lease(lease)
    ready = check_backlog(spec.name, None, store=log)
    assert ready is not None and "retry the unfinished epochs [0]" in ready["plan"]["reason"], ready
    assert ready["backlog"]["files"] == 0
    lease = acquire_lease(log, spec.name, "run-2")
    log.start_attempt(lease, [epoch])
    log.mark_failed(lease, [epoch], "boom again")
    log.release_lease(lease)
    assert "failed 2 times" in halt_reason(log, spec.name, 2, 10)
    assert check_backlog(spec.name, None, store=log) is None, "a halted pipeline's sensor does not fire"
    land(spec, files=2, seed=2)
    assert check_backlog(spec.name, None, store=log) is None, "not even on new data"
    log.close()


def test_a_waiting_run_gives_way_to_a_queued_run_of_its_dag(monkeypatch):
    """A cleared past run of a @continuous pipeline is queued behind the run waiting for data
    (max_active_runs=1): after GIVE_WAY_AFTER_S the waiting run's trigger gives way."""
    from sluice.airflow import triggers

    assert not triggers.should_give_way(triggers.GIVE_WAY_AFTER_S + 1, 0)
    assert not triggers.should_give_way(triggers.GIVE_WAY_AFTER_S - 1, 1), "no thrashing right after a start"
    assert triggers.should_give_way(triggers.GIVE_WAY_AFTER_S, 1)
    assert triggers.queued_runs("ysb") == 0, "outside Airflow nobody can be asked: never give way"
    spec = make_pipeline("trigger_give_way")
    asked = []
    monkeypatch.setattr(triggers, "GIVE_WAY_AFTER_S", 0.5)
    monkeypatch.setattr(triggers, "queued_runs", lambda dag_id: asked.append(dag_id) or 1)
    payload = first_event(BacklogTrigger(spec.name, poll_interval=0.2, dag_id=spec.name))
    assert payload["status"] == "give_way" and payload["queued"] == 1 and payload["waited_s"] >= 0.5
    assert set(asked) == {spec.name}
    no_dag = BacklogTrigger(spec.name, poll_interval=0.1)  # a cron run's trigger: never gives way
    polls = count_polls(monkeypatch)
    started = time.monotonic()

    async def quiet() -> list:
        events = []

        async def take() -> None:
            async for event in no_dag.run():
                events.append(event.payload)

        task = asyncio.create_task(take())
        # Past the give-way delay by several polls, counted (not a fixed sleep).
        await until(lambda: len(polls) >= 5 and time.monotonic() - started > 2 * triggers.GIVE_WAY_AFTER_S,
                    "five polls past the give-way delay")
        task.cancel()
        return events

    assert asyncio.run(quiet()) == [], "a trigger without a dag_id must not give way"
