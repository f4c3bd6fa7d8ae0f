"""sluice's exactly-once protocol, one ordered story (DESIGN.md, "Exactly-once protocol v2"),
as Spark's ``MicroBatchExecution`` reads ``populateStartOffsets`` -> ``constructNextBatch`` ->
``runBatch``. Airflow's tasks and the command line call these steps; the rules they apply are
pure functions in ``sluice.protocol``, the state they change lives in ``sluice.store``.

A group, step by step:

1. **Reconcile** (``plan``): a dead run's unpublished epochs become this run's group, with their
   recorded ranges, before anything new is planned. Before they are written again, every table
   gets this run's lease token and is restored to before the first commit holding them
   (``GroupRunner.reconcile_tables``): a group that failed part way ends with exactly the
   rerun's output in every table.
2. **Plan** (``plan``): take the lease (a busy pipeline fails fast; a holder proven dead is taken
   over), discover new files, and write the group's epoch ranges ahead, in one store transaction.
3. **Process** (``run`` -> ``GroupRunner``): read exactly the group's ranges as one Spark job,
   transform, split rejected and quarantined records, validate each epoch's output.
4. **Commit** (``run`` -> ``GroupRunner``): one Delta transaction per table and group, its
   txnVersion carrying the lease token (the fence is part of the commit); then the epoch log.
   ``validate`` is the gate after it: an epoch that failed under the ``fail`` policy halts.
5. **Publish** (``checkpoint`` -> ``publish``): the JSON epoch records next to each table first
   (idempotent), then the epochs become ``published``; the lease is released.

Then the operator actions, as sections: **rollback** (preconditions, intent, fence, RESTORE, new
generation, optional recompute), **redo** (a cleared task of a past group), **backfill** (the
epochs whose data arrived in an interval), **rebuild** (a lost store from the records), and
**skip a file**. Those that change a table record their intent first, so the next run
finishes or refuses what a crash interrupted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from sluice import adaptive, faults, protocol, validation
from sluice.errors import (
    FencedError,
    OperatorActionRequired,
    PipelineBusyError,
    PipelineHaltedError,
    SluiceError,
    SourceError,
)
from sluice.runner import GroupRunner, fence_tables, pipeline_tables
from sluice.sources import source_for
from sluice.spec import PipelineSpec, SourceSpec
from sluice.store import EpochLog, Group, Lease, records
from sluice.store.epoch_log import RollbackPlan, utcnow

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import SparkSession

log = logging.getLogger("sluice.execution")


# -- the plan a group travels with (plan -> run -> validate -> checkpoint, in Airflow via XCom) ----


@dataclass(frozen=True)
class SensedPlan:
    """What the backlog sensor hands to the plan step (in Airflow through XCom): the sizes the
    controllers chose (or the run's params), why the group fires, and when its clock started."""

    epoch_size: int | None = None
    k: int | None = None
    reason: str = "manual"
    backlog: dict[str, Any] | None = None  # ``Backlog.as_dict()`` when the sensor fired
    fired_at: float | None = None  # epoch seconds: the group's wall-clock time starts here
    partitions: int | None = None  # the controllers' shuffle partitions (DyBBS)
    predicted_wall_s: float | None = None
    rate_rps: float | None = None
    file_rate: float | None = None
    started: dict[str, Any] | None = None  # ``adaptive.StartReason.as_record()``: why the group started now

    @classmethod
    def fired(cls, verdict_plan: dict[str, Any], backlog: dict[str, Any] | None, params: dict[str, Any]) -> SensedPlan:
        """The controllers' plan (``adaptive.Verdict.plan()``) unless the run's params override
        epoch size or k."""
        sensed = cls.from_xcom(dict(verdict_plan, backlog=backlog, fired_at=time.time()))
        for key in ("epoch_size", "k"):
            if params.get(key):
                sensed = replace(sensed, **{key: params[key]},
                                 reason=f"{sensed.reason} ({key} {params[key]} from the run's params)")
        return sensed

    def measured(self) -> dict[str, Any]:
        """What the group records of the controllers' view, beside its reason (``Group.plan``)."""
        return {key: value for key in ("partitions", "fired_at", "rate_rps", "file_rate", "predicted_wall_s",
                                       "started")
                if (value := getattr(self, key)) is not None}

    def as_xcom(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_xcom(cls, value: dict[str, Any] | None) -> SensedPlan:
        names = cls.__dataclass_fields__
        return cls(**{key: v for key, v in (value or {}).items() if key in names and v is not None})


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


# -- 1-2. reconcile and plan (write-ahead): no Spark -----------------------------------------------


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
            source_for(spec, epoch_log).discover()
            group = epoch_log.plan_group(lease, epoch_size=epoch_size or spec.control.epoch_files,
                                         k=k or spec.control.group_epochs, plan={**(extra or {}), "reason": reason},
                                         only_leftovers=recover, fresh_attempts=recover,
                                         max_bytes=spec.epoch_size_bound)
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


# -- 3-4. process and commit: one Spark job and one Delta commit per table (sluice.runner) ---------


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
        actions.append(rollback(spec, epoch_log, spark, lease,
                                           to_epoch=pending.get("requested_to_epoch", pending["to_epoch"]),
                                           reason=pending["reason"], recompute=True,
                                           through_epoch=pending.get("through_epoch")))
    groups = epoch_log.unpublished_groups(spec.name, owner)
    if not groups and group_id is not None:
        done = epoch_log.group(spec.name, group_id)
        if done.state in (protocol.PUBLISHED, protocol.ROLLED_BACK):
            actions.append(redo_group(spec, epoch_log, spark, lease, done))
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


# -- validate: the gate before publishing ----------------------------------------------------------


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


# -- 5. publish: epoch records first (idempotent), then the store; release the lease ---------------


def write_epoch_records(spec: PipelineSpec, epoch_log: EpochLog, group: Group) -> list[str]:
    """The JSON records of a group's epochs as published, next to each table
    (``sluice.store.records``). Each names the files of its range, so the store (manifest
    included) can be rebuilt from them alone. Written before the store publishes the group (and
    again by a retry): no crash leaves a published epoch without its record."""
    written = []
    files = {e.epoch_id: [[f.path, f.size, f.mtime] for f in epoch_log.manifest(spec.name, e.start, e.end)]
             for e in group.epochs}
    now = utcnow()
    for sink in spec.sinks:
        for epoch in group.epochs:
            if epoch.state not in (protocol.COMMITTED, protocol.PUBLISHED):
                continue
            published = replace(epoch, state=protocol.PUBLISHED, published_at=epoch.published_at or now)
            path = records.write_epoch(sink.path, dict(published.as_record(), sink=sink.name,
                                                        version=epoch.delta_versions.get(sink.name),
                                                        files=files[epoch.epoch_id]))
            written.append(str(path))
    return written


def publish(spec: PipelineSpec, epoch_log: EpochLog, lease: Lease, group_id: int) -> Group:
    """Checkpoint: the group's committed epochs become ``published``; their JSON records are
    written first (idempotent), so a crash in between leaves nothing for a retry to miss."""
    epoch_log.check_lease(lease)
    write_epoch_records(spec, epoch_log, epoch_log.group(spec.name, group_id))
    faults.maybe_fail("before_publish")
    return epoch_log.finish_group(lease, group_id, protocol.PUBLISHED)


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
    backlog = source_for(spec, epoch_log).backlog()
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


# -- the whole chain, for the command line and run-once jobs ---------------------------------------


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


# -- rollback (Structured Streaming §7.2): preconditions, intent, fence, RESTORE, new generation ---


class RollbackRefusedError(OperatorActionRequired):
    """A rollback's preconditions do not hold; nothing was changed."""


@dataclass(frozen=True)
class TableRestore:
    path: str
    keys: tuple[str, ...]  # epoch-log keys of the writers of this table (sink, _rejected, ...)
    target: int | None  # version to RESTORE to; None: no restore needed
    latest: int | None


def plan_restores(spec: PipelineSpec, spark: SparkSession, plan: RollbackPlan) -> list[TableRestore]:
    """Per table, the version to RESTORE to: the last one an epoch before ``to_epoch`` wrote
    (version 0, the empty table, if none did), when any epoch wrote after it."""
    from sluice.sinks.delta import commit_lineage, history, is_delta_table

    restores = []
    for path, keys in spec.table_writers().items():
        if not is_delta_table(spark, path):
            continue
        latest = int(history(spark, path, 1).first()["version"])
        target = restore_target(plan, keys)
        needed = False  # did this pipeline commit to the table after the target?
        for commit in commit_lineage(spark, path):  # newest first
            if commit.version <= target or commit.pipeline == spec.name:
                needed = commit.version > target
                break
        restores.append(TableRestore(path, tuple(keys), target if needed else None, latest))
    return restores


def restore_target(plan: RollbackPlan, keys: Iterable[str]) -> int:
    """The version a table written through ``keys`` goes back to: the last one an epoch before
    ``to_epoch`` wrote (version 0, the empty table, if none did)."""
    return max((v for e in plan.kept for k in keys if (v := e.delta_versions.get(k)) is not None), default=0)


def check_version_restorable(spark: SparkSession, path: str, version: int) -> str | None:
    """Why ``version`` of the table cannot be restored (log or data files vacuumed), or None."""
    try:
        files = spark.read.format("delta").option("versionAsOf", version).load(path).inputFiles()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return f"table {path}: version {version} is no longer in the Delta log ({first})"
    missing = []
    for uri in files:
        parsed = urlparse(uri)
        if parsed.scheme in ("", "file") and not Path(unquote(parsed.path)).exists():
            missing.append(unquote(parsed.path))
    if missing:
        return (f"table {path}: version {version} was vacuumed: {len(missing)} of its {len(files)} data files "
                f"are gone (e.g. {missing[0]})")
    return None


def source_problems(spec: PipelineSpec, epoch_log: EpochLog, plan: RollbackPlan) -> list[str]:
    """Why the source can no longer give the rolled-back ranges again (files gone, Kafka
    retention), for a recompute; empty when it can."""
    if not plan.rolled_back:
        return []
    try:
        source_for(spec, epoch_log).check_retained(plan.rolled_back[0].start, plan.rolled_back[-1].end)
    except SourceError as exc:
        return [f"the source no longer holds the data to recompute: {exc}"]
    return []


def check_preconditions(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession,
                        plan: RollbackPlan) -> list[TableRestore]:
    """Raise ``RollbackRefusedError`` listing everything that blocks the rollback: files of the
    rolled-back ranges no longer at the source, table versions that were vacuumed, or a table
    another pipeline wrote to since (its rows would be restored away)."""
    from sluice.sinks.delta import restore_conflict

    problems = source_problems(spec, epoch_log, plan)
    restores = plan_restores(spec, spark, plan)
    for r in restores:
        if r.target is not None:
            problems += [p for p in (check_version_restorable(spark, r.path, r.target),
                                     restore_conflict(spark, r.path, spec.name, r.target)) if p]
    if problems:
        raise RollbackRefusedError(
            f"pipeline {spec.name!r}: rollback to epoch {plan.to_epoch} refused, nothing was changed:\n  - "
            + "\n  - ".join(problems))
    return restores


def rollback(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession, lease: Lease, *, to_epoch: int,
             reason: str, recompute: bool, through_epoch: int | None = None) -> dict[str, Any]:
    """Roll the pipeline back to ``to_epoch`` under ``lease``: check the preconditions and change
    nothing if one fails; record the intent in the store; record this lease's token in every
    table, RESTORE each to the version before ``to_epoch``; then roll the epoch log back: the
    generation is bumped (Delta's RESTORE does not undo txn ids, delta-io/delta#1813), later
    epochs become ``rolled_back`` and the source position rewinds to ``to_epoch``'s start.

    With ``recompute`` the rolled-back ranges are planned again: those up to ``through_epoch``
    (all by default) as one group of this lease, the rest for later runs. Returns a report,
    with ``group_id`` of the group to run now, if any.
    """
    plan, shared = group_rollback_plan(epoch_log, spec.name, to_epoch)
    replan_later = recompute
    if shared:
        log.info("pipeline %s: %s", spec.name, shared_commit_note(shared, to_epoch))
        if not recompute:
            recompute, through_epoch = True, to_epoch - 1
    try:
        restores = check_preconditions(spec, epoch_log, spark, plan)
    except RollbackRefusedError:
        # An intent recorded early (a backfill's plan step cannot check table versions) whose
        # restores never started is withdrawn: the refusal changes nothing, as it says.
        pending = epoch_log.pending_rollback(spec.name)
        if pending and pending.get("to_epoch") in (plan.to_epoch, to_epoch) and not pending.get("restoring"):
            epoch_log.cancel_rollback(lease)
        raise
    details = {"to_epoch": plan.to_epoch, "requested_to_epoch": to_epoch, "reason": reason, "owner": lease.owner,
               "generation": plan.generation, "restoring": True}
    if through_epoch is not None:
        details["through_epoch"] = through_epoch
    epoch_log.begin_rollback(lease, details)
    from sluice.sinks.delta import restore

    # No earlier run may commit to a table once this one starts restoring it.
    fence_tables(spark, spec, plan.generation, lease.fence)
    for r in restores:
        if r.target is not None:
            metrics = restore(spark, r.path, r.target)
            log.info("pipeline %s: restored %s from version %s to %s: %s", spec.name, r.path, r.latest, r.target,
                     metrics)
            faults.maybe_fail("mid_rollback", plan.to_epoch)
    new_gen, group = epoch_log.finish_rollback(lease, plan, replan=recompute, reason=reason,
                                               through_epoch=through_epoch, replan_later=replan_later)
    record = {"pipeline": spec.name, "generation": new_gen, "from_generation": plan.generation,
              "to_epoch": to_epoch, "restored_to_epoch": plan.to_epoch,
              "reason": reason, "by": lease.owner, "at": utcnow().isoformat() + "Z",
              "rolled_back": [[e.epoch_id, e.start, e.end, e.state] for e in plan.rolled_back],
              "restored": {r.path: r.target for r in restores if r.target is not None}}
    write_rollback_record(spec, record)
    log.info("pipeline %s: rolled back to epoch %s (generation %s -> %s): %s", spec.name, to_epoch,
             plan.generation, new_gen, json.dumps(record["restored"]))
    return dict(record, group_id=group.group_id if group else None)


def group_rollback_plan(epoch_log: EpochLog, pipeline: str, to_epoch: int) -> tuple[RollbackPlan, list[int]]:
    """The plan of a rollback to ``to_epoch``, and the kept epochs that share a Delta commit with
    it. A group commit holds several epochs in one Delta version: rolling back into its middle
    restores the version before it and recomputes its epochs before ``to_epoch`` with their
    recorded ranges (and, with recompute, the rest as well); the plan then starts at the first."""
    plan = epoch_log.rollback_plan(pipeline, to_epoch)
    shared = sharing_a_commit(plan)
    return (epoch_log.rollback_plan(pipeline, shared[0]) if shared else plan), shared


def shared_commit_note(shared: list[int], to_epoch: int) -> str:
    return (f"epochs {shared} share a Delta commit with epoch {to_epoch}: the tables go back to before epoch "
            f"{shared[0]}, and those epochs are recomputed with their recorded ranges")


def sharing_a_commit(plan: RollbackPlan) -> list[int]:
    """Kept epochs written in the same Delta commit as a rolled-back one (one commit per group)."""
    first_rolled = plan.rolled_back[0].epoch_id if plan.rolled_back else None
    if first_rolled is None:
        return []
    versions = {(k, v) for e in plan.rolled_back for k, v in e.delta_versions.items() if v is not None}
    return [e.epoch_id for e in plan.kept
            if any((k, v) in versions for k, v in e.delta_versions.items())
            or (e.rows.get("commit") and e.rows["commit"][1] >= first_rolled)]


def write_rollback_record(spec: PipelineSpec, record: dict[str, Any]) -> None:
    """Note a rollback next to each table: a store rebuilt from the epoch records must not
    revive the epochs it rolled back."""
    for sink in spec.sinks:
        records.write_rollback(sink.path, record)


# -- redo: a cleared processing task of a past group -----------------------------------------------


def redo_group(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession, lease: Lease,
               group: Group) -> dict[str, Any]:
    """A cleared processing task of a past group: roll back to its first epoch and plan it and
    every later epoch again with their recorded ranges, as one group of this lease."""
    first = min(group.epoch_ids)
    reason = f"{lease.owner} re-ran group {group.group_id} (epochs {group.epoch_ids}), cleared in Airflow"
    return rollback(spec, epoch_log, spark, lease, to_epoch=first, reason=reason, recompute=True)


# -- backfill: recompute the epochs whose data arrived in a run's interval -------------------------


def _plan_backfill(spec: PipelineSpec, epoch_log: EpochLog, lease: Lease, epoch_size: int | None,
                   k: int | None, interval: tuple[float, float]) -> GroupPlan | None:
    """A backfill run's share: data that landed before the interval's end and was never
    planned is planned now (processed for the first time); otherwise the epochs whose data
    arrived in the interval are recomputed (a rollback ``run`` performs)."""
    new = _plan_backfill_new_data(spec, epoch_log, lease, epoch_size, k, interval[1])
    if new is not None:
        return new
    ids = epochs_arrived(spec, epoch_log, *interval)
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
    source_for(spec, epoch_log).check_retained(epochs[ids[0]].start, epochs[ids[-1]].end)
    epoch_log.begin_rollback(lease, {"to_epoch": ids[0], "through_epoch": ids[-1], "reason": reason,
                                     "owner": lease.owner})
    return GroupPlan(spec.name, None, plan={"reason": reason}, rollback=PlannedRollback(ids[0], ids[-1]))


def _plan_backfill_new_data(spec: PipelineSpec, epoch_log: EpochLog, lease: Lease, epoch_size: int | None,
                            k: int | None, before: float) -> GroupPlan | None:
    """New epochs over never-planned files that landed before ``before`` (epoch seconds)."""
    source_for(spec, epoch_log).discover()
    unplanned = epoch_log.manifest(spec.name, epoch_log.next_offset(spec.name))
    landed = [f.position for f in unplanned if f.mtime < before]
    if not landed:
        return None
    size = epoch_size or spec.control.epoch_files
    # All of it in this run: a backfill's last run must leave none of its range unprocessed.
    # k as large as one epoch per file: the byte bound may split the files into more epochs.
    group = epoch_log.plan_group(lease, epoch_size=size, k=k or max(spec.control.group_epochs, len(landed)),
                                 until_offset=max(landed) + 1, max_bytes=spec.epoch_size_bound,
                                 plan={"reason": f"backfill: {len(landed)} files that landed before "
                                                 f"{_iso(before)} were never processed"})
    return GroupPlan.of(group) if group else None


def epochs_arrived(spec: PipelineSpec, epoch_log: EpochLog, start: float, end: float) -> list[int]:
    """Epochs of the current generation whose data arrived in ``[start, end)`` (epoch seconds):
    an epoch belongs to the interval in which its last file landed, so to exactly one."""
    found = []
    for e in epoch_log.epochs(spec.name):
        if e.state == protocol.ROLLED_BACK:
            continue
        files = epoch_log.manifest(spec.name, e.start, e.end)
        if files and start <= max(f.mtime for f in files) < end:
            found.append(e.epoch_id)
    return found


def _iso(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- rebuild: a lost store, from the epoch records next to the tables ------------------------------


def rebuild_store(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession, owner: str) -> dict[str, Any]:
    """Rebuild a lost store from the records, then undo anything the tables hold beyond the
    last published epoch (a group that committed but did not publish before the loss).

    All or nothing, and rerunnable: the records load in one store transaction together with a
    rollback intent that halts the pipeline; a rebuild killed before that intent is cleared is
    resumed by running it again. The lease tokens start above every token in the tables, so
    Delta does not take the next run for an older one."""
    from sluice.sinks.delta import commit_lineage, is_delta_table

    pending = epoch_log.pending_rollback(spec.name) if epoch_log.has_pipeline(spec.name) else None
    resuming = bool(pending and pending.get("rebuild"))
    if epoch_log.has_pipeline(spec.name) and not resuming:
        raise SluiceError(f"pipeline {spec.name!r}: the epoch store at {epoch_log.url} already holds this "
                          "pipeline; rebuild only into an empty store")
    try:
        epochs, rollbacks = records.read([s.path for s in spec.sinks])
    except records.RecordError as exc:
        raise SluiceError(f"pipeline {spec.name!r}: {exc}") from None
    live = records.live(epochs, rollbacks)
    protocol.check_contiguous((r.epoch_id, r.start, r.end) for r in live)
    generation = max([r.generation for r in epochs] + [r.generation for r in rollbacks], default=0)
    files = []
    for r in live:
        if len(r.files) != r.end - r.start:
            raise SluiceError(f"pipeline {spec.name!r}: the record {r.path} of epoch {r.epoch_id} lists "
                              f"{len(r.files)} files for offsets [{r.start}, {r.end})")
        files += [(r.start + i, path, size, mtime) for i, (path, size, mtime) in enumerate(r.files)]
    if not resuming:
        token = max((c.token for t in pipeline_tables(spec) if is_delta_table(spark, t.path)
                     for c in commit_lineage(spark, t.path)), default=0)
        epoch_log.load_records(spec.name, generation, files, [r.fields for r in live], fence=token,
                               intent={"to_epoch": len(live), "rebuild": True, "owner": owner,
                                       "reason": "store rebuild in progress: run the rebuild again to finish it"})
    report: dict[str, Any] = {"pipeline": spec.name, "generation": generation, "epochs": len(live),
                              "files": len(files), "rolled_back_orphans": None, "resumed": resuming}
    lease = epoch_log.acquire_lease(spec.name, owner)
    try:
        plan = epoch_log.rollback_plan(spec.name, len(live))
        if any(r.target is not None for r in plan_restores(spec, spark, plan)):
            faults.maybe_fail("mid_rebuild")
            report["rolled_back_orphans"] = rollback(
                spec, epoch_log, spark, lease, to_epoch=len(live), recompute=False,
                reason="store rebuilt: the tables held epochs after the last published one")
        else:
            epoch_log.cancel_rollback(lease)
    finally:
        epoch_log.release_lease(lease)
    report["generation"] = epoch_log.generation(spec.name)
    return report


# -- skip a file that is gone or unreadable --------------------------------------------------------


def skip_file(spec: PipelineSpec, epoch_log: EpochLog, path: str, *, by: str, reason: str) -> dict[str, Any]:
    """Leave a file that is gone or unreadable out of its epoch, on purpose and recorded (who,
    when, why). ``path``: as in the manifest (absolute), or relative to the landing folder.
    Failed epochs holding it get fresh attempts, so the next run (or ``sluice_recover``) runs
    them without it."""
    if not isinstance(spec.source, SourceSpec):  # a Kafka chunk or a Delta version: its kafka:// or delta:// path
        candidates = [path]
    else:
        candidates = [str(Path(path).absolute()), str((spec.landing_dir / path).absolute())]
    known = {p for p, _, _ in epoch_log.known_files(spec.name)}
    match = next((c for c in candidates if c in known), candidates[0])
    entry, epochs = epoch_log.skip_file(spec.name, match, by=by, reason=reason)
    log.warning("pipeline %s: file %s (offset %s) skipped by %s: %s; epochs %s read without it", spec.name,
                entry.path, entry.position, by, reason, epochs)
    return {"pipeline": spec.name, "file": entry.path, "position": entry.position, "epochs": epochs,
            "skipped": entry.skipped.as_record() if entry.skipped else None}
