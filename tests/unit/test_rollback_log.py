"""Unit tests of the epoch log's side of rollbacks, halts and store rebuilds, and of choosing
the live epoch records (no Spark, no Airflow)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

_PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice import protocol  # noqa: E402
from sluice.errors import ProtocolError  # noqa: E402
from sluice.model import RollbackIntent  # noqa: E402
from sluice.protocol.leases import acquire_lease  # noqa: E402
from sluice.protocol.operations import (  # noqa: E402
    begin_rollback,
    finish_rollback,
    load_records,
    rollback_plan,
    skip_entry,
)
from sluice.protocol.planning import halt_reason, plan_group  # noqa: E402
from sluice.store import EpochStore  # noqa: E402
from tests.unit.test_epoch_store import commit_all, files, spans  # noqa: E402

P = "pipe"


@pytest.fixture
def log(db_url: str):
    store = EpochStore(db_url)
    yield store
    store.close()


def published_groups(log: EpochStore, n_groups: int, epoch_size: int = 2, k: int = 2) -> None:
    log.register_files(P, files(n_groups * epoch_size * k))
    for _ in range(n_groups):
        lease = acquire_lease(log, P, "run")
        group = plan_group(log, lease, epoch_size=epoch_size, k=k)
        commit_all(log, lease, group)
        log.finish_group(lease, group.group_id)
        log.release_lease(lease)


def test_rollback_bumps_generation_carries_the_prefix_and_replans_exact_ranges(log):
    published_groups(log, 3)  # epochs 0..5, ranges of 2 files
    plan = rollback_plan(log, P, 3)
    assert [e.epoch_id for e in plan.kept] == [0, 1, 2] and [e.epoch_id for e in plan.rolled_back] == [3, 4, 5]
    lease = acquire_lease(log, P, "op")
    begin_rollback(log, lease, RollbackIntent(3, "bad release", "op"))
    assert "rollback to epoch 3" in halt_reason(log, P, 3, 10)
    with pytest.raises(ProtocolError, match="did not finish"):  # no planning on half-restored tables
        plan_group(log, lease, epoch_size=2, k=2)
    gen, group = finish_rollback(log, lease, plan, replan=True, reason="bad release")
    assert gen == 1 and log.generation(P) == 1 and halt_reason(log, P, 3, 10) is None
    assert [(e.epoch_id, e.start, e.end, e.state) for e in group.epochs] == [
        (3, 6, 8, "planned"), (4, 8, 10, "planned"), (5, 10, 12, "planned")]
    current = log.epochs(P)
    assert [(e.epoch_id, e.state, e.generation) for e in current[:3]] == [
        (0, "published", 1), (1, "published", 1), (2, "published", 1)]
    assert current[0].delta_versions == {"out": 0}, "carried epochs keep their Delta versions"
    assert {e.state for e in log.epochs(P, generation=0) if e.epoch_id >= 3} == {protocol.ROLLED_BACK}
    assert log.unpublished_groups(P, "op")[0].group_id == group.group_id
    protocol.check_contiguous((e.epoch_id, e.start, e.end) for e in current)


def test_rollback_without_recompute_rewinds_the_source(log):
    published_groups(log, 2)
    lease = acquire_lease(log, P, "op")
    gen, group = finish_rollback(log, lease, rollback_plan(log, P, 1), replan=False, reason="r")
    assert group is None and gen == 1
    assert log.next_offset(P) == 2  # the end of epoch 0: epoch 1's files are planned again
    regrouped = plan_group(log, lease, epoch_size=3, k=10)
    assert [(e.epoch_id, e.start, e.end) for e in regrouped.epochs] == [(1, 2, 5), (2, 5, 8)]


def test_backfill_share_replans_later_epochs_for_the_next_run(log):
    published_groups(log, 2)  # epochs 0..3
    lease = acquire_lease(log, P, "backfill-1")
    _, group = finish_rollback(log, lease, rollback_plan(log, P, 1), replan=True, reason="b", through_epoch=2)
    assert group.epoch_ids == [1, 2]
    later = next(e for e in log.epochs(P) if e.epoch_id == 3)
    assert later.state == protocol.PLANNED and later.group_id != group.group_id
    commit_all(log, lease, group)
    log.finish_group(lease, group.group_id)
    log.release_lease(lease)
    lease = acquire_lease(log, P, "backfill-2")
    share = plan_group(log, lease, epoch_size=2, k=2, only_leftovers=True, through_epoch=3)
    assert [(e.epoch_id, e.start, e.end) for e in share.epochs] == [(3, 6, 8)]


def test_rollback_refuses_unknown_epochs_and_unwritten_epochs_before_it(log):
    published_groups(log, 1)
    with pytest.raises(ProtocolError, match=r"holds epochs 0\.\.1"):
        rollback_plan(log, P, 5)
    log.register_files(P, files(4, start=4))
    lease = acquire_lease(log, P, "run")
    group = plan_group(log, lease, epoch_size=2, k=2)  # epochs 2, 3 planned, never written
    log.mark_failed(lease, [group.epochs[0]], "boom")
    with pytest.raises(ProtocolError, match=r"epochs \[2, 3\] before epoch 4 are not written"):
        rollback_plan(log, P, 4)
    assert [e.epoch_id for e in rollback_plan(log, P, 2).rolled_back] == [2, 3]


def test_halt_on_validation_failure_and_on_repeated_failures(log):
    log.register_files(P, files(4))
    lease = acquire_lease(log, P, "run")
    group = plan_group(log, lease, epoch_size=2, k=2)
    first, second = group.epochs
    log.start_attempt(lease, [first])
    log.mark_failed(lease, [first], "Py4JJavaError: boom")
    assert halt_reason(log, P, max_attempts=3, max_crashes=10) is None  # one failure: the next run retries
    for _ in range(2):
        log.start_attempt(lease, [first])
        log.mark_failed(lease, [first], "Py4JJavaError: boom")
    assert "failed 3 times" in halt_reason(log, P, max_attempts=3, max_crashes=10)
    log.mark_committed(lease, [(first, {}, {}, {}, None)])
    log.mark_failed(lease, [second], "validation failed: out: ...",
                    validation={"out": {"success": False, "failed": [{"expectation": "x"}]}})
    assert "epoch 1 failed validation" in halt_reason(log, P, max_attempts=3, max_crashes=10)


def test_load_records_rebuilds_manifest_epochs_and_groups(log):
    records = [{"epoch_id": 0, "group_id": 0, "start": 0, "end": 2, "delta_versions": {"out": 1}},
               {"epoch_id": 1, "group_id": 1, "start": 2, "end": 3, "delta_versions": {"out": 2}}]
    manifest = [(i, f"/landing/f{i}.json", 10, 100.0 + i) for i in range(3)]
    load_records(log, P, 2, manifest, records, [], fence=5, intent=RollbackIntent(2, "rebuild", "op", rebuild=True))
    assert log.pending_rollback(P).rebuild and acquire_lease(log, P, "next").fence > 5
    assert log.knows(P)
    assert log.generation(P) == 2 and len(log.manifest(P)) == 3
    assert [(e.epoch_id, e.start, e.end, e.state) for e in log.epochs(P)] == [
        (0, 0, 2, "published"), (1, 2, 3, "published")]
    assert log.next_offset(P) == 3
    assert [g.state for g in log.groups(P)] == ["published", "published"]


def test_live_records_drop_what_a_later_rollback_undid():
    from sluice.store.records import EpochRecord, RollbackRecord, live

    def rec(epoch: int, gen: int) -> EpochRecord:
        return EpochRecord(Path(f"e{epoch}-g{gen}"), epoch, gen, epoch, epoch + 1, (), {})

    def rollback(gen: int, to_epoch: int) -> RollbackRecord:
        return RollbackRecord(Path(f"g{gen}"), gen, to_epoch, to_epoch, {})

    epochs = [rec(0, 0), rec(1, 0), rec(2, 0), rec(3, 0), rec(2, 1), rec(3, 2)]
    live_set = live(epochs, [rollback(1, 2), rollback(2, 3)])
    assert [(r.epoch_id, r.generation) for r in live_set] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    # A rollback with no recompute yet: epochs >= 1 are gone from the live set.
    assert [r.epoch_id for r in live(epochs[:4], [rollback(1, 1)])] == [0]


# -- epoch history, skipped files, attempts ------------------------------------------------------


def test_epoch_history_shows_each_epoch_of_each_generation_once_with_its_writer(log):
    published_groups(log, 2)  # epochs 0..3 in generation 0
    lease = acquire_lease(log, P, "op")
    plan = rollback_plan(log, P, 2)
    begin_rollback(log, lease, RollbackIntent(2, "r", "op"))
    _, group = finish_rollback(log, lease, plan, replan=True, reason="r")
    commit_all(log, lease, group)
    log.finish_group(lease, group.group_id)
    history = [(e.epoch_id, e.written_generation, e.generation, e.state) for e in log.epoch_history(P)]
    assert history == [
        (0, 0, 1, "published"), (1, 0, 1, "published"),  # carried into generation 1, written in 0
        (2, 0, 0, "rolled_back"), (2, 1, 1, "published"),
        (3, 0, 0, "rolled_back"), (3, 1, 1, "published")]
    # A second rollback carries the carried copies again: still written in generation 0.
    lease = acquire_lease(log, P, "op")
    plan = rollback_plan(log, P, 3)
    begin_rollback(log, lease, RollbackIntent(3, "r2", "op"))
    finish_rollback(log, lease, plan, replan=False, reason="r2")
    history = [(e.epoch_id, e.written_generation, e.generation, e.state) for e in log.epoch_history(P)]
    assert history[:2] == [(0, 0, 2, "published"), (1, 0, 2, "published")]
    assert (2, 1, 2, "published") in history and (3, 1, 1, "rolled_back") in history
    # A page: the last N epoch ids below ``before``, every generation's row of each.
    whole = log.epoch_history(P)
    for last, before in itertools.product([None, 0, 1, 2, 4, 7], [None, 0, 1, 2, 3, 4, 10]):
        ids = sorted({e.epoch_id for e in whole if before is None or e.epoch_id < before})
        kept = set(ids if last is None else ids[max(0, len(ids) - last):] if last else [])
        page = log.epoch_history(P, last=last, before=before)
        assert page == [e for e in whole if e.epoch_id in kept], (last, before)


def test_skip_file_is_recorded_and_gives_the_failed_epoch_fresh_attempts(log):
    log.register_files(P, files(4))
    lease = acquire_lease(log, P, "run")
    group = plan_group(log, lease, epoch_size=2, k=2)
    for _ in range(3):
        log.start_attempt(lease, [group.epochs[1]])
        log.mark_failed(lease, [group.epochs[1]], "SourceError: file /landing/f0002.json is no longer there")
    assert "failed 3 times" in halt_reason(log, P, 3, 10)
    with pytest.raises(ProtocolError, match="needs a reason"):
        skip_entry(log, P, "/landing/f0002.json", by="ops", reason=" ")
    with pytest.raises(ProtocolError, match="not in the source manifest"):
        skip_entry(log, P, "/landing/nope.json", by="ops", reason="gone")
    entry, holders = skip_entry(log, P, "/landing/f0002.json", by="ops:ana", reason="upload truncated")
    assert holders == [1] and entry.position == 2
    assert entry.skipped.by == "ops:ana" and entry.skipped.reason == "upload truncated"
    assert halt_reason(log, P, 3, 10) is None, "fresh attempts: the pipeline runs again"
    skipped = {e.path: e.skipped for e in log.manifest(P)}
    assert skipped["/landing/f0002.json"] is not None and skipped["/landing/f0003.json"] is None
    assert log.manifest(P, 2, 3)[0].as_record()["skipped"]["reason"] == "upload truncated"


def test_recovery_gives_fresh_attempts_and_backfill_plans_below_an_offset(log):
    log.register_files(P, files(6))
    lease = acquire_lease(log, P, "run")
    group = plan_group(log, lease, epoch_size=2, k=1, until_offset=3)
    assert spans(group) == [(0, 0, 2)]
    log.start_attempt(lease, [group.epochs[0]])
    log.mark_failed(lease, [group.epochs[0]], "boom")
    again = plan_group(log, lease, epoch_size=2, k=3, only_leftovers=True)
    assert again.epochs[0].failures == 1, "a plain retry keeps counting"
    again = plan_group(log, lease, epoch_size=2, k=3, only_leftovers=True, fresh_attempts=True)
    assert again.epochs[0].failures == 0 and again.epochs[0].crashes == 0
    assert again.epochs[0].attempts == 1, "an epoch ever attempted stays so (reconcile trusts it on any storage)"
    commit_all(log, lease, again)
    log.finish_group(lease, again.group_id)
    assert spans(plan_group(log, lease, epoch_size=2, k=5, until_offset=3)) == [(1, 2, 3)]


def test_a_recorded_intent_is_continued_by_the_rollback_into_its_group_and_no_other(log):
    """A backfill records "to epoch 3"; the run step restores to epoch 2 (3 shares epoch 2's
    group commit) under that intent. A rollback to another epoch is refused until it is done."""
    published_groups(log, 2)
    lease = acquire_lease(log, P, "backfill")
    begin_rollback(log, lease, RollbackIntent(3, "backfill", "backfill"))
    with pytest.raises(ProtocolError, match=r"rollback to epoch 3 .* did not finish"):
        begin_rollback(log, lease, RollbackIntent(1, "other", "backfill", requested_to_epoch=1))
    begin_rollback(log, lease, RollbackIntent(2, "backfill", "backfill", requested_to_epoch=3, restoring=True))
    assert log.pending_rollback(P).to_epoch == 2
    with pytest.raises(ProtocolError, match=r"rollback to epoch 3 .* did not finish"):
        begin_rollback(log, lease, RollbackIntent(1, "other", "backfill", requested_to_epoch=1))
    begin_rollback(log, lease, RollbackIntent(3, "backfill, its plan step again", "backfill"))
