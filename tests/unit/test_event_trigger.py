"""When the event trigger of a ``@backlog`` pipeline creates a DAG run (pure rule), and the poll
loop the event triggers share (stand-in polls: no store, no source, no Airflow)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import pytest

from sluice.airflow import triggers
from sluice.airflow.triggers import should_fire


def test_fires_on_ready_data_when_no_run_is_active():
    assert should_fire(True, 0, next_offset=0, fired=None, now=100.0, settle_s=120)
    assert not should_fire(False, 0, next_offset=0, fired=None, now=100.0, settle_s=120)
    assert not should_fire(True, 1, next_offset=0, fired=None, now=100.0, settle_s=120), "a run is queued or running"


def test_fires_once_per_backlog_until_it_settles():
    fired = (4, 100.0)
    # The run it created may not be visible yet, and the backlog looks the same until it plans.
    assert not should_fire(True, 0, next_offset=4, fired=fired, now=110.0, settle_s=120)
    assert should_fire(True, 0, next_offset=8, fired=fired, now=110.0, settle_s=120), "new data was planned since"
    # That run died before planning: the same backlog gets a new run once the wait has passed.
    assert should_fire(True, 0, next_offset=4, fired=fired, now=221.0, settle_s=120)
    # Airflow could not be asked (None): memory alone decides.
    assert should_fire(True, None, next_offset=8, fired=fired, now=110.0, settle_s=120)


# -- the event triggers' shared poll loop (no store, no source: the polls are stand-ins) -------


class FakeStore:
    opened: list[FakeStore] = []

    def __init__(self, url: str | None = None) -> None:
        self.closed = False
        FakeStore.opened.append(self)

    def close(self) -> None:
        self.closed = True


def scripted(results: list):
    """A poll returning (or raising) the next of ``results``; the store it is given is recorded."""
    calls: list = []

    def poll(*args, **kwargs):
        calls.append(args + tuple(kwargs.values()))
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    return poll, calls


def take(agen, n: int, timeout: float = 10.0) -> list:
    """The first ``n`` items of an async generator, which is then closed."""

    async def run() -> list:
        items: list = []
        async with aclosing(agen):
            async for item in agen:
                items.append(item)
                if len(items) == n:
                    break
        return items

    return asyncio.run(asyncio.wait_for(run(), timeout))


@pytest.fixture
def store(monkeypatch):
    FakeStore.opened = []
    monkeypatch.setattr(triggers, "EpochStore", FakeStore)
    return FakeStore.opened


def test_the_poll_loop_yields_results_and_logs_each_distinct_error_once(store, caplog):
    poll, calls = scripted([ValueError("down"), ValueError("down"), 1, ValueError("down"), KeyError("x"), 2])
    with caplog.at_level(logging.ERROR, logger=triggers.__name__):
        assert take(triggers.poll_forever("p", "backlog", 0, poll), 2) == [1, 2]
    assert len(store) == 1 and store[0].closed, "one store for the loop, closed when it stops"
    assert all(c == (store[0],) for c in calls) and len(calls) == 6
    errors = [r.getMessage() for r in caplog.records]
    assert errors == ["pipeline p: the backlog poll failed (retrying every 0 s): ValueError: down"] * 2 + [
        "pipeline p: the backlog poll failed (retrying every 0 s): KeyError: 'x'"], "again after a success"


def test_the_freshness_trigger_fires_on_a_breach_and_on_the_recovery(store, monkeypatch):
    def seen(breached: bool) -> dict:
        return {"pipeline": "p", "age_s": 1.0, "sla_s": 2.0, "breached": breached}

    poll, calls = scripted([seen(True), seen(True), RuntimeError("broker"), seen(False), seen(False), seen(True)])
    monkeypatch.setattr(triggers, "measure_freshness", poll)
    events = take(triggers.FreshnessTrigger("p", poll_interval=0).run(), 3)
    assert [e.payload["change"] for e in events] == ["breached", "recovered", "breached"]
    assert events[0].payload == {"change": "breached", **seen(True)}
    assert calls[0] == ("p", store[0]) and store[0].closed


def test_the_backlog_event_trigger_fires_once_per_backlog(store, monkeypatch):
    def ready(offset: int) -> dict:
        return {"backlog": {"next_offset": offset}, "plan": {"k": 1}}

    poll, calls = scripted([None, ready(4), ready(4), RuntimeError("gone"), ready(8)])
    monkeypatch.setattr(triggers, "check_backlog", poll)
    monkeypatch.setattr(triggers, "active_runs", lambda dag_id: 0)
    events = take(triggers.BacklogEventTrigger("p", "p_dag", poll_interval=0).run(), 2)
    assert [e.payload for e in events] == [{"pipeline": "p", **ready(4)}, {"pipeline": "p", **ready(8)}]
    assert calls[0] == ("p", None, 1, store[0], True) and store[0].closed


def test_the_event_triggers_serialize_as_before():
    assert triggers.BacklogEventTrigger("p", "d", poll_interval=2.0, settle_s=60.0).serialize() == (
        "sluice.airflow.triggers.BacklogEventTrigger",
        {"pipeline": "p", "dag_id": "d", "poll_interval": 2.0, "settle_s": 60.0})
    assert triggers.FreshnessTrigger("p", poll_interval=3.0).serialize() == (
        "sluice.airflow.triggers.FreshnessTrigger", {"pipeline": "p", "poll_interval": 3.0})
    masked = repr(triggers.BacklogTrigger("p", "postgresql+psycopg2://u:secret@h/db"))
    assert "secret" not in masked and "u:***@h/db" in masked
