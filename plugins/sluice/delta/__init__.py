"""One facade over Delta tables: what sluice's protocol, sinks and Delta source do to a table,
and nothing else. Two implementations keep the same semantics:

* ``sluice.delta.spark.SparkTables``: real Delta Lake through a SparkSession (classic or Spark
  Connect);
* ``sluice.delta.twin.TwinTables``: an in-memory twin for the unit tests and the deterministic
  simulation (``sluice.sim``), held to real Delta by ``tests/integration/test_delta_conformance.py``.

The semantics the protocol relies on (Delta 4.4.0):

* every table change is a numbered commit; creating a table is a commit of its own (version 0);
* a write carrying a ``Txn`` is skipped when the table recorded that app id at a version at
  least as high, and fails when a concurrent commit set the same app id;
* ``RESTORE`` keeps the recorded transactions (delta-io/delta#1813) and carries none itself, so
  Delta does not fence it; ``restore`` here is fenced: one transaction reads the table, refuses if
  a newer token is recorded, and commits the restore together with this run's ``Txn`` (a
  concurrent commit fails it);
* a version whose files were vacuumed, or whose log was cleaned up, cannot be restored.

Examples (the twin; ``SparkTables(spark)`` answers the same)::

    >>> from sluice.delta.twin import TwinTables
    >>> from sluice.model import Txn
    >>> tables = TwinTables()
    >>> tables.create("t", like=[])
    True
    >>> tables.write("t", [{"k": 1}], APPEND, txn=Txn("app", 5), metadata="{}")
    >>> tables.write("t", [{"k": 1}], APPEND, txn=Txn("app", 5), metadata="{}")  # a replay: skipped
    >>> tables.version("t"), tables.txn_version("t", "app")
    (1, 5)
    >>> tables.restore("t", 0, txn=Txn("app", 6), metadata="{}")["restored_to"]
    0
    >>> tables.txn_version("t", "app")  # RESTORE keeps (here: moves up) the recorded txn
    6
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.model import TableCommit, Txn

__all__ = ["APPEND", "TableCommit", "TableShape", "Tables", "Txn", "Written", "commit_of"]


@dataclass(frozen=True)
class TableShape:
    """How rows go into a table: ``append``, ``aggregate`` (MERGE adding ``sums`` by ``keys``) or
    ``upsert`` (MERGE by ``keys``, the greatest row by ``sequence_by`` wins, ``delete_when`` rows
    kept as tombstones; ``sluice.delta.upsert``); Delta partition columns, and where rows go
    before a keyed write (``hash`` or ``prompt``)."""

    mode: str = "append"
    keys: tuple[str, ...] = ()
    sums: tuple[str, ...] = ()
    partition_by: tuple[str, ...] = ()
    partitioning: str = "hash"
    sequence_by: str | None = None
    delete_when: str | None = None
    history: str = "none"

    @classmethod
    def of(cls, spec: Any, partitioning: str = "hash") -> TableShape:
        """The shape of a ``SinkSpec``."""
        return cls(spec.mode, tuple(spec.keys or ()), tuple(spec.sums or ()), tuple(spec.partition_by or ()),
                   partitioning, getattr(spec, "sequence_by", None), getattr(spec, "delete_when", None),
                   getattr(spec, "history", None) or "none")


APPEND = TableShape()


@dataclass(frozen=True)
class Written:
    """What a write reports beyond its commit: the key statistics of a keyed write
    (``partitioning: prompt``, ``sluice.sinks.layout``)."""

    keys: dict[str, Any] | None = None


@dataclass
class Restored:
    """A restore's outcome: Delta's metrics, and the version it went back to."""

    restored_to: int
    version: int | None
    metrics: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:  # reports read it as a mapping
        return {"restored_to": self.restored_to, "version": self.version, **self.metrics}[key]


class Tables(ABC):
    """Delta tables by path. ``Frame`` is the implementation's frame type: a Spark DataFrame, or
    the twin's list of row dicts."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a Delta table is at ``path``."""

    @abstractmethod
    def version(self, path: str) -> int | None:
        """The table's latest version, or ``None`` when there is no table."""

    @abstractmethod
    def create(self, path: str, like: Any, partition_by: Sequence[str] = (), metadata: str | None = None,
               shape: TableShape | None = None, txn: Txn | None = None) -> bool:
        """Create the table empty, with ``like``'s schema, unless it exists (a commit of its own,
        with ``metadata`` as its ``userMetadata``); an upsert ``shape`` adds its tombstone flag.
        With ``txn`` the creation commit records it: the table is born fenced, and no write of
        an older token ever lands in it. Returns whether this call made the table (its version
        0 is this commit); a table that exists is left as it is."""

    @abstractmethod
    def txn_version(self, path: str, app_id: str) -> int | None:
        """The last version recorded for ``app_id`` (``None``: none, or no table)."""

    @abstractmethod
    def write(self, path: str, frame: Any, shape: TableShape, *, txn: Txn, metadata: str,
              rows: int | None = None) -> Written:
        """Write ``frame`` in one commit carrying ``txn`` and ``metadata`` (its ``userMetadata``);
        Delta skips it, silently, when the table recorded ``txn.app_id`` at ``txn.version`` or
        above. ``rows``: the frame's row count when known."""

    @abstractmethod
    def fence(self, path: str, txn: Txn, metadata: str) -> None:
        """An empty commit that only records ``txn`` (skipped like a write)."""

    @abstractmethod
    def restore(self, path: str, version: int, *, txn: Txn, metadata: str) -> Restored:
        """RESTORE the table to ``version``, fenced: in one transaction, refuse with
        ``FencedError`` when the table recorded ``txn.app_id`` under a newer token, else commit
        the restore with ``txn`` (kept at the recorded version when that is higher). A commit
        that races it fails it."""

    @abstractmethod
    def lineage(self, path: str) -> Iterator[TableCommit]:
        """Every retained commit, newest first (lazily where the implementation can)."""

    @abstractmethod
    def commit_rows(self, path: str, version: int) -> int:
        """Rows commit ``version`` wrote (an append's output rows, a MERGE's source rows)."""

    @abstractmethod
    def restorable(self, path: str, version: int) -> str | None:
        """Why ``version`` cannot be restored (its log or files were cleaned up), or ``None``."""

    def refuse_restore(self, path: str, version: int, recorded: int | None, txn: Txn) -> None:
        """Raise unless ``txn`` may RESTORE ``path`` to ``version``: a newer owner's token
        recorded there (``FencedError``; Delta's own RESTORE honours no txn, so every
        implementation checks it in the RESTORE's transaction), or the version cleaned up."""
        from sluice.errors import FencedError, SluiceError
        from sluice.protocol.rules import fenced_out, txn_token

        if fenced_out(recorded, txn_token(txn.version)):
            raise FencedError(f"table {path}: a newer owner's token {txn_token(recorded)} is recorded "
                              f"({txn.app_id}); token {txn_token(txn.version)} may not restore it")
        problem = self.restorable(path, version)
        if problem:
            raise SluiceError(problem)

    @abstractmethod
    def optimize(self, path: str) -> Any:
        """Compact the table's files (no data change, no txn)."""

    @abstractmethod
    def put_file(self, path: str, relative: str, text: str) -> None:
        """Write a side file next to the table (``<table>/<relative>``, Delta ignores ``_`` folders),
        atomically: no reader sees half of it."""

    @abstractmethod
    def list_files(self, path: str, folder: str) -> list[tuple[str, str]]:
        """``(name, text)`` of the side files in ``<table>/<folder>``, by name."""

    def find_commit(self, path: str, app_id: str, last_epoch: int, limit: int | None = None) -> int | None:
        """The version of the newest commit by ``app_id`` whose last epoch is ``last_epoch``
        (searching the newest ``limit`` commits, or all retained)."""
        for n, commit in enumerate(self.lineage(path)):
            if limit is not None and n >= limit:
                break
            if commit.app_id == app_id and commit.epochs and max(commit.epochs) == last_epoch and not commit.fence:
                return commit.version
        return None


def commit_of(version: int, operation: str, user_metadata: str | None,
              parameters: dict[str, Any] | None) -> TableCommit:
    """A Delta commit as the protocol reads it, from its commitInfo's operation, parameters and
    userMetadata (sluice writes JSON there: app id, generation, token, epochs)."""
    try:
        meta = json.loads(user_metadata or "null")
    except ValueError:
        meta = None
    meta = meta if isinstance(meta, dict) else {}
    params = parameters or {}
    restored = params.get("version") if operation == "RESTORE" else None
    if restored in (None, "") and meta.get("restore_to") is not None:  # a restore written as an overwrite
        restored = meta["restore_to"]
    epochs = tuple(int(e[0]) for e in meta.get("epochs") or []) or (
        (int(meta["epoch"]),) if "epoch" in meta and "epochs" not in meta else ())
    return TableCommit(version, "RESTORE" if meta.get("restore_to") is not None else str(operation or ""),
                       int(restored) if restored not in (None, "") else None, meta.get("app_id"),
                       meta.get("generation"), epochs, int(meta.get("token") or 0), meta.get("pipeline"),
                       bool(meta.get("fence")), meta.get("sink"))
