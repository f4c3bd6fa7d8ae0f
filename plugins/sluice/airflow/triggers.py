"""``BacklogTrigger``: waits, in the triggerer, until a pipeline's source has a backlog."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from sluice.store import EpochLog


def check_backlog(pipeline: str, store_url: str | None, min_files: int,
                  epoch_log: EpochLog | None = None) -> dict[str, Any] | None:
    """One poll: the backlog as a dict when a group should start, else ``None``.

    Blocking (file listing, SQL): the trigger runs it in a thread, with its own ``EpochLog``.
    """
    from sluice.sources import FileSource
    from sluice.spec import get_spec

    spec = get_spec(pipeline)
    log = epoch_log or EpochLog(store_url)
    try:
        backlog = FileSource(spec, log).backlog()
    finally:
        if epoch_log is None:
            log.close()
    if backlog.files >= min_files:
        return backlog.as_dict()
    return None


class BacklogTrigger(BaseTrigger):
    """Fires once the pipeline's source holds at least ``min_files`` unplanned files.

    Holds no worker slot: it polls from the triggerer's event loop, the blocking listing in a
    thread. Errors (a missing landing folder, a broken spec) are sent back as an event, so
    the sensor fails with the message instead of the trigger dying silently.
    """

    def __init__(self, pipeline: str, store_url: str | None = None, poll_interval: float = 5.0,
                 min_files: int = 1) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.store_url = store_url
        self.poll_interval = poll_interval
        self.min_files = min_files

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("sluice.airflow.triggers.BacklogTrigger",
                {"pipeline": self.pipeline, "store_url": self.store_url,
                 "poll_interval": self.poll_interval, "min_files": self.min_files})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        polls = 0
        # One store connection pool for the life of the trigger (not one per poll).
        epoch_log = await asyncio.to_thread(EpochLog, self.store_url)
        try:
            while True:
                polls += 1
                try:
                    backlog = await asyncio.to_thread(check_backlog, self.pipeline, self.store_url, self.min_files,
                                                      epoch_log)
                except Exception as exc:  # reported to the sensor, which fails with it
                    yield TriggerEvent({"status": "error", "pipeline": self.pipeline,
                                        "message": f"{type(exc).__name__}: {exc}"})
                    return
                if backlog is not None:
                    yield TriggerEvent({"status": "ready", "pipeline": self.pipeline, "backlog": backlog,
                                        "waited_s": round(time.monotonic() - started, 3), "polls": polls})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            epoch_log.close()
