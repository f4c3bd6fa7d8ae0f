"""The typed records every layer of sluice shares: the protocol decides with them, the store
persists them, the Delta facade and the sources speak them. Pure data: no I/O, no Spark, no
Airflow. Records that are persisted as JSON (a rollback intent, the table-side epoch records)
carry a ``format`` so a newer release's record is refused rather than misread.

One idea, one type: an epoch with its source range is an ``EpochRange`` (what a table commit
and a read need), and an ``Epoch`` when the store's whole record of it travels (state,
attempts, versions, counts).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

# -- epoch states ------------------------------------------------------------------------------

PLANNED = "planned"
COMMITTED = "committed"
PUBLISHED = "published"
FAILED = "failed"
QUARANTINED = "quarantined"
ROLLED_BACK = "rolled_back"

#: Epochs in these states still need their data written (again, with the recorded range).
UNFINISHED = frozenset({PLANNED, FAILED})
#: Epochs a run planned but did not publish: the next run takes them over as its group, before
#: planning anything new; committed ones are not rewritten, only published.
UNPUBLISHED = UNFINISHED | {COMMITTED}


def iso(moment: datetime | None) -> str | None:
    """A naive UTC datetime as ISO text with a ``Z``."""
    return moment.isoformat() + "Z" if moment else None


def parse_iso(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.removesuffix("Z")) if value else None


# -- who holds a pipeline ----------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a pipeline's lease, stored as text: ``airflow:<dag_id>:<run_id>``, one DAG run
    (the runs of a DAG share the prefix ``airflow:<dag_id>:``), or ``cli:<host>:<pid>``, one
    process outside Airflow. Built and parsed here only."""

    kind: str  # AIRFLOW or CLI
    scope: str  # the DAG id, or the host
    name: str  # the run id, or the process id

    AIRFLOW = "airflow"
    CLI = "cli"

    @classmethod
    def dag_run(cls, dag_id: str, run_id: str) -> LeaseOwner:
        return cls(cls.AIRFLOW, dag_id, run_id)

    @classmethod
    def this_process(cls) -> LeaseOwner:
        return cls(cls.CLI, socket.gethostname(), str(os.getpid()))

    @classmethod
    def parse(cls, text: str | None) -> LeaseOwner | None:
        kind, _, rest = (text or "").partition(":")
        if kind == cls.AIRFLOW:
            scope, _, name = rest.partition(":")  # a DAG id holds no ':', a run id may
        elif kind == cls.CLI:
            scope, _, name = rest.rpartition(":")  # the process id comes last
        else:
            return None
        return cls(kind, scope, name) if scope and name else None

    @staticmethod
    def runs_of(dag_id: str) -> str:
        """The prefix of every run of ``dag_id``: what a take-over among one DAG's runs matches."""
        return f"{LeaseOwner.AIRFLOW}:{dag_id}:"

    @property
    def dag_prefix(self) -> str | None:
        return self.runs_of(self.scope) if self.kind == self.AIRFLOW else None

    def __str__(self) -> str:
        return f"{self.kind}:{self.scope}:{self.name}"


@dataclass(frozen=True)
class Lease:
    """A pipeline's lease as one run holds it: ``fence`` is its fencing token, bumped on every
    acquisition; every store write and every Delta commit of the run carries it."""

    pipeline: str
    owner: str
    fence: int


# -- the source's manifest ---------------------------------------------------------------------


@dataclass(frozen=True)
class FileSkip:
    """An operator's decision to leave a file out of its epoch (gone or unreadable)."""

    at: datetime
    by: str
    reason: str

    def as_record(self) -> dict[str, str]:
        return {"at": iso(self.at) or "", "by": self.by, "reason": self.reason}


@dataclass(frozen=True)
class ManifestEntry:
    """One registered piece of a source: a file, a Kafka chunk, a Delta version. Its position
    is the offset an epoch's range names; it never changes once given."""

    position: int
    path: str
    size: int
    mtime: float
    skipped: FileSkip | None = None

    def as_record(self) -> dict[str, Any]:
        return {"position": self.position, "path": self.path, "size": self.size, "mtime": self.mtime,
                "skipped": self.skipped.as_record() if self.skipped else None}


# -- epochs and groups -------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochRange:
    """One epoch's write-ahead range of source offsets ``[start, end)``: what a read and a table
    commit need of an epoch."""

    epoch_id: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Attempts:
    """How often an epoch was tried: ``total`` ever (never reset: the "attempted before" marker
    reconcile trusts on any storage), and since an operator's last reset the ``failures`` (an
    error was recorded: a poison record, a bug) and the ``crashes`` (an attempt that ended
    without a word: its driver was killed, went out of memory, its machine was lost)."""

    total: int = 0
    failures: int = 0
    crashes: int = 0
    open: bool = False  # an attempt started and has not recorded its outcome yet


@dataclass(frozen=True)
class Epoch:
    """An epoch as the store records it, in one generation."""

    pipeline: str
    epoch_id: int
    generation: int
    group_id: int
    start: int
    end: int
    state: str
    attempts: int = 0  # ever started (``Attempts.total``)
    delta_versions: dict[str, int | None] = field(default_factory=dict)
    rows: dict[str, Any] = field(default_factory=dict)  # counts: input, rejected, quarantined, output, keys
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    validation: dict[str, Any] | None = None
    planned_at: datetime | None = None
    committed_at: datetime | None = None
    published_at: datetime | None = None
    #: The generation whose run wrote the epoch (a rollback carries kept epochs into the new
    #: generation unchanged; ``generation`` is then the one it lives in now).
    written_generation: int | None = None
    failures: int = 0  # recorded failures since the last operator reset (``Attempts.failures``)
    crashes: int = 0  # attempts that ended without a word since then (``Attempts.crashes``)

    @property
    def range(self) -> EpochRange:
        return EpochRange(self.epoch_id, self.start, self.end)

    @property
    def commit_span(self) -> tuple[int, int] | None:
        """The first and last epoch of the Delta commit that holds this one (one commit per
        group), or ``None`` for a commit of its own."""
        span = self.rows.get("commit")
        return (int(span[0]), int(span[1])) if span else None

    def as_record(self) -> dict[str, Any]:
        """JSON-able form, for XCom, logs and the ``_sluice/epochs`` records."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("planned_at", "committed_at", "published_at"):
            record[key] = iso(record[key])
        return record


@dataclass(frozen=True)
class Group:
    """k consecutive epochs one run processes and commits together. ``plan`` is the sizing
    decision it was planned with (epoch size, k, why it started) as the store keeps it."""

    pipeline: str
    group_id: int
    owner: str
    fence: int
    state: str
    epochs: tuple[Epoch, ...]
    plan: dict[str, Any]
    reprocessing: bool = False

    @property
    def epoch_ids(self) -> list[int]:
        return [e.epoch_id for e in self.epochs]

    def as_record(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline, "group_id": self.group_id, "owner": self.owner,
            "fence": self.fence, "state": self.state, "plan": self.plan,
            "reprocessing": self.reprocessing, "epochs": [e.as_record() for e in self.epochs],
        }


# -- rollbacks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback of ``pipeline`` to ``to_epoch`` changes in the epoch log."""

    pipeline: str
    to_epoch: int
    generation: int  # the generation being rolled back
    rolled_back: tuple[Epoch, ...]  # epochs >= to_epoch of that generation
    kept: tuple[Epoch, ...]  # epochs < to_epoch, carried into the new generation


@dataclass(frozen=True)
class RollbackIntent:
    """A rollback recorded before any table is restored (the store's ``pending_rollback``):
    until it is finished or withdrawn no group is planned, so a crash half way cannot let new
    epochs land on restored tables. ``restoring``: restores may have started (it can then only
    be finished, not withdrawn). ``rebuild``: a store rebuild's orphan rollback."""

    to_epoch: int
    reason: str
    owner: str
    requested_to_epoch: int | None = None
    through_epoch: int | None = None
    generation: int | None = None
    restoring: bool = False
    rebuild: bool = False
    started_at: str | None = None

    FORMAT = 1

    @property
    def asked(self) -> int:
        """The epoch the operator asked for (a rollback into a group commit restores to before
        the group's first epoch)."""
        return self.to_epoch if self.requested_to_epoch is None else self.requested_to_epoch

    def continues(self, other: RollbackIntent) -> bool:
        """Whether ``other`` continues this intent: the same epoch asked for, or the same epoch
        restored to."""
        return bool({self.to_epoch, self.asked} & {other.to_epoch, other.asked})

    def as_record(self) -> dict[str, Any]:
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"format": self.FORMAT, **{k: v for k, v in record.items() if v is not None}}

    @classmethod
    def of(cls, record: dict[str, Any] | None) -> RollbackIntent | None:
        if not record:
            return None
        from sluice.errors import ProtocolError

        if int(record.get("format", 0)) > cls.FORMAT:
            raise ProtocolError(f"a rollback intent of format {record.get('format')} (this sluice reads up to "
                                f"{cls.FORMAT}): run the release that recorded it")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def describe(self) -> str:
        """Why the pipeline waits, and what an operator does about it."""
        if self.rebuild:
            return (f"a store rebuild started at {self.started_at} did not finish; run `make store-rebuild "
                    "PIPELINE=<name>` (sluice rebuild-store) again to complete it")
        text = (f"a rollback to epoch {self.asked} started at {self.started_at} did not finish ({self.reason}); "
                f"roll back again (sluice_rollback, from the console or `make rollback`) with the same to_epoch "
                "to complete it")
        if not self.restoring:
            text += (", or withdraw it (no table was restored yet): recover with withdraw_rollback=true "
                     "(the console, or `make recover WITHDRAW=true`)")
        return text


# -- Delta commits as the protocol reads them --------------------------------------------------


@dataclass(frozen=True)
class TableCommit:
    """What reconcile needs of one Delta commit: its operation, the version a RESTORE went back
    to, and the sluice ``userMetadata`` (app id, generation, epochs, token) if sluice wrote it."""

    version: int
    operation: str
    restored_to: int | None = None
    app_id: str | None = None
    generation: int | None = None
    epochs: tuple[int, ...] = ()
    token: int = 0  # the lease token of the run that wrote it (0: before tokens were recorded)
    pipeline: str | None = None  # the sluice pipeline that wrote it (None: not sluice)
    fence: bool = False  # an empty commit that only records a token
    sink: str | None = None  # the sink of ``pipeline`` this table is (None: not sluice, or not recorded)


@dataclass(frozen=True)
class Txn:
    """A Delta ``SetTransaction``: Delta skips a write whose version is not above the one it
    recorded for the app id, and refuses one that races a concurrent commit of the same app id."""

    app_id: str
    version: int
