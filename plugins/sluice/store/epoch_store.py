"""``EpochStore``: where sluice persists its write-ahead log of epochs, groups, source manifests,
leases and rollbacks, in one SQL database (SQLite or Postgres; never Airflow's).

The store only persists. What to write is decided by the protocol (``sluice.protocol``), which
composes the typed reads and writes of a ``StoreTx`` inside one transaction where a step must be
atomic (planning a group, finishing a rollback, taking a lease). The store enforces one rule of
its own, the fence: every change a run makes carries its lease token and fails once a newer run
took the lease over.

Every transaction is a step boundary (``sluice.boundary``) for the simulation. On SQLite a
transaction that writes takes the write lock at ``BEGIN IMMEDIATE`` (two writers serialise
instead of deadlocking on upgrade); a read begins deferred, so it never waits behind a writer
(WAL). On Postgres a lock wait gives up after ``LOCK_TIMEOUT_S`` and the server ends a
transaction left idle for ``IDLE_IN_TRANSACTION_S`` (a paused process cannot block a take-over
for ever). Lease expiry is judged by the store's clock, not by each host's.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    bindparam,
    cast,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, OperationalError

from sluice import boundary
from sluice.errors import FencedError, PipelineBusyError, ProtocolError
from sluice.model import (
    COMMITTED,
    FAILED,
    PLANNED,
    PUBLISHED,
    ROLLED_BACK,
    Epoch,
    FileSkip,
    Group,
    Lease,
    ManifestEntry,
    RollbackIntent,
)
from sluice.store import schema
from sluice.store.models import ControlRow, EpochRow, GroupRow, PipelineRow, RollbackRow, SourceFileRow

DEFAULT_LEASE_TTL_S = 600.0
#: Postgres: how long a statement waits for a row lock (a take-over behind a paused holder).
LOCK_TIMEOUT_S = 10
#: Postgres: a transaction idle this long (its process paused or lost) is ended by the server.
IDLE_IN_TRANSACTION_S = 60


def utcnow() -> datetime:
    """This host's clock, naive UTC (what a record says when something happened here; never what
    decides a lease: that is the store's clock, ``EpochStore.now``)."""
    return datetime.fromtimestamp(boundary.host_time(), UTC).replace(tzinfo=None)


def store_url() -> str:
    """Where the epoch store lives.

    ``$SLUICE_STORE_URL`` wins; else the Airflow connection ``sluice_store`` (its extra
    ``url`` or its URI; ``sluice.airflow.hooks.SluiceStoreHook``) when one is defined; else
    SQLite under ``$AIRFLOW_HOME`` (or ``var/``).
    """
    url = os.environ.get("SLUICE_STORE_URL")
    if url:
        return url
    if os.environ.get("AIRFLOW_CONN_SLUICE_STORE") or "airflow.sdk" in sys.modules:
        from sluice.airflow.hooks import connection_url

        url = connection_url()
        if url:
            return url
    home = os.environ.get("AIRFLOW_HOME")
    if home:
        return f"sqlite:///{Path(home) / 'sluice.db'}"
    from sluice.paths import data_dir

    return f"sqlite:///{data_dir() / 'sluice.db'}"


def redacted(url: str) -> str:
    """The URL with its password masked: what an error message may say."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses
        return "<the store URL>"


#: Lease tokens follow the store's clock: each acquisition's token is the seconds since this
#: moment, or the previous token + 1 if that is higher. So tokens rise with time, whatever store
#: issued them: a store made after another was lost (and rebuilt, ``REBUILD_MARGIN`` above)
#: hands out tokens above every token the lost one could have issued, and Delta refuses a run of
#: the lost store that is still going. ``token << 32`` must fit a Delta txnVersion (a signed
#: 64-bit integer): good until 2087.
TOKEN_EPOCH = datetime(2020, 1, 1)
#: How far tokens may have run ahead of the clock (acquisitions faster than one a second, for
#: long): a rebuilt store's first token is this far above the clock and every token in the tables.
REBUILD_MARGIN = 1_000_000


def token_base(now: datetime) -> int:
    return max(0, int((now - TOKEN_EPOCH).total_seconds()))


# -- typed rows ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineState:
    """The pipeline's row: its generation, its lease and the rollback it waits for."""

    name: str
    generation: int
    fence: int
    lease_owner: str | None
    lease_acquired_at: datetime | None
    lease_expires_at: datetime | None
    intent: RollbackIntent | None
    announced: dict[str, int]
    exists: bool = True

    def holds(self, lease: Lease) -> bool:
        return self.fence == lease.fence and self.lease_owner == lease.owner


P, E, G, F, R, C = (PipelineRow.__table__, EpochRow.__table__, GroupRow.__table__, SourceFileRow.__table__,
                    RollbackRow.__table__, ControlRow.__table__)
#: Statements built once: a store transaction is a step of every protocol step, and building a
#: statement costs about as much as running it on SQLite.
_PIPELINE = select(P).where(P.c.name == bindparam("p"))
_PIPELINE_LOCKED = _PIPELINE.with_for_update()
_EPOCHS = select(E).where(E.c.pipeline == bindparam("p"), E.c.generation == bindparam("g")).order_by(E.c.epoch_id)
_EPOCH = select(E).where(E.c.pipeline == bindparam("p"), E.c.epoch_id == bindparam("e"),
                         E.c.generation == bindparam("g"))
_GROUP = select(G).where(G.c.pipeline == bindparam("p"), G.c.group_id == bindparam("gid"))
_GROUP_EPOCHS = (select(E).where(E.c.pipeline == bindparam("p"), E.c.group_id == bindparam("gid"))
                 .order_by(E.c.epoch_id, E.c.generation))
_MANIFEST_END = select(func.max(F.c.position)).where(F.c.pipeline == bindparam("p"))
_NEXT_GROUP = select(func.max(G.c.group_id)).where(G.c.pipeline == bindparam("p"))
_NEXT_OFFSET = select(func.max(E.c.end_offset)).where(E.c.pipeline == bindparam("p"), E.c.generation == bindparam("g"),
                                                      E.c.state != ROLLED_BACK)


def _epoch(row: Any) -> Epoch:
    return Epoch(
        pipeline=row.pipeline, epoch_id=row.epoch_id, generation=row.generation, group_id=row.group_id,
        start=row.start_offset, end=row.end_offset, state=row.state, attempts=row.attempts,
        delta_versions=dict(row.delta_versions or {}), rows=dict(row.rows or {}), timings=dict(row.timings or {}),
        error=row.error, validation=row.validation, planned_at=row.planned_at, committed_at=row.committed_at,
        published_at=row.published_at,
        written_generation=row.generation if row.origin_generation is None else row.origin_generation,
        failures=row.failures or 0, crashes=row.crashes or 0,
    )


def _entry(row: Any) -> ManifestEntry:
    skipped = (FileSkip(row.skipped_at, row.skipped_by or "", row.skip_reason or "")
               if row.skipped_at is not None else None)
    return ManifestEntry(row.position, row.path, row.size, row.mtime, skipped)


#: Epoch fields and the columns they are kept in (the others have the same name).
_EPOCH_COLUMNS = {"start": "start_offset", "end": "end_offset"}
_PIPELINE_COLUMNS = {"intent": "pending_rollback"}


class StoreTx:
    """One transaction of the store on one pipeline: the typed reads and writes the protocol
    composes into an atomic step (SQLAlchemy Core on one connection)."""

    def __init__(self, store: EpochStore, conn: Connection, pipeline: str, write: bool) -> None:
        self.store, self.conn, self.pipeline, self.write = store, conn, pipeline, write
        self._now: datetime | None = None

    def _one(self, stmt: Any, **params: Any) -> Any:
        return self.conn.execute(stmt, {"p": self.pipeline, **params}).first()

    def _all(self, stmt: Any, **params: Any) -> list[Any]:
        return list(self.conn.execute(stmt, {"p": self.pipeline, **params}))

    # -- the pipeline's row ----------------------------------------------------------------------

    def _row(self, *, lock: bool = False) -> Any:
        row = self._one(_PIPELINE_LOCKED if lock else _PIPELINE)
        if row is None and lock:
            # SELECT ... FOR UPDATE locks no row that does not exist yet: on Postgres two first
            # writers both get here, and the second's INSERT waits for the first's commit, then
            # fails on the key. Its savepoint absorbs that, and it locks the row the first made.
            try:
                with self.conn.begin_nested():
                    self.conn.execute(insert(P).values(name=self.pipeline, generation=0,
                                                       fence=token_base(self.now()), created_at=utcnow()))
            except IntegrityError:
                pass
            row = self._one(_PIPELINE_LOCKED)
        return row

    def state(self, *, lock: bool = False) -> PipelineState:
        """The pipeline's row (locked for a writer; its initial state, unwritten, for a reader of
        a pipeline that never ran)."""
        row = self._row(lock=lock)
        if row is None:
            return PipelineState(self.pipeline, 0, 0, None, None, None, None, {}, exists=False)
        return PipelineState(row.name, row.generation, row.fence, row.lease_owner, row.lease_acquired_at,
                             row.lease_expires_at, RollbackIntent.of(row.pending_rollback),
                             dict(row.announced or {}))

    def update_state(self, **changes: Any) -> None:
        """Change fields of the pipeline's row (``intent`` as a ``RollbackIntent`` or None)."""
        self._row(lock=True)
        values = {_PIPELINE_COLUMNS.get(k, k): (v.as_record() if v is not None else None) if k == "intent" else v
                  for k, v in changes.items()}
        self.conn.execute(update(P).where(P.c.name == self.pipeline).values(**values))

    def check_lease(self, lease: Lease) -> PipelineState:
        """The pipeline's row, locked, if ``lease`` still holds it; else ``FencedError``."""
        state = self.state(lock=True)
        if not state.holds(lease):
            raise FencedError(
                f"pipeline {lease.pipeline!r}: lease of {lease.owner!r} (token {lease.fence}) was "
                f"taken over by {state.lease_owner!r} (token {state.fence}); this run must stop")
        return state

    def now(self) -> datetime:
        """The store's clock (naive UTC, read once per transaction): leases expire by it,
        whatever each host's clock says."""
        if self._now is None:
            self._now = self.store.store_now(self.conn)
        return self._now

    # -- epochs ----------------------------------------------------------------------------------

    def epochs(self, generation: int | None = None, *, states: Sequence[str] | None = None,
               last: int | None = None) -> list[Epoch]:
        """Epochs of one generation (default: the current one) in epoch order: those in ``states``
        (all by default), the last ``last`` of them only (a poll's history: a pipeline's epochs
        are never pruned, and reading them all cost 0.8 s at 30,000 on SQLite)."""
        gen = self.state().generation if generation is None else generation
        if states is None and last is None:
            return [_epoch(r) for r in self._all(_EPOCHS, g=gen)]
        stmt = select(E).where(E.c.pipeline == self.pipeline, E.c.generation == gen)
        if states is not None:
            stmt = stmt.where(E.c.state.in_(list(states)))
        if last is None:
            return [_epoch(r) for r in self.conn.execute(stmt.order_by(E.c.epoch_id))]
        rows = list(self.conn.execute(stmt.order_by(E.c.epoch_id.desc()).limit(max(0, last))))
        return [_epoch(r) for r in reversed(rows)]

    def epoch(self, epoch_id: int, generation: int) -> Epoch | None:
        row = self._one(_EPOCH, e=epoch_id, g=generation)
        return _epoch(row) if row is not None else None

    def attempt(self, epoch_id: int, generation: int) -> tuple[int, bool]:
        """``(attempts ever, an attempt open)`` of an epoch."""
        row = self._epoch_row(epoch_id, generation)
        return row.attempts, bool(row.attempt_open)

    def insert_epoch(self, epoch: Epoch, *, attempt_open: bool = False) -> None:
        """Add an epoch row (a new epoch, or one carried into a new generation)."""
        origin = epoch.written_generation if epoch.written_generation not in (None, epoch.generation) else None
        self.conn.execute(insert(E).values(
            pipeline=self.pipeline, epoch_id=epoch.epoch_id, generation=epoch.generation, group_id=epoch.group_id,
            start_offset=epoch.start, end_offset=epoch.end, state=epoch.state, attempts=epoch.attempts,
            failures=epoch.failures, crashes=epoch.crashes, attempt_open=attempt_open,
            delta_versions=dict(epoch.delta_versions), rows=dict(epoch.rows), timings=dict(epoch.timings),
            error=epoch.error, validation=epoch.validation, planned_at=epoch.planned_at or self.now(),
            committed_at=epoch.committed_at, published_at=epoch.published_at, origin_generation=origin))

    def _epoch_row(self, epoch_id: int, generation: int) -> Any:
        row = self._one(_EPOCH, e=epoch_id, g=generation)
        if row is None:
            raise ProtocolError(f"pipeline {self.pipeline!r} has no epoch {epoch_id} in generation {generation}")
        return row

    def update_epoch(self, epoch_id: int, generation: int, **changes: Any) -> None:
        """Change fields of an epoch (model field names; ``attempt_open`` too)."""
        done = self.conn.execute(update(E).where(E.c.pipeline == self.pipeline, E.c.epoch_id == epoch_id,
                                                 E.c.generation == generation)
                                 .values(**{_EPOCH_COLUMNS.get(k, k): v for k, v in changes.items()}))
        if done.rowcount == 0:
            raise ProtocolError(f"pipeline {self.pipeline!r} has no epoch {epoch_id} in generation {generation}")

    def next_offset(self, generation: int) -> int:
        """The first source offset no live epoch of ``generation`` covers."""
        return self._one(_NEXT_OFFSET, g=generation)[0] or 0

    # -- groups ----------------------------------------------------------------------------------

    def group(self, group_id: int, *, reprocessing: bool = False) -> Group:
        g = self._one(_GROUP, gid=group_id)
        if g is None:
            raise ProtocolError(f"pipeline {self.pipeline!r} has no group {group_id}")
        latest: dict[int, Any] = {}
        for r in self._all(_GROUP_EPOCHS, gid=group_id):  # the newest generation of each epoch in the group
            latest[r.epoch_id] = r
        return Group(self.pipeline, group_id, g.owner, g.fence, g.state,
                     tuple(_epoch(r) for r in latest.values()), dict(g.plan or {}), reprocessing)

    def group_ids(self, *, states: Sequence[str] | None = None, owner: str | None = None,
                  since: int | None = None) -> list[int]:
        stmt = select(G.c.group_id).where(G.c.pipeline == self.pipeline)
        if since is not None:
            stmt = stmt.where(G.c.group_id >= since)
        if states is not None:
            stmt = stmt.where(G.c.state.in_(list(states)))
        if owner is not None:
            stmt = stmt.where(G.c.owner == owner)
        return [r[0] for r in self.conn.execute(stmt.order_by(G.c.group_id))]

    def group_spans(self, states: Sequence[str]) -> list[tuple[int, int, int]]:
        """``(group id, first epoch, last epoch)`` of the groups in ``states``."""
        return [(g, f, la) for g, f, la in self.conn.execute(
            select(G.c.group_id, G.c.first_epoch, G.c.last_epoch).where(
                G.c.pipeline == self.pipeline, G.c.state.in_(list(states))))]

    def next_group_id(self) -> int:
        last = self._one(_NEXT_GROUP)[0]
        return 0 if last is None else last + 1

    def insert_group(self, group_id: int, *, owner: str, fence: int, first_epoch: int, last_epoch: int,
                     state: str, plan: dict[str, Any], finished: bool = False) -> None:
        now = self.now()
        self.conn.execute(insert(G).values(pipeline=self.pipeline, group_id=group_id, owner=owner, fence=fence,
                                           first_epoch=first_epoch, last_epoch=last_epoch, state=state, plan=plan,
                                           planned_at=now, finished_at=now if finished else None))

    def update_group(self, group_id: int, **changes: Any) -> None:
        done = self.conn.execute(update(G).where(G.c.pipeline == self.pipeline, G.c.group_id == group_id)
                                 .values(**changes))
        if done.rowcount == 0:
            raise ProtocolError(f"pipeline {self.pipeline!r} has no group {group_id}")

    # -- the manifest ----------------------------------------------------------------------------

    def manifest_end(self) -> int:
        last = self._one(_MANIFEST_END)[0]
        return 0 if last is None else last + 1

    def sizes(self, start: int, end: int) -> list[int]:
        """Sizes of the entries ``[start, end)`` in order; a skipped one counts 0."""
        return [0 if skipped is not None else size for size, skipped in self.conn.execute(
            select(F.c.size, F.c.skipped_at).where(F.c.pipeline == self.pipeline, F.c.position >= start,
                                                   F.c.position < end).order_by(F.c.position))]

    def manifest(self, start: int = 0, end: int | None = None) -> list[ManifestEntry]:
        stmt = select(F).where(F.c.pipeline == self.pipeline, F.c.position >= start)
        if end is not None:
            stmt = stmt.where(F.c.position < end)
        return [_entry(r) for r in self.conn.execute(stmt.order_by(F.c.position))]

    def entry(self, path: str) -> ManifestEntry | None:
        row = self.conn.execute(select(F).where(F.c.pipeline == self.pipeline, F.c.path == path)).first()
        return _entry(row) if row is not None else None

    def skip(self, path: str, skip: FileSkip) -> None:
        self.conn.execute(update(F).where(F.c.pipeline == self.pipeline, F.c.path == path, F.c.skipped_at.is_(None))
                          .values(skipped_at=skip.at, skipped_by=skip.by, skip_reason=skip.reason[:4000]))

    def forget_files(self) -> None:
        """Drop the manifest (a rebuild replaces what a run registered in the empty store)."""
        self.conn.execute(delete(F).where(F.c.pipeline == self.pipeline))

    def add_files(self, files: Sequence[tuple[int, str, int, float]]) -> None:
        """Manifest entries ``(position, path, size, mtime)``, as they are."""
        if files:
            now = self.now()
            self.conn.execute(insert(F), [{"pipeline": self.pipeline, "position": position, "path": path,
                                           "size": size, "mtime": mtime, "discovered_at": now}
                                          for position, path, size, mtime in files])

    # -- rollbacks -------------------------------------------------------------------------------

    def forget_rollbacks(self) -> None:
        """Drop the rollbacks' records (a rebuild replaces them with those next to the sinks)."""
        self.conn.execute(delete(R).where(R.c.pipeline == self.pipeline))

    def add_rollback(self, generation: int, record: dict[str, Any]) -> None:
        self.conn.execute(insert(R).values(pipeline=self.pipeline, generation=generation, record=record,
                                           recorded_at=self.now()))

    def flush(self) -> None:
        """(Core writes go out at once; kept for the steps that read back what they wrote.)"""


# -- the engine --------------------------------------------------------------------------------------

def _configure_sqlite(engine: Engine) -> None:
    """WAL mode, a generous busy timeout; ``BEGIN IMMEDIATE`` for a transaction that writes,
    a deferred ``BEGIN`` for one that only reads."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        # The timeout first: switching a new file to WAL takes its lock, and waits only as long
        # as the timeout set by then (Python's 5 s), while another process may hold it for a
        # whole migration ("database is locked" when four processes opened a new store at once)
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("sluice_write") else "BEGIN")


#: One engine (and schema check) per store URL and process: an Airflow worker, the triggerer
#: and the api-server open the store once per task, poke or request, and each opening used to
#: pay a schema check. Keyed by process id too: a pool must not cross a fork (the task runner
#: forks its workers). A SQLite file deleted or replaced since (a lost store, rebuilt) gets a
#: new engine: the old one would write to the unlinked file.
_ENGINES: dict[tuple[int, str], tuple[Engine, Engine, int | None]] = {}
_ENGINES_LOCK = threading.Lock()


def _sqlite_file(url: str) -> Path | None:
    path = url.removeprefix("sqlite:///")
    return Path(path) if url.startswith("sqlite:///") and path and path != ":memory:" else None


def _inode(path: Path | None) -> int | None:
    try:
        return path.stat().st_ino if path is not None else None
    except FileNotFoundError:
        return -1


def _open(url: str) -> tuple[Engine, Engine]:
    """The engine of ``url`` (reads), and the same engine for writes (SQLite: BEGIN IMMEDIATE)."""
    key, file = (os.getpid(), url), _sqlite_file(url)
    with _ENGINES_LOCK:
        cached = _ENGINES.get(key)
        if cached is not None and cached[2] == _inode(file):
            return cached[0], cached[1]
        if cached is not None:
            cached[0].dispose()
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
        connect_args: dict[str, Any] = {}
        if url.startswith("postgresql"):
            connect_args["options"] = (f"-c lock_timeout={LOCK_TIMEOUT_S * 1000} "
                                       f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}")
        engine = create_engine(url, future=True, connect_args=connect_args)
        if engine.dialect.name == "sqlite":
            _configure_sqlite(engine)
        schema.upgrade(engine)
        writes = engine.execution_options(sluice_write=True)
        _ENGINES[key] = engine, writes, _inode(file)
        return engine, writes


def _lock_timeout(exc: OperationalError) -> bool:
    return "lock timeout" in str(exc).lower() or "LockNotAvailable" in type(getattr(exc, "orig", None)).__name__


class EpochStore:
    """The epoch store of all pipelines, in one SQL database (SQLite or Postgres). Cheap to
    construct: the engine behind a URL is made (and the schema checked) once per process.

    ``clock``: the store's clock (the simulation's); by default the database server's
    (Postgres) or this host's (SQLite, a local file)."""

    def __init__(self, url: str | None = None, *, clock: Callable[[], datetime] | None = None) -> None:
        self.url = url or store_url()
        self.engine, self._writer = _open(self.url)
        self._clock = clock

    def close(self) -> None:
        """Close the idle pooled connections (the engine stays usable: it opens new ones)."""
        self.engine.dispose()

    def store_now(self, conn: Connection) -> datetime:
        """The database's clock (Postgres: the server's; SQLite: the host's, through SQLite), or
        the simulation's."""
        if self._clock is not None:
            return self._clock()
        if self.engine.dialect.name == "postgresql":
            return conn.execute(text("SELECT timezone('utc', clock_timestamp())")).scalar()
        return datetime.fromisoformat(conn.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar())

    @contextmanager
    def transaction(self, pipeline: str, *, write: bool = True, step: str = "tx") -> Iterator[StoreTx]:
        """One transaction on ``pipeline`` (a step boundary): committed when the block ends."""
        boundary.step(f"store.{'w' if write else 'r'}.{step}")
        try:
            with (self._writer if write else self.engine).begin() as conn:
                yield StoreTx(self, conn, pipeline, write)
        except OperationalError as exc:
            if _lock_timeout(exc):
                raise PipelineBusyError(
                    f"pipeline {pipeline!r}: the epoch store's row is locked by a transaction that has not "
                    f"finished in {LOCK_TIMEOUT_S} s (a process paused inside it?); the server ends it after "
                    f"{IDLE_IN_TRANSACTION_S} s idle") from None
            raise

    def read(self, pipeline: str, step: str = "read") -> Any:
        return self.transaction(pipeline, write=False, step=step)

    # -- leases ----------------------------------------------------------------------------------

    def renew_lease(self, lease: Lease, ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        from datetime import timedelta

        with self.transaction(lease.pipeline, step="renew_lease") as tx:
            tx.check_lease(lease)
            tx.update_state(lease_expires_at=tx.now() + timedelta(seconds=ttl_s))

    def check_lease(self, lease: Lease) -> None:
        with self.transaction(lease.pipeline, step="check_lease") as tx:
            tx.check_lease(lease)

    def release_lease(self, lease: Lease) -> bool:
        """Give the lease up if this run still holds it; returns whether it did."""
        with self.transaction(lease.pipeline, step="release_lease") as tx:
            if not tx.state(lock=True).holds(lease):
                return False
            tx.update_state(lease_owner=None, lease_expires_at=None, lease_acquired_at=None)
            return True

    def lease_holder(self, pipeline: str) -> str | None:
        with self.read(pipeline, "lease_holder") as tx:
            state = tx.state()
            return state.lease_owner if state.lease_expires_at and state.lease_expires_at > tx.now() else None

    def current_lease(self, pipeline: str, owner: str) -> Lease:
        """The lease ``owner`` holds now (for a task that continues a run's group)."""
        with self.read(pipeline, "current_lease") as tx:
            state = tx.state()
            if state.lease_owner != owner:
                raise FencedError(f"pipeline {pipeline!r}: {owner!r} does not hold the lease "
                                  f"(holder: {state.lease_owner!r})")
            return Lease(pipeline, owner, state.fence)

    def generation(self, pipeline: str) -> int:
        with self.read(pipeline, "generation") as tx:
            return tx.state().generation

    def pending_rollback(self, pipeline: str) -> RollbackIntent | None:
        with self.read(pipeline, "pending_rollback") as tx:
            return tx.state().intent

    def pipeline_state(self, pipeline: str) -> PipelineState:
        with self.read(pipeline, "pipeline_state") as tx:
            return tx.state()

    # -- the manifest ----------------------------------------------------------------------------

    def known_files(self, pipeline: str) -> set[tuple[str, int, float]]:
        """``(path, size, mtime)`` of every file in the manifest: what a file source has seen."""
        with self.read(pipeline, "known_files") as tx:
            return {(p, size, mtime) for p, size, mtime in tx.conn.execute(
                select(F.c.path, F.c.size, F.c.mtime).where(F.c.pipeline == pipeline))}

    def register_files(self, pipeline: str, files: Sequence[tuple[str, int, float]]) -> int:
        """Append newly discovered ``(path, size, mtime)`` files, in the given order, to the
        manifest; paths already registered keep their position. Returns the manifest's end."""
        if not files:  # a poll that found nothing new writes nothing
            with self.read(pipeline, "manifest_end") as tx:
                return tx.manifest_end()
        with self.transaction(pipeline, step="register_files") as tx:
            # Positions are dense: the pipeline's row lock serialises registrations (a sensor's
            # and a planner's) on Postgres, as BEGIN IMMEDIATE does on SQLite.
            tx.state(lock=True)
            known = {r[0] for r in tx.conn.execute(select(F.c.path).where(F.c.pipeline == pipeline))}
            position = tx.manifest_end()
            new = []
            for path, size, mtime in files:
                if path in known:
                    continue
                new.append((position, path, size, mtime))
                known.add(path)
                position += 1
            tx.add_files(new)
            return position

    def manifest(self, pipeline: str, start: int = 0, end: int | None = None) -> list[ManifestEntry]:
        with self.read(pipeline, "manifest") as tx:
            return tx.manifest(start, end)

    def manifest_tail(self, pipeline: str, start: int, last: int) -> list[ManifestEntry]:
        """The entries from position ``start`` on, together with the manifest's ``last`` last
        entries wherever they start, by position: what a backlog poll reads, in one query."""
        with self.read(pipeline, "manifest_tail") as tx:
            other = F.alias()  # not correlated with the outer query's rows
            end = select(func.max(other.c.position)).where(other.c.pipeline == pipeline).scalar_subquery()
            rows = tx.conn.execute(select(F).where(
                F.c.pipeline == pipeline, or_(F.c.position >= start, F.c.position > end - last),
            ).order_by(F.c.position))
            return [_entry(r) for r in rows]

    def chunk_ends(self, pipeline: str, prefix: str) -> dict[int, int]:
        """Per key, the highest ``end`` of the manifest's paths ``<prefix><key>/<start>-<end>``
        (integers): a Kafka source's chunks, ``prefix`` ``kafka://<topic>/``, key the partition.
        One aggregate query, however long the manifest; other paths are left out."""
        path = F.c.path
        strpos = func.instr if self.engine.dialect.name == "sqlite" else func.strpos  # same arguments
        rest = func.substr(path, len(prefix) + 1)  # <key>/<start>-<end>
        chunks = select(
            cast(func.substr(rest, 1, strpos(rest, "/") - 1), BigInteger).label("key"),
            cast(func.substr(rest, strpos(rest, "-") + 1), BigInteger).label("end"),
        ).where(F.c.pipeline == pipeline, func.substr(path, 1, len(prefix)) == prefix).subquery()
        with self.read(pipeline, "chunk_ends") as tx:
            return {int(key): int(end) for key, end in tx.conn.execute(
                select(chunks.c.key, func.max(chunks.c.end)).group_by(chunks.c.key))}

    # -- epochs and groups -----------------------------------------------------------------------

    def epochs(self, pipeline: str, generation: int | None = None, *, states: Sequence[str] | None = None,
               last: int | None = None) -> list[Epoch]:
        """Epochs of one generation (default: the current one), in epoch order; ``states`` and
        ``last`` as in ``StoreTx.epochs``."""
        with self.read(pipeline, "epochs") as tx:
            return tx.epochs(generation, states=states, last=last)

    def epoch_history(self, pipeline: str, *, last: int | None = None, before: int | None = None) -> list[Epoch]:
        """Every epoch of every generation once, in (epoch, written generation) order: a
        rolled-back epoch as ``rolled_back`` in the generation that wrote it, an epoch a
        rollback carried forward once, with its current state and ``written_generation``.

        A page of a long history (epochs are never pruned): ``before``, only epoch ids below it;
        ``last``, only the ``last`` highest epoch ids (each with all its generations' rows)::

            page = store.epoch_history("ysb", last=1000)
            older = store.epoch_history("ysb", last=1000, before=page[0].epoch_id)
        """
        with self.read(pipeline, "epoch_history") as tx:
            below = [E.c.pipeline == pipeline, *([E.c.epoch_id < before] if before is not None else [])]
            stmt = select(E).where(*below)
            if last is not None:
                page = (select(E.c.epoch_id).where(*below).distinct().order_by(E.c.epoch_id.desc())
                        .limit(max(0, last)).subquery())
                # no epoch in the page: the minimum is NULL, and no row compares with it
                stmt = stmt.where(E.c.epoch_id >= select(func.min(page.c.epoch_id)).scalar_subquery())
            rows = tx.conn.execute(stmt.order_by(E.c.epoch_id, E.c.generation))
            newest: dict[tuple[int, int], Any] = {}
            for r in rows:  # a carried copy replaces the row it was copied from
                newest[(r.epoch_id, r.generation if r.origin_generation is None else r.origin_generation)] = r
            return [_epoch(newest[key]) for key in sorted(newest)]

    def next_offset(self, pipeline: str) -> int:
        with self.read(pipeline, "next_offset") as tx:
            return tx.next_offset(tx.state().generation)

    def group(self, pipeline: str, group_id: int) -> Group:
        with self.read(pipeline, "group") as tx:
            return tx.group(group_id)

    def group_plans(self, pipeline: str, *, since: int | None = None) -> dict[int, dict[str, Any]]:
        """Each group's plan (sizes, reason, why it started) by group id, in one query (from
        group ``since`` on)."""
        with self.read(pipeline, "group_plans") as tx:
            stmt = select(G.c.group_id, G.c.plan).where(G.c.pipeline == pipeline)
            if since is not None:
                stmt = stmt.where(G.c.group_id >= since)
            return {group_id: dict(plan or {}) for group_id, plan in tx.conn.execute(stmt)}

    def groups(self, pipeline: str, *, since: int | None = None) -> list[Group]:
        """The groups in order (from group ``since`` on: a page of a long history)."""
        with self.read(pipeline, "groups") as tx:
            return [tx.group(i) for i in tx.group_ids(since=since)]

    def unpublished_groups(self, pipeline: str, owner: str) -> list[Group]:
        """Groups ``owner`` planned that are not closed yet, in order (a DAG run's own groups)."""
        with self.read(pipeline, "unpublished_groups") as tx:
            return [tx.group(i) for i in tx.group_ids(states=[PLANNED], owner=owner)]

    def group_of_owner(self, pipeline: str, owner: str) -> Group | None:
        """The first group ``owner`` (a DAG run) planned, whatever its state now."""
        with self.read(pipeline, "group_of_owner") as tx:
            ids = tx.group_ids(owner=owner)
            return tx.group(ids[0]) if ids else None

    def start_attempt(self, lease: Lease, epochs: Sequence[Epoch]) -> bool:
        """Count an attempt of each epoch, in one transaction; an attempt still open (its
        process died without a word) counts as a crash. Returns whether any epoch of the
        pipeline was published before."""
        with self.transaction(lease.pipeline, step="start_attempt") as tx:
            tx.check_lease(lease)
            published = self.knows_in(tx, published=True)
            for epoch in epochs:
                row = tx._epoch_row(epoch.epoch_id, epoch.generation)
                tx.update_epoch(epoch.epoch_id, epoch.generation, attempts=row.attempts + 1, attempt_open=True,
                                crashes=(row.crashes or 0) + (1 if row.attempt_open else 0))
            return published

    def mark_committed(self, lease: Lease, records: Sequence[tuple[Epoch, dict[str, int | None], dict[str, Any],
                                                                   dict[str, float], dict[str, Any] | None]]) -> None:
        """Record a commit (step 4): its epochs ``(epoch, delta versions, rows, timings,
        validation)`` become committed together, in one store transaction; an epoch committed
        or published already is left as it is (a rerun of a committed epoch changes nothing)."""
        from sluice.protocol.rules import check_transition

        with self.transaction(lease.pipeline, step="mark_committed") as tx:
            tx.check_lease(lease)
            now = tx.now()
            for epoch, versions, rows, timings, validation in records:
                row = tx._epoch_row(epoch.epoch_id, epoch.generation)
                if row.state in (COMMITTED, PUBLISHED):
                    tx.update_epoch(epoch.epoch_id, epoch.generation, attempt_open=False)
                    continue
                check_transition(row.epoch_id, row.state, COMMITTED)
                tx.update_epoch(epoch.epoch_id, epoch.generation, attempt_open=False, state=COMMITTED, error=None,
                                delta_versions=versions, rows=rows, timings=timings, validation=validation,
                                committed_at=now)

    def mark_failed(self, lease: Lease, epochs: Sequence[Epoch], error: str, *,
                    validation: dict[str, Any] | None = None, rows: dict[str, int] | None = None) -> None:
        """Record that an attempt of ``epochs`` failed with ``error`` (a failure, not a crash)."""
        with self.transaction(lease.pipeline, step="mark_failed") as tx:
            tx.check_lease(lease)
            for epoch in epochs:
                row = tx._epoch_row(epoch.epoch_id, epoch.generation)
                if row.state in (PLANNED, FAILED):
                    changes: dict[str, Any] = {"state": FAILED, "error": error[:4000], "validation": validation,
                                               "attempt_open": False,
                                               "failures": (row.failures or 0) + (1 if row.attempt_open else 0)}
                    if rows is not None:
                        changes["rows"] = rows
                    tx.update_epoch(epoch.epoch_id, epoch.generation, **changes)

    def finish_group(self, lease: Lease, group_id: int) -> Group:
        """Publish a group: its committed epochs become published."""
        with self.transaction(lease.pipeline, step="finish_group") as tx:
            tx.check_lease(lease)
            group = tx.group(group_id)
            pending = [e.epoch_id for e in group.epochs if e.state not in (COMMITTED, PUBLISHED)]
            if pending:
                raise ProtocolError(f"pipeline {lease.pipeline!r} group {group_id}: epochs {pending} "
                                    "are not committed; cannot publish")
            now = tx.now()
            for e in group.epochs:
                if e.state == COMMITTED:
                    tx.update_epoch(e.epoch_id, e.generation, state=PUBLISHED, published_at=now)
            tx.update_group(group_id, state=PUBLISHED, finished_at=now)
            tx.flush()
            return tx.group(group_id)

    def rollbacks(self, pipeline: str) -> list[dict[str, Any]]:
        """The finished rollbacks' records, oldest first."""
        with self.read(pipeline, "rollbacks") as tx:
            return [dict(r.record) for r in tx.conn.execute(
                select(R.c.record).where(R.c.pipeline == pipeline).order_by(R.c.generation))]

    def knows(self, pipeline: str, *, published: bool = False) -> bool:
        """Whether the store holds any epoch of ``pipeline``, or was rebuilt for it (``published``:
        any published epoch). A lease taken, or files registered, leave no such history."""
        with self.read(pipeline, "knows") as tx:
            return self.knows_in(tx, published=published)

    @staticmethod
    def knows_in(tx: StoreTx, *, published: bool = False) -> bool:
        """``knows`` within a transaction."""
        stmt = select(E.c.epoch_id).where(E.c.pipeline == tx.pipeline)
        if published:
            stmt = stmt.where(E.c.state == PUBLISHED)
        if tx.conn.execute(stmt.limit(1)).first() is not None:
            return True
        row = tx._row()
        return row is not None and row.rebuilt_at is not None and not published

    def has_pipeline(self, pipeline: str) -> bool:
        with self.read(pipeline, "has_pipeline") as tx:
            return tx._row() is not None or tx.conn.execute(
                select(E.c.epoch_id).where(E.c.pipeline == pipeline).limit(1)).first() is not None

    def announce(self, pipeline: str, versions: dict[str, int]) -> None:
        """Acknowledge that Asset events reported every change of these tables up to these
        versions (never moves one back)."""
        with self.transaction(pipeline, step="announce") as tx:
            state = tx.state(lock=True)
            merged = dict(state.announced)
            for table, version in versions.items():
                merged[table] = max(version, merged.get(table, -1))
            tx.update_state(announced=merged)

    def source_identity(self, pipeline: str) -> dict[str, Any] | None:
        """What the source was when its records were registered (``record_source_identity``)."""
        with self.read(pipeline, "source_identity") as tx:
            row = tx._row()
            return dict(row.source_identity) if row is not None and row.source_identity else None

    def record_source_identity(self, pipeline: str, identity: dict[str, Any]) -> None:
        """Record what the source is (a Kafka topic's ID), merged into what was recorded."""
        with self.transaction(pipeline, step="record_source_identity") as tx:
            row = tx._row(lock=True)
            tx.update_state(source_identity={**(row.source_identity or {}), **identity})

    # -- adaptive control ------------------------------------------------------------------------

    def control_state(self, pipeline: str) -> dict[str, Any] | None:
        with self.read(pipeline, "control_state") as tx:
            row = tx.conn.execute(select(C.c.state).where(C.c.pipeline == pipeline)).first()
            return dict(row.state) if row else None

    def save_control_state(self, pipeline: str, state: dict[str, Any]) -> None:
        with self.transaction(pipeline, step="save_control_state") as tx:
            done = tx.conn.execute(update(C).where(C.c.pipeline == pipeline).values(state=state, updated_at=utcnow()))
            if done.rowcount == 0:
                tx.conn.execute(insert(C).values(pipeline=pipeline, state=state, updated_at=utcnow()))

    def summary(self, pipeline: str) -> dict[str, Any]:
        """Counts by state, contiguity and totals of the current generation, for reports (the
        console's pipeline list). Aggregated in SQL: reading every epoch cost 0.8 s at 30,000
        (``make bench-store``). Contiguity is checked there too; a gap is then named by
        ``check_contiguous`` over the whole list, as before."""
        from sluice.protocol.rules import check_contiguous

        with self.read(pipeline, "summary") as tx:
            gen = tx.state().generation
            mine = (E.c.pipeline == pipeline) & (E.c.generation == gen)
            by_state = {state: int(n) for state, n in tx.conn.execute(
                select(E.c.state, func.count()).where(mine).group_by(E.c.state).order_by(E.c.state))}
            n, groups, first_id, last_id, *sums = tx.conn.execute(select(
                func.count(), func.count(E.c.group_id.distinct()), func.min(E.c.epoch_id), func.max(E.c.epoch_id),
                *(func.coalesce(func.sum(E.c.rows[key].as_integer()), 0) for key in _SUMMED)).where(mine)).one()
            first = tx.conn.execute(select(E.c.start_offset).where(mine, E.c.epoch_id == first_id)).scalar()
            end = tx.conn.execute(select(E.c.end_offset).where(mine, E.c.epoch_id == last_id)).scalar()
            after = E.alias("after")
            gaps = tx.conn.execute(select(func.count()).select_from(E.join(after, (after.c.pipeline == E.c.pipeline) & (
                after.c.generation == E.c.generation) & (after.c.epoch_id == E.c.epoch_id + 1))).where(
                mine, after.c.start_offset != E.c.end_offset)).scalar()
            if n and (first_id != 0 or last_id != n - 1 or first != 0 or gaps or
                      tx.conn.execute(select(func.count()).where(mine, E.c.end_offset < E.c.start_offset)).scalar()):
                check_contiguous((e.epoch_id, e.start, e.end) for e in tx.epochs(gen))
        return {
            "pipeline": pipeline,
            "generation": gen,
            "epochs": int(n),
            "groups": int(groups),
            "by_state": by_state,
            "offsets": [int(first), int(end)] if n else [0, 0],
            "rows": {key: int(total) for key, total in zip(_SUMMED, sums, strict=True)},
        }


#: The row counts ``summary`` totals.
_SUMMED = ("input", "output", "rejected")


def epoch_with(epoch: Epoch, **changes: Any) -> Epoch:
    """A copy of ``epoch`` with ``changes`` (model field names)."""
    names = {f.name for f in fields(Epoch)}
    return replace(epoch, **{k: v for k, v in changes.items() if k in names})
