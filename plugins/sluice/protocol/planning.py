"""Steps 1 and 2 of a group in the store: reconcile (a dead run's unpublished epochs become the
next group, with their recorded ranges) and plan (write the group's new epoch ranges ahead of any
read), each in one store transaction under the run's lease."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.errors import ProtocolError
from sluice.model import FAILED, PLANNED, UNPUBLISHED, Epoch, Group, Lease
from sluice.protocol import rules
from sluice.spec import PipelineSpec
from sluice.store import EpochStore


def plan_group(store: EpochStore, lease: Lease, *, epoch_size: int, k: int, plan: dict[str, Any] | None = None,
               only_leftovers: bool = False, through_epoch: int | None = None, until_offset: int | None = None,
               fresh_attempts: bool = False, max_bytes: int | None = None,
               first_size: int | None = None) -> Group | None:
    """Reconcile, then plan (write-ahead) the next group of the pipeline.

    Epochs a dead run left ``planned``, ``failed`` or ``committed`` (unpublished) form the group
    first, with their recorded ranges. Otherwise up to ``k`` new epochs of ``epoch_size`` offsets
    are appended from the next unplanned offset to the end of the manifest, in one transaction.
    Returns ``None`` when there is nothing to do. ``only_leftovers`` plans nothing new (recovery);
    ``through_epoch`` takes leftovers only up to that epoch (a backfill run's share);
    ``until_offset`` plans new epochs only below that offset (a backfill run's data);
    ``fresh_attempts`` resets the leftovers' failure and crash counts and a failed epoch's
    validation results (an operator's recovery);
    ``max_bytes`` bounds each new epoch in bytes too (files skipped on purpose count 0);
    ``first_size`` makes the first new epoch that many offsets (a probe of one larger epoch).
    """
    with store.transaction(lease.pipeline, step="plan_group") as tx:
        state = tx.check_lease(lease)
        if state.intent is not None:
            raise ProtocolError(f"pipeline {lease.pipeline!r}: {state.intent.describe()}")
        gen = state.generation
        # Only the unpublished epochs and the last one are read: epochs are never pruned, and this
        # runs in the store's write transaction of every group (the whole generation, with the
        # rule applied per epoch, took 1.6 s at 3,000 epochs and 5 minutes at 30,000).
        unpublished = tx.epochs(gen, states=sorted(UNPUBLISHED))
        again = set(rules.epochs_to_reprocess([(e.epoch_id, e.state) for e in unpublished]))
        leftover = [e for e in unpublished if e.epoch_id in again]
        if through_epoch is not None:
            leftover = [e for e in leftover if e.epoch_id <= through_epoch]
        group_id = tx.next_group_id()
        record = dict(plan or {}, epoch_size=epoch_size, k=k, **({"first_size": first_size} if first_size else {}))
        now = tx.now()
        if leftover:
            # Re-run the dead run's epochs with their recorded ranges, as a new group.
            open_groups = set(tx.group_ids(states=[PLANNED]))
            for e in leftover:
                changes: dict[str, Any] = {"group_id": group_id}
                if fresh_attempts:  # the operator's word: count afresh, and a failed gate is retried
                    changes.update(failures=0, crashes=0, attempt_open=False,
                                   validation=None if e.state == FAILED else e.validation)
                tx.update_epoch(e.epoch_id, gen, **changes)
                if e.group_id in open_groups:
                    tx.update_group(e.group_id, state=FAILED, finished_at=now)
            ids = [e.epoch_id for e in leftover]
            record["reason"] = f"reprocess epochs {ids} left unfinished by a previous run"
            tx.insert_group(group_id, owner=lease.owner, fence=lease.fence, first_epoch=ids[0], last_epoch=ids[-1],
                            state=PLANNED, plan=record)
            tx.flush()
            return tx.group(group_id, reprocessing=True)
        if only_leftovers:
            return None
        start = tx.next_offset(gen)
        end = tx.manifest_end()
        end = end if until_offset is None else min(end, until_offset)
        sizes = tx.sizes(start, end) if max_bytes is not None else None
        ranges = rules.plan_ranges(start, end, epoch_size, k, sizes, max_bytes, first_size)
        if not ranges:
            return None
        next_id = max((e.epoch_id for e in tx.epochs(gen, last=1)), default=-1) + 1
        for i, rng in enumerate(ranges):
            tx.insert_epoch(Epoch(lease.pipeline, next_id + i, gen, group_id, rng.start, rng.end, PLANNED,
                                  planned_at=now))
        tx.insert_group(group_id, owner=lease.owner, fence=lease.fence, first_epoch=next_id,
                        last_epoch=next_id + len(ranges) - 1, state=PLANNED, plan=record)
        tx.flush()
        return tx.group(group_id)


def halt_reason(store: EpochStore, pipeline: str, max_attempts: int, max_crashes: int) -> str | None:
    """Why no new group may start, or ``None``: a rollback left half done (or a backfill's
    recorded intent), an epoch that failed validation under the ``fail`` policy, one that
    failed ``max_attempts`` times, one whose driver died ``max_crashes`` times."""
    with store.read(pipeline, "halt_reason") as tx:
        state = tx.state()
        if state.intent is not None:
            return state.intent.describe()
        epochs = tx.epochs(state.generation, states=[PLANNED, FAILED])
    return rules.halt_reason(epochs, max_attempts, max_crashes)


@dataclass(frozen=True)
class PlanContext:
    """What the plan step reads before it takes the lease, in one read: whether the store knows
    the pipeline, the group this owner planned before, and why the pipeline is halted."""

    known: bool
    earlier: Group | None
    halt: str | None


def context(store: EpochStore, spec: PipelineSpec, owner: str | None) -> PlanContext:
    with store.read(spec.name, "plan_context") as tx:
        state = tx.state()
        known = store.knows_in(tx)
        ids = tx.group_ids(owner=owner) if owner is not None else []
        earlier = tx.group(ids[0]) if ids else None
        if state.intent is not None:
            halt = state.intent.describe()
        else:
            halt = rules.halt_reason(tx.epochs(state.generation, states=[PLANNED, FAILED]),
                                     spec.control.max_attempts, spec.control.max_crashes)
    return PlanContext(known, earlier, halt)
