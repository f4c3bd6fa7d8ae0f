"""Unit tests of ``sluice.protocol``: the pure rules of the exactly-once protocol (no I/O)."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

_PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice import protocol  # noqa: E402
from sluice.errors import ProtocolError  # noqa: E402
from sluice.protocol import (  # noqa: E402
    Range,
    check_contiguous,
    check_transition,
    epochs_to_reprocess,
    plan_ranges,
    sink_app_id,
)


def spans(ranges: list[Range]) -> list[tuple[int, int]]:
    return [(r.start, r.end) for r in ranges]


# -- Range -------------------------------------------------------------------------------------


def test_range_size_and_half_open():
    assert Range(3, 7).size == 4
    assert Range(0, 1).size == 1


@pytest.mark.parametrize(("start", "end"), [(5, 5), (6, 5), (-1, 3)])
def test_range_rejects_empty_reversed_or_negative(start, end):
    with pytest.raises(ProtocolError, match=rf"\[{start}, {end}\)"):
        Range(start, end)


# -- plan_ranges -------------------------------------------------------------------------------


def test_plan_ranges_full_epochs_then_partial_last():
    assert spans(plan_ranges(0, 10, 4, 5)) == [(0, 4), (4, 8), (8, 10)]


def test_plan_ranges_starts_at_next_offset():
    assert spans(plan_ranges(7, 20, 5, 2)) == [(7, 12), (12, 17)]


def test_plan_ranges_stops_at_k_epochs_even_with_more_backlog():
    ranges = plan_ranges(0, 1000, 10, 3)
    assert spans(ranges) == [(0, 10), (10, 20), (20, 30)]


def test_plan_ranges_k_never_exceeds_backlog():
    # 3 offsets available, k = 10: one offset per epoch at most three epochs, never empty ones.
    assert spans(plan_ranges(5, 8, 1, 10)) == [(5, 6), (6, 7), (7, 8)]
    assert spans(plan_ranges(5, 8, 100, 10)) == [(5, 8)]


@pytest.mark.parametrize(("next_offset", "available_end"), [(4, 4), (9, 4), (0, 0)])
def test_plan_ranges_nothing_available_plans_nothing(next_offset, available_end):
    assert plan_ranges(next_offset, available_end, 4, 3) == []


@pytest.mark.parametrize(("epoch_size", "k"), [(0, 1), (1, 0), (-3, 2), (2, -1)])
def test_plan_ranges_rejects_invalid_size_or_k(epoch_size, k):
    with pytest.raises(ProtocolError, match=">= 1"):
        plan_ranges(0, 10, epoch_size, k)


def test_plan_ranges_probe_epoch_first_then_the_epoch_size():
    assert spans(plan_ranges(0, 100, 5, 3, first_size=20)) == [(0, 20), (20, 25), (25, 30)]
    assert spans(plan_ranges(0, 12, 5, 3, first_size=20)) == [(0, 12)]
    with pytest.raises(ProtocolError, match=">= 1"):
        plan_ranges(0, 10, 4, 2, first_size=0)


def test_plan_ranges_rejects_invalid_args_even_without_backlog():
    with pytest.raises(ProtocolError):
        plan_ranges(10, 10, 0, 1)


def test_plan_ranges_rejects_negative_start():
    with pytest.raises(ProtocolError):
        plan_ranges(-2, 10, 4, 1)


def test_plan_ranges_invariants_random():
    rng = random.Random(20260101)
    for _ in range(5000):
        next_offset = rng.randint(0, 500)
        available_end = next_offset + rng.choice([0, 0, 1, 2, rng.randint(0, 400)]) - rng.choice([0, 0, 0, 3])
        epoch_size = rng.choice([1, 2, 3, rng.randint(1, 64), rng.randint(1, 1000)])
        k = rng.choice([1, 2, rng.randint(1, 50)])
        first = rng.choice([None, None, 1, rng.randint(1, 2000)])  # the controllers' probe epoch
        args = (next_offset, available_end, epoch_size, k)
        ranges = plan_ranges(*args, first_size=first)
        backlog = max(0, available_end - next_offset)
        sizes = [first or epoch_size] + [epoch_size] * (k - 1)  # the oracle: the planned sizes, in order

        assert len(ranges) <= k, args
        assert len(ranges) <= backlog, args  # k never exceeds the backlog
        if backlog == 0:
            assert ranges == [], args
            continue
        assert ranges, args
        assert ranges[0].start == next_offset, args
        for a, b in itertools.pairwise(ranges):
            assert a.end == b.start, args  # contiguous
        assert all(r.end <= available_end for r in ranges), args  # nothing beyond what is available
        assert [r.size for r in ranges[:-1]] == sizes[:len(ranges) - 1], (args, first)  # only the last may be partial
        assert 1 <= ranges[-1].size <= sizes[len(ranges) - 1], (args, first)
        covered = ranges[-1].end - next_offset
        assert covered == min(backlog, sum(sizes)), (args, first)  # greedy: plans as much as allowed
        # The plan is a valid, dense epoch log by itself.
        check_contiguous(((i, r.start, r.end) for i, r in enumerate(ranges)), first_offset=next_offset)


# -- check_contiguous --------------------------------------------------------------------------


def test_check_contiguous_accepts_dense_contiguous_log():
    check_contiguous([(0, 0, 4), (1, 4, 8), (2, 8, 9)])
    check_contiguous([])
    check_contiguous([(0, 10, 12), (1, 12, 20)], first_offset=10)


def test_check_contiguous_rejects_non_dense_ids():
    with pytest.raises(ProtocolError, match="expected 1, found 2"):
        check_contiguous([(0, 0, 4), (2, 4, 8)])


def test_check_contiguous_ids_must_start_at_zero():
    with pytest.raises(ProtocolError, match="expected 0, found 1"):
        check_contiguous([(1, 0, 4)])


def test_check_contiguous_rejects_gap():
    with pytest.raises(ProtocolError, match="epoch 1 starts at 5, but the previous epoch ended at 4"):
        check_contiguous([(0, 0, 4), (1, 5, 8)])


def test_check_contiguous_rejects_overlap():
    with pytest.raises(ProtocolError, match="epoch 1 starts at 3"):
        check_contiguous([(0, 0, 4), (1, 3, 8)])


def test_check_contiguous_rejects_wrong_first_offset():
    with pytest.raises(ProtocolError, match="starts at 0"):
        check_contiguous([(0, 0, 4)], first_offset=2)


def test_check_contiguous_rejects_empty_epoch():
    with pytest.raises(ProtocolError, match=r"invalid epoch range \[4, 4\)"):
        check_contiguous([(0, 0, 4), (1, 4, 4)])


# -- check_transition --------------------------------------------------------------------------


@pytest.mark.parametrize(("current", "new"), [
    (protocol.PLANNED, protocol.COMMITTED),
    (protocol.PLANNED, protocol.FAILED),
    (protocol.FAILED, protocol.COMMITTED),  # a failed epoch is retried with the same range
    (protocol.FAILED, protocol.FAILED),
    (protocol.COMMITTED, protocol.PUBLISHED),
    (protocol.COMMITTED, protocol.QUARANTINED),
    (protocol.QUARANTINED, protocol.PUBLISHED),
    (protocol.PUBLISHED, protocol.ROLLED_BACK),
    (protocol.COMMITTED, protocol.ROLLED_BACK),
    (protocol.PLANNED, protocol.ROLLED_BACK),
])
def test_check_transition_allowed(current, new):
    check_transition(3, current, new)


@pytest.mark.parametrize(("current", "new"), [
    (protocol.PLANNED, protocol.PUBLISHED),  # cannot publish without committing
    (protocol.FAILED, protocol.PUBLISHED),
    (protocol.PUBLISHED, protocol.COMMITTED),
    (protocol.PUBLISHED, protocol.PLANNED),
    (protocol.COMMITTED, protocol.PLANNED),
    (protocol.COMMITTED, protocol.FAILED),  # committed data is in the sink: it cannot "fail" afterwards
    (protocol.ROLLED_BACK, protocol.PLANNED),
    (protocol.ROLLED_BACK, protocol.COMMITTED),
    (protocol.ROLLED_BACK, protocol.PUBLISHED),
    ("bogus", protocol.COMMITTED),
    (protocol.PLANNED, "bogus"),
])
def test_check_transition_refused(current, new):
    with pytest.raises(ProtocolError, match=rf"epoch 42: cannot go from '{current}' to '{new}'"):
        check_transition(42, current, new)


def test_rolled_back_is_terminal():
    for new in (protocol.PLANNED, protocol.COMMITTED, protocol.PUBLISHED, protocol.FAILED,
                protocol.QUARANTINED, protocol.ROLLED_BACK):
        with pytest.raises(ProtocolError):
            check_transition(0, protocol.ROLLED_BACK, new)


# -- already_written / epochs_to_reprocess / sink_app_id ---------------------------------------


@pytest.mark.parametrize(("recorded", "token", "epoch", "expected"), [
    (None, 1, 0, False),  # the table has never seen this app id
    ((1 << 32) | 1, 1, 0, True),  # the same run's epoch 0, replayed
    ((1 << 32) | 6, 1, 3, True),  # an earlier epoch of the same token
    ((1 << 32) | 4, 1, 5, False),  # a later epoch
    ((1 << 32) | 6, 2, 0, False),  # a newer token writes, whatever the epoch
    ((3 << 32), 2, 9, True),  # a newer owner's fence: an older token's write is skipped
])
def test_already_written(recorded, token, epoch, expected):
    """Delta skips a write whose txnVersion is not above the one recorded for its app id."""
    from sluice.protocol import txn_version

    def already_written(recorded_txn_version: int | None, token: int, last_epoch: int) -> bool:
        return recorded_txn_version is not None and recorded_txn_version >= txn_version(token, last_epoch)

    assert already_written(recorded, token, epoch) is expected


def test_txn_version_packs_token_and_epoch():
    from sluice.protocol import fenced_out, txn_epoch, txn_token, txn_version

    version = txn_version(7, 41)
    assert (txn_token(version), txn_epoch(version)) == (7, 41)
    assert txn_epoch(txn_version(7, -1)) == -1, "a fence carries no epoch"
    assert txn_version(8, -1) > txn_version(7, 2**31), "a newer token outranks every epoch of an older one"
    assert fenced_out(txn_version(8, -1), 7) and not fenced_out(txn_version(7, 3), 7)
    assert not fenced_out(None, 1)
    with pytest.raises(ProtocolError):
        txn_version(1, 2**32)


def test_epochs_to_reprocess_picks_unpublished_epochs_in_order():
    # A dead run's leftovers: unwritten (planned), failed, and written but not yet published.
    states = [
        (0, protocol.PUBLISHED), (1, protocol.COMMITTED), (2, protocol.FAILED), (3, protocol.PLANNED),
        (4, protocol.QUARANTINED), (5, protocol.ROLLED_BACK), (6, protocol.PLANNED),
    ]
    assert epochs_to_reprocess(states) == [1, 2, 3, 6]


def test_epochs_to_reprocess_nothing_left():
    assert epochs_to_reprocess([]) == []
    assert epochs_to_reprocess([(0, protocol.PUBLISHED), (1, protocol.QUARANTINED), (2, protocol.ROLLED_BACK)]) == []


def test_unfinished_epochs_are_the_ones_to_rewrite():
    assert protocol.UNFINISHED == {protocol.PLANNED, protocol.FAILED}
    assert protocol.UNPUBLISHED == protocol.UNFINISHED | {protocol.COMMITTED}


def test_sink_app_id_format():
    assert sink_app_id("ysb", "campaign_views", 0) == "sluice:ysb:campaign_views:g0"
    assert sink_app_id("p", "s", 12) == "sluice:p:s:g12"


def test_sink_app_id_changes_with_generation():
    ids = {sink_app_id("ysb", "views", g) for g in range(5)}
    assert len(ids) == 5


def test_a_dead_driver_is_told_apart_from_a_failing_transform():
    from sluice.compute import driver_died

    class Py4JNetworkError(Exception):
        pass

    assert driver_died(ConnectionRefusedError(111, "Connection refused"))
    assert driver_died(Py4JNetworkError("An error occurred while trying to connect to the Java server"))
    wrapped = RuntimeError("job failed")
    wrapped.__cause__ = ConnectionResetError()
    assert driver_died(wrapped)
    assert driver_died(RuntimeError("java.lang.OutOfMemoryError: Java heap space"))
    assert not driver_died(ValueError("cannot resolve column campaign_id"))


# -- first_commit_holding: which commit reconcile restores before ------------------------------


def _commits(*specs):
    from sluice.protocol import TableCommit

    return [TableCommit(v, op, restored_to=r, app_id=a, generation=g, epochs=tuple(e)) for v, op, r, a, g, e in
            reversed(specs)]


def test_first_commit_holding_finds_the_oldest_commit_of_the_epochs():
    from sluice.protocol import first_commit_holding

    commits = _commits((0, "CREATE", None, None, None, ()), (1, "WRITE", None, "a", 0, (0, 1)),
                       (2, "WRITE", None, "a", 0, (2, 3)), (3, "WRITE", None, "a", 0, ()),  # a fence
                       (4, "WRITE", None, "a", 0, (4, 5)))
    assert first_commit_holding(commits, "a", 0, 4) == 4
    assert first_commit_holding(commits, "a", 0, 3) == 2
    assert first_commit_holding(commits, "a", 0, 6) is None
    assert first_commit_holding(commits, "b", 0, 0) is None


def test_first_commit_holding_follows_restores():
    from sluice.protocol import first_commit_holding

    # Epochs 2..3 were written at 2, undone by the RESTORE at 3 (to 1), written again at 4.
    commits = _commits((0, "CREATE", None, None, None, ()), (1, "WRITE", None, "a", 0, (0, 1)),
                       (2, "WRITE", None, "a", 0, (2, 3)), (3, "RESTORE", 1, None, None, ()))
    assert first_commit_holding(commits, "a", 0, 2) is None, "the restore undid them"
    commits = _commits((0, "CREATE", None, None, None, ()), (1, "WRITE", None, "a", 0, (0, 1)),
                       (2, "WRITE", None, "a", 0, (2, 3)), (3, "RESTORE", 1, None, None, ()),
                       (4, "MERGE", None, "a", 0, (2, 3)))
    assert first_commit_holding(commits, "a", 0, 2) == 4


def test_first_commit_holding_stops_at_an_older_generation():
    from sluice.protocol import first_commit_holding

    commits = _commits((0, "WRITE", None, "g0", 0, (0, 1, 2)), (1, "RESTORE", 0, None, None, ()),
                       (2, "WRITE", None, "g1", 1, (1, 2)))
    assert first_commit_holding(commits, "g1", 1, 1) == 2
    assert first_commit_holding(commits, "g1", 1, 3) is None


@pytest.mark.parametrize("late", ["fence", "create"])
def test_first_commit_holding_passes_over_a_late_fence_of_an_older_generation(late):
    """Sim seed 97003300: a table the rollback's rerun made and wrote in generation 1, then the
    fence of a generation-0 run stopped while it made its tables (its app id had no txn in that
    table). Stopping at that fence kept the rerun's epoch 0 beside the next attempt's: 35 extra
    counts. Seed 673911345: the same with that run's table creation, which on a table that is
    there lands as an empty append not marked a fence (epoch 0 twice in ``_rejected``). Neither
    holds data; an older generation's write still ends the walk."""
    from sluice.protocol import TableCommit, first_commit_holding

    commits = [TableCommit(v, "WRITE", app_id=a, generation=g, epochs=e, fence=f) for v, a, g, e, f in reversed((
        (0, "g1", 1, (), False), (1, "g1", 1, (0,), False), (2, "g0", 0, (), late == "fence"),
        (3, "g1", 1, (), True)))]
    assert first_commit_holding(commits, "g1", 1, 0) == 1
    written = [TableCommit(v, "WRITE", app_id=a, generation=g, epochs=e, fence=f) for v, a, g, e, f in reversed((
        (0, "g1", 1, (), False), (1, "g1", 1, (0,), False), (2, "g0", 0, (5,), False), (3, "g1", 1, (), True)))]
    assert first_commit_holding(written, "g1", 1, 0) is None


def test_lease_owner_round_trips_run_ids_with_colons_and_names_its_dag():
    run = protocol.LeaseOwner.dag_run("ysb", "manual__2026-11-24T11:20:25.123+00:00")
    assert str(run) == "airflow:ysb:manual__2026-11-24T11:20:25.123+00:00"
    assert protocol.LeaseOwner.parse(str(run)) == run
    assert run.dag_prefix == protocol.LeaseOwner.runs_of("ysb") == "airflow:ysb:"
    here = protocol.LeaseOwner.this_process()
    assert protocol.LeaseOwner.parse(str(here)) == here and here.dag_prefix is None and here.name.isdigit()
    assert protocol.LeaseOwner.parse("cli:host.example:42").scope == "host.example"
    for text in (None, "", "new-owner", "airflow:ysb", "job:x:1"):
        assert protocol.LeaseOwner.parse(text) is None


# -- foreign_commits: a RESTORE must not undo another pipeline's rows ---------------------------


def test_foreign_commits_lists_other_pipelines_above_the_target_in_the_current_lineage():
    from sluice.protocol import TableCommit, foreign_commits

    newest_first = [TableCommit(v, op, restored_to=r, pipeline=p) for v, op, r, p in reversed([
        (0, "CREATE", None, "a"), (1, "WRITE", None, "a"), (2, "WRITE", None, "b"), (3, "WRITE", None, "a"),
        (4, "WRITE", None, "b"), (5, "RESTORE", 3, None), (6, "WRITE", None, "a"), (7, "WRITE", None, None)])]
    # b's version 4 was undone by the RESTORE to 3; its version 2 is still in the table.
    assert foreign_commits(newest_first, "a", 1) == {"b": [2]}
    assert foreign_commits(newest_first, "a", 2) == {}
    assert foreign_commits(newest_first, "b", 0) == {"a": [1, 3, 6]}
    assert foreign_commits(newest_first, "a", 7) == {}
    assert foreign_commits([], "a", 0) == {}


# -- plan_ranges bounded in bytes ---------------------------------------------------------------


def test_plan_ranges_bounded_in_bytes_ends_an_epoch_before_the_file_that_passes_the_bound():
    sizes = [40, 40, 30, 100, 5, 5, 250, 10]  # offsets 10..17
    assert spans(plan_ranges(10, 18, 4, 10, sizes, max_bytes=100)) == [
        (10, 12), (12, 13), (13, 14), (14, 16), (16, 17), (17, 18)]  # 40+40+30 > 100 ends it; 250 alone
    assert spans(plan_ranges(10, 18, 2, 10, sizes, max_bytes=1000)) == [(10, 12), (12, 14), (14, 16), (16, 18)]
    assert spans(plan_ranges(10, 18, 4, 2, sizes, max_bytes=100)) == [(10, 12), (12, 13)]  # k still caps


def test_plan_ranges_bounded_in_bytes_random_invariants():
    rnd = random.Random(5)
    for _ in range(300):
        n = rnd.randint(0, 30)
        sizes = [rnd.randint(0, 50) for _ in range(n)]
        bound, size, k = rnd.randint(1, 120), rnd.randint(1, 8), rnd.randint(1, 40)
        ranges = plan_ranges(3, 3 + n, size, k, sizes, max_bytes=bound)
        check_contiguous([(i, r.start, r.end) for i, r in enumerate(ranges)], first_offset=3)
        assert len(ranges) <= k
        for r in ranges:
            held = sizes[r.start - 3:r.end - 3]
            assert 1 <= len(held) <= size
            assert sum(held) <= bound or len(held) == 1, (sizes, bound, spans(ranges))
            if r.end < 3 + n and len(held) < size and r is not ranges[-1]:
                assert sum(held) + sizes[r.end - 3] > bound, "an epoch ended early without reaching the bound"
        if len(ranges) < k:
            assert (ranges[-1].end if ranges else 3) == 3 + n, "backlog left although k allowed more"


def test_plan_ranges_bounded_in_bytes_needs_every_size():
    with pytest.raises(ProtocolError, match="needs a size for each"):
        plan_ranges(0, 3, 2, 2, [1, 2], max_bytes=10)
    with pytest.raises(ProtocolError):
        plan_ranges(0, 3, 2, 2, None, max_bytes=10)
