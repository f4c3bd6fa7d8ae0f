"""Unit tests of ``sluice.store.EpochStore`` on a temporary SQLite file and on a real Postgres server
(no Spark, no Airflow)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import pytest

_PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice import protocol  # noqa: E402
from sluice.errors import FencedError, PipelineBusyError, ProtocolError  # noqa: E402
from sluice.protocol.leases import acquire_lease  # noqa: E402
from sluice.protocol.operations import skip_entry  # noqa: E402
from sluice.protocol.planning import halt_reason, plan_group  # noqa: E402
from sluice.store import EpochStore, Lease  # noqa: E402

P = "pipe"

@pytest.fixture
def log(db_url: str):
    store = EpochStore(db_url)
    yield store
    store.close()


def files(n: int, start: int = 0) -> list[tuple[str, int, float]]:
    return [(f"/landing/f{i:04d}.json", 100 + i, 1000.0 + i) for i in range(start, start + n)]


def spans(group) -> list[tuple[int, int, int]]:
    return [(e.epoch_id, e.start, e.end) for e in group.epochs]


def commit_all(log: EpochStore, lease: Lease, group, rows: dict[str, int] | None = None) -> None:
    for e in group.epochs:
        log.mark_committed(lease, [(e, {"out": e.epoch_id}, rows or {}, {"epoch_s": 0.1}, None)])


# -- manifest ----------------------------------------------------------------------------------


def test_register_files_assigns_positions_in_order(log):
    assert len(log.manifest(P)) == 0
    assert log.register_files(P, files(3)) == 3
    entries = log.manifest(P)
    assert [(e.position, e.path, e.size, e.mtime) for e in entries] == [
        (0, "/landing/f0000.json", 100, 1000.0),
        (1, "/landing/f0001.json", 101, 1001.0),
        (2, "/landing/f0002.json", 102, 1002.0),
    ]
    assert log.known_files(P) == set(files(3))


def test_register_files_keeps_positions_and_skips_known_paths(log):
    log.register_files(P, files(3))
    # A relisting returns known files again (possibly in another order) plus new ones.
    relisted = [files(3)[2], ("/landing/new_b.json", 5, 1.0), files(3)[0], ("/landing/new_a.json", 6, 2.0)]
    assert log.register_files(P, relisted) == 5
    positions = {e.path: e.position for e in log.manifest(P)}
    assert positions == {
        "/landing/f0000.json": 0, "/landing/f0001.json": 1, "/landing/f0002.json": 2,
        "/landing/new_b.json": 3, "/landing/new_a.json": 4,  # appended in the given order
    }
    assert log.register_files(P, relisted) == 5  # nothing new: unchanged end
    assert len(log.manifest(P)) == 5


def test_register_files_skips_duplicates_within_one_call(log):
    dup = files(1) + files(1)
    assert log.register_files(P, dup) == 1


def test_manifest_slices_by_position(log):
    log.register_files(P, files(6))
    assert [e.position for e in log.manifest(P, 2, 5)] == [2, 3, 4]
    assert [e.position for e in log.manifest(P, 4)] == [4, 5]
    assert log.manifest(P, 6) == []


def test_manifest_tail_is_the_entries_from_an_offset_and_the_last_ones_in_one_read(log):
    assert log.manifest_tail(P, 0, 3) == []
    log.register_files(P, files(10))
    log.register_files("other", files(20))
    positions = [e.position for e in log.manifest_tail(P, 8, 5)]
    assert positions == [5, 6, 7, 8, 9]  # the last 5 hold [8, 10)
    assert [e.position for e in log.manifest_tail(P, 2, 5)] == list(range(2, 10))  # [2, 10) holds the last 5
    assert [e.position for e in log.manifest_tail(P, 10, 3)] == [7, 8, 9]  # nothing from 10 on
    assert [e.position for e in log.manifest_tail(P, 4, 0)] == [4, 5, 6, 7, 8, 9]
    assert log.manifest_tail(P, 0, 100) == log.manifest(P)


def test_manifests_are_per_pipeline(log):
    log.register_files("a", files(2))
    log.register_files("b", files(1))
    assert len(log.manifest("a")) == 2
    assert len(log.manifest("b")) == 1
    assert log.manifest("c") == []


# -- planning ----------------------------------------------------------------------------------


def test_plan_group_returns_none_when_nothing_available(log):
    lease = acquire_lease(log, P, "run-1")
    assert plan_group(log, lease, epoch_size=4, k=3) is None
    assert log.epochs(P) == []
    assert log.groups(P) == []


def test_plan_group_writes_contiguous_dense_epochs_from_manifest(log):
    log.register_files(P, files(10))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=4, k=5, plan={"reason": "backlog"})
    assert group is not None
    assert group.group_id == 0
    assert group.owner == "run-1"
    assert group.fence == lease.fence
    assert group.state == protocol.PLANNED
    assert group.reprocessing is False
    assert spans(group) == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]  # last epoch partial, nothing past the manifest
    assert all(e.state == protocol.PLANNED and e.generation == 0 for e in group.epochs)
    assert group.plan == {"reason": "backlog", "epoch_size": 4, "k": 5}
    # Written ahead: another reader sees the same ranges.
    assert [(e.epoch_id, e.start, e.end) for e in log.epochs(P)] == spans(group)
    assert log.next_offset(P) == 10


def test_plan_group_limits_to_k_epochs(log):
    log.register_files(P, files(100))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=4, k=3)
    assert spans(group) == [(0, 0, 4), (1, 4, 8), (2, 8, 12)]
    assert log.next_offset(P) == 12


def test_plan_group_continues_after_published_group(log):
    log.register_files(P, files(10))
    lease = acquire_lease(log, P, "run-1")
    g0 = plan_group(log, lease, epoch_size=4, k=1)
    commit_all(log, lease, g0)
    log.finish_group(lease, g0.group_id)
    g1 = plan_group(log, lease, epoch_size=4, k=2)
    assert g1.group_id == 1  # a fresh group id (0 was reused once: `(max or -1) + 1` with max == 0)
    assert spans(g1) == [(1, 4, 8), (2, 8, 10)]
    assert g1.reprocessing is False
    commit_all(log, lease, g1)
    log.finish_group(lease, g1.group_id)
    assert plan_group(log, lease, epoch_size=4, k=2) is None  # the manifest is exhausted
    assert [g.group_id for g in log.groups(P)] == [0, 1]
    assert log.summary(P)["by_state"] == {protocol.PUBLISHED: 3}


def test_leftover_epochs_are_replanned_as_new_group_with_same_ranges(log):
    log.register_files(P, files(10))
    dead = acquire_lease(log, P, "run-1", ttl_s=0.01)
    g0 = plan_group(log, dead, epoch_size=4, k=2)
    log.mark_failed(dead, [g0.epochs[1]], "boom")
    time.sleep(0.05)  # run-1 dies; its lease expires
    log.register_files(P, files(5, start=10))  # more data arrived meanwhile: must not change the ranges

    lease = acquire_lease(log, P, "run-2")
    g1 = plan_group(log, lease, epoch_size=2, k=5)  # other settings: must not change the ranges either
    assert g1.group_id == 1
    assert g1.reprocessing is True
    assert spans(g1) == spans(g0) == [(0, 0, 4), (1, 4, 8)]
    assert [e.state for e in g1.epochs] == [protocol.PLANNED, protocol.FAILED]
    assert "reprocess" in g1.plan["reason"]
    assert log.group(P, 0).state == protocol.FAILED  # the dead run's group
    assert log.group(P, 0).epochs == ()  # its epochs moved to the new group
    # Once the leftovers are done, planning continues after them.
    commit_all(log, lease, g1)
    log.finish_group(lease, g1.group_id)
    g2 = plan_group(log, lease, epoch_size=4, k=5)
    assert spans(g2) == [(2, 8, 12), (3, 12, 15)]


def test_dead_runs_committed_epochs_are_published_by_recovery(log):
    log.register_files(P, files(9))
    dead = acquire_lease(log, P, "run-1", ttl_s=0.01)
    g0 = plan_group(log, dead, epoch_size=3, k=3)
    for e in g0.epochs[:2]:  # epochs 0 and 1 reach the sink
        log.mark_committed(dead, [(e, {}, {}, {}, None)])
    time.sleep(0.05)  # run-1 dies before epoch 2 and before publishing

    lease = acquire_lease(log, P, "run-2")
    g1 = plan_group(log, lease, epoch_size=3, k=3)
    assert g1.reprocessing is True
    assert spans(g1) == spans(g0)  # committed ones too: they still need publishing
    assert [e.state for e in g1.epochs] == [protocol.COMMITTED, protocol.COMMITTED, protocol.PLANNED]
    assert log.group(P, g0.group_id).state == protocol.FAILED
    for e in g1.epochs:
        if e.state != protocol.COMMITTED:  # as GroupRunner.run does
            log.mark_committed(lease, [(e, {}, {}, {}, None)])
    log.finish_group(lease, g1.group_id)
    assert log.summary(P)["by_state"] == {protocol.PUBLISHED: 3}


def test_dead_runs_fully_committed_group_is_published_by_recovery(log):
    log.register_files(P, files(4))
    dead = acquire_lease(log, P, "run-1", ttl_s=0.01)
    g0 = plan_group(log, dead, epoch_size=2, k=2)
    commit_all(log, dead, g0)
    time.sleep(0.05)  # run-1 dies between the last commit and publish

    lease = acquire_lease(log, P, "run-2")
    g1 = plan_group(log, lease, epoch_size=2, k=2)
    assert g1 is not None, "the dead run's committed epochs are left unpublished, and the group 'planned'"
    assert g1.reprocessing is True
    assert g1.epoch_ids == [0, 1]
    log.finish_group(lease, g1.group_id)
    assert log.summary(P)["by_state"] == {protocol.PUBLISHED: 2}


# -- leases ------------------------------------------------------------------------------------


def test_same_owner_reacquires_and_bumps_fence(log):
    first = acquire_lease(log, P, "run-1")
    again = acquire_lease(log, P, "run-1")
    assert first == Lease(P, "run-1", first.fence)
    assert again.owner == "run-1" and again.fence > first.fence
    assert log.lease_holder(P) == "run-1"


def test_tokens_rise_with_the_stores_clock_whatever_store_issued_them(tmp_path):
    """A store made after another was lost hands out tokens above the lost one's (tokens follow
    the store's clock): a run of the lost store still going is then refused by Delta."""
    from datetime import datetime, timedelta

    now = datetime(2026, 6, 1)
    lost = EpochStore(f"sqlite:///{tmp_path}/lost.db", clock=lambda: now)
    old = [acquire_lease(lost, P, "run-old").fence for _ in range(5)]  # five acquisitions in a second
    assert old == sorted(set(old)), "strictly increasing"
    later = now + timedelta(seconds=30)
    new = EpochStore(f"sqlite:///{tmp_path}/new.db", clock=lambda: later)
    assert acquire_lease(new, P, "run-new").fence > max(old)
    assert acquire_lease(new, P, "run-new").fence < 1 << 31, "token << 32 fits a Delta txnVersion (a signed long)"


def test_other_owner_is_busy_with_pipeline_and_holder_named(log):
    held = acquire_lease(log, P, "dag_ysb:run-1").fence
    with pytest.raises(PipelineBusyError) as info:
        acquire_lease(log, P, "dag_other:run-9")
    message = str(info.value)
    assert repr(P) in message
    assert "'dag_ysb:run-1'" in message
    assert log.lease_holder(P) == "dag_ysb:run-1"  # unchanged
    assert log.current_lease(P, "dag_ysb:run-1").fence == held  # a refused attempt does not bump the fence


def test_leases_are_per_pipeline(log):
    a = acquire_lease(log, "a", "run-1")
    acquire_lease(log, "a", "run-1")
    assert acquire_lease(log, "b", "run-2").fence <= a.fence + 1, "b's tokens do not count a's acquisitions"


def test_expired_lease_can_be_taken(log):
    old = acquire_lease(log, P, "run-1", ttl_s=0.01)
    time.sleep(0.05)
    assert log.lease_holder(P) is None
    new = acquire_lease(log, P, "run-2")
    assert new.fence > old.fence
    assert log.lease_holder(P) == "run-2"
    with pytest.raises(FencedError, match="run-1"):
        log.check_lease(old)


def test_take_over_prefix_takes_a_live_lease_of_the_same_prefix(log):
    old = acquire_lease(log, P, "sluice_ysb:manual__1")
    with pytest.raises(PipelineBusyError):
        acquire_lease(log, P, "sluice_ysb:manual__2", take_over_prefix="other_dag:")
    new = acquire_lease(log, P, "sluice_ysb:manual__2", take_over_prefix="sluice_ysb:")
    assert new.fence > old.fence
    assert log.lease_holder(P) == "sluice_ysb:manual__2"
    with pytest.raises(FencedError):
        log.renew_lease(old)


def test_take_over_prefix_leaves_a_run_that_is_still_going_alone(log):
    """A backfill run beside a scheduled run of the same DAG: the prefix matches, but the holder's
    DAG run is alive, so the pipeline is busy; once that run has ended the lease is taken."""
    acquire_lease(log, P, "airflow:d:scheduled__1")
    running = {"airflow:d:scheduled__1"}
    with pytest.raises(PipelineBusyError, match="scheduled__1"):
        acquire_lease(log, P, "airflow:d:backfill__1", take_over_prefix="airflow:d:", alive=running.__contains__)
    running.clear()
    acquire_lease(log, P, "airflow:d:backfill__1", take_over_prefix="airflow:d:", alive=running.__contains__)
    assert log.lease_holder(P) == "airflow:d:backfill__1"


def test_stale_lease_is_fenced(log):
    log.register_files(P, files(8))
    stale = acquire_lease(log, P, "run-1")
    group = plan_group(log, stale, epoch_size=4, k=2)
    fresh = acquire_lease(log, P, "run-1")  # e.g. a retried task of the same run
    assert fresh.fence > stale.fence
    with pytest.raises(FencedError, match="this run must stop"):
        log.mark_committed(stale, [(group.epochs[0], {}, {}, {}, None)])
    with pytest.raises(FencedError):
        plan_group(log, stale, epoch_size=4, k=2)
    with pytest.raises(FencedError):
        log.finish_group(stale, group.group_id)
    with pytest.raises(FencedError):
        log.mark_failed(stale, [group.epochs[0]], "x")
    # Nothing changed under the stale token.
    assert [e.state for e in log.epochs(P)] == [protocol.PLANNED, protocol.PLANNED]
    log.mark_committed(fresh, [(group.epochs[0], {}, {}, {}, None)])
    assert log.epochs(P)[0].state == protocol.COMMITTED


def test_release_lease(log):
    lease = acquire_lease(log, P, "run-1")
    assert log.release_lease(lease) is True
    assert log.lease_holder(P) is None
    assert log.release_lease(lease) is False  # released already
    with pytest.raises(FencedError):
        log.check_lease(lease)
    other = acquire_lease(log, P, "run-2")  # free now, no wait for expiry
    assert other.fence > lease.fence


def test_current_lease_names_the_holder(log):
    held = acquire_lease(log, P, "run-1")
    assert log.current_lease(P, "run-1") == Lease(P, "run-1", held.fence)
    with pytest.raises(FencedError, match="'run-1'"):
        log.current_lease(P, "run-2")


# -- commit and publish ------------------------------------------------------------------------


def random_groups(log: EpochStore, rng, *, died: float, rows=lambda: {}) -> Lease:
    """Random groups (20-60 files, epochs of 1-4, k of 1-4) committed and published, until one,
    with probability ``died`` each, is a run that died: some of its epochs committed, the rest
    left planned. ``rows()``: each epoch's row counts. Returns the lease that planned them."""
    log.register_files(P, files(rng.randint(20, 60)))
    lease = acquire_lease(log, P, "run-1")
    while (group := plan_group(log, lease, epoch_size=rng.randint(1, 4), k=rng.randint(1, 4))) is not None:
        done = group.epochs if rng.random() >= died else group.epochs[:rng.randint(0, len(group.epochs))]
        for e in done:
            log.mark_committed(lease, [(e, {"out": e.epoch_id}, rows(), {"epoch_s": 0.1}, None)])
        if len(done) < len(group.epochs):
            break
        log.finish_group(lease, group.group_id)
    return lease


def test_epochs_by_state_and_the_last_ones_are_those_of_the_whole_list(log):
    """A poll reads the last epochs (the controllers' history) and the unpublished ones, not every
    epoch a pipeline ever ran: the query with ``states`` and ``last`` returns what filtering the
    whole list gives, in epoch order. Seeded (printed); a few groups published, the last one half
    committed. 0.1 s."""
    import random

    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    random_groups(log, random.Random(seed), died=0.2)
    whole = log.epochs(P)
    for states in (None, [protocol.PUBLISHED], sorted(protocol.UNPUBLISHED), [protocol.PLANNED]):
        for last in (None, 0, 1, 3, len(whole), len(whole) + 5):
            chosen = [e for e in whole if states is None or e.state in states]
            expected = chosen if last is None else chosen[len(chosen) - min(last, len(chosen)):]
            assert log.epochs(P, states=states, last=last) == expected, (seed, states, last)


def test_a_plan_takes_the_unpublished_epochs_in_order_then_numbers_new_ones_after_the_last(log):
    """A group's plan reads only the unpublished epochs and the last one (it read the whole
    generation and applied the reprocess rule per epoch: 5 minutes at 30,000 epochs,
    ``make bench-store``). Seeded (printed): random groups published, the last one partly
    committed; the next plan must take exactly the epochs not published, in epoch order, with
    their ranges, and a plan after it number its epochs from the largest id + 1. 0.1 s."""
    import random

    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    lease = random_groups(log, random.Random(seed), died=0.3)
    whole = log.epochs(P)
    log.release_lease(lease)
    lease = acquire_lease(log, P, "run-2")
    again = plan_group(log, lease, epoch_size=2, k=2)
    left = [(e.epoch_id, e.start, e.end) for e in whole if e.state not in ("published",)]
    if left:
        assert again is not None and [(e.epoch_id, e.start, e.end) for e in again.epochs] == left, seed
        commit_all(log, lease, again)
        log.finish_group(lease, again.group_id)
    log.register_files(P, files(3, start=1000))
    new = plan_group(log, lease, epoch_size=1, k=2)
    last = whole[-1].epoch_id
    assert new is not None and [e.epoch_id for e in new.epochs] == [last + 1, last + 2], seed


def test_mark_committed_then_publish_moves_states(log):
    log.register_files(P, files(6))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=3, k=2)
    for e in group.epochs:
        log.start_attempt(lease, [e])
    commit_all(log, lease, group, rows={"input": 10, "output": 7, "rejected": 3})
    committed = log.group(P, group.group_id)
    assert [e.state for e in committed.epochs] == [protocol.COMMITTED] * 2
    assert committed.epochs[1].delta_versions == {"out": 1}
    assert committed.epochs[0].attempts == 1
    assert committed.epochs[0].committed_at is not None
    assert committed.state == protocol.PLANNED

    published = log.finish_group(lease, group.group_id)
    assert published.state == protocol.PUBLISHED
    assert [e.state for e in published.epochs] == [protocol.PUBLISHED] * 2
    assert all(e.published_at is not None for e in published.epochs)
    assert [e.state for e in log.epochs(P)] == [protocol.PUBLISHED] * 2


def test_mark_committed_is_idempotent(log):
    log.register_files(P, files(2))
    lease = acquire_lease(log, P, "run-1")
    epoch = plan_group(log, lease, epoch_size=2, k=1).epochs[0]
    log.mark_committed(lease, [(epoch, {"out": 4}, {"input": 2}, {}, None)])
    log.mark_committed(lease, [(epoch, {"out": 9}, {"input": 99}, {}, None)])  # a replay
    (stored,) = log.epochs(P)
    assert stored.state == protocol.COMMITTED
    assert stored.delta_versions == {"out": 4}
    assert stored.rows == {"input": 2}


def test_mark_committed_after_publish_changes_nothing(log):
    log.register_files(P, files(2))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=2, k=1)
    commit_all(log, lease, group)
    log.finish_group(lease, group.group_id)
    log.mark_committed(lease, [(group.epochs[0], {"out": 99}, {"input": 1}, {}, None)])
    (stored,) = log.epochs(P)
    assert stored.state == protocol.PUBLISHED
    assert stored.delta_versions == {"out": 0}
    assert stored.published_at is not None


def test_plan_group_while_own_group_in_flight_replans_it(log):
    """A retried plan task (same owner, new token) takes over its own unfinished group."""
    log.register_files(P, files(8))
    first = acquire_lease(log, P, "run-1")
    g0 = plan_group(log, first, epoch_size=4, k=2)
    retry = acquire_lease(log, P, "run-1")
    g1 = plan_group(log, retry, epoch_size=4, k=2)
    assert g1.reprocessing is True
    assert spans(g1) == spans(g0)
    assert g1.fence == retry.fence
    assert log.group(P, g0.group_id).state == protocol.FAILED
    assert log.next_offset(P) == 8  # no new epochs were planned


def test_failed_epoch_can_still_commit(log):
    log.register_files(P, files(2))
    lease = acquire_lease(log, P, "run-1")
    epoch = plan_group(log, lease, epoch_size=2, k=1).epochs[0]
    log.mark_failed(lease, [epoch], "x" * 5000)
    (failed,) = log.epochs(P)
    assert failed.state == protocol.FAILED
    assert len(failed.error) == 4000  # truncated
    log.mark_committed(lease, [(epoch, {}, {}, {}, None)])
    (stored,) = log.epochs(P)
    assert stored.state == protocol.COMMITTED
    assert stored.error is None


def test_finish_group_refuses_to_publish_uncommitted_epochs(log):
    log.register_files(P, files(6))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=2, k=3)
    log.mark_committed(lease, [(group.epochs[0], {}, {}, {}, None)])
    with pytest.raises(ProtocolError, match=r"group 0: epochs \[1, 2\] are not committed; cannot publish") as info:
        log.finish_group(lease, group.group_id)
    assert repr(P) in str(info.value)
    # The refusal changed nothing.
    assert log.group(P, 0).state == protocol.PLANNED
    assert [e.state for e in log.epochs(P)] == [protocol.COMMITTED, protocol.PLANNED, protocol.PLANNED]


def test_finish_group_unknown_group(log):
    lease = acquire_lease(log, P, "run-1")
    with pytest.raises(ProtocolError, match="has no group 7"):
        log.finish_group(lease, 7)
    with pytest.raises(ProtocolError, match="has no group 7"):
        log.group(P, 7)


def test_summary_counts(log):
    log.register_files(P, files(7))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=2, k=4)
    for e in group.epochs[:3]:
        log.mark_committed(lease, [(e, {}, {"input": 10, "output": 8, "rejected": 2}, {}, None)])
    log.mark_failed(lease, [group.epochs[3]], "boom")
    summary = log.summary(P)
    assert summary == {
        "pipeline": P,
        "generation": 0,
        "epochs": 4,
        "groups": 1,
        "by_state": {protocol.COMMITTED: 3, protocol.FAILED: 1},
        "offsets": [0, 7],
        "rows": {"input": 30, "output": 24, "rejected": 6},
    }


def test_summary_of_empty_pipeline(log):
    summary = log.summary(P)
    assert summary["epochs"] == 0
    assert summary["by_state"] == {}
    assert summary["offsets"] == [0, 0]


def test_summary_aggregated_in_the_store_is_the_whole_lists(log):
    """The console's summary is aggregated in SQL (it read every epoch: 0.8 s at 30,000): it
    equals the totals computed from the whole list in Python. Seeded (printed): random groups
    with random row counts, some published, the last one partly committed. Then an epoch
    starting past its predecessor's end is named as a gap. 0.1 s."""
    import dataclasses
    import random

    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    rng = random.Random(seed)
    random_groups(log, rng, died=0.2, rows=lambda: {key: rng.randint(0, 500) for key in ("input", "output", "rejected")
                                                   if rng.random() < 0.9})
    whole = log.epochs(P)
    by_state: dict[str, int] = {}
    for e in whole:
        by_state[e.state] = by_state.get(e.state, 0) + 1
    assert log.summary(P) == {
        "pipeline": P, "generation": 0, "epochs": len(whole), "groups": len({e.group_id for e in whole}),
        "by_state": by_state, "offsets": [whole[0].start, whole[-1].end],
        "rows": {key: sum(e.rows.get(key, 0) for e in whole) for key in ("input", "output", "rejected")}}, seed
    last = whole[-1]
    with log.transaction(P) as tx:
        tx.insert_epoch(dataclasses.replace(last, epoch_id=last.epoch_id + 1, start=last.end + 1, end=last.end + 2))
    with pytest.raises(ProtocolError, match=f"epoch {last.epoch_id + 1} starts at {last.end + 1}"):
        log.summary(P)


def test_epoch_and_group_records_are_json_able(log):
    import json

    log.register_files(P, files(2))
    lease = acquire_lease(log, P, "run-1")
    group = plan_group(log, lease, epoch_size=2, k=1)
    record = json.loads(json.dumps(group.as_record()))
    assert record["epochs"][0]["start"] == 0
    assert record["epochs"][0]["planned_at"].endswith("Z")
    assert record["epochs"][0]["committed_at"] is None


# -- two processes -----------------------------------------------------------------------------


def test_two_instances_on_the_same_file_see_each_others_writes(db_url):
    a, b = EpochStore(db_url), EpochStore(db_url)
    try:
        a.register_files(P, files(4))
        assert len(b.manifest(P)) == 4
        lease_b = acquire_lease(b, P, "run-b")
        with pytest.raises(PipelineBusyError, match="run-b"):
            acquire_lease(a, P, "run-a")
        group = plan_group(b, lease_b, epoch_size=2, k=2)
        assert [(e.epoch_id, e.start, e.end) for e in a.epochs(P)] == spans(group)
        a.mark_committed(lease_b, [(group.epochs[0], {}, {}, {}, None)])
        assert b.epochs(P)[0].state == protocol.COMMITTED
        assert b.release_lease(lease_b)
        lease_a = acquire_lease(a, P, "run-a")
        with pytest.raises(FencedError):
            b.check_lease(lease_b)
        assert lease_a.fence > lease_b.fence
    finally:
        a.close()
        b.close()


def _race_for_lease(url: str, pipeline: str, owner: str, barrier, results) -> None:
    """Child process: open the store, wait for the other racer, then try to take the lease."""
    store = EpochStore(url)
    try:
        barrier.wait(timeout=60)
        try:
            lease = acquire_lease(store, pipeline, owner)
        except PipelineBusyError as exc:
            results.put((owner, "busy", str(exc)))
        else:
            results.put((owner, "won", lease.fence))
    except Exception as exc:  # reported to the parent, which fails the test with it
        results.put((owner, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        store.close()


def test_two_processes_race_for_the_lease(db_url):
    EpochStore(db_url).close()  # the schema exists; the pipeline row does not yet
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    owners = ["proc-a", "proc-b"]
    procs = [ctx.Process(target=_race_for_lease, args=(db_url, "raced", o, barrier, results)) for o in owners]
    for p in procs:
        p.start()
    try:
        outcomes = sorted((results.get(timeout=90) for _ in owners), key=lambda r: r[1])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    (loser, busy, message), (winner, won, fence) = outcomes
    assert (busy, won) == ("busy", "won"), outcomes
    assert {loser, winner} == set(owners)
    assert "'raced'" in message and repr(winner) in message
    log = EpochStore(db_url)
    try:
        assert log.lease_holder("raced") == winner
        assert log.current_lease("raced", winner).fence == fence, "the loser's refused attempt bumped nothing"
    finally:
        log.close()


def test_store_url_precedence(monkeypatch, tmp_path):
    """$SLUICE_STORE_URL, then the Airflow connection `sluice_store`, then $AIRFLOW_HOME."""
    from sluice.store import store_url

    monkeypatch.setenv("SLUICE_STORE_URL", "sqlite:///from-env.db")
    monkeypatch.setenv("AIRFLOW_CONN_SLUICE_STORE", "postgresql://u:secret@db:5432/sluice")
    assert store_url() == "sqlite:///from-env.db"
    monkeypatch.delenv("SLUICE_STORE_URL")
    assert store_url() == "postgresql+psycopg2://u:secret@db:5432/sluice"
    monkeypatch.setenv("AIRFLOW_CONN_SLUICE_STORE", '{"conn_type": "sqlite", "extra": {"url": "sqlite:///x.db"}}')
    assert store_url() == "sqlite:///x.db"
    monkeypatch.delenv("AIRFLOW_CONN_SLUICE_STORE")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    assert store_url() == f"sqlite:///{tmp_path}/sluice.db"


# -- one engine per store and process ------------------------------------------------------------


def test_one_engine_per_store_and_a_new_one_for_a_replaced_sqlite_file(tmp_path):
    """Opening the store again shares the engine (no schema check per task); a SQLite file
    deleted since (a lost store) gets a new engine and a new schema, not the unlinked file."""
    url = f"sqlite:///{tmp_path}/shared.db"
    first, second = EpochStore(url), EpochStore(url)
    assert first.engine is second.engine
    first.register_files(P, files(2))
    assert len(second.manifest(P)) == 2
    first.close()  # idle connections only: the other handle keeps working
    assert len(second.manifest(P)) == 2
    for f in tmp_path.glob("shared.db*"):
        f.unlink()
    fresh = EpochStore(url)
    assert fresh.engine is not first.engine
    assert fresh.manifest(P) == [], "a new, empty store: the tables were created again"
    fresh.register_files(P, files(1))
    assert len(EpochStore(url).manifest(P)) == 1
    assert (tmp_path / "shared.db").exists()


# -- reads write nothing ------------------------------------------------------------------------


def test_reads_of_a_pipeline_that_never_ran_write_nothing(tmp_path):
    """The epoch API and the sensors only read: a pipeline with no row yet gets its initial
    state, and the store's file does not change (no row, so no write lock was taken). SQLite
    only: its file's bytes show any write."""
    import sqlite3

    db_url = f"sqlite:///{tmp_path}/s.db"
    EpochStore(db_url).close()  # the schema, as a writer created it
    path = db_url.removeprefix("sqlite:///")
    before = Path(path).read_bytes()
    reader = EpochStore(db_url)
    try:
        assert reader.generation(P) == 0 and reader.lease_holder(P) is None
        assert reader.pending_rollback(P) is None and halt_reason(reader, P, 3, 10) is None
        assert reader.epochs(P) == [] and reader.epoch_history(P) == [] and reader.control_state(P) is None
        assert reader.summary(P)["epochs"] == 0 and reader.next_offset(P) == 0
    finally:
        reader.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM sluice_pipelines").fetchone() == (0,)
    wal = Path(path + "-wal")
    assert Path(path).read_bytes() == before and (not wal.exists() or wal.stat().st_size == 0), "a read wrote"
    writer = EpochStore(db_url)
    try:
        acquire_lease(writer, P, "w")  # a writer creates the row
        assert writer.lease_holder(P) == "w"
    finally:
        writer.close()


def test_plan_group_bounds_new_epochs_in_bytes_and_counts_a_skipped_file_as_nothing(log):
    sizes = [60, 50, 30, 200, 20]
    log.register_files(P, [(f"/landing/b{i}.json", size, 1000.0 + i) for i, size in enumerate(sizes)])
    skip_entry(log, P, "/landing/b1.json", by="op", reason="lost upload")
    lease = acquire_lease(log, P, "w")
    group = plan_group(log, lease, epoch_size=3, k=10, max_bytes=100)
    # b1 is skipped (0 bytes): 60 + 0 + 30 fits; 200 is an epoch alone; then 20.
    assert spans(group) == [(0, 0, 3), (1, 3, 4), (2, 4, 5)]
