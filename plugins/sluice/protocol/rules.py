"""Pure rules of sluice's exactly-once protocol (Structured Streaming §6.1), free of I/O: the
epoch state machine, how ranges are planned, how a lease token travels in a Delta txn, how a
table's commits are read back, when an epoch has failed too often. The steps
(``sluice.protocol.run``, ``.group``, ``.operations``) apply them; keeping them here makes the
invariants unit-testable in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from sluice.errors import ProtocolError
from sluice.model import (
    COMMITTED,
    FAILED,
    PLANNED,
    PUBLISHED,
    QUARANTINED,
    ROLLED_BACK,
    UNFINISHED,
    UNPUBLISHED,
    Epoch,
    LeaseOwner,
    TableCommit,
)

__all__ = ["COMMITTED", "FAILED", "PLANNED", "PUBLISHED", "QUARANTINED", "ROLLED_BACK", "UNFINISHED", "UNPUBLISHED",
           "LeaseOwner", "TableCommit"]

#: States an epoch may move to from each state. ``failed`` epochs are retried with the same
#: range, so they can still commit; ``rolled_back`` is terminal for that generation.
TRANSITIONS: dict[str, frozenset[str]] = {
    PLANNED: frozenset({COMMITTED, FAILED, ROLLED_BACK}),
    FAILED: frozenset({COMMITTED, FAILED, ROLLED_BACK}),
    COMMITTED: frozenset({PUBLISHED, QUARANTINED, ROLLED_BACK}),
    QUARANTINED: frozenset({PUBLISHED, ROLLED_BACK}),
    PUBLISHED: frozenset({ROLLED_BACK}),
    ROLLED_BACK: frozenset(),
}


@dataclass(frozen=True)
class Range:
    """A half-open source offset range ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ProtocolError(f"invalid epoch range [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start


def check_transition(epoch_id: int, current: str, new: str) -> None:
    if new not in TRANSITIONS.get(current, frozenset()):
        raise ProtocolError(f"epoch {epoch_id}: cannot go from {current!r} to {new!r}")


def plan_ranges(next_offset: int, available_end: int, epoch_size: int, k: int,
                sizes: Sequence[int] | None = None, max_bytes: int | None = None,
                first_size: int | None = None) -> list[Range]:
    """Split the backlog ``[next_offset, available_end)`` into at most ``k`` epochs.

    Every epoch holds ``epoch_size`` offsets except possibly the last, and the ranges are
    contiguous: ``end(e) == start(e + 1)``. Nothing is planned beyond what is available, so
    ``k`` never exceeds the backlog.

    With ``max_bytes`` an epoch is bounded in bytes too: it ends before the offset that would
    take it past ``max_bytes`` (``sizes[i]`` is the size of offset ``next_offset + i``), and
    still holds at least one offset, so a file larger than the bound is an epoch of its own.

    With ``first_size`` the first epoch holds that many offsets instead (the controllers' probe
    of one epoch at a size not measured yet).
    """
    if epoch_size < 1 or k < 1 or (first_size is not None and first_size < 1):
        raise ProtocolError(f"epoch size, first size and k must be >= 1 (got {epoch_size}, {first_size}, {k})")
    if max_bytes is not None and (max_bytes < 1 or sizes is None or len(sizes) < available_end - next_offset):
        raise ProtocolError(f"a bound of {max_bytes} bytes needs a size for each of the {available_end - next_offset}"
                            f" offsets (got {None if sizes is None else len(sizes)})")
    ranges: list[Range] = []
    start = next_offset
    while start < available_end and len(ranges) < k:
        end = min(start + (first_size if first_size and not ranges else epoch_size), available_end)
        if max_bytes is not None and sizes is not None:
            total = 0
            for offset in range(start, end):
                total += sizes[offset - next_offset]
                if total > max_bytes and offset > start:
                    end = offset
                    break
        ranges.append(Range(start, end))
        start = end
    return ranges


def check_contiguous(ranges: Iterable[tuple[int, int, int]], first_offset: int = 0) -> None:
    """Raise unless ``(epoch_id, start, end)`` triples are dense and contiguous from 0."""
    expected_id, expected_start = 0, first_offset
    for epoch_id, start, end in ranges:
        if epoch_id != expected_id:
            raise ProtocolError(f"epoch ids not dense: expected {expected_id}, found {epoch_id}")
        if start != expected_start:
            raise ProtocolError(
                f"epoch {epoch_id} starts at {start}, but the previous epoch ended at {expected_start}"
            )
        Range(start, end)
        expected_id, expected_start = epoch_id + 1, end


def sink_app_id(pipeline: str, sink: str, generation: int) -> str:
    """The Delta ``txnAppId`` of one sink: a rollback bumps the generation (delta-io/delta#1813)."""
    return f"sluice:{pipeline}:{sink}:g{generation}"


#: A Delta ``txnVersion`` packs the writer's lease token above the epoch: ``token << 32 |
#: (last epoch + 1)``. Delta skips (and, when concurrent, refuses) a write whose txnVersion is not
#: above the one it recorded for the app id, so once a newer owner's token is in a table, no
#: older run can change it, whatever its timing: the fence is part of the Delta transaction.
TXN_EPOCH_BITS = 32


def txn_version(token: int, last_epoch: int) -> int:
    """The txnVersion of a commit holding epochs up to ``last_epoch`` (-1: a fence, no epoch)."""
    if not 0 <= last_epoch + 1 < 1 << TXN_EPOCH_BITS or token < 0:
        raise ProtocolError(f"cannot pack token {token} and epoch {last_epoch} into a txnVersion")
    return (token << TXN_EPOCH_BITS) | (last_epoch + 1)


def txn_token(version: int) -> int:
    """The lease token a txnVersion carries."""
    return version >> TXN_EPOCH_BITS


def txn_epoch(version: int) -> int:
    """The last epoch a txnVersion carries (-1 for a fence)."""
    return (version & ((1 << TXN_EPOCH_BITS) - 1)) - 1


def fenced_out(recorded_txn_version: int | None, token: int) -> bool:
    """Whether a newer owner's token is recorded in the table (this run may not write it)."""
    return recorded_txn_version is not None and txn_token(recorded_txn_version) > token


def epochs_to_reprocess(states: Sequence[tuple[int, str]]) -> list[int]:
    """Epoch ids a new run must finish and publish before planning more (a dead run's
    leftovers: unwritten, failed, or written but not yet published)."""
    return [epoch_id for epoch_id, state in states if state in UNPUBLISHED]


def current_lineage(commits: Iterable[TableCommit]) -> Iterator[TableCommit]:
    """The commits still in the table, newest first, from all its commits newest first: a
    RESTORE's lineage continues at the version it restored (what it undid is no longer in the
    table, and the RESTORE itself adds nothing). Lazy: a walk that stops early reads little."""
    restored_to: int | None = None
    for commit in commits:
        if restored_to is not None and commit.version > restored_to:
            continue  # undone by a RESTORE
        if commit.operation == "RESTORE" and commit.restored_to is not None:
            restored_to = commit.restored_to
            continue
        yield commit


def foreign_commits(commits: Iterable[TableCommit], pipeline: str, after: int) -> dict[str, list[int]]:
    """The commits of *other* sluice pipelines that a RESTORE of the table to version ``after``
    would undo: those above ``after`` in the table's current lineage, by pipeline. ``commits``
    come newest first. A table two pipelines write must never be restored by one of them: the
    other's rows would go too."""
    found: dict[str, list[int]] = {}
    for commit in current_lineage(commits):
        if commit.version <= after:
            break
        if commit.pipeline is not None and commit.pipeline != pipeline:
            found.setdefault(commit.pipeline, []).insert(0, commit.version)
    return found


def first_commit_holding(commits: Iterable[TableCommit], app_id: str, generation: int,
                         from_epoch: int) -> int | None:
    """The oldest commit, in the table's current lineage, in which ``app_id`` wrote any epoch
    >= ``from_epoch``; ``None`` when the table holds none of them.

    ``commits`` come newest first (read lazily: the walk usually stops after a few). The walk
    stops at a commit of an older generation that wrote data (a generation's writes all come
    after the rollback that started it) and at one of this app id holding only older epochs. An
    older generation's commit holding no epochs is passed over: a run of that generation that was
    stopped while it made its tables can land its fence after this generation's writes (sim seed
    97003300: a table the rollback's rerun had made and written, then the stale run's fence, and
    the next attempt stopped there and kept the rerun's epoch beside its own), or its table's
    creation, which on a table that is there lands as an empty append (seed 673911345).
    """
    found = None
    for commit in current_lineage(commits):
        if commit.app_id is not None and commit.generation is not None and commit.generation < generation:
            if not commit.epochs:
                continue
            break
        if commit.app_id == app_id and commit.epochs:
            if max(commit.epochs) < from_epoch:
                break
            found = commit.version
    return found


def halt_reason(epochs: Sequence[Epoch], max_attempts: int, max_crashes: int) -> str | None:
    """Why no new group may start because of the current generation's failed epochs, or
    ``None``: one that failed validation under the ``fail`` policy, one whose attempts failed
    ``max_attempts`` times (an error each time: a poison record, a bug), or one whose driver
    died ``max_crashes`` times without a word (killed, out of memory: counted apart, since a
    preempted machine is not a poison record). Recovery (``sluice_recover``) resets the counts."""
    for e in epochs:
        if e.state == FAILED and e.validation and not all(v.get("success", True) for v in e.validation.values()):
            return (f"epoch {e.epoch_id} failed validation and the policy is `fail`: {e.error}. "
                    "Fix the transform or the data, then recover (sluice_recover: rerun with the same ranges) "
                    "or roll back (sluice_rollback), from the console or `make recover`/`make rollback`")
    for e in epochs:
        if e.state in UNFINISHED and e.failures >= max_attempts:
            return (f"epoch {e.epoch_id} (offsets [{e.start}, {e.end})) failed {e.failures} times "
                    f"(control.max_attempts = {max_attempts}); last error: {e.error}. Fix the cause, then recover "
                    "(sluice_recover; or skip a file that is gone or unreadable, sluice_skip_file), from the "
                    "console or `make recover`/`make skip-file`")
        if e.state in UNFINISHED and e.crashes >= max_crashes:
            return (f"epoch {e.epoch_id} (offsets [{e.start}, {e.end})): its Spark driver died {e.crashes} times "
                    f"without reporting an error (control.max_crashes = {max_crashes}): killed, out of memory, or "
                    "its machine lost. Raise spark.driver.memory or lower control.epoch_files if it ran out of "
                    "memory, then recover (sluice_recover, from the console or `make recover`)")
    return None
