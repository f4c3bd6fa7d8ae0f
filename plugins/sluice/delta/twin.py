"""``TwinTables``: Delta tables in memory, with the semantics sluice's protocol relies on and
nothing more (see ``sluice.delta``): numbered commits of add/remove file actions, table creation
as version 0, txn skip and the same-app-id conflict, RESTORE keeping transactions, fenced
restores, concurrent commits conflicting, log and file retention. Frames are lists of row dicts.

Every mutating call is two steps (``sluice.boundary``): it reads a snapshot, then commits
against it, so the simulation can put another actor's commit in between and see Delta's
conflict rules applied. ``tests/integration/test_delta_conformance.py`` runs the same scenarios
on real Delta and on the twin and compares them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice import boundary
from sluice.delta import Restored, Tables, TableShape, Written, commit_of, upsert
from sluice.errors import SluiceError
from sluice.model import TableCommit, Txn


class TableNotFound(SluiceError):
    """``[DELTA_TABLE_NOT_FOUND]``: no Delta table at the path."""


class ConcurrentCommit(SluiceError):
    """A commit lost a race Delta's conflict checker does not resolve (the same app id set by
    the winner, or data the loser read changed under it)."""


@dataclass(frozen=True)
class _Commit:
    version: int
    operation: str
    adds: tuple[str, ...]
    removes: tuple[str, ...]
    txns: tuple[tuple[str, int], ...]
    user_metadata: str | None
    parameters: dict[str, Any]
    read_version: int
    rows: int


@dataclass
class _Table:
    partition_by: tuple[str, ...] = ()
    commits: list[_Commit] = field(default_factory=list)
    files: dict[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)
    vacuumed: set[str] = field(default_factory=set)
    log_start: int = 0  # versions before it were cleaned from the log
    side: dict[str, str] = field(default_factory=dict)  # side files by relative path

    @property
    def latest(self) -> int:
        return len(self.commits) - 1

    def live(self, version: int | None = None) -> list[str]:
        """The data files of ``version`` (default: the latest), in the order they were added."""
        live: dict[str, None] = {}
        for commit in self.commits[: (self.latest if version is None else version) + 1]:
            for name in commit.removes:
                live.pop(name, None)
            for name in commit.adds:
                live[name] = None
        return list(live)

    def txns(self) -> dict[str, int]:
        """The recorded transactions: every commit's, newest winning; a RESTORE undoes none."""
        found: dict[str, int] = {}
        for commit in self.commits:
            found.update(commit.txns)
        return found

    def rows(self, version: int | None = None) -> list[dict[str, Any]]:
        return [dict(row) for name in self.live(version) for row in self.files[name]]


class TwinTables(Tables):
    """In-memory Delta tables by path (shared by every actor of a simulation)."""

    def __init__(self) -> None:
        self._tables: dict[str, _Table] = {}
        self._names = itertools.count()
        self._lock = threading.Lock()  # the simulation runs one actor at a time; tests may not

    # -- reads -----------------------------------------------------------------------------------

    def _table(self, path: str) -> _Table:
        table = self._tables.get(path)
        if table is None or not table.commits:
            raise TableNotFound(f"[DELTA_TABLE_NOT_FOUND] Delta table {path} doesn't exist")
        return table

    def exists(self, path: str) -> bool:
        boundary.step("delta.r.exists")
        table = self._tables.get(path)
        return table is not None and bool(table.commits)

    def version(self, path: str) -> int | None:
        boundary.step("delta.r.version")
        table = self._tables.get(path)
        return table.latest if table is not None and table.commits else None

    def txn_version(self, path: str, app_id: str) -> int | None:
        boundary.step("delta.r.txn_version")
        table = self._tables.get(path)
        return table.txns().get(app_id) if table is not None and table.commits else None

    def lineage(self, path: str) -> Iterator[TableCommit]:
        boundary.step("delta.r.lineage")
        table = self._tables.get(path)
        if table is None or not table.commits:
            raise TableNotFound(f"[DELTA_TABLE_NOT_FOUND] Delta table {path} doesn't exist")
        for commit in reversed(table.commits[table.log_start:]):
            yield commit_of(commit.version, commit.operation, commit.user_metadata, commit.parameters)

    def commit_rows(self, path: str, version: int) -> int:
        boundary.step("delta.r.commit_rows")
        return self._table(path).commits[version].rows

    def restorable(self, path: str, version: int) -> str | None:
        boundary.step("delta.r.restorable")
        table = self._table(path)
        if version < table.log_start or version > table.latest:
            return f"table {path}: version {version} is no longer in the Delta log"
        gone = [name for name in table.live(version) if name in table.vacuumed]
        if gone:
            return (f"table {path}: version {version} was vacuumed: {len(gone)} of its "
                    f"{len(table.live(version))} data files are gone (e.g. {gone[0]})")
        return None

    def rows(self, path: str, version: int | None = None) -> list[dict[str, Any]]:
        """The table's rows (at ``version``): what a reader sees. Not a step: oracles read it."""
        table = self._tables.get(path)
        return table.rows(version) if table is not None and table.commits else []

    def list_files(self, path: str, folder: str) -> list[tuple[str, str]]:
        boundary.step("delta.r.list_files")
        table = self._tables.get(path)
        if table is None:
            return []
        prefix = folder.rstrip("/") + "/"
        return sorted((name[len(prefix):], text) for name, text in table.side.items()
                      if name.startswith(prefix) and "/" not in name[len(prefix):])

    # -- writes ----------------------------------------------------------------------------------

    def _commit(self, path: str, read_version: int, operation: str, *, adds: Sequence[tuple[dict[str, Any], ...]] = (),
                readds: Sequence[str] = (), removes: Sequence[str] = (), txn: Txn | None = None,
                metadata: str | None = None,
                parameters: dict[str, Any] | None = None, rows: int = 0, reads_data: bool = False,
                strict: bool = False) -> int:
        """Commit at the latest version + 1 after Delta's conflict check against the commits
        since ``read_version``: a winner that set the same app id fails it, and so does one that
        changed data this commit read (``reads_data``), or any winner at all (``strict``:
        RESTORE's ``commitLarge``). ``adds``: new files' rows; ``readds``: files added again."""
        table = self._tables[path]
        winners = table.commits[read_version + 1:]
        if winners and strict:
            raise ConcurrentCommit(f"table {path}: concurrent commits {[w.version for w in winners]} after version "
                                   f"{read_version}: the {operation} was not committed")
        for winner in winners:
            if txn is not None and any(app == txn.app_id for app, _ in winner.txns):
                raise ConcurrentCommit(f"table {path}: ConcurrentTransactionException: version {winner.version} "
                                       f"set {txn.app_id} concurrently")
            if reads_data and (winner.adds or winner.removes):
                raise ConcurrentCommit(f"table {path}: ConcurrentAppendException: version {winner.version} "
                                       "changed data this commit read")
        names = list(readds)
        for file_rows in adds:
            name = f"part-{next(self._names):05d}.parquet"
            table.files[name] = tuple(dict(r) for r in file_rows)
            names.append(name)
        version = table.latest + 1
        table.commits.append(_Commit(version, operation, tuple(names), tuple(removes),
                                     ((txn.app_id, txn.version),) if txn else (), metadata, dict(parameters or {}),
                                     read_version, rows))
        return version

    def create(self, path: str, like: Any, partition_by: Sequence[str] = (), metadata: str | None = None,
               shape: TableShape | None = None, txn: Txn | None = None) -> bool:
        # (rows carry no schema: an upsert's flag needs none)
        boundary.step("delta.w.create:begin")
        existing = self._tables.get(path)
        if existing is not None and existing.commits:
            return False
        boundary.step("delta.w.create:commit")
        table = self._tables.setdefault(path, _Table(tuple(partition_by)))
        if table.commits:  # created meanwhile: without a txn a no-op (IF NOT EXISTS), with one
            if txn is not None:  # an empty append to the table that is there: a fence
                self.fence(path, txn, metadata or "{}")
            return False
        # Real Delta records a txn only through a write: the table is created by an empty append.
        self._commit(path, -1, "CREATE TABLE" if txn is None else "WRITE", txn=txn, metadata=metadata)
        return True

    def write(self, path: str, frame: Any, shape: TableShape, *, txn: Txn, metadata: str,
              rows: int | None = None) -> Written:
        boundary.step("delta.w.write:begin")
        rows_in = [dict(r) for r in frame]
        table = self._tables.get(path)
        if table is None or not table.commits:
            if shape.mode != "append":
                raise TableNotFound(f"[DELTA_TABLE_NOT_FOUND] Delta table {path} doesn't exist")
            boundary.step("delta.w.write:commit")  # an append to a missing path creates the table
            table = self._tables.setdefault(path, _Table(shape.partition_by))
            if table.commits:
                raise ConcurrentCommit(f"table {path}: created concurrently")
            self._commit(path, -1, "WRITE", adds=[tuple(rows_in)], txn=txn, metadata=metadata, rows=len(rows_in))
            return Written()
        read_version = table.latest
        recorded = table.txns().get(txn.app_id)
        if recorded is not None and recorded >= txn.version:
            return Written()  # WriteIntoDelta: this app's version is in the table already
        current = table.live(read_version)
        boundary.step("delta.w.write:commit")
        if shape.mode == "append":
            self._commit(path, read_version, "WRITE", adds=[tuple(rows_in)], txn=txn, metadata=metadata,
                         rows=len(rows_in))
            return Written()
        if shape.mode == "upsert" and shape.history == "scd2":  # every version, in sequence order
            flagged = upsert.flag_deletes(rows_in, shape)
            held = [row for name in current for row in table.files[name]]
            versions = upsert.history_rows(held, flagged, shape)
            touched = {upsert.key_of(r, shape) for r in flagged}  # MERGE's source: their versions
            self._commit(path, read_version, "MERGE" if current else "WRITE",
                         adds=[tuple(versions)] if versions else [], removes=current, txn=txn, metadata=metadata,
                         rows=sum(upsert.key_of(r, shape) in touched for r in versions), reads_data=bool(current))
            return Written()
        if shape.mode == "upsert":  # sluice.delta.upsert: the greatest change per key wins
            changes = upsert.reduce_changes(upsert.flag_deletes(rows_in, shape), shape)
            if not current:  # no row to match: appended, as SparkTables does
                self._commit(path, read_version, "WRITE", adds=[tuple(changes.values())], txn=txn,
                             metadata=metadata, rows=len(changes))
                return Written()
            held = [row for name in current for row in table.files[name]]
            merged_rows = upsert.merge_changes(held, changes, shape)
            self._commit(path, read_version, "MERGE", adds=[tuple(merged_rows)] if merged_rows else [],
                         removes=current, txn=txn, metadata=metadata, rows=len(changes), reads_data=True)
            return Written()
        sums = _sums_by_key(rows_in, shape.keys, shape.sums)
        if not current:  # no row to match: the sums are appended (as SparkTables does, saving MERGE's join)
            self._commit(path, read_version, "WRITE", adds=[tuple(sums.values())], txn=txn, metadata=metadata,
                         rows=len(sums))
            return Written()
        merged: dict[tuple[Any, ...], dict[str, Any]] = {}
        for name in current:
            for row in table.files[name]:
                merged[tuple(row[k] for k in shape.keys)] = dict(row)
        for key, row in sums.items():
            if key in merged:
                for column in shape.sums:
                    merged[key][column] = merged[key][column] + row[column]
            else:
                merged[key] = dict(row)
        self._commit(path, read_version, "MERGE", adds=[tuple(merged.values())] if merged else [],
                     removes=current, txn=txn, metadata=metadata, rows=len(sums), reads_data=True)
        return Written()

    def fence(self, path: str, txn: Txn, metadata: str) -> None:
        boundary.step("delta.w.fence:begin")
        table = self._table(path)
        read_version = table.latest
        recorded = table.txns().get(txn.app_id)
        if recorded is not None and recorded >= txn.version:
            return
        boundary.step("delta.w.fence:commit")
        self._commit(path, read_version, "WRITE", txn=txn, metadata=metadata)

    def restore(self, path: str, version: int, *, txn: Txn, metadata: str) -> Restored:
        boundary.step("delta.w.restore:begin")
        table = self._table(path)
        read_version = table.latest
        recorded = table.txns().get(txn.app_id)
        self.refuse_restore(path, version, recorded, txn)
        target, live = table.live(version), table.live(read_version)
        adds, removes = [n for n in target if n not in live], [n for n in live if n not in target]
        keep = txn if recorded is None or recorded < txn.version else Txn(txn.app_id, recorded)
        boundary.step("delta.w.restore:commit")
        new = self._commit(path, read_version, "RESTORE", readds=adds, removes=removes, txn=keep, metadata=metadata,
                           parameters={"version": version}, strict=True)
        return Restored(version, new, {"num_restored_files": len(adds), "num_removed_files": len(removes)})

    def optimize(self, path: str) -> Any:
        boundary.step("delta.w.optimize:begin")
        table = self._table(path)
        read_version = table.latest
        live = table.live(read_version)
        rows = tuple(row for name in live for row in table.files[name])
        boundary.step("delta.w.optimize:commit")
        if len(live) < 2:
            return {"metrics": {"numFilesAdded": 0, "numFilesRemoved": 0}}
        self._commit(path, read_version, "OPTIMIZE", adds=[rows], removes=live, reads_data=True)
        return {"metrics": {"numFilesAdded": 1, "numFilesRemoved": len(live)}}

    def put_file(self, path: str, relative: str, text: str) -> None:
        boundary.step("delta.w.put_file")
        self._tables.setdefault(path, _Table()).side[relative] = text

    # -- retention (tests and the simulation's faults) ---------------------------------------------

    def vacuum(self, path: str) -> list[str]:
        """VACUUM with no retention: every file not in the latest version is gone."""
        table = self._table(path)
        live = set(table.live())
        gone = [name for name in table.files if name not in live and name not in table.vacuumed]
        table.vacuumed.update(gone)
        return gone

    def clean_log(self, path: str, keep_from: int) -> None:
        """The log's cleanup: versions before ``keep_from`` are no longer readable."""
        table = self._table(path)
        table.log_start = max(table.log_start, min(keep_from, table.latest))

    def paths(self) -> list[str]:
        return sorted(p for p, t in self._tables.items() if t.commits)

    def all_commits(self, path: str) -> list[_Commit]:
        """Every commit of the table, oldest first (for invariants and the conformance test)."""
        return list(self._tables[path].commits) if path in self._tables else []


def _sums_by_key(rows: list[dict[str, Any]], keys: Sequence[str],
                 sums: Sequence[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """One row per key with ``sums`` added up (what a MERGE's source must be: unique keys)."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        key = tuple(row[k] for k in keys)
        if key in found:
            for column in sums:
                found[key][column] += row[column]
        else:
            found[key] = {**{k: row[k] for k in keys}, **{c: row[c] for c in sums}}
    return found
