"""The backlog trigger: serialisable to a class path the triggerer can import, fires on a
backlog, and reports source errors as an event instead of dying."""

from __future__ import annotations

import asyncio
import importlib

from sluice.airflow.triggers import BacklogTrigger
from tests.pipelines import land, make_pipeline


def first_event(trigger: BacklogTrigger, timeout: float = 10.0) -> dict:
    async def take() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("trigger ended without an event")

    return asyncio.run(asyncio.wait_for(take(), timeout))


def test_serialize_round_trips_through_its_class_path():
    trigger = BacklogTrigger("ysb", "sqlite:///x.db", poll_interval=2.0, min_files=3)
    path, kwargs = trigger.serialize()
    module, _, name = path.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)
    assert path.startswith("sluice."), "the triggerer imports it from the plugins folder"


def test_fires_once_files_land():
    spec = make_pipeline("trigger_fires")
    trigger = BacklogTrigger(spec.name, poll_interval=0.2, min_files=2)

    async def land_later() -> dict:
        async def writer() -> None:
            await asyncio.sleep(0.6)
            land(spec, files=2)

        task = asyncio.create_task(writer())
        async for event in trigger.run():
            await task
            return event.payload
        raise AssertionError("no event")

    payload = asyncio.run(asyncio.wait_for(land_later(), 15))
    assert payload["status"] == "ready" and payload["backlog"]["files"] == 2
    assert payload["polls"] >= 2, "it must have polled an empty folder first"


def test_missing_landing_folder_is_an_error_event_naming_folder_and_pipeline():
    spec = make_pipeline("trigger_missing")
    spec.landing_dir.rmdir()
    payload = first_event(BacklogTrigger(spec.name, poll_interval=0.1))
    assert payload["status"] == "error"
    assert str(spec.landing_dir) in payload["message"] and "'trigger_missing'" in payload["message"]
