"""Operator actions on a pipeline: rollback (manual, by clearing a task, by backfill) and
rebuilding a lost epoch store from the epoch records next to the tables.

A rollback (Structured Streaming §7.2) checks its preconditions first and changes nothing if
one fails; then it records its intent in the store, RESTOREs every table of the pipeline to
the version before ``to_epoch``, and rolls the epoch log back: the generation is bumped (Delta's
RESTORE does not undo txn ids, delta-io/delta#1813), later epochs become ``rolled_back`` and the
source position rewinds to ``to_epoch``'s start. With ``recompute`` their exact recorded ranges
are planned again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from sluice import faults, protocol
from sluice.errors import OperatorActionRequired, SluiceError, SourceError
from sluice.runner import write_rollback_record
from sluice.sources import FileSource
from sluice.spec import PipelineSpec
from sluice.store import EpochLog, Group, Lease, records
from sluice.store.epoch_log import RollbackPlan, utcnow

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("sluice.operations")


class RollbackRefusedError(OperatorActionRequired):
    """A rollback's preconditions do not hold; nothing was changed."""


@dataclass(frozen=True)
class TableRestore:
    path: str
    keys: tuple[str, ...]  # epoch-log keys of the writers of this table (sink, _rejected, ...)
    target: int | None  # version to RESTORE to; None: no restore needed
    latest: int | None


def tables(spec: PipelineSpec) -> dict[str, list[str]]:
    """Every Delta table the pipeline writes, with the epoch-log keys of its writers."""
    found: dict[str, list[str]] = {}
    for sink in spec.sinks:
        found.setdefault(sink.path, []).append(sink.name)
        found.setdefault(spec.quarantine_table, []).append(f"_quarantine_{sink.name}")  # before one commit
    found.setdefault(spec.quarantine_table, []).append("_quarantine")
    found.setdefault(spec.rejected_table, []).append("_rejected")
    return found


def _sluice_commits_after(spark: SparkSession, path: str, version: int, pipeline: str) -> list[int]:
    from pyspark.sql import functions as F

    from sluice.sinks.delta import history

    rows = (history(spark, path).where(F.col("version") > version)
            .select("version", "userMetadata").collect())
    found = []
    for row in rows:
        try:
            meta = json.loads(row["userMetadata"]) if row["userMetadata"] else None
        except ValueError:
            meta = None
        if isinstance(meta, dict) and meta.get("pipeline") == pipeline:
            found.append(int(row["version"]))
    return sorted(found)


def plan_restores(spec: PipelineSpec, spark: SparkSession, plan: RollbackPlan) -> list[TableRestore]:
    """Per table, the version to RESTORE to: the last one an epoch before ``to_epoch`` wrote
    (version 0, the empty table, if none did), when any epoch wrote after it."""
    from sluice.sinks.delta import history, is_delta_table

    restores = []
    for path, keys in tables(spec).items():
        if not is_delta_table(spark, path):
            continue
        latest = int(history(spark, path, 1).first()["version"])
        kept = [e.delta_versions.get(k) for e in plan.kept for k in keys]
        target = max((v for v in kept if v is not None), default=0)
        needed = bool(_sluice_commits_after(spark, path, target, spec.name))
        restores.append(TableRestore(path, tuple(keys), target if needed else None, latest))
    return restores


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


def check_preconditions(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession,
                        plan: RollbackPlan) -> list[TableRestore]:
    """Raise ``RollbackRefusedError`` listing everything that blocks the rollback: files of the
    rolled-back ranges no longer at the source, or table versions that were vacuumed."""
    problems = []
    if plan.rolled_back:
        try:
            FileSource(spec, epoch_log).check_retained(plan.rolled_back[0].start, plan.rolled_back[-1].end)
        except SourceError as exc:
            problems.append(f"the source no longer holds the data to recompute: {exc}")
    restores = plan_restores(spec, spark, plan)
    for r in restores:
        if r.target is not None:
            problem = check_version_restorable(spark, r.path, r.target)
            if problem:
                problems.append(problem)
    if problems:
        raise RollbackRefusedError(
            f"pipeline {spec.name!r}: rollback to epoch {plan.to_epoch} refused, nothing was changed:\n  - "
            + "\n  - ".join(problems))
    return restores


def rollback(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession, lease: Lease, *, to_epoch: int,
             reason: str, recompute: bool, through_epoch: int | None = None) -> dict[str, Any]:
    """Roll the pipeline back to ``to_epoch`` under ``lease`` (see the module docstring).

    With ``recompute`` the rolled-back ranges are planned again: those up to ``through_epoch``
    (all by default) as one group of this lease, the rest for later runs. Returns a report,
    with ``group_id`` of the group to run now, if any.
    """
    plan = epoch_log.rollback_plan(spec.name, to_epoch)
    shared = sharing_a_commit(plan)
    replan_later = recompute
    if shared:
        # A group commit holds several epochs in one Delta version: rolling back into its
        # middle restores the version before it and recomputes its epochs before to_epoch with
        # their recorded ranges (and, with recompute, the rest as well).
        log.info("pipeline %s: epochs %s share a Delta commit with epoch %s; they are recomputed", spec.name,
                 shared, to_epoch)
        plan = epoch_log.rollback_plan(spec.name, shared[0])
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
    from sluice.runner import fence_tables
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


def sharing_a_commit(plan: RollbackPlan) -> list[int]:
    """Kept epochs written in the same Delta commit as a rolled-back one (one commit per group)."""
    first_rolled = plan.rolled_back[0].epoch_id if plan.rolled_back else None
    if first_rolled is None:
        return []
    versions = {(k, v) for e in plan.rolled_back for k, v in e.delta_versions.items() if v is not None}
    return [e.epoch_id for e in plan.kept
            if any((k, v) in versions for k, v in e.delta_versions.items())
            or (e.rows.get("commit") and e.rows["commit"][1] >= first_rolled)]


def redo_group(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession, lease: Lease,
               group: Group) -> dict[str, Any]:
    """A cleared processing task of a past group: roll back to its first epoch and plan it and
    every later epoch again with their recorded ranges, as one group of this lease."""
    first = min(group.epoch_ids)
    reason = f"{lease.owner} re-ran group {group.group_id} (epochs {group.epoch_ids}), cleared in Airflow"
    return rollback(spec, epoch_log, spark, lease, to_epoch=first, reason=reason, recompute=True)


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


# -- rebuilding the store ----------------------------------------------------------------------

def rebuild_store(spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession, owner: str) -> dict[str, Any]:
    """Rebuild a lost store from the records, then undo anything the tables hold beyond the
    last published epoch (a group that committed but did not publish before the loss).

    All or nothing, and rerunnable: the records load in one store transaction together with a
    rollback intent that halts the pipeline; a rebuild killed before that intent is cleared is
    resumed by running it again. The lease tokens start above every token in the tables, so
    Delta does not take the next run for an older one."""
    from sluice.runner import pipeline_tables
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


# -- skipping a file ---------------------------------------------------------------------------

def skip_file(spec: PipelineSpec, epoch_log: EpochLog, path: str, *, by: str, reason: str) -> dict[str, Any]:
    """Leave a file that is gone or unreadable out of its epoch, on purpose and recorded (who,
    when, why). ``path``: as in the manifest (absolute), or relative to the landing folder.
    Failed epochs holding it get fresh attempts, so the next run (or ``sluice_recover``) runs
    them without it."""
    candidates = [str(Path(path).absolute()), str((spec.landing_dir / path).absolute())]
    known = epoch_log.known_paths(spec.name)
    match = next((c for c in candidates if c in known), candidates[0])
    entry, epochs = epoch_log.skip_file(spec.name, match, by=by, reason=reason)
    log.warning("pipeline %s: file %s (offset %s) skipped by %s: %s; epochs %s read without it", spec.name,
                entry.path, entry.position, by, reason, epochs)
    return {"pipeline": spec.name, "file": entry.path, "position": entry.position, "epochs": epochs,
            "skipped": entry.skipped.as_record() if entry.skipped else None}
