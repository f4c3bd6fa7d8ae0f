"""The operator actions on a pipeline, each in its own order:

* **rollback** (Structured Streaming §7.2): preconditions or refuse changing nothing; record the
  intent; fence every table; RESTORE each (fenced) to the version before ``to_epoch``; in one
  store transaction bump the generation, mark later epochs ``rolled_back``, rewind the source,
  optionally plan the recompute, and keep the rollback's record; write that record next to every
  table (rewritten by every publish if a crash left one out);
* **redo**: a cleared processing task of a past group rolls back to it and recomputes it and
  every later epoch;
* **backfill**: the epochs whose data arrived in a backfill run's interval are recomputed;
* **rebuild**: a lost store from the epoch records next to the tables;
* **skip a file** that is gone or unreadable, recorded;
* **withdraw** a recorded rollback intent whose restores never started.

Those that change a table record their intent first, so the next run finishes or refuses what a
crash interrupted; every long one keeps its lease alive.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice import faults
from sluice.errors import OperatorActionRequired, ProtocolError, SluiceError, SourceError, StoreLostError
from sluice.model import (
    COMMITTED,
    PLANNED,
    PUBLISHED,
    ROLLED_BACK,
    UNFINISHED,
    Epoch,
    FileSkip,
    Group,
    Lease,
    ManifestEntry,
    RollbackIntent,
    RollbackPlan,
)
from sluice.protocol import planning, rules
from sluice.protocol.group import fence_tables, restore_conflict
from sluice.protocol.leases import acquire_lease
from sluice.protocol.tables import pipeline_tables
from sluice.sources import source_for
from sluice.spec import PipelineSpec, SourceSpec
from sluice.store import EpochStore, records
from sluice.store.epoch_store import REBUILD_MARGIN, redacted, token_base, utcnow

if TYPE_CHECKING:
    from sluice.delta import Tables
    from sluice.protocol.runtime import Runtime

log = logging.getLogger("sluice.protocol.operations")


class RollbackRefusedError(OperatorActionRequired):
    """A rollback's preconditions do not hold; nothing was changed."""


# -- the rollback's plan ----------------------------------------------------------------------------


def rollback_plan(store: EpochStore, pipeline: str, to_epoch: int) -> RollbackPlan:
    """Which epochs a rollback to ``to_epoch`` would roll back and keep; raises
    ``ProtocolError`` when it cannot be done (no such epoch, unfinished epochs before it)."""
    with store.read(pipeline, "rollback_plan") as tx:
        gen = tx.state().generation
        epochs = [e for e in tx.epochs(gen) if e.state != ROLLED_BACK]
    end = epochs[-1].epoch_id + 1 if epochs else 0
    if not 0 <= to_epoch <= end:
        raise ProtocolError(f"pipeline {pipeline!r}: cannot roll back to epoch {to_epoch}: generation {gen} "
                            f"holds epochs 0..{end - 1}")
    kept = tuple(e for e in epochs if e.epoch_id < to_epoch)
    unfinished = [e.epoch_id for e in kept if e.state in UNFINISHED]
    if unfinished:
        raise ProtocolError(f"pipeline {pipeline!r}: epochs {unfinished} before epoch {to_epoch} are not "
                            "written yet (planned or failed); recover them first, or roll back to "
                            f"epoch {unfinished[0]}")
    return RollbackPlan(pipeline, to_epoch, gen, tuple(e for e in epochs if e.epoch_id >= to_epoch), kept)


def sharing_a_commit(plan: RollbackPlan) -> list[int]:
    """Kept epochs written in the same Delta commit as a rolled-back one (one commit per group)."""
    first_rolled = plan.rolled_back[0].epoch_id if plan.rolled_back else None
    if first_rolled is None:
        return []
    versions = {(k, v) for e in plan.rolled_back for k, v in e.delta_versions.items() if v is not None}
    return [e.epoch_id for e in plan.kept
            if any((k, v) in versions for k, v in e.delta_versions.items())
            or (e.commit_span and e.commit_span[1] >= first_rolled)]


def group_rollback_plan(store: EpochStore, pipeline: str, to_epoch: int) -> tuple[RollbackPlan, list[int]]:
    """The plan of a rollback to ``to_epoch``, and the kept epochs that share a Delta commit with
    it. A group commit holds several epochs in one Delta version: rolling back into its middle
    restores the version before it and recomputes its epochs before ``to_epoch`` with their
    recorded ranges (and, with recompute, the rest as well); the plan then starts at the first."""
    plan = rollback_plan(store, pipeline, to_epoch)
    shared = sharing_a_commit(plan)
    return (rollback_plan(store, pipeline, shared[0]) if shared else plan), shared


def shared_commit_note(shared: list[int], to_epoch: int) -> str:
    return (f"epochs {shared} share a Delta commit with epoch {to_epoch}: the tables go back to before epoch "
            f"{shared[0]}, and those epochs are recomputed with their recorded ranges")


@dataclass(frozen=True)
class TableRestore:
    path: str
    keys: tuple[str, ...]  # the writers of this table (sink, _rejected, ...)
    target: int | None  # version to RESTORE to; None: no restore needed
    latest: int | None


def restore_target(plan: RollbackPlan, keys: Iterable[str]) -> int:
    """The version a table written through ``keys`` goes back to: the last one an epoch before
    ``to_epoch`` wrote (version 0, the empty table, if none did)."""
    return max((v for e in plan.kept for k in keys if (v := e.delta_versions.get(k)) is not None), default=0)


def plan_restores(spec: PipelineSpec, runtime: Runtime, plan: RollbackPlan) -> list[TableRestore]:
    """Per table, the version to RESTORE to: the last one an epoch before ``to_epoch`` wrote
    (version 0, the empty table, if none did), when this pipeline committed after it."""
    tables = runtime.tables
    restores = []
    for path, keys in spec.table_writers().items():
        latest = tables.version(path)
        if latest is None:
            continue
        target = restore_target(plan, keys)
        needed = False
        for commit in tables.lineage(path):  # newest first
            if commit.version <= target or (commit.pipeline == spec.name and not commit.fence):
                needed = commit.version > target
                break
        restores.append(TableRestore(path, tuple(keys), target if needed else None, latest))
    return restores


def source_problems(spec: PipelineSpec, store: EpochStore, plan: RollbackPlan) -> list[str]:
    """Why the source can no longer give the rolled-back ranges again (files gone, Kafka
    retention), for a recompute; empty when it can."""
    if not plan.rolled_back:
        return []
    try:
        source_for(spec, store).check_retained(plan.rolled_back[0].start, plan.rolled_back[-1].end)
    except SourceError as exc:
        return [f"the source no longer holds the data to recompute: {exc}"]
    return []


def check_new_to_store(spec: PipelineSpec, store: EpochStore, tables: Tables) -> None:
    """A pipeline of which the store knows no epoch must not find its tables made or written by
    an earlier run: the store was lost or replaced. A run now would start again from offset 0 and
    write those records again, beside a run of the lost store that may still be going; a
    rollback would restore away what a rebuild brings back, and leave a history the rebuild
    cannot load. Raise ``StoreLostError``, changing nothing, naming the way out (``sluice
    rebuild-store``: it fences the tables above every token and restores what no record vouches
    for)."""
    for table in pipeline_tables(spec):
        if not tables.exists(table.path):
            continue
        written = next((c for c in rules.current_lineage(tables.lineage(table.path)) if c.pipeline == spec.name),
                       None)
        if written is not None:
            raise StoreLostError(
                f"pipeline {spec.name!r} is new to the epoch store at {redacted(store.url)}, but its table "
                f"{table.path} holds its commits (version {written.version}, lease token {written.token}): the "
                f"store was lost or replaced. Nothing was changed. Rebuild the store from the tables' epoch "
                f"records: `make store-rebuild PIPELINE={spec.name}` (sluice rebuild-store --pipeline {spec.name})")


def check_preconditions(spec: PipelineSpec, store: EpochStore, runtime: Runtime,
                        plan: RollbackPlan) -> list[TableRestore]:
    """Raise ``RollbackRefusedError`` listing everything that blocks the rollback: files of the
    rolled-back ranges no longer at the source, table versions that were vacuumed, or a table
    another pipeline wrote to since (its rows would be restored away)."""
    problems = source_problems(spec, store, plan)
    restores = plan_restores(spec, runtime, plan)
    for r in restores:
        if r.target is not None:
            problems += [p for p in (runtime.tables.restorable(r.path, r.target),
                                     restore_conflict(runtime, r.path, spec.name, r.target)) if p]
    if problems:
        raise RollbackRefusedError(
            f"pipeline {spec.name!r}: rollback to epoch {plan.to_epoch} refused, nothing was changed:\n  - "
            + "\n  - ".join(problems))
    return restores


# -- the rollback ------------------------------------------------------------------------------------


def begin_rollback(store: EpochStore, lease: Lease, intent: RollbackIntent) -> None:
    """Record a rollback before any table is restored: until it is finished no group is
    planned, so a crash half way cannot let new epochs land on restored tables."""
    with store.transaction(lease.pipeline, step="begin_rollback") as tx:
        state = tx.check_lease(lease)
        if state.intent is not None and not state.intent.continues(intent):
            raise ProtocolError(f"pipeline {lease.pipeline!r}: {state.intent.describe()}")
        started = state.intent.started_at if state.intent is not None else None
        tx.update_state(intent=RollbackIntent(**{**vars(intent), "started_at": started or utcnow().isoformat() + "Z"}))


def cancel_rollback(store: EpochStore, lease: Lease) -> None:
    """Withdraw a recorded rollback intent whose restores never started."""
    with store.transaction(lease.pipeline, step="cancel_rollback") as tx:
        tx.check_lease(lease)
        tx.update_state(intent=None)


def finish_rollback(store: EpochStore, lease: Lease, plan: RollbackPlan, *, replan: bool, reason: str,
                    through_epoch: int | None = None, replan_later: bool = True,
                    record: dict[str, Any] | None = None) -> tuple[int, Group | None]:
    """Roll the epoch log back, in one store transaction: bump the generation, carry epochs
    before ``to_epoch`` into it, mark the rest ``rolled_back``; with ``replan``, plan their exact
    ranges again as one group of this lease (up to ``through_epoch``; the later ones as a group
    for a later run, unless not ``replan_later``: then the source position rewinds to them); keep
    the rollback's ``record``. Returns the new generation and that group."""
    with store.transaction(lease.pipeline, step="finish_rollback") as tx:
        state = tx.check_lease(lease)
        if state.generation != plan.generation:
            raise ProtocolError(f"pipeline {lease.pipeline!r}: generation changed from {plan.generation} to "
                                f"{state.generation} during the rollback")
        now = tx.now()
        new_gen = plan.generation + 1
        group_id = tx.next_group_id()
        # Committed but unpublished epochs before to_epoch are published with the recomputed ones.
        regroup = {e.epoch_id for e in plan.kept if e.state == COMMITTED} if replan else set()
        for e in plan.kept:
            carried = tx.epoch(e.epoch_id, plan.generation)
            assert carried is not None
            tx.insert_epoch(Epoch(**{**vars(carried), "generation": new_gen,
                                     "group_id": group_id if e.epoch_id in regroup else carried.group_id,
                                     "written_generation": carried.written_generation}))
        for e in plan.rolled_back:
            current = tx.epoch(e.epoch_id, plan.generation)
            assert current is not None
            rules.check_transition(e.epoch_id, current.state, ROLLED_BACK)
            tx.update_epoch(e.epoch_id, plan.generation, state=ROLLED_BACK, attempt_open=False,
                            error=f"rolled back to epoch {plan.to_epoch} (generation {new_gen}): {reason}"[:4000])
        for gid, _, last in tx.group_spans([PLANNED]):
            if last >= plan.to_epoch:
                tx.update_group(gid, state=ROLLED_BACK, finished_at=now)
        tx.update_state(generation=new_gen, intent=None)
        group = None
        now_ids = [e.epoch_id for e in plan.rolled_back if through_epoch is None or e.epoch_id <= through_epoch]
        later = [e for e in plan.rolled_back if e.epoch_id not in now_ids]
        why = f"recompute after rollback to epoch {plan.to_epoch}: {reason}"
        if replan and later and replan_later:  # planned again, for a later run (the next backfill run) to take
            tx.insert_group(group_id + 1, owner="rollback", fence=lease.fence, first_epoch=later[0].epoch_id,
                            last_epoch=later[-1].epoch_id, state=PLANNED, plan={"reason": why})
            for e in later:
                tx.insert_epoch(Epoch(lease.pipeline, e.epoch_id, new_gen, group_id + 1, e.start, e.end, PLANNED,
                                      planned_at=now))
        if replan and (now_ids or regroup):
            for e in plan.rolled_back[:len(now_ids)]:
                tx.insert_epoch(Epoch(lease.pipeline, e.epoch_id, new_gen, group_id, e.start, e.end, PLANNED,
                                      planned_at=now))
            tx.insert_group(group_id, owner=lease.owner, fence=lease.fence,
                            first_epoch=min(regroup, default=plan.to_epoch),
                            last_epoch=max([plan.to_epoch - 1, *now_ids]), state=PLANNED,
                            plan={"reason": why, "epoch_size": None, "k": len(now_ids) + len(regroup)})
            tx.flush()
            group = tx.group(group_id, reprocessing=True)
        if record is not None:
            tx.add_rollback(new_gen, dict(record, generation=new_gen))
        return new_gen, group


def rollback(spec: PipelineSpec, store: EpochStore, runtime: Runtime, lease: Lease, *, to_epoch: int,
             reason: str, recompute: bool, through_epoch: int | None = None) -> dict[str, Any]:
    """Roll the pipeline back to ``to_epoch`` under ``lease``: check the preconditions and change
    nothing if one fails; record the intent in the store; record this lease's token in every
    table, RESTORE each (fenced) to the version before ``to_epoch``; then roll the epoch log back:
    the generation is bumped (Delta's RESTORE does not undo txn ids, delta-io/delta#1813), later
    epochs become ``rolled_back`` and the source position rewinds to ``to_epoch``'s start.

    With ``recompute`` the rolled-back ranges are planned again: those up to ``through_epoch``
    (all by default) as one group of this lease, the rest for later runs. Returns a report,
    with ``group_id`` of the group to run now, if any. The lease is kept alive throughout.
    """
    with runtime.keeper(store, lease, spec.control.lease_ttl_s):
        return _rollback(spec, store, runtime, lease, to_epoch=to_epoch, reason=reason, recompute=recompute,
                         through_epoch=through_epoch)


def _rollback(spec: PipelineSpec, store: EpochStore, runtime: Runtime, lease: Lease, *, to_epoch: int,
              reason: str, recompute: bool, through_epoch: int | None) -> dict[str, Any]:
    if not store.knows(spec.name):
        check_new_to_store(spec, store, runtime.tables)
    plan, shared = group_rollback_plan(store, spec.name, to_epoch)
    replan_later = recompute
    if shared:
        log.info("pipeline %s: %s", spec.name, shared_commit_note(shared, to_epoch))
        if not recompute:
            recompute, through_epoch = True, to_epoch - 1
    try:
        restores = check_preconditions(spec, store, runtime, plan)
    except RollbackRefusedError:
        # An intent recorded early (a backfill's plan step cannot check table versions) whose
        # restores never started is withdrawn: the refusal changes nothing, as it says.
        pending = store.pending_rollback(spec.name)
        if pending is not None and pending.to_epoch in (plan.to_epoch, to_epoch) and not pending.restoring:
            cancel_rollback(store, lease)
        raise
    begin_rollback(store, lease, RollbackIntent(plan.to_epoch, reason, lease.owner, requested_to_epoch=to_epoch,
                                                through_epoch=through_epoch, generation=plan.generation,
                                                restoring=True))
    # No earlier run may commit to a table once this one starts restoring it; what each table
    # needs is read again after the fence: a run whose lease this one took may have committed
    # since the preconditions were checked.
    fence_tables(spec, runtime, plan.generation, lease.fence)
    restores = plan_restores(spec, runtime, plan)
    tables = {t.path: t for t in pipeline_tables(spec)}
    restored_as: dict[str, int | None] = {}
    for r in restores:
        if r.target is not None:
            table = tables[r.path]
            metrics = table.restore(runtime.tables, r.target, generation=plan.generation, token=lease.fence)
            restored_as[r.path] = getattr(metrics, "version", None)
            log.info("pipeline %s: restored %s from version %s to %s: %s", spec.name, r.path, r.latest, r.target,
                     getattr(metrics, "metrics", metrics))
            faults.maybe_fail("mid_rollback", plan.to_epoch)
    announced = store.pipeline_state(spec.name).announced
    record = {"pipeline": spec.name, "from_generation": plan.generation,
              "to_epoch": to_epoch, "restored_to_epoch": plan.to_epoch,
              "reason": reason, "by": lease.owner, "at": utcnow().isoformat() + "Z",
              "rolled_back": [[e.epoch_id, e.start, e.end, e.state] for e in plan.rolled_back],
              "restored": {r.path: r.target for r in restores if r.target is not None},
              "restore_versions": {path: v for path, v in restored_as.items() if v is not None}}
    new_gen, group = finish_rollback(store, lease, plan, replan=recompute, reason=reason,
                                     through_epoch=through_epoch, replan_later=replan_later, record=record)
    record["generation"] = new_gen
    write_rollback_records(spec, store, runtime)
    log.info("pipeline %s: rolled back to epoch %s (generation %s -> %s): %s", spec.name, to_epoch,
             plan.generation, new_gen, json.dumps(record["restored"]))
    # What the Asset events of the rollback say per sink: every version since the last
    # acknowledged event, through its RESTORE.
    changes = {s.name: {"versions": [announced.get(s.path, -1) + 1, restored_as[s.path]],
                        "restored_to_version": record["restored"][s.path]}
               for s in spec.sinks if restored_as.get(s.path) is not None}
    return dict(record, group_id=group.group_id if group else None, changes=changes)


def write_rollback_records(spec: PipelineSpec, store: EpochStore, runtime: Runtime) -> None:
    """Note every finished rollback next to each sink (idempotent): a store rebuilt from the
    epoch records must not revive the epochs a rollback undid. Called after each rollback and
    by every publish, so a crash between the store's rollback and these files is repaired."""
    finished = store.rollbacks(spec.name)
    if not finished:
        return
    for sink in spec.sinks:
        present = {name for name, _ in runtime.tables.list_files(sink.path, records.folder(records.ROLLBACK))}
        for record in finished:
            if records.rollback_name(record["generation"]) not in present:
                records.write_rollback(runtime.tables, sink.path, record)


# -- redo: a cleared processing task of a past group ---------------------------------------------------


def redo_group(spec: PipelineSpec, store: EpochStore, runtime: Runtime, lease: Lease, group: Group) -> dict[str, Any]:
    """A cleared processing task of a past group: roll back to its first epoch and plan it and
    every later epoch again with their recorded ranges, as one group of this lease."""
    first = min(group.epoch_ids)
    reason = f"{lease.owner} re-ran group {group.group_id} (epochs {group.epoch_ids}), cleared in Airflow"
    return dict(rollback(spec, store, runtime, lease, to_epoch=first, reason=reason, recompute=True), redo=True)


# -- backfill: recompute the epochs whose data arrived in a run's interval ---------------------------


def epochs_arrived(spec: PipelineSpec, store: EpochStore, start: float, end: float) -> list[int]:
    """Epochs of the current generation whose data arrived in ``[start, end)`` (epoch seconds):
    an epoch belongs to the interval in which its last file landed, so to exactly one."""
    found = []
    for e in store.epochs(spec.name):
        if e.state == ROLLED_BACK:
            continue
        files = store.manifest(spec.name, e.start, e.end)
        if files and start <= max(f.mtime for f in files) < end:
            found.append(e.epoch_id)
    return found


def plan_backfill(spec: PipelineSpec, store: EpochStore, lease: Lease, epoch_size: int | None,
                  k: int | None, interval: tuple[float, float]) -> tuple[Group | None, dict[str, Any] | None]:
    """A backfill run's share: data that landed before the interval's end and was never
    planned is planned now (processed for the first time); otherwise the epochs whose data
    arrived in the interval are recomputed: the rollback is recorded here (its intent) and
    performed by the run's processing step. Returns the group, or the recorded rollback."""
    new = _plan_backfill_new_data(spec, store, lease, epoch_size, k, interval[1])
    if new is not None:
        return new, None
    ids = epochs_arrived(spec, store, *interval)
    if not ids:
        log.info("pipeline %s: no epoch's data arrived in %s", spec.name, interval)
        return None, None
    states = {e.epoch_id: e.state for e in store.epochs(spec.name)}
    if all(states[i] in rules.UNPUBLISHED for i in ids):  # planned again by this backfill's first run
        group = planning.plan_group(store, lease, epoch_size=epoch_size or spec.control.epoch_files,
                                    k=k or spec.control.group_epochs, only_leftovers=True, through_epoch=ids[-1],
                                    plan={"reason": f"backfill: epochs {ids} arrived in {interval}"})
        return group, None
    reason = f"backfill: recompute epochs {ids[0]}..{ids[-1]}, whose data arrived in {list(interval)}"
    # Before the intent is recorded: a file gone from the source refuses the backfill and
    # leaves the pipeline as it was (a recorded intent would halt it until completed).
    epochs = {e.epoch_id: e for e in store.epochs(spec.name)}
    source_for(spec, store).check_retained(epochs[ids[0]].start, epochs[ids[-1]].end)
    begin_rollback(store, lease, RollbackIntent(ids[0], reason, lease.owner, through_epoch=ids[-1]))
    return None, {"to_epoch": ids[0], "through_epoch": ids[-1], "reason": reason}


def _plan_backfill_new_data(spec: PipelineSpec, store: EpochStore, lease: Lease, epoch_size: int | None,
                            k: int | None, before: float) -> Group | None:
    """New epochs over never-planned files that landed before ``before`` (epoch seconds)."""
    source_for(spec, store).discover()
    unplanned = store.manifest(spec.name, store.next_offset(spec.name))
    landed = [f.position for f in unplanned if f.mtime < before]
    if not landed:
        return None
    size = epoch_size or spec.control.epoch_files
    # All of it in this run: a backfill's last run must leave none of its range unprocessed.
    # k as large as one epoch per file: the byte bound may split the files into more epochs.
    return planning.plan_group(store, lease, epoch_size=size, k=k or max(spec.control.group_epochs, len(landed)),
                               until_offset=max(landed) + 1, max_bytes=spec.epoch_size_bound,
                               plan={"reason": f"backfill: {len(landed)} files that landed before "
                                               f"{_iso(before)} were never processed"})


def _iso(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- rebuild: a lost store, from the epoch records next to the tables ----------------------------------


def rebuild_store(spec: PipelineSpec, store: EpochStore, runtime: Runtime, owner: str) -> dict[str, Any]:
    """Rebuild a lost store from the records, then undo anything the tables hold beyond the
    last published epoch (a group that committed but did not publish before the loss).

    All or nothing, and rerunnable: the records load in one store transaction together with a
    rollback intent that halts the pipeline; a rebuild killed before that intent is cleared is
    resumed by running it again. The lease tokens start above every token in the tables, so
    Delta does not take the next run for an older one."""
    pending = store.pending_rollback(spec.name)
    resuming = bool(pending and pending.rebuild)
    if store.knows(spec.name) and not resuming:
        raise SluiceError(f"pipeline {spec.name!r}: the epoch store at {redacted(store.url)} already holds this "
                          "pipeline; rebuild only into an empty store")
    tables = runtime.tables
    try:
        epochs, rollbacks = records.read(tables, [s.path for s in spec.sinks])
    except records.RecordError as exc:
        raise SluiceError(f"pipeline {spec.name!r}: {exc}") from None
    live = records.live(epochs, rollbacks)
    rules.check_contiguous((r.epoch_id, r.start, r.end) for r in live)
    generation = max([r.generation for r in epochs] + [r.generation for r in rollbacks], default=0)
    files = []
    for r in live:
        if len(r.files) != r.end - r.start:
            raise SluiceError(f"pipeline {spec.name!r}: the record {r.path} of epoch {r.epoch_id} lists "
                              f"{len(r.files)} files for offsets [{r.start}, {r.end})")
        files += [(r.start + i, path, size, mtime) for i, (path, size, mtime) in enumerate(r.files)]
    # A group's epochs share one commit per table, but their records are files of their own: a
    # run stopped while writing them can leave records of the group's first epochs only (sim seed
    # 10600179: epoch 0's record, not epoch 1's, and one commit holding both). Adopting the
    # recorded ones and undoing the rest cannot be done by a RESTORE, which takes whole commits
    # (the rest was planned and written again: 23 extra counts). The epochs from the start of
    # such a commit are undone and recomputed instead.
    whole = _whole_commits_before(spec, tables, len(live))
    if not resuming:
        # Above every token in the tables and every token the lost store could have issued
        # (tokens follow the clock, ``epoch_store.REBUILD_MARGIN``): its runs still going are refused.
        token = max((c.token for t in pipeline_tables(spec) if tables.exists(t.path)
                     for c in tables.lineage(t.path)), default=0)
        with store.read(spec.name, "clock") as tx:
            token = max(token, token_base(tx.now())) + REBUILD_MARGIN
        load_records(store, spec.name, generation, files, [r.fields for r in live], rollbacks, fence=token,
                      intent=RollbackIntent(whole, "store rebuild in progress: run the rebuild again to finish it",
                                            owner, rebuild=True))
    # The epochs the store holds: on a resume, those it was loaded with. The records read now may
    # list more: a run of the lost store that committed after the first attempt read them and
    # before its fence (sim seed 95000919: the rebuild asked to roll back to an epoch the store
    # never held, on every rerun). Such a commit is an orphan to undo, not an epoch to adopt.
    loaded = pending.to_epoch if pending is not None and resuming else whole
    # A run killed while it wrote its epochs' records (one per sink, before the publish) left
    # them next to some sinks only; the store that would have had it write them again is lost.
    # The epochs the store now holds get their record next to every sink (sim seed 97002586).
    have = {Path(r.path) for r in epochs}
    for r in live[:loaded]:
        for sink in spec.sinks:
            if records.epoch_path(sink.path, r.epoch_id, r.generation) not in have:
                records.write_epoch(tables, sink.path, dict(
                    r.fields, sink=sink.name, version=(r.fields.get("delta_versions") or {}).get(sink.name)))
    report: dict[str, Any] = {"pipeline": spec.name, "generation": generation, "epochs": loaded,
                              "files": len(files), "rolled_back_orphans": None, "resumed": resuming}
    lease = acquire_lease(store, spec.name, owner, ttl_s=spec.control.lease_ttl_s)
    try:
        # Every table gets this lease's token first (above every token in them): a run of the
        # lost store still going can no longer commit, and the check below sees all it wrote.
        fence_tables(spec, runtime, generation, lease.fence)
        plan = rollback_plan(store, spec.name, loaded)
        if any(r.target is not None for r in plan_restores(spec, runtime, plan)):
            faults.maybe_fail("mid_rebuild")
            report["rolled_back_orphans"] = rollback(
                spec, store, runtime, lease, to_epoch=loaded, recompute=False,
                reason="store rebuilt: the tables held epochs after the last published one")
        else:
            cancel_rollback(store, lease)
    finally:
        store.release_lease(lease)
    report["generation"] = store.generation(spec.name)
    return report


def _whole_commits_before(spec: PipelineSpec, tables: Any, epoch_id: int) -> int:
    """The largest epoch id ``<= epoch_id`` that no commit of the pipeline's tables straddles
    (one holding epochs both before it and from it on)."""
    commits = [c for t in pipeline_tables(spec) if tables.exists(t.path)
               for c in rules.current_lineage(tables.lineage(t.path)) if c.pipeline == spec.name and c.epochs]
    start, moved = epoch_id, True
    while moved:
        straddling = [min(c.epochs) for c in commits if min(c.epochs) < start <= max(c.epochs)]
        moved = bool(straddling)
        start = min(straddling, default=start)
    return start


def load_records(store: EpochStore, pipeline: str, generation: int, files: list[tuple[int, str, int, float]],
                  epochs: list[dict[str, Any]], rollbacks: list[records.RollbackRecord], *, fence: int,
                  intent: RollbackIntent) -> None:
    """The manifest, the epochs (all published, in ``generation``), their groups and the
    rollbacks' records, in one transaction, with ``intent`` halting the pipeline until the
    rebuild clears it; ``fence``: the last lease token the tables hold."""
    from sluice.model import parse_iso

    with store.transaction(pipeline, step="load_records") as tx:
        now = tx.now()
        tx.state(lock=True)
        if tx.group_ids():
            raise SluiceError(f"pipeline {pipeline!r}: a run planned epochs in the empty store while it was being "
                              "rebuilt; empty the store again and run the rebuild again")
        tx.forget_files()  # registered by a run the empty store refused: the records' manifest replaces it
        tx.forget_rollbacks()  # the records next to the sinks are the whole history; a copy here would clash
        tx.update_state(generation=generation, fence=fence, rebuilt_at=now,
                        intent=RollbackIntent(**{**vars(intent), "started_at": now.isoformat() + "Z"}))
        tx.add_files(files)
        groups: dict[int, list[int]] = {}
        for e in epochs:
            groups.setdefault(e["group_id"], []).append(e["epoch_id"])
            written = e.get("written_generation", e.get("generation", generation))
            tx.insert_epoch(Epoch(
                pipeline, e["epoch_id"], generation, e["group_id"], e["start"], e["end"], PUBLISHED,
                attempts=e.get("attempts", 1), delta_versions=e.get("delta_versions") or {},
                rows=e.get("rows") or {}, timings=e.get("timings") or {}, validation=e.get("validation"),
                planned_at=parse_iso(e.get("planned_at")) or now, committed_at=parse_iso(e.get("committed_at")),
                published_at=parse_iso(e.get("published_at")),
                written_generation=None if written == generation else written))
        for group_id, ids in groups.items():
            tx.insert_group(group_id, owner="rebuilt", fence=0, first_epoch=min(ids), last_epoch=max(ids),
                            state="published", plan={"reason": "rebuilt from epoch records"}, finished=True)
        for generation_of, record in {r.generation: r for r in rollbacks}.items():  # one copy per sink
            tx.add_rollback(generation_of, dict(record.fields, generation=generation_of))


# -- skip a file that is gone or unreadable; withdraw an intent -------------------------------------------


def skip_file(spec: PipelineSpec, store: EpochStore, path: str, *, by: str, reason: str) -> dict[str, Any]:
    """Leave a file that is gone or unreadable out of its epoch, on purpose and recorded (who,
    when, why). ``path``: as in the manifest (absolute), or relative to the landing folder.
    Failed epochs holding it, and the failed epochs of their groups (one commit per group),
    get fresh failure and crash counts, so the next run (or ``sluice_recover``) runs them
    without it."""
    if not reason.strip():
        raise ProtocolError(f"pipeline {spec.name!r}: skipping {path} needs a reason (it is recorded)")
    if not isinstance(spec.source, SourceSpec):  # a Kafka chunk or a Delta version: its kafka:// or delta:// path
        candidates = [path]
    else:
        candidates = [str(Path(path).absolute()), str((spec.landing_dir / path).absolute())]
    known = {p for p, _, _ in store.known_files(spec.name)}
    match = next((c for c in candidates if c in known), candidates[0])
    entry, ids = skip_entry(store, spec.name, match, by=by, reason=reason)
    # a skip changes what is read from now on, not what was written: rows of the file that a
    # committed or published epoch holds stay in the tables until those epochs are rolled back
    written = [e.epoch_id for e in store.epochs(spec.name) if e.epoch_id in ids and e.state in (COMMITTED, PUBLISHED)]
    note = (f"epochs {written} were written with it: its rows stay in the tables until they are rolled back "
            f"(sluice rollback --pipeline {spec.name} --to-epoch {written[0]} --reason ...), whose rerun reads "
            "without it"
            if written else f"epochs {ids} read without it")
    log.warning("pipeline %s: file %s (offset %s) skipped by %s: %s; %s", spec.name, entry.path, entry.position, by,
                reason, note)
    return {"pipeline": spec.name, "file": entry.path, "position": entry.position, "epochs": ids,
            "written": written, "note": note, "skipped": entry.skipped.as_record() if entry.skipped else None}


def skip_entry(store: EpochStore, pipeline: str, path: str, *, by: str, reason: str) -> tuple[ManifestEntry, list[int]]:
    """``skip_file`` of a manifest path, in one store transaction: the skip recorded, the
    failed epochs holding it (and the failed epochs of their groups) given fresh failure and
    crash counts. Returns the entry and the epochs of the current generation that hold it."""
    if not reason.strip():
        raise ProtocolError(f"pipeline {pipeline!r}: skipping {path} needs a reason (it is recorded)")
    with store.transaction(pipeline, step="skip_file") as tx:
        entry = tx.entry(path)
        if entry is None:
            raise ProtocolError(
                f"pipeline {pipeline!r}: {path} is not in the source manifest (never discovered); a file "
                "that was never discovered needs no skip: remove it from the landing folder")
        tx.skip(path, FileSkip(utcnow(), by, reason))
        gen = tx.state().generation
        epochs = tx.epochs(gen)
        holders = [e for e in epochs if e.state != ROLLED_BACK and e.start <= entry.position < e.end]
        groups = {e.group_id for e in holders if e.state in UNFINISHED}
        for e in epochs:
            if e.group_id in groups and e.state in UNFINISHED:
                tx.update_epoch(e.epoch_id, gen, failures=0, crashes=0, attempt_open=False)
        tx.flush()
        skipped = tx.entry(path)
    assert skipped is not None
    return skipped, [e.epoch_id for e in holders]


def withdraw_rollback(spec: PipelineSpec, store: EpochStore, lease: Lease) -> dict[str, Any] | None:
    """Withdraw a recorded rollback intent (a backfill's whose processing step never ran)
    whose restores never started: the pipeline runs on as if it had not been asked. One whose
    restores may have started can only be finished (trigger sluice_rollback again)."""
    with store.transaction(spec.name, step="withdraw_rollback") as tx:
        state = tx.check_lease(lease)
        intent = state.intent
        if intent is None:
            return None
        if intent.restoring or intent.rebuild:
            raise OperatorActionRequired(f"pipeline {spec.name!r}: {intent.describe()} (its restores may have "
                                         "started: it cannot be withdrawn, only finished)")
        tx.update_state(intent=None)
    log.warning("pipeline %s: withdrew the recorded rollback to epoch %s (%s)", spec.name, intent.asked,
                intent.reason)
    return intent.as_record()
