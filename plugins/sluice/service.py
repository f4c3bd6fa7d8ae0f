"""The steps of one group, as Airflow tasks and the command line call them.

``plan`` (reconcile + write-ahead, no Spark) -> ``run`` (Spark) -> ``checkpoint`` (publish,
release the lease). ``run_once`` chains them for a single run-once invocation.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from sluice.runner import GroupRunner, publish
from sluice.sources import FileSource
from sluice.spec import PipelineSpec
from sluice.store import EpochLog

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import SparkSession

log = logging.getLogger("sluice.service")


def cli_owner() -> str:
    return f"cli:{socket.gethostname()}:{os.getpid()}"


def plan(spec: PipelineSpec, epoch_log: EpochLog, owner: str, *, epoch_size: int | None = None,
         k: int | None = None, reason: str = "backlog", take_over_prefix: str | None = None) -> dict[str, Any] | None:
    """Take the lease, discover new files, and plan the next group (or re-plan a dead run's).

    Returns the group as a JSON-able record, or ``None`` (lease released) when there is
    nothing to process.
    """
    lease = epoch_log.acquire_lease(spec.name, owner, ttl_s=spec.control.lease_ttl_s,
                                    take_over_prefix=take_over_prefix)
    try:
        FileSource(spec, epoch_log).discover()
        group = epoch_log.plan_group(lease, epoch_size=epoch_size or spec.control.epoch_files,
                                     k=k or spec.control.group_epochs, plan={"reason": reason})
    except BaseException:
        epoch_log.release_lease(lease)
        raise
    if group is None:
        epoch_log.release_lease(lease)
        return None
    record = group.as_record()
    log.info("pipeline %s: planned group %s, epochs %s, ranges %s%s", spec.name, group.group_id,
             group.epoch_ids, [[e.start, e.end] for e in group.epochs],
             " (reprocessing a previous run's epochs)" if group.reprocessing else "")
    return record


def run(spec: PipelineSpec, epoch_log: EpochLog, owner: str, group_id: int, spark: SparkSession) -> dict[str, Any]:
    lease = epoch_log.current_lease(spec.name, owner)
    group = GroupRunner(spec, epoch_log, spark).run(lease, epoch_log.group(spec.name, group_id))
    return group.as_record()


def checkpoint(spec: PipelineSpec, epoch_log: EpochLog, owner: str, group_id: int) -> dict[str, Any]:
    lease = epoch_log.current_lease(spec.name, owner)
    group = publish(spec, epoch_log, lease, group_id)
    epoch_log.release_lease(lease)
    backlog = FileSource(spec, epoch_log).backlog()
    return {"group": group.as_record(), "backlog": backlog.as_dict()}


def release(spec: PipelineSpec, epoch_log: EpochLog, owner: str) -> bool:
    """Give up ``owner``'s lease after a failure, so the next run need not wait for expiry."""
    try:
        return epoch_log.release_lease(epoch_log.current_lease(spec.name, owner))
    except Exception:  # not the holder any more: nothing to release
        return False


def run_once(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession | Callable[[], SparkSession], *,
             owner: str | None = None, epoch_size: int | None = None, k: int | None = None,
             drain: bool = False) -> list[dict[str, Any]]:
    """Plan, run and publish groups until there is nothing left (``drain``) or once.

    ``spark`` may be a factory: the session is then started only once a group is planned, so
    a run that finds the pipeline busy or idle fails or returns before paying for a JVM.
    """
    owner = owner or cli_owner()
    done = []
    while True:
        planned = plan(spec, epoch_log, owner, epoch_size=epoch_size, k=k)
        if planned is None:
            break
        try:
            if callable(spark):
                spark = spark()
            run(spec, epoch_log, owner, planned["group_id"], spark)
            done.append(checkpoint(spec, epoch_log, owner, planned["group_id"]))
        except BaseException:
            release(spec, epoch_log, owner)
            raise
        if not drain:
            break
    return done

