"""``EpochLog``: the write-ahead log of epochs, groups, source manifests and leases.

Epoch ranges are written here *before* any data is read and never change afterwards, so a
rerun reads exactly the same records. A lease with a fencing token keeps at most one group per
pipeline in flight: every state change a run makes carries its token and fails once a newer
run has taken the lease over.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Engine, cast, create_engine, event, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker

from sluice import protocol
from sluice.errors import FencedError, PipelineBusyError, ProtocolError
from sluice.store import schema
from sluice.store.models import ControlRow, EpochRow, GroupRow, PipelineRow, SourceFileRow

DEFAULT_LEASE_TTL_S = 600.0


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def store_url() -> str:
    """Where the epoch store lives.

    ``$SLUICE_STORE_URL`` wins; else the Airflow connection ``sluice_store`` (its extra
    ``url`` or its URI) when one is defined; else SQLite under ``$AIRFLOW_HOME`` (or ``var/``).
    """
    url = os.environ.get("SLUICE_STORE_URL")
    if url:
        return url
    if os.environ.get("AIRFLOW_CONN_SLUICE_STORE") or "airflow.sdk" in sys.modules:
        url = _airflow_connection_url()
        if url:
            return url
    home = os.environ.get("AIRFLOW_HOME")
    if home:
        return f"sqlite:///{Path(home) / 'sluice.db'}"
    from sluice.paths import data_dir

    return f"sqlite:///{data_dir() / 'sluice.db'}"


def _airflow_connection_url() -> str | None:
    try:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection("sluice_store")
    except Exception:  # no such connection, or not inside Airflow: fall back to the default
        return None
    url = conn.extra_dejson.get("url")
    if url:
        return url
    uri = conn.get_uri()
    return uri.replace("postgres://", "postgresql+psycopg2://", 1)


def _dead_local_process(owner: str | None) -> bool:
    """A command-line owner ``cli:<host>:<pid>`` on this host whose process has exited."""
    parsed = protocol.LeaseOwner.parse(owner)
    here = protocol.LeaseOwner.this_process()
    if parsed is None or parsed.kind != here.kind or parsed.scope != here.scope or not parsed.name.isdigit():
        return False
    try:
        os.kill(int(parsed.name), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclass(frozen=True)
class Lease:
    pipeline: str
    owner: str
    fence: int


@dataclass(frozen=True)
class FileSkip:
    """An operator's decision to leave a file out of its epoch (gone or unreadable)."""

    at: datetime
    by: str
    reason: str

    def as_record(self) -> dict[str, str]:
        return {"at": self.at.isoformat() + "Z", "by": self.by, "reason": self.reason}


@dataclass(frozen=True)
class ManifestEntry:
    position: int
    path: str
    size: int
    mtime: float
    skipped: FileSkip | None = None

    @classmethod
    def of(cls, row: SourceFileRow) -> ManifestEntry:
        skipped = (FileSkip(row.skipped_at, row.skipped_by or "", row.skip_reason or "")
                   if row.skipped_at is not None else None)
        return cls(row.position, row.path, row.size, row.mtime, skipped)

    def as_record(self) -> dict[str, Any]:
        return {"position": self.position, "path": self.path, "size": self.size, "mtime": self.mtime,
                "skipped": self.skipped.as_record() if self.skipped else None}


@dataclass(frozen=True)
class Epoch:
    pipeline: str
    epoch_id: int
    generation: int
    group_id: int
    start: int
    end: int
    state: str
    attempts: int = 0
    delta_versions: dict[str, int | None] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    validation: dict[str, Any] | None = None
    planned_at: datetime | None = None
    committed_at: datetime | None = None
    published_at: datetime | None = None
    #: The generation whose run wrote the epoch (a rollback carries kept epochs into the new
    #: generation unchanged; ``generation`` is then the one it lives in now).
    written_generation: int | None = None

    @classmethod
    def of(cls, row: EpochRow) -> Epoch:
        return cls(
            pipeline=row.pipeline, epoch_id=row.epoch_id, generation=row.generation,
            group_id=row.group_id, start=row.start_offset, end=row.end_offset, state=row.state,
            attempts=row.attempts, delta_versions=dict(row.delta_versions or {}),
            rows=dict(row.rows or {}), timings=dict(row.timings or {}), error=row.error,
            validation=row.validation, planned_at=row.planned_at, committed_at=row.committed_at,
            published_at=row.published_at,
            written_generation=row.generation if row.origin_generation is None else row.origin_generation,
        )

    def as_record(self) -> dict[str, Any]:
        """JSON-able form, for XCom, logs and the ``_sluice/epochs`` records."""
        record = {k: v for k, v in self.__dict__.items()}
        for key in ("planned_at", "committed_at", "published_at"):
            value = record[key]
            record[key] = value.isoformat() + "Z" if value else None
        return record


@dataclass(frozen=True)
class Group:
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


def _configure_sqlite(engine: Engine) -> None:
    """WAL mode, a generous busy timeout, and BEGIN IMMEDIATE for every transaction.

    pysqlite's default deferred BEGIN lets two writers both read, then deadlock on upgrade;
    taking the write lock at BEGIN serialises planners instead, which the lease relies on.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback of ``pipeline`` to ``to_epoch`` changes in the epoch log."""

    pipeline: str
    to_epoch: int
    generation: int  # the generation being rolled back
    rolled_back: tuple[Epoch, ...]  # epochs >= to_epoch of that generation
    kept: tuple[Epoch, ...]  # epochs < to_epoch, carried into the new generation


#: One engine (and schema check) per store URL and process: an Airflow worker, the triggerer
#: and the api-server open the store once per task, poke or request, and each opening used to
#: pay a schema check. Keyed by process id too: a pool must not cross a
#: fork (the task runner forks its workers). A SQLite file deleted or replaced since (a lost
#: store, rebuilt) gets a new engine: the old one would write to the unlinked file.
_ENGINES: dict[tuple[int, str], tuple[Engine, sessionmaker[Session], int | None]] = {}
_ENGINES_LOCK = threading.Lock()


def _sqlite_file(url: str) -> Path | None:
    path = url.removeprefix("sqlite:///")
    return Path(path) if url.startswith("sqlite:///") and path and path != ":memory:" else None


def _inode(path: Path | None) -> int | None:
    try:
        return path.stat().st_ino if path is not None else None
    except FileNotFoundError:
        return -1


def _open(url: str) -> tuple[Engine, sessionmaker[Session]]:
    key, file = (os.getpid(), url), _sqlite_file(url)
    with _ENGINES_LOCK:
        cached = _ENGINES.get(key)
        if cached is not None and cached[2] == _inode(file):
            return cached[0], cached[1]
        if cached is not None:
            cached[0].dispose()
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, future=True)
        if engine.dialect.name == "sqlite":
            _configure_sqlite(engine)
        schema.upgrade(engine)
        sessions = sessionmaker(engine, expire_on_commit=False)
        _ENGINES[key] = engine, sessions, _inode(file)
        return engine, sessions


class EpochLog:
    """The epoch store of all pipelines, in one SQL database (SQLite or Postgres). Cheap to
    construct: the engine behind a URL is made (and the schema checked) once per process."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or store_url()
        self.engine, self._sessions = _open(self.url)

    def close(self) -> None:
        """Close the idle pooled connections (the engine stays usable: it opens new ones)."""
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    # -- pipelines and leases -------------------------------------------------------------

    def _pipeline(self, session: Session, name: str, *, lock: bool = False) -> PipelineRow:
        """The pipeline's row, locked for a writer. Only a writer creates it: a read of a
        pipeline that never ran (the epoch API, a sensor) sees its initial state and writes
        nothing, so it never takes the store's write lock."""
        stmt = select(PipelineRow).where(PipelineRow.name == name)
        if lock:
            stmt = stmt.with_for_update()
        row = session.scalars(stmt).first()
        if row is None and not lock:
            return PipelineRow(name=name, generation=0, fence=0, created_at=utcnow())
        if row is None:
            # SELECT ... FOR UPDATE locks no row that does not exist yet: on Postgres two first
            # writers both get here, and the second's INSERT waits for the first's commit, then
            # fails on the key. Its savepoint absorbs that, and it locks the row the first made.
            # (SQLite's BEGIN IMMEDIATE already serialised them.)
            try:
                with session.begin_nested():
                    session.add(PipelineRow(name=name, generation=0, fence=0, created_at=utcnow()))
            except IntegrityError:
                pass
            row = session.scalars(stmt).one()
        return row

    def generation(self, pipeline: str) -> int:
        with self._tx() as s:
            return self._pipeline(s, pipeline).generation

    def acquire_lease(self, pipeline: str, owner: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S,
                      take_over_prefix: str | None = None, alive: Callable[[str], bool] | None = None) -> Lease:
        """Take the pipeline's lease, or fail fast with ``PipelineBusyError``.

        The same owner re-acquires its own lease (a retried task). A lease held by another
        owner is taken only once it has expired, when it belongs to a command-line run on this
        host whose process is gone, or when its owner starts with ``take_over_prefix`` (another
        run of the same DAG) and ``alive(owner)`` says that run has ended. Without ``alive`` the
        prefix alone decides, which is right only where one run of the DAG can be active at a
        time: Airflow applies ``max_active_runs`` to backfill runs separately, so a backfill run
        and a scheduled run of one DAG can overlap. Every acquisition bumps the fencing token.
        """
        now = utcnow()
        with self._tx() as s:
            row = self._pipeline(s, pipeline, lock=True)
            held = row.lease_owner is not None and row.lease_owner != owner
            live = row.lease_expires_at is not None and row.lease_expires_at > now
            stale_same_dag = (take_over_prefix is not None and (row.lease_owner or "").startswith(take_over_prefix)
                              and not (alive is not None and row.lease_owner and alive(row.lease_owner)))
            if held and live and not stale_same_dag and not _dead_local_process(row.lease_owner):
                raise PipelineBusyError(
                    f"pipeline {pipeline!r} is busy: its lease is held by {row.lease_owner!r} "
                    f"since {row.lease_acquired_at:%Y-%m-%d %H:%M:%S} UTC until "
                    f"{row.lease_expires_at:%H:%M:%S} UTC; at most one group per pipeline may be "
                    "in flight. Wait for that run, or release the lease once it is known dead."
                )
            if row.lease_owner != owner:
                row.lease_acquired_at = now
            row.lease_owner = owner
            row.lease_expires_at = now + timedelta(seconds=ttl_s)
            row.fence += 1
            return Lease(pipeline, owner, row.fence)

    def _check_fence(self, session: Session, lease: Lease) -> PipelineRow:
        row = self._pipeline(session, lease.pipeline, lock=True)
        if row.fence != lease.fence or row.lease_owner != lease.owner:
            raise FencedError(
                f"pipeline {lease.pipeline!r}: lease of {lease.owner!r} (token {lease.fence}) was "
                f"taken over by {row.lease_owner!r} (token {row.fence}); this run must stop"
            )
        return row

    def renew_lease(self, lease: Lease, ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        with self._tx() as s:
            row = self._check_fence(s, lease)
            row.lease_expires_at = utcnow() + timedelta(seconds=ttl_s)

    def check_lease(self, lease: Lease) -> None:
        with self._tx() as s:
            self._check_fence(s, lease)

    def release_lease(self, lease: Lease) -> bool:
        """Give the lease up if this run still holds it; returns whether it did."""
        with self._tx() as s:
            row = self._pipeline(s, lease.pipeline, lock=True)
            if row.fence != lease.fence or row.lease_owner != lease.owner:
                return False
            row.lease_owner = row.lease_expires_at = row.lease_acquired_at = None
            return True

    def lease_holder(self, pipeline: str) -> str | None:
        with self._tx() as s:
            row = self._pipeline(s, pipeline)
            return row.lease_owner if row.lease_expires_at and row.lease_expires_at > utcnow() else None

    def current_lease(self, pipeline: str, owner: str) -> Lease:
        """The lease ``owner`` holds now (for a task that continues a run's group)."""
        with self._tx() as s:
            row = self._pipeline(s, pipeline)
            if row.lease_owner != owner:
                raise FencedError(f"pipeline {pipeline!r}: {owner!r} does not hold the lease "
                                  f"(holder: {row.lease_owner!r})")
            return Lease(pipeline, owner, row.fence)

    # -- source manifest ---------------------------------------------------------------------

    @staticmethod
    def _manifest_end(session: Session, pipeline: str) -> int:
        last = session.scalar(select(func.max(SourceFileRow.position)).where(SourceFileRow.pipeline == pipeline))
        return 0 if last is None else last + 1

    def known_files(self, pipeline: str) -> set[tuple[str, int, float]]:
        """``(path, size, mtime)`` of every file in the manifest: what a file source has seen."""
        with self._tx() as s:
            return {(p, size, mtime) for p, size, mtime in s.execute(
                select(SourceFileRow.path, SourceFileRow.size, SourceFileRow.mtime)
                .where(SourceFileRow.pipeline == pipeline))}

    def register_files(self, pipeline: str, files: Sequence[tuple[str, int, float]]) -> int:
        """Append newly discovered ``(path, size, mtime)`` files, in the given order, to the
        manifest; paths already registered keep their position. Returns the manifest's end."""
        now = utcnow()
        with self._tx() as s:
            if not files:  # a poll that found nothing new writes nothing
                return self._manifest_end(s, pipeline)
            # Positions are dense: the pipeline's row lock serialises registrations (a sensor's
            # and a planner's) on Postgres, as BEGIN IMMEDIATE does on SQLite.
            self._pipeline(s, pipeline, lock=True)
            known = set(s.scalars(select(SourceFileRow.path).where(SourceFileRow.pipeline == pipeline)))
            position = self._manifest_end(s, pipeline)
            for path, size, mtime in files:
                if path in known:
                    continue
                s.add(SourceFileRow(pipeline=pipeline, position=position, path=path, size=size,
                                    mtime=mtime, discovered_at=now))
                known.add(path)
                position += 1
            return position

    def manifest(self, pipeline: str, start: int = 0, end: int | None = None) -> list[ManifestEntry]:
        with self._tx() as s:
            stmt = select(SourceFileRow).where(SourceFileRow.pipeline == pipeline,
                                               SourceFileRow.position >= start)
            if end is not None:
                stmt = stmt.where(SourceFileRow.position < end)
            rows = s.scalars(stmt.order_by(SourceFileRow.position))
            return [ManifestEntry.of(r) for r in rows]

    def manifest_tail(self, pipeline: str, start: int, last: int) -> list[ManifestEntry]:
        """The entries from position ``start`` on, together with the manifest's ``last`` last
        entries wherever they start, by position: what a backlog poll reads, in one query."""
        with self._tx() as s:
            other = aliased(SourceFileRow)  # not correlated with the outer query's rows
            end = select(func.max(other.position)).where(other.pipeline == pipeline).scalar_subquery()
            rows = s.scalars(select(SourceFileRow).where(
                SourceFileRow.pipeline == pipeline,
                or_(SourceFileRow.position >= start, SourceFileRow.position > end - last),
            ).order_by(SourceFileRow.position))
            return [ManifestEntry.of(r) for r in rows]

    def chunk_ends(self, pipeline: str, prefix: str) -> dict[int, int]:
        """Per key, the highest ``end`` of the manifest's paths ``<prefix><key>/<start>-<end>``
        (integers): a Kafka source's chunks, ``prefix`` ``kafka://<topic>/``, key the partition.
        One aggregate query, however long the manifest; other paths are left out."""
        path = SourceFileRow.path
        strpos = func.instr if self.engine.dialect.name == "sqlite" else func.strpos  # same arguments
        rest = func.substr(path, len(prefix) + 1)  # <key>/<start>-<end>
        chunks = select(
            cast(func.substr(rest, 1, strpos(rest, "/") - 1), BigInteger).label("key"),
            cast(func.substr(rest, strpos(rest, "-") + 1), BigInteger).label("end"),
        ).where(SourceFileRow.pipeline == pipeline, func.substr(path, 1, len(prefix)) == prefix).subquery()
        with self._tx() as s:
            return {int(key): int(end) for key, end in s.execute(
                select(chunks.c.key, func.max(chunks.c.end)).group_by(chunks.c.key))}

    def skip_file(self, pipeline: str, path: str, *, by: str, reason: str) -> tuple[ManifestEntry, list[int]]:
        """Leave a registered file out of its epoch on purpose, recorded (who, when, why).

        Epochs whose range holds the file read around it from now on, reruns and rollback
        recomputes included. Failed epochs holding it, and the failed epochs of their groups,
        get fresh attempts, so a pipeline halted on that file runs again. Returns the entry and
        the epochs of the current generation that hold it."""
        if not reason.strip():
            raise ProtocolError(f"pipeline {pipeline!r}: skipping {path} needs a reason (it is recorded)")
        with self._tx() as s:
            row = s.scalars(select(SourceFileRow).where(SourceFileRow.pipeline == pipeline,
                                                        SourceFileRow.path == path)).first()
            if row is None:
                raise ProtocolError(
                    f"pipeline {pipeline!r}: {path} is not in the source manifest (never discovered); a file "
                    "that was never discovered needs no skip: remove it from the landing folder")
            if row.skipped_at is None:
                row.skipped_at, row.skipped_by, row.skip_reason = utcnow(), by, reason[:4000]
            gen = self._pipeline(s, pipeline).generation
            holders = list(s.scalars(select(EpochRow).where(
                EpochRow.pipeline == pipeline, EpochRow.generation == gen, EpochRow.state != protocol.ROLLED_BACK,
                EpochRow.start_offset <= row.position, EpochRow.end_offset > row.position)))
            # One commit per group: the other epochs of a holder's group failed with it.
            groups = {e.group_id for e in holders if e.state == protocol.FAILED}
            for epoch in s.scalars(select(EpochRow).where(EpochRow.pipeline == pipeline, EpochRow.generation == gen,
                                                          EpochRow.state == protocol.FAILED)):
                if epoch.group_id in groups:
                    epoch.attempts = 0
            s.flush()
            return ManifestEntry.of(row), [e.epoch_id for e in holders]

    # -- epochs and groups -------------------------------------------------------------------

    def epochs(self, pipeline: str, generation: int | None = None) -> list[Epoch]:
        """Epochs of one generation (default: the current one), in epoch order."""
        with self._tx() as s:
            gen = self._pipeline(s, pipeline).generation if generation is None else generation
            rows = s.scalars(select(EpochRow).where(EpochRow.pipeline == pipeline, EpochRow.generation == gen)
                             .order_by(EpochRow.epoch_id))
            return [Epoch.of(r) for r in rows]

    def epoch_history(self, pipeline: str) -> list[Epoch]:
        """Every epoch of every generation once, in (epoch, written generation) order: a
        rolled-back epoch as ``rolled_back`` in the generation that wrote it, an epoch a
        rollback carried forward once, with its current state and ``written_generation``."""
        with self._tx() as s:
            rows = s.scalars(select(EpochRow).where(EpochRow.pipeline == pipeline)
                             .order_by(EpochRow.epoch_id, EpochRow.generation))
            newest: dict[tuple[int, int], EpochRow] = {}
            for r in rows:  # a carried copy replaces the row it was copied from
                newest[(r.epoch_id, r.generation if r.origin_generation is None else r.origin_generation)] = r
            return [Epoch.of(newest[key]) for key in sorted(newest)]

    def next_offset(self, pipeline: str) -> int:
        """The first source offset no live epoch covers."""
        with self._tx() as s:
            return self._next_offset(s, pipeline, self._pipeline(s, pipeline).generation)

    @staticmethod
    def _next_offset(session: Session, pipeline: str, generation: int) -> int:
        end = session.scalar(select(func.max(EpochRow.end_offset)).where(
            EpochRow.pipeline == pipeline, EpochRow.generation == generation,
            EpochRow.state != protocol.ROLLED_BACK))
        return end or 0

    def group(self, pipeline: str, group_id: int) -> Group:
        with self._tx() as s:
            return self._group(s, pipeline, group_id)

    @staticmethod
    def _group(session: Session, pipeline: str, group_id: int, reprocessing: bool = False) -> Group:
        g = session.get(GroupRow, (pipeline, group_id))
        if g is None:
            raise ProtocolError(f"pipeline {pipeline!r} has no group {group_id}")
        rows = session.scalars(select(EpochRow).where(EpochRow.pipeline == pipeline, EpochRow.group_id == group_id)
                               .order_by(EpochRow.epoch_id, EpochRow.generation))
        latest: dict[int, EpochRow] = {}
        for r in rows:  # the newest generation of each epoch in the group
            latest[r.epoch_id] = r
        return Group(pipeline, group_id, g.owner, g.fence, g.state,
                     tuple(Epoch.of(r) for r in latest.values()), dict(g.plan or {}), reprocessing)

    def group_plans(self, pipeline: str) -> dict[int, dict[str, Any]]:
        """Each group's plan (sizes, reason, why it started) by group id, in one query."""
        with self._tx() as s:
            rows = s.execute(select(GroupRow.group_id, GroupRow.plan).where(GroupRow.pipeline == pipeline))
            return {group_id: dict(plan or {}) for group_id, plan in rows}

    def groups(self, pipeline: str) -> list[Group]:
        with self._tx() as s:
            ids = s.scalars(select(GroupRow.group_id).where(GroupRow.pipeline == pipeline).order_by(GroupRow.group_id))
            return [self._group(s, pipeline, i) for i in list(ids)]

    def plan_group(self, lease: Lease, *, epoch_size: int, k: int, plan: dict[str, Any] | None = None,
                   only_leftovers: bool = False, through_epoch: int | None = None,
                   until_offset: int | None = None, fresh_attempts: bool = False,
                   max_bytes: int | None = None) -> Group | None:
        """Reconcile, then plan (write-ahead) the next group of this pipeline.

        Epochs a dead run left ``planned`` or ``failed`` form the group first, with their
        recorded ranges. Otherwise up to ``k`` new epochs of ``epoch_size`` offsets are appended
        from the next unplanned offset to the end of the manifest, in one transaction. Returns
        ``None`` when there is nothing to do. ``only_leftovers`` plans nothing new (recovery);
        ``through_epoch`` takes leftovers only up to that epoch (a backfill run's share);
        ``until_offset`` plans new epochs only below that offset (a backfill run's data);
        ``fresh_attempts`` resets the leftovers' attempt counts (an operator's recovery);
        ``max_bytes`` bounds each new epoch in bytes too (files skipped on purpose count 0).
        """
        now = utcnow()
        with self._tx() as s:
            pipe = self._check_fence(s, lease)
            if pipe.pending_rollback:
                raise ProtocolError(f"pipeline {lease.pipeline!r}: {_pending_message(pipe.pending_rollback)}")
            gen = pipe.generation
            rows = list(s.scalars(select(EpochRow).where(EpochRow.pipeline == lease.pipeline,
                                                         EpochRow.generation == gen).order_by(EpochRow.epoch_id)))
            leftover_ids = protocol.epochs_to_reprocess([(r.epoch_id, r.state) for r in rows])
            if through_epoch is not None:
                leftover_ids = [i for i in leftover_ids if i <= through_epoch]
            last_group = s.scalar(select(func.max(GroupRow.group_id)).where(GroupRow.pipeline == lease.pipeline))
            group_id = 0 if last_group is None else last_group + 1
            record = dict(plan or {}, epoch_size=epoch_size, k=k)
            if leftover_ids:
                # Re-run the dead run's epochs with their recorded ranges, as a new group.
                for r in rows:
                    if r.epoch_id in leftover_ids:
                        if fresh_attempts:
                            r.attempts = 0
                        dead = s.get(GroupRow, (lease.pipeline, r.group_id))
                        if dead is not None and dead.state == protocol.PLANNED:
                            dead.state, dead.finished_at = protocol.FAILED, now
                        r.group_id = group_id
                record["reason"] = f"reprocess epochs {leftover_ids} left unfinished by a previous run"
                first, last = leftover_ids[0], leftover_ids[-1]
                s.add(GroupRow(pipeline=lease.pipeline, group_id=group_id, owner=lease.owner, fence=lease.fence,
                               first_epoch=first, last_epoch=last, state=protocol.PLANNED, plan=record,
                               planned_at=now))
                s.flush()
                return self._group(s, lease.pipeline, group_id, reprocessing=True)
            if only_leftovers:
                return None
            start = self._next_offset(s, lease.pipeline, gen)
            end = self._manifest_end(s, lease.pipeline)
            end = end if until_offset is None else min(end, until_offset)
            sizes = None
            if max_bytes is not None:
                sizes = [0 if skipped is not None else size for size, skipped in s.execute(
                    select(SourceFileRow.size, SourceFileRow.skipped_at).where(
                        SourceFileRow.pipeline == lease.pipeline, SourceFileRow.position >= start,
                        SourceFileRow.position < end).order_by(SourceFileRow.position))]
            ranges = protocol.plan_ranges(start, end, epoch_size, k, sizes, max_bytes)
            if not ranges:
                return None
            next_id = (max((r.epoch_id for r in rows), default=-1)) + 1
            for i, rng in enumerate(ranges):
                s.add(EpochRow(pipeline=lease.pipeline, epoch_id=next_id + i, generation=gen, group_id=group_id,
                               start_offset=rng.start, end_offset=rng.end, state=protocol.PLANNED,
                               attempts=0, delta_versions={}, rows={}, timings={}, planned_at=now))
            s.add(GroupRow(pipeline=lease.pipeline, group_id=group_id, owner=lease.owner, fence=lease.fence,
                           first_epoch=next_id, last_epoch=next_id + len(ranges) - 1, state=protocol.PLANNED,
                           plan=record, planned_at=now))
            s.flush()
            return self._group(s, lease.pipeline, group_id)

    def _epoch_row(self, session: Session, lease: Lease, epoch_id: int, generation: int) -> EpochRow:
        self._check_fence(session, lease)
        row = session.get(EpochRow, (lease.pipeline, epoch_id, generation))
        if row is None:
            raise ProtocolError(f"pipeline {lease.pipeline!r} has no epoch {epoch_id} in generation {generation}")
        return row

    def start_attempt(self, lease: Lease, epoch: Epoch) -> None:
        with self._tx() as s:
            row = self._epoch_row(s, lease, epoch.epoch_id, epoch.generation)
            row.attempts += 1

    def mark_committed(self, lease: Lease, epoch: Epoch, *, delta_versions: dict[str, int | None],
                       rows: dict[str, Any], timings: dict[str, float],
                       validation: dict[str, Any] | None = None) -> None:
        """Record that every sink holds the epoch (step 4 of the protocol)."""
        with self._tx() as s:
            row = self._epoch_row(s, lease, epoch.epoch_id, epoch.generation)
            if row.state in (protocol.COMMITTED, protocol.PUBLISHED):
                return  # a rerun of a committed epoch changes nothing
            protocol.check_transition(row.epoch_id, row.state, protocol.COMMITTED)
            row.state, row.error = protocol.COMMITTED, None
            row.delta_versions, row.rows, row.timings = delta_versions, rows, timings
            row.validation = validation
            row.committed_at = utcnow()

    def mark_group_committed(self, lease: Lease, epochs: Sequence[tuple[Epoch, dict[str, int | None],
                                                                        dict[str, Any], dict[str, float],
                                                                        dict[str, Any] | None]]) -> None:
        """Record a group commit (step 4): its epochs ``(epoch, delta versions, rows, timings,
        validation)`` become committed together, in one store transaction."""
        now = utcnow()
        with self._tx() as s:
            self._check_fence(s, lease)
            for epoch, versions, rows, timings, validation in epochs:
                row = s.get(EpochRow, (lease.pipeline, epoch.epoch_id, epoch.generation))
                if row is None:
                    raise ProtocolError(f"pipeline {lease.pipeline!r} has no epoch {epoch.epoch_id} in "
                                        f"generation {epoch.generation}")
                if row.state in (protocol.COMMITTED, protocol.PUBLISHED):
                    continue
                protocol.check_transition(row.epoch_id, row.state, protocol.COMMITTED)
                row.state, row.error = protocol.COMMITTED, None
                row.delta_versions, row.rows, row.timings, row.validation = versions, rows, timings, validation
                row.committed_at = now

    def mark_failed(self, lease: Lease, epoch: Epoch, error: str, *, validation: dict[str, Any] | None = None,
                    rows: dict[str, int] | None = None) -> None:
        with self._tx() as s:
            row = self._epoch_row(s, lease, epoch.epoch_id, epoch.generation)
            if row.state in (protocol.PLANNED, protocol.FAILED):
                row.state, row.error = protocol.FAILED, error[:4000]
                row.validation = validation
                if rows is not None:
                    row.rows = rows

    def finish_group(self, lease: Lease, group_id: int, state: str) -> Group:
        """Close a group: ``published`` moves its committed epochs to published."""
        now = utcnow()
        with self._tx() as s:
            self._check_fence(s, lease)
            g = s.get(GroupRow, (lease.pipeline, group_id))
            if g is None:
                raise ProtocolError(f"pipeline {lease.pipeline!r} has no group {group_id}")
            group = self._group(s, lease.pipeline, group_id)
            if state == protocol.PUBLISHED:
                pending = [e.epoch_id for e in group.epochs if e.state not in (protocol.COMMITTED, protocol.PUBLISHED)]
                if pending:
                    raise ProtocolError(f"pipeline {lease.pipeline!r} group {group_id}: epochs {pending} "
                                        "are not committed; cannot publish")
                for e in group.epochs:
                    row = s.get(EpochRow, (lease.pipeline, e.epoch_id, e.generation))
                    if row.state == protocol.COMMITTED:
                        row.state, row.published_at = protocol.PUBLISHED, now
            g.state, g.finished_at = state, now
            s.flush()
            return self._group(s, lease.pipeline, group_id)

    # -- halts, rollbacks, rebuilds ----------------------------------------------------------

    def halt_reason(self, pipeline: str, max_attempts: int) -> str | None:
        """Why no new group may start, or ``None``: a rollback left half done, an epoch that
        failed validation under the ``fail`` policy, or one that failed ``max_attempts`` times.
        Recovery (``sluice_recover``) reruns failed epochs regardless."""
        with self._tx() as s:
            pipe = self._pipeline(s, pipeline)
            if pipe.pending_rollback:
                return _pending_message(pipe.pending_rollback)
            failed = s.scalars(select(EpochRow).where(
                EpochRow.pipeline == pipeline, EpochRow.generation == pipe.generation,
                EpochRow.state == protocol.FAILED).order_by(EpochRow.epoch_id)).first()
        if failed is None:
            return None
        if failed.validation and not all(v.get("success", True) for v in failed.validation.values()):
            return (f"epoch {failed.epoch_id} failed validation and the policy is `fail`: {failed.error}. "
                    "Fix the transform or the data, then trigger sluice_recover (rerun with the same ranges) "
                    "or sluice_rollback")
        if failed.attempts >= max_attempts:
            return (f"epoch {failed.epoch_id} failed {failed.attempts} times (control.max_attempts = "
                    f"{max_attempts}); last error: {failed.error}. Fix the cause, then trigger sluice_recover")
        return None

    def unpublished_groups(self, pipeline: str, owner: str) -> list[Group]:
        """Groups ``owner`` planned that are not closed yet, in order (a DAG run's own groups)."""
        with self._tx() as s:
            ids = list(s.scalars(select(GroupRow.group_id).where(
                GroupRow.pipeline == pipeline, GroupRow.owner == owner, GroupRow.state == protocol.PLANNED)
                .order_by(GroupRow.group_id)))
            return [self._group(s, pipeline, i) for i in ids]

    def group_of_owner(self, pipeline: str, owner: str) -> Group | None:
        """The first group ``owner`` (a DAG run) planned, whatever its state now."""
        with self._tx() as s:
            first = s.scalar(select(func.min(GroupRow.group_id)).where(
                GroupRow.pipeline == pipeline, GroupRow.owner == owner))
            return None if first is None else self._group(s, pipeline, first)

    def rollback_plan(self, pipeline: str, to_epoch: int) -> RollbackPlan:
        """Which epochs a rollback to ``to_epoch`` would roll back and keep; raises
        ``ProtocolError`` when it cannot be done (no such epoch, unfinished epochs before it)."""
        with self._tx() as s:
            gen = self._pipeline(s, pipeline).generation
            rows = list(s.scalars(select(EpochRow).where(EpochRow.pipeline == pipeline, EpochRow.generation == gen)
                                  .order_by(EpochRow.epoch_id)))
        epochs = [Epoch.of(r) for r in rows if r.state != protocol.ROLLED_BACK]
        end = epochs[-1].epoch_id + 1 if epochs else 0
        if not 0 <= to_epoch <= end:
            raise ProtocolError(f"pipeline {pipeline!r}: cannot roll back to epoch {to_epoch}: generation {gen} "
                                f"holds epochs 0..{end - 1}")
        kept = tuple(e for e in epochs if e.epoch_id < to_epoch)
        unfinished = [e.epoch_id for e in kept if e.state in protocol.UNFINISHED]
        if unfinished:
            raise ProtocolError(f"pipeline {pipeline!r}: epochs {unfinished} before epoch {to_epoch} are not "
                                "written yet (planned or failed); recover them first, or roll back to "
                                f"epoch {unfinished[0]}")
        return RollbackPlan(pipeline, to_epoch, gen, tuple(e for e in epochs if e.epoch_id >= to_epoch), kept)

    def begin_rollback(self, lease: Lease, details: dict[str, Any]) -> None:
        """Record a rollback before any table is restored: until ``finish_rollback`` no group
        is planned, so a crash half way cannot let new epochs land on restored tables."""
        with self._tx() as s:
            row = self._check_fence(s, lease)
            if row.pending_rollback and not same_rollback(row.pending_rollback, details):
                raise ProtocolError(f"pipeline {lease.pipeline!r}: {_pending_message(row.pending_rollback)}")
            row.pending_rollback = dict(details, started_at=utcnow().isoformat() + "Z")

    def cancel_rollback(self, lease: Lease) -> None:
        """Withdraw a recorded rollback intent whose restores never started."""
        with self._tx() as s:
            self._check_fence(s, lease).pending_rollback = None

    def pending_rollback(self, pipeline: str) -> dict[str, Any] | None:
        with self._tx() as s:
            return self._pipeline(s, pipeline).pending_rollback

    def finish_rollback(self, lease: Lease, plan: RollbackPlan, *, replan: bool, reason: str,
                        through_epoch: int | None = None, replan_later: bool = True) -> tuple[int, Group | None]:
        """Roll the epoch log back: bump the generation, carry epochs before ``to_epoch`` into
        it, mark the rest ``rolled_back``; with ``replan``, plan their exact ranges again as one
        group of this lease (up to ``through_epoch``; the later ones as a group for a later run,
        unless not ``replan_later``: then the source position rewinds to them). Returns the
        new generation and that group."""
        now = utcnow()
        with self._tx() as s:
            pipe = self._check_fence(s, lease)
            if pipe.generation != plan.generation:
                raise ProtocolError(f"pipeline {lease.pipeline!r}: generation changed from {plan.generation} to "
                                    f"{pipe.generation} during the rollback")
            new_gen = plan.generation + 1
            last = s.scalar(select(func.max(GroupRow.group_id)).where(GroupRow.pipeline == lease.pipeline))
            group_id = 0 if last is None else last + 1
            # Committed but unpublished epochs before to_epoch are published with the recomputed ones.
            regroup = {e.epoch_id for e in plan.kept if e.state == protocol.COMMITTED} if replan else set()
            for e in plan.kept:
                old = s.get(EpochRow, (lease.pipeline, e.epoch_id, plan.generation))
                s.add(EpochRow(pipeline=old.pipeline, epoch_id=old.epoch_id, generation=new_gen,
                               group_id=group_id if old.epoch_id in regroup else old.group_id,
                               start_offset=old.start_offset, end_offset=old.end_offset,
                               state=old.state, attempts=old.attempts, delta_versions=old.delta_versions,
                               rows=old.rows, timings=old.timings, error=old.error, validation=old.validation,
                               planned_at=old.planned_at, committed_at=old.committed_at,
                               published_at=old.published_at,
                               origin_generation=(old.generation if old.origin_generation is None
                                                  else old.origin_generation)))
            for e in plan.rolled_back:
                row = s.get(EpochRow, (lease.pipeline, e.epoch_id, plan.generation))
                protocol.check_transition(e.epoch_id, row.state, protocol.ROLLED_BACK)
                row.state = protocol.ROLLED_BACK
                row.error = f"rolled back to epoch {plan.to_epoch} (generation {new_gen}): {reason}"[:4000]
            for g in s.scalars(select(GroupRow).where(GroupRow.pipeline == lease.pipeline,
                                                      GroupRow.state == protocol.PLANNED)):
                if g.last_epoch >= plan.to_epoch:
                    g.state, g.finished_at = protocol.ROLLED_BACK, now
            pipe.generation = new_gen
            pipe.pending_rollback = None
            group = None
            now_ids = [e.epoch_id for e in plan.rolled_back if through_epoch is None or e.epoch_id <= through_epoch]
            later = [e for e in plan.rolled_back if e.epoch_id not in now_ids]
            if replan and later and replan_later:  # planned again, for a later run (the next backfill run) to take
                s.add(GroupRow(pipeline=lease.pipeline, group_id=group_id + 1, owner="rollback", fence=lease.fence,
                               first_epoch=later[0].epoch_id, last_epoch=later[-1].epoch_id,
                               state=protocol.PLANNED, planned_at=now,
                               plan={"reason": f"recompute after rollback to epoch {plan.to_epoch}: {reason}"}))
                for e in later:
                    s.add(EpochRow(pipeline=lease.pipeline, epoch_id=e.epoch_id, generation=new_gen,
                                   group_id=group_id + 1, start_offset=e.start, end_offset=e.end,
                                   state=protocol.PLANNED, attempts=0, delta_versions={}, rows={}, timings={},
                                   planned_at=now))
            if replan and (now_ids or regroup):
                for e in plan.rolled_back[:len(now_ids)]:
                    s.add(EpochRow(pipeline=lease.pipeline, epoch_id=e.epoch_id, generation=new_gen,
                                   group_id=group_id, start_offset=e.start, end_offset=e.end,
                                   state=protocol.PLANNED, attempts=0, delta_versions={}, rows={}, timings={},
                                   planned_at=now))
                s.add(GroupRow(pipeline=lease.pipeline, group_id=group_id, owner=lease.owner, fence=lease.fence,
                               first_epoch=min(regroup, default=plan.to_epoch),
                               last_epoch=max([plan.to_epoch - 1, *now_ids]),
                               state=protocol.PLANNED, planned_at=now,
                               plan={"reason": f"recompute after rollback to epoch {plan.to_epoch}: {reason}",
                                     "epoch_size": None, "k": len(now_ids) + len(regroup)}))
                s.flush()
                group = self._group(s, lease.pipeline, group_id, reprocessing=True)
            return new_gen, group

    def has_pipeline(self, pipeline: str) -> bool:
        with self._tx() as s:
            return s.get(PipelineRow, pipeline) is not None or s.scalar(
                select(func.count()).select_from(EpochRow).where(EpochRow.pipeline == pipeline)) > 0

    def load_records(self, pipeline: str, generation: int, files: Sequence[tuple[int, str, int, float]],
                     epochs: Sequence[dict[str, Any]], *, fence: int = 0,
                     intent: dict[str, Any] | None = None) -> None:
        """Rebuild a lost store from published epoch records: the manifest ``(position, path,
        size, mtime)``, the epochs (all published, in ``generation``) and their groups, in one
        transaction; ``fence``: the last lease token the tables hold; ``intent``: a rollback
        intent that halts the pipeline until the rebuild clears it."""
        now = utcnow()
        with self._tx() as s:
            s.add(PipelineRow(name=pipeline, generation=generation, fence=fence, created_at=now,
                              pending_rollback=dict(intent, started_at=now.isoformat() + "Z") if intent else None))
            for position, path, size, mtime in files:
                s.add(SourceFileRow(pipeline=pipeline, position=position, path=path, size=size, mtime=mtime,
                                    discovered_at=now))
            groups: dict[int, list[dict[str, Any]]] = {}
            for e in epochs:
                groups.setdefault(e["group_id"], []).append(e)
                written = e.get("written_generation", e.get("generation", generation))
                s.add(EpochRow(pipeline=pipeline, epoch_id=e["epoch_id"], generation=generation,
                               origin_generation=None if written == generation else written,
                               group_id=e["group_id"], start_offset=e["start"], end_offset=e["end"],
                               state=protocol.PUBLISHED, attempts=e.get("attempts", 1),
                               delta_versions=e.get("delta_versions") or {}, rows=e.get("rows") or {},
                               timings=e.get("timings") or {}, validation=e.get("validation"),
                               planned_at=_parse_time(e.get("planned_at")) or now,
                               committed_at=_parse_time(e.get("committed_at")),
                               published_at=_parse_time(e.get("published_at"))))
            for group_id, members in groups.items():
                ids = [m["epoch_id"] for m in members]
                s.add(GroupRow(pipeline=pipeline, group_id=group_id, owner="rebuilt", fence=0,
                               first_epoch=min(ids), last_epoch=max(ids), state=protocol.PUBLISHED,
                               plan={"reason": "rebuilt from epoch records"}, planned_at=now, finished_at=now))

    # -- adaptive control ---------------------------------------------------------------------

    def control_state(self, pipeline: str) -> dict[str, Any] | None:
        with self._tx() as s:
            row = s.get(ControlRow, pipeline)
            return dict(row.state) if row else None

    def save_control_state(self, pipeline: str, state: dict[str, Any]) -> None:
        with self._tx() as s:
            row = s.get(ControlRow, pipeline)
            if row is None:
                s.add(ControlRow(pipeline=pipeline, state=state, updated_at=utcnow()))
            else:
                row.state, row.updated_at = state, utcnow()

    def summary(self, pipeline: str) -> dict[str, Any]:
        """Counts by state, contiguity and totals of the current generation, for reports."""
        epochs = self.epochs(pipeline)
        by_state: dict[str, int] = {}
        for e in epochs:
            by_state[e.state] = by_state.get(e.state, 0) + 1
        protocol.check_contiguous((e.epoch_id, e.start, e.end) for e in epochs)
        return {
            "pipeline": pipeline,
            "generation": self.generation(pipeline),
            "epochs": len(epochs),
            "groups": len({e.group_id for e in epochs}),
            "by_state": by_state,
            "offsets": [epochs[0].start, epochs[-1].end] if epochs else [0, 0],
            "rows": {key: sum(e.rows.get(key, 0) for e in epochs) for key in ("input", "output", "rejected")},
        }


def same_rollback(pending: dict[str, Any], details: dict[str, Any]) -> bool:
    """Whether ``details`` continue the recorded intent: the same epoch asked for, or the same
    epoch restored to (a rollback into a group commit restores to the group's first epoch)."""
    def targets(d: dict[str, Any]) -> set[Any]:
        return {d.get("to_epoch"), d.get("requested_to_epoch", d.get("to_epoch"))}

    return bool(targets(pending) & targets(details))


def _pending_message(pending: dict[str, Any]) -> str:
    if pending.get("rebuild"):
        return (f"a store rebuild started at {pending.get('started_at')} did not finish; run `make store-rebuild "
                "PIPELINE=<name>` (sluice rebuild-store) again to complete it")
    asked = pending.get("requested_to_epoch", pending.get("to_epoch"))
    return (f"a rollback to epoch {asked} started at {pending.get('started_at')} did not finish "
            f"({pending.get('reason')}); trigger sluice_rollback again with the same to_epoch to complete it")


def _parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.removesuffix("Z")) if value else None
