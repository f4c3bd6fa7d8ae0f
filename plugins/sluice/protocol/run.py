"""sluice's exactly-once protocol, one ordered story (Structured Streaming §6.1, per group), as
the methods of one ``PipelineRun``: a DAG run, or a command-line process, under one lease owner.

1. **Reconcile** (``plan``): a dead run's unpublished epochs become this run's group, with their
   recorded ranges, before anything new is planned (``planning.plan_group``).
2. **Plan** (``plan``): take the lease (a busy pipeline fails fast; a holder proven dead is taken
   over), discover new data, and write the group's epoch ranges ahead, in one store transaction.
3. **Process** (``process`` -> ``group.GroupJob``): every table made ready, the attempt counted,
   the tables reconciled if the epochs were attempted before (fence, fenced RESTORE), the lease
   checked with every table made (a later rollback fences them all); then read
   exactly the group's ranges, transform, split rejected and quarantined records, validate.
4. **Commit** (``process`` -> ``group.GroupJob``): one Delta transaction per table and group, its
   txnVersion carrying the lease token (the fence is part of the commit); then the store.
   ``validate`` is the gate after it: an epoch that failed under the ``fail`` policy halts.
5. **Publish** (``publish``): the JSON epoch records next to each table first (idempotent), then
   the epochs become ``published``; missing rollback records are written again; the lease is
   released.

The operator actions (rollback, redo, backfill, rebuild, skip a file) are in ``operations``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sluice import faults, validation
from sluice.errors import FencedError, PipelineBusyError, PipelineHaltedError, StoreLostError
from sluice.model import (
    COMMITTED,
    FAILED,
    PLANNED,
    PUBLISHED,
    ROLLED_BACK,
    Epoch,
    Group,
    Lease,
    LeaseOwner,
    ManifestEntry,
)
from sluice.protocol import operations, planning
from sluice.protocol.group import GroupJob
from sluice.protocol.leases import acquire_lease
from sluice.protocol.runtime import Runtime
from sluice.sources import source_for
from sluice.spec import PipelineSpec
from sluice.store import EpochStore, records
from sluice.store.epoch_store import redacted

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import SparkSession

log = logging.getLogger("sluice.protocol.run")


# -- what a group travels with (plan -> process -> validate -> publish, in Airflow via XCom) ---------


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
    first_size: int | None = None  # the first epoch's files when the controllers probe one larger epoch

    @classmethod
    def fired(cls, verdict_plan: dict[str, Any], backlog: dict[str, Any] | None, params: dict[str, Any]) -> SensedPlan:
        """The controllers' plan (``adaptive.Verdict.plan()``) unless the run's params override
        epoch size or k."""
        sensed = cls.from_xcom(dict(verdict_plan, backlog=backlog, fired_at=time.time()))
        for key in ("epoch_size", "k"):
            if params.get(key):  # the operator's sizes hold for every epoch: no probe epoch
                sensed = replace(sensed, **{key: params[key]}, first_size=None,
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
class PlannedRollback:
    """A rollback the plan step recorded (a backfill's): the processing step performs it."""

    to_epoch: int
    through_epoch: int


@dataclass(frozen=True)
class GroupPlan:
    """What the plan step hands to the next ones (in Airflow through XCom, as ``as_xcom()``):
    the group it planned, or a rollback it recorded (then ``group_id`` is ``None``)."""

    pipeline: str
    group_id: int | None
    epochs: tuple[Epoch, ...] = ()
    plan: dict[str, Any] = field(default_factory=dict)  # the sizing decision and its reason
    reprocessing: bool = False  # the group finishes a previous run's epochs
    rollback: PlannedRollback | None = None

    @classmethod
    def of(cls, group: Group) -> GroupPlan:
        """What XCom carries of the group: each epoch's id, generation, range and state."""
        epochs = tuple(Epoch(e.pipeline, e.epoch_id, e.generation, e.group_id, e.start, e.end, e.state)
                       for e in group.epochs)
        return cls(group.pipeline, group.group_id, epochs, dict(group.plan), group.reprocessing)

    def as_xcom(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "group_id": self.group_id,
                "epochs": [{"epoch_id": e.epoch_id, "generation": e.generation, "start": e.start, "end": e.end,
                            "state": e.state} for e in self.epochs],
                "plan": self.plan, "reprocessing": self.reprocessing,
                "rollback": vars(self.rollback) if self.rollback else None}

    @classmethod
    def from_xcom(cls, value: dict[str, Any]) -> GroupPlan:
        rollback = value.get("rollback")
        group_id = value["group_id"]
        owner_group = group_id if group_id is not None else -1
        return cls(value["pipeline"], group_id,
                   tuple(Epoch(value["pipeline"], e["epoch_id"], e["generation"], owner_group, e["start"], e["end"],
                               e["state"]) for e in value.get("epochs") or ()),
                   dict(value.get("plan") or {}), bool(value.get("reprocessing")),
                   PlannedRollback(rollback["to_epoch"], rollback["through_epoch"]) if rollback else None)


def cli_owner() -> str:
    """The lease owner of this process, outside Airflow."""
    return str(LeaseOwner.this_process())


class PipelineRun:
    """One run of ``spec`` under the lease owner ``owner``: the protocol's steps as methods, in
    order. ``runtime``: the tables and the data plane (``Runtime.spark``; the simulation's twin).

    Example (the command line's ``sluice run-group --plan``)::

        run = PipelineRun(spec, EpochStore(), cli_owner(), Runtime.spark(get_session))
        planned = run.plan()
        if planned is not None:
            run.process(planned.group_id)
            run.validate()
            run.publish()
    """

    def __init__(self, spec: PipelineSpec, store: EpochStore, owner: str, runtime: Runtime | None = None) -> None:
        self.spec = spec
        self.store = store
        self.owner = owner
        self.runtime = runtime

    def _runtime(self) -> Runtime:
        if self.runtime is None:
            raise RuntimeError("this step needs a runtime (tables and compute): PipelineRun(..., runtime=...)")
        return self.runtime

    # -- 1-2. reconcile and plan (write-ahead): no Spark -----------------------------------------

    def plan(self, *, epoch_size: int | None = None, k: int | None = None, reason: str = "backlog",
             take_over_prefix: str | None = None, recover: bool = False,
             interval: tuple[float, float] | None = None, resume_own: bool = False,
             extra: dict[str, Any] | None = None, alive: Callable[[str], bool] | None = None,
             withdraw_rollback: bool = False, first_size: int | None = None) -> GroupPlan | None:
        """Take the lease, discover new data, and plan the next group (or re-plan a dead run's).

        Returns the group's plan, or ``None`` (lease released) when there is nothing to process.
        With ``resume_own`` (one group per Airflow DAG run) a run that planned before (a retried
        or cleared task) gets its group back. ``recover`` reruns failed or unfinished epochs
        only, even on a halted pipeline (``withdraw_rollback`` first withdraws a recorded
        rollback whose restores never started); ``interval`` (a backfill run's data interval,
        epoch seconds) recomputes the epochs whose data arrived in it: the first run of a
        backfill records a rollback that ``process`` performs. ``alive(owner)`` tells whether
        the run holding the lease under ``take_over_prefix`` is still going. ``first_size``: the
        first new epoch's offsets when they differ from ``epoch_size`` (the controllers' probe).
        """
        spec, store = self.spec, self.store
        context = planning.context(store, spec, self.owner if resume_own else None)
        if self.runtime is not None and not context.known:
            operations.check_new_to_store(spec, store, self._runtime().tables)  # refuses a lost store
        lease = acquire_lease(store, spec.name, self.owner, ttl_s=spec.control.lease_ttl_s,
                              take_over_prefix=take_over_prefix, alive=alive)
        try:
            earlier = context.earlier
            if earlier is not None:
                log.info("pipeline %s: this run planned group %s before (%s); continuing it", spec.name,
                         earlier.group_id, earlier.state)
                return GroupPlan.of(earlier)
            if withdraw_rollback:
                operations.withdraw_rollback(spec, store, lease)
                context = planning.context(store, spec, None)
            halt = None if recover else context.halt
            if halt:
                raise PipelineHaltedError(f"pipeline {spec.name!r} is halted: {halt}")
            if interval is not None:
                group, rollback = operations.plan_backfill(spec, store, lease, epoch_size, k, interval)
                planned = (GroupPlan.of(group) if group else
                           GroupPlan(spec.name, None, plan={"reason": rollback["reason"]},
                                     rollback=PlannedRollback(rollback["to_epoch"], rollback["through_epoch"]))
                           if rollback else None)
            else:
                source_for(spec, store).discover()
                group = planning.plan_group(store, lease, epoch_size=epoch_size or spec.control.epoch_files,
                                            k=k or spec.control.group_epochs, plan={**(extra or {}), "reason": reason},
                                            only_leftovers=recover, fresh_attempts=recover,
                                            max_bytes=spec.epoch_size_bound, first_size=first_size)
                planned = GroupPlan.of(group) if group else None
        except BaseException:
            store.release_lease(lease)
            raise
        if planned is None:
            store.release_lease(lease)
            return None
        log.info("pipeline %s: planned group %s, epochs %s, ranges %s%s", spec.name, planned.group_id,
                 [e.epoch_id for e in planned.epochs], [[e.start, e.end] for e in planned.epochs],
                 " (reprocessing a previous run's epochs)" if planned.reprocessing else "")
        return planned

    # -- 3-4. process and commit: one job and one Delta commit per table (``group``) ---------------

    def _lease(self, group_id: int | None, alive: Callable[[str], bool] | None) -> Lease:
        """The lease of the run that planned ``group_id``, under a new fencing token: every process
        that writes the tables has its own token, so its Delta commits outrank (and fence out)
        every earlier attempt's, this run's own retried task included.

        A run whose group was published and whose task is now re-run (cleared in Airflow) takes
        the lease back from another run of the same DAG only if that run is proven over
        (``alive(owner)`` is False), or its lease expired; any other run that lost its lease stops."""
        spec, store = self.spec, self.store
        ttl = spec.control.lease_ttl_s
        try:
            return acquire_lease(store, spec.name, self.owner, ttl_s=ttl, held=True)
        except FencedError:
            group = store.group(spec.name, group_id) if group_id is not None else None
            if group is None or group.state not in (PUBLISHED, ROLLED_BACK):
                raise
            parsed = LeaseOwner.parse(self.owner)
            prefix = parsed.dag_prefix if parsed is not None and alive is not None else None
            try:
                return acquire_lease(store, spec.name, self.owner, ttl_s=ttl, take_over_prefix=prefix, alive=alive)
            except PipelineBusyError as exc:
                raise FencedError(f"{exc} (this run's group {group_id} was published; it cannot redo it now)") from None

    def process(self, group_id: int | None, *, concurrency: int | None = None,
                alive: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Process the groups this run planned. Also: finish a rollback the plan step recorded (a
        backfill), or, when the run's group was published already (its task was cleared), roll
        back to that group and recompute it and every later epoch with their recorded ranges.

        ``concurrency``: epochs computed at once under ``commit: epoch`` (default:
        ``adaptive.concurrency_level``); ``alive``: see ``_lease``."""
        spec, store, runtime = self.spec, self.store, self._runtime()
        lease = self._lease(group_id, alive or runtime.alive)
        actions = []
        with store.read(spec.name, "process") as tx:
            pending = tx.state().intent
            groups = [tx.group(i) for i in tx.group_ids(states=[PLANNED], owner=self.owner)]
        if pending is not None and pending.owner == self.owner and not pending.rebuild:
            actions.append(operations.rollback(spec, store, runtime, lease, to_epoch=pending.asked,
                                               reason=pending.reason, recompute=True,
                                               through_epoch=pending.through_epoch))
            groups = store.unpublished_groups(spec.name, self.owner)
        if not groups and group_id is not None:
            done = store.group(spec.name, group_id)
            if done.state in (PUBLISHED, ROLLED_BACK):
                actions.append(operations.redo_group(spec, store, runtime, lease, done))
                groups = store.unpublished_groups(spec.name, self.owner)
        job = GroupJob(spec, store, runtime)
        if spec.commit == "group":  # one commit per group computes the group as one job: concurrent epochs are moot
            ran = [job.run(lease, g).as_record() for g in groups]
            return {"pipeline": spec.name, "groups": ran, "rollbacks": actions, "concurrency": 1}
        from sluice import adaptive  # the controllers (numpy): not imported by every task's DAG parse

        level = concurrency or adaptive.concurrency_level(spec, store)
        t0 = time.monotonic()
        ran = [job.run(lease, g, concurrency=level).as_record() for g in groups]
        n = sum(e["rows"].get("input", 0) for g in ran for e in g["epochs"] if e["state"] == COMMITTED)
        adaptive.record_concurrency(spec, store, level, n, time.monotonic() - t0)
        return {"pipeline": spec.name, "groups": ran, "rollbacks": actions, "concurrency": level}

    # -- validate: the gate before publishing -----------------------------------------------------

    def validate(self) -> dict[str, Any]:
        """The gate before publishing: per epoch of this run's groups, the recorded results of
        each sink's expectation suite. Raises ``ValidationFailedError`` (and the pipeline stays
        halted) when an epoch failed under the ``fail`` policy."""
        spec = self.spec
        epochs = [e for g in self.store.unpublished_groups(spec.name, self.owner) for e in g.epochs]
        failed = [e for e in epochs if e.state == FAILED and e.validation]
        report = {"pipeline": spec.name, "policy": spec.validation.policy,
                  "epochs": [{"epoch_id": e.epoch_id, "state": e.state, "validation": e.validation} for e in epochs]}
        if failed:
            e = failed[0]
            raise validation.ValidationFailedError(
                f"pipeline {spec.name!r} halted: epoch {e.epoch_id} (offsets [{e.start}, {e.end})) failed validation "
                f"and was not written ({validation.describe(e.validation)}). Nothing of it is in the tables. Fix the "
                "transform or the data, then recover (sluice_recover), or roll back to an earlier epoch "
                "(sluice_rollback): the console, or `make recover`/`make rollback`")
        return report

    # -- 5. publish: epoch records first (idempotent), then the store; release the lease ----------

    def write_epoch_records(self, group: Group, entries: list[ManifestEntry]) -> list[str]:
        """The JSON records of a group's epochs as published, next to each table
        (``sluice.store.records``). Each names the files of its range (``entries``: the manifest
        over the group's ranges, read with the group), so the store (manifest included) can be
        rebuilt from them alone. Written before the store publishes the group (and again by a
        retry): no crash leaves a published epoch without its record. A range the entries do not
        cover (the store was replaced since the group was read) is refused: its record would
        rebuild a manifest without those files."""
        from sluice.store.epoch_store import utcnow

        spec = self.spec
        tables = self._runtime().tables
        written: list[str] = []
        if not group.epochs:
            return written
        files = {e.epoch_id: [[f.path, f.size, f.mtime] for f in entries if e.start <= f.position < e.end]
                 for e in group.epochs}
        short = [e.epoch_id for e in group.epochs if len(files[e.epoch_id]) != e.end - e.start]
        if short:
            raise StoreLostError(f"pipeline {spec.name!r}: the epoch store at {redacted(self.store.url)} does not list "
                                 f"the files of epochs {short} of group {group.group_id} (was it lost or replaced?); "
                                 "no epoch record was written")
        now = utcnow()
        for sink in spec.sinks:
            for epoch in group.epochs:
                if epoch.state not in (COMMITTED, PUBLISHED):
                    continue
                published = replace(epoch, state=PUBLISHED, published_at=epoch.published_at or now)
                written.append(records.write_epoch(tables, sink.path, dict(
                    published.as_record(), sink=sink.name, version=epoch.delta_versions.get(sink.name),
                    files=files[epoch.epoch_id])))
        return written

    def _publish_group(self, lease: Lease, group_id: int) -> Group:
        with self.store.read(self.spec.name, "publish") as tx:
            if not tx.state().holds(lease):  # checked again, under the lock, when the group is published
                tx.check_lease(lease)
            group = tx.group(group_id)
            # The files of the group's ranges, in the same read as the lease and the group.
            entries = (tx.manifest(min(e.start for e in group.epochs), max(e.end for e in group.epochs))
                       if group.epochs else [])
        self.write_epoch_records(group, entries)
        faults.maybe_fail("before_publish")
        return self.store.finish_group(lease, group_id)

    def publish(self) -> dict[str, Any]:
        """Checkpoint: publish every group this run processed, in order (their epochs become
        ``published``, their records written first), repair missing rollback records, and
        release the lease."""
        spec, store = self.spec, self.store
        with store.read(spec.name, "publish") as tx:
            state = tx.state()
            if state.lease_owner != self.owner:
                raise FencedError(f"pipeline {spec.name!r}: {self.owner!r} does not hold the lease "
                                  f"(holder: {state.lease_owner!r})")
            lease = Lease(spec.name, self.owner, state.fence)
            ids = tx.group_ids(states=[PLANNED], owner=self.owner)
        groups = [self._publish_group(lease, gid) for gid in ids]
        operations.write_rollback_records(spec, store, self._runtime())
        store.release_lease(lease)
        if spec.control.adaptive:
            from sluice import adaptive

            for g in groups:
                try:
                    adaptive.record_group(spec, store, g)
                except Exception:  # the controllers learn nothing from this group; publishing stands
                    log.exception("pipeline %s: could not record group %s for the controllers", spec.name, g.group_id)
        backlog = source_for(spec, store).backlog()
        published = [e for g in groups for e in g.epochs]
        state = store.pipeline_state(spec.name)
        recompute = any(g.plan.get("reason", "").startswith("recompute after rollback") for g in groups)
        changes = {}
        for s in spec.sinks:
            version = max((e.delta_versions.get(s.name) for e in published
                           if e.delta_versions.get(s.name) is not None), default=None)
            changes[s.name] = {"epochs": [e.epoch_id for e in published], "version": version,
                               "generation": state.generation,
                               # Every version of the table since the last acknowledged event: a
                               # change an unacknowledged event (a failed task's) reported comes again.
                               "versions": (None if version is None
                                            else [state.announced.get(s.path, -1) + 1, version])}
        return {"groups": [g.as_record() for g in groups], "group": groups[-1].as_record() if groups else None,
                "published": changes, "change": "recompute" if recompute else "publish",
                "backlog": backlog.as_dict()}

    def acknowledge(self, changes: dict[str, dict[str, Any]]) -> None:
        """The Asset events of ``changes`` (a ``publish``'s ``published``, a rollback's
        ``changes``) were emitted: later events report from their last version on. Called by the
        task after the one that emitted them, which runs only once it succeeded; events not
        acknowledged are reported again (at least once)."""
        versions = {self.spec.sink(name).path: int(c["versions"][1]) for name, c in changes.items()
                    if c.get("versions")}
        if versions:
            self.store.announce(self.spec.name, versions)

    def release(self) -> bool:
        """Give up this owner's lease after a failure, so the next run need not wait for expiry."""
        try:
            return self.store.release_lease(self.store.current_lease(self.spec.name, self.owner))
        except Exception:  # not the holder any more: nothing to release
            return False

    # -- the whole chain, for the command line and run-once jobs ----------------------------------

    def run_once(self, *, epoch_size: int | None = None, k: int | None = None, drain: bool = False,
                 extra: dict[str, Any] | None = None, first_size: int | None = None) -> list[dict[str, Any]]:
        """Plan, process, validate and publish groups until there is nothing left (``drain``) or
        once. The runtime's Spark starts only once a group is planned: a run that finds the
        pipeline busy or idle fails or returns before paying for a JVM."""
        done = []
        while True:
            planned = self.plan(epoch_size=epoch_size, k=k, extra=extra, reason=(extra or {}).get("reason", "backlog"),
                                first_size=first_size)
            if planned is None:
                break
            first_size = None  # a drain's later groups: the probe was measured
            try:
                self.process(planned.group_id)
                self.validate()
                done.append(self.publish())
            except BaseException:
                self.release()
                raise
            if not drain:
                break
        return done


def run_once(spec: PipelineSpec, store: EpochStore, spark: SparkSession | Callable[[], SparkSession] | Runtime, *,
             owner: str | None = None, epoch_size: int | None = None, k: int | None = None,
             drain: bool = False, extra: dict[str, Any] | None = None,
             first_size: int | None = None) -> list[dict[str, Any]]:
    """``PipelineRun.run_once`` with a Spark runtime (``spark``: a session, a factory of one, or
    a ``Runtime``)."""
    runtime = spark if isinstance(spark, Runtime) else Runtime.spark(spark)
    return PipelineRun(spec, store, owner or cli_owner(), runtime).run_once(epoch_size=epoch_size, k=k, drain=drain,
                                                                           extra=extra, first_size=first_size)
