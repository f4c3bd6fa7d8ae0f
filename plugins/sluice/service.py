"""The steps of one group, as Airflow tasks and the command line call them.

``plan`` (reconcile + write-ahead, no Spark) -> ``run`` (Spark) -> ``validate`` (the gate) ->
``checkpoint`` (publish, release the lease). ``run_once`` chains them for a single run-once invocation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice import adaptive, operations, protocol, validation
from sluice.errors import FencedError, PipelineBusyError, PipelineHaltedError
from sluice.runner import GroupRunner, publish
from sluice.sources import FileSource
from sluice.spec import PipelineSpec
from sluice.store import EpochLog, Group, Lease

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import SparkSession

log = logging.getLogger("sluice.service")


@dataclass(frozen=True)
class PlannedEpoch:
    """One epoch of a planned group: its write-ahead range of source offsets."""

    epoch_id: int
    generation: int
    start: int
    end: int
    state: str


@dataclass(frozen=True)
class PlannedRollback:
    """A rollback the plan step recorded (a backfill's): the run step performs it."""

    to_epoch: int
    through_epoch: int


@dataclass(frozen=True)
class GroupPlan:
    """What the plan step hands to the next ones (in Airflow through XCom, as ``as_xcom()``):
    the group it planned, or a rollback it recorded (then ``group_id`` is ``None``)."""

    pipeline: str
    group_id: int | None
    epochs: tuple[PlannedEpoch, ...] = ()
    plan: dict[str, Any] = field(default_factory=dict)  # the controllers' decision and its reason
    reprocessing: bool = False  # the group finishes a previous run's epochs
    rollback: PlannedRollback | None = None

    @classmethod
    def of(cls, group: Group) -> GroupPlan:
        return cls(group.pipeline, group.group_id,
                   tuple(PlannedEpoch(e.epoch_id, e.generation, e.start, e.end, e.state) for e in group.epochs),
                   dict(group.plan), group.reprocessing)

    def as_xcom(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "group_id": self.group_id,
                "epochs": [vars(e) for e in self.epochs], "plan": self.plan, "reprocessing": self.reprocessing,
                "rollback": vars(self.rollback) if self.rollback else None}

    @classmethod
    def from_xcom(cls, value: dict[str, Any]) -> GroupPlan:
        rollback = value.get("rollback")
        return cls(value["pipeline"], value["group_id"],
                   tuple(PlannedEpoch(e["epoch_id"], e["generation"], e["start"], e["end"], e["state"])
                         for e in value.get("epochs") or ()),
                   dict(value.get("plan") or {}), bool(value.get("reprocessing")),
                   PlannedRollback(rollback["to_epoch"], rollback["through_epoch"]) if rollback else None)


def cli_owner() -> str:
    """The lease owner of this process, outside Airflow."""
    return str(protocol.LeaseOwner.this_process())


def plan(spec: PipelineSpec, epoch_log: EpochLog, owner: str, *, epoch_size: int | None = None,
         k: int | None = None, reason: str = "backlog", take_over_prefix: str | None = None,
         recover: bool = False, interval: tuple[float, float] | None = None,
         resume_own: bool = False, extra: dict[str, Any] | None = None,
         alive: Callable[[str], bool] | None = None) -> GroupPlan | None:
    """Take the lease, discover new files, and plan the next group (or re-plan a dead run's).

    Returns the group's plan, or ``None`` (lease released) when there is
    nothing to process. With ``resume_own`` (one group per Airflow DAG run) a run that planned
    before (a retried or cleared task) gets its group back.
    ``recover`` reruns failed or unfinished epochs only, even on a halted pipeline;
    ``interval`` (a backfill run's data interval, epoch seconds) recomputes the epochs whose
    data arrived in it: the first run of a backfill records a rollback that ``run`` performs.
    ``alive(owner)`` tells whether the run holding the lease under ``take_over_prefix`` is still
    going (then the pipeline is busy).
    """
    lease = epoch_log.acquire_lease(spec.name, owner, ttl_s=spec.control.lease_ttl_s,
                                    take_over_prefix=take_over_prefix, alive=alive)
    try:
        earlier = epoch_log.group_of_owner(spec.name, owner) if resume_own else None
        if earlier is not None:
            log.info("pipeline %s: this run planned group %s before (%s); continuing it", spec.name,
                     earlier.group_id, earlier.state)
            return GroupPlan.of(earlier)
        halt = None if recover else epoch_log.halt_reason(spec.name, spec.control.max_attempts)
        if halt:
            raise PipelineHaltedError(f"pipeline {spec.name!r} is halted: {halt}")
        if interval is not None:
            planned = _plan_backfill(spec, epoch_log, lease, epoch_size, k, interval)
        else:
            FileSource(spec, epoch_log).discover()
            group = epoch_log.plan_group(lease, epoch_size=epoch_size or spec.control.epoch_files,
                                         k=k or spec.control.group_epochs, plan={**(extra or {}), "reason": reason},
                                         only_leftovers=recover, fresh_attempts=recover)
            planned = GroupPlan.of(group) if group else None
    except BaseException:
        epoch_log.release_lease(lease)
        raise
    if planned is None:
        epoch_log.release_lease(lease)
        return None
    log.info("pipeline %s: planned group %s, epochs %s, ranges %s%s", spec.name, planned.group_id,
             [e.epoch_id for e in planned.epochs], [[e.start, e.end] for e in planned.epochs],
             " (reprocessing a previous run's epochs)" if planned.reprocessing else "")
    return planned


def _plan_backfill(spec: PipelineSpec, epoch_log: EpochLog, lease: Lease, epoch_size: int | None,
                   k: int | None, interval: tuple[float, float]) -> GroupPlan | None:
    """A backfill run's share: data that landed before the interval's end and was never
    planned is planned now (processed for the first time); otherwise the epochs whose data
    arrived in the interval are recomputed (a rollback ``run`` performs)."""
    new = _plan_backfill_new_data(spec, epoch_log, lease, epoch_size, k, interval[1])
    if new is not None:
        return new
    ids = operations.epochs_arrived(spec, epoch_log, *interval)
    if not ids:
        log.info("pipeline %s: no epoch's data arrived in %s", spec.name, interval)
        return None
    states = {e.epoch_id: e.state for e in epoch_log.epochs(spec.name)}
    if all(states[i] in protocol.UNPUBLISHED for i in ids):  # planned again by this backfill's first run
        group = epoch_log.plan_group(lease, epoch_size=epoch_size or spec.control.epoch_files,
                                     k=k or spec.control.group_epochs, only_leftovers=True, through_epoch=ids[-1],
                                     plan={"reason": f"backfill: epochs {ids} arrived in {interval}"})
        return GroupPlan.of(group) if group else None
    reason = f"backfill: recompute epochs {ids[0]}..{ids[-1]}, whose data arrived in {list(interval)}"
    # Before the intent is recorded: a file gone from the source refuses the backfill and
    # leaves the pipeline as it was (a recorded intent would halt it until completed).
    epochs = {e.epoch_id: e for e in epoch_log.epochs(spec.name)}
    FileSource(spec, epoch_log).check_retained(epochs[ids[0]].start, epochs[ids[-1]].end)
    epoch_log.begin_rollback(lease, {"to_epoch": ids[0], "through_epoch": ids[-1], "reason": reason,
                                     "owner": lease.owner})
    return GroupPlan(spec.name, None, plan={"reason": reason}, rollback=PlannedRollback(ids[0], ids[-1]))


def _plan_backfill_new_data(spec: PipelineSpec, epoch_log: EpochLog, lease: Lease, epoch_size: int | None,
                            k: int | None, before: float) -> GroupPlan | None:
    """New epochs over never-planned files that landed before ``before`` (epoch seconds)."""
    FileSource(spec, epoch_log).discover()
    unplanned = epoch_log.manifest(spec.name, epoch_log.next_offset(spec.name))
    landed = [f.position for f in unplanned if f.mtime < before]
    if not landed:
        return None
    size = epoch_size or spec.control.epoch_files
    # All of it in this run: a backfill's last run must leave none of its range unprocessed.
    group = epoch_log.plan_group(lease, epoch_size=size, k=k or max(spec.control.group_epochs, -(-len(landed) // size)),
                                 until_offset=max(landed) + 1,
                                 plan={"reason": f"backfill: {len(landed)} files that landed before "
                                                 f"{_iso(before)} were never processed"})
    return GroupPlan.of(group) if group else None


def _iso(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run_lease(spec: PipelineSpec, epoch_log: EpochLog, owner: str, group_id: int | None,
               alive: Callable[[str], bool] | None = None) -> Lease:
    """The lease of the run that planned ``group_id``, under a new fencing token: every process
    that writes the tables has its own token, so its Delta commits outrank (and fence out)
    every earlier attempt's, this run's own retried task included.

    A run whose group was published and whose task is now re-run (cleared in Airflow) takes
    the lease back from another run of the same DAG only if that run is proven over
    (``alive(owner)`` is False), or its lease expired; any other run that lost its lease stops."""
    ttl = spec.control.lease_ttl_s
    try:
        epoch_log.current_lease(spec.name, owner)
    except FencedError:
        group = epoch_log.group(spec.name, group_id) if group_id is not None else None
        if group is None or group.state not in (protocol.PUBLISHED, protocol.ROLLED_BACK):
            raise
        parsed = protocol.LeaseOwner.parse(owner)
        prefix = parsed.dag_prefix if parsed is not None and alive is not None else None
        try:
            return epoch_log.acquire_lease(spec.name, owner, ttl_s=ttl, take_over_prefix=prefix, alive=alive)
        except PipelineBusyError as exc:
            raise FencedError(f"{exc} (this run's group {group_id} was published; it cannot redo it now)") from None
    return epoch_log.acquire_lease(spec.name, owner, ttl_s=ttl)


def run(spec: PipelineSpec, epoch_log: EpochLog, owner: str, group_id: int | None,
        spark: SparkSession, concurrency: int | None = None,
        alive: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Process the groups this run planned. Also: finish a rollback the plan step recorded (a
    backfill), or, when the run's group was published already (its task was cleared), roll
    back to that group and recompute it and every later epoch with their recorded ranges.

    ``concurrency``: epochs computed at once under ``commit: epoch`` (default:
    ``adaptive.concurrency_level``); ``alive``: see ``_run_lease``."""
    lease = _run_lease(spec, epoch_log, owner, group_id, alive)
    actions = []
    pending = epoch_log.pending_rollback(spec.name)
    if pending and pending.get("owner") == owner:
        actions.append(operations.rollback(spec, epoch_log, spark, lease,
                                           to_epoch=pending.get("requested_to_epoch", pending["to_epoch"]),
                                           reason=pending["reason"], recompute=True,
                                           through_epoch=pending.get("through_epoch")))
    groups = epoch_log.unpublished_groups(spec.name, owner)
    if not groups and group_id is not None:
        done = epoch_log.group(spec.name, group_id)
        if done.state in (protocol.PUBLISHED, protocol.ROLLED_BACK):
            actions.append(operations.redo_group(spec, epoch_log, spark, lease, done))
            groups = epoch_log.unpublished_groups(spec.name, owner)
    runner = GroupRunner(spec, epoch_log, spark)
    # One commit per group computes the group as one Spark job: concurrent epochs are moot.
    level = 1 if spec.commit == "group" else concurrency or adaptive.concurrency_level(spec, epoch_log)
    t0 = time.monotonic()
    ran = [runner.run(lease, g, concurrency=level).as_record() for g in groups]
    records = sum(e["rows"].get("input", 0) for g in ran for e in g["epochs"] if e["state"] == protocol.COMMITTED)
    if spec.commit == "epoch":
        adaptive.record_concurrency(spec, epoch_log, level, records, time.monotonic() - t0)
    return {"pipeline": spec.name, "groups": ran, "rollbacks": actions, "concurrency": level}


def validate(spec: PipelineSpec, epoch_log: EpochLog, owner: str) -> dict[str, Any]:
    """The gate before publishing: per epoch of this run's groups, the recorded results of
    each sink's expectation suite. Raises ``ValidationFailedError`` (and the pipeline stays
    halted) when an epoch failed under the ``fail`` policy."""
    epochs = [e for g in epoch_log.unpublished_groups(spec.name, owner) for e in g.epochs]
    failed = [e for e in epochs if e.state == protocol.FAILED and e.validation]
    report = {"pipeline": spec.name, "policy": spec.validation.policy,
              "epochs": [{"epoch_id": e.epoch_id, "state": e.state, "validation": e.validation} for e in epochs]}
    if failed:
        e = failed[0]
        raise validation.ValidationFailedError(
            f"pipeline {spec.name!r} halted: epoch {e.epoch_id} (offsets [{e.start}, {e.end})) failed validation "
            f"and was not written ({validation.describe(e.validation)}). Nothing of it is in the tables. Fix the "
            "transform or the data, then trigger sluice_recover, or sluice_rollback to an earlier epoch")
    return report


def checkpoint(spec: PipelineSpec, epoch_log: EpochLog, owner: str, group_id: int | None = None) -> dict[str, Any]:
    """Publish every group this run processed, in order, and release the lease."""
    lease = epoch_log.current_lease(spec.name, owner)
    groups = [publish(spec, epoch_log, lease, g.group_id) for g in epoch_log.unpublished_groups(spec.name, owner)]
    epoch_log.release_lease(lease)
    if spec.control.adaptive:
        for g in groups:
            try:
                adaptive.record_group(spec, epoch_log, g)
            except Exception:  # the controllers learn nothing from this group; publishing stands
                log.exception("pipeline %s: could not record group %s for the controllers", spec.name, g.group_id)
    backlog = FileSource(spec, epoch_log).backlog()
    published = [e for g in groups for e in g.epochs]
    return {"groups": [g.as_record() for g in groups], "group": groups[-1].as_record() if groups else None,
            "published": {s.name: {"epochs": [e.epoch_id for e in published],
                                   "version": max((e.delta_versions.get(s.name) for e in published
                                                   if e.delta_versions.get(s.name) is not None), default=None),
                                   "generation": epoch_log.generation(spec.name)} for s in spec.sinks},
            "backlog": backlog.as_dict()}


def release(spec: PipelineSpec, epoch_log: EpochLog, owner: str) -> bool:
    """Give up ``owner``'s lease after a failure, so the next run need not wait for expiry."""
    try:
        return epoch_log.release_lease(epoch_log.current_lease(spec.name, owner))
    except Exception:  # not the holder any more: nothing to release
        return False


def run_once(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession | Callable[[], SparkSession], *,
             owner: str | None = None, epoch_size: int | None = None, k: int | None = None,
             drain: bool = False, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Plan, run and publish groups until there is nothing left (``drain``) or once.

    ``spark`` may be a factory: the session is then started only once a group is planned, so
    a run that finds the pipeline busy or idle fails or returns before paying for a JVM.
    """
    owner = owner or cli_owner()
    done = []
    while True:
        planned = plan(spec, epoch_log, owner, epoch_size=epoch_size, k=k, extra=extra,
                       reason=(extra or {}).get("reason", "backlog"))
        if planned is None:
            break
        try:
            if callable(spark):
                spark = spark()
            run(spec, epoch_log, owner, planned.group_id, spark)
            validate(spec, epoch_log, owner)
            done.append(checkpoint(spec, epoch_log, owner, planned.group_id))
        except BaseException:
            release(spec, epoch_log, owner)
            raise
        if not drain:
            break
    return done

