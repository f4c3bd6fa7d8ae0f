"""The rules of a Delta-table source (issue 15 item 3), apart from Spark: which upstream
versions become manifest entries, and when an upstream RESTORE makes what was read garbage.

An upstream table's commits are registered one manifest entry per version that changed data,
``delta://<table path>@<version>``, oldest first; an epoch (a range of manifest positions) is then
a fixed set of versions, read again exactly by a rerun or a recompute (its change data feed, or
the files the versions added). Versions that change no data (OPTIMIZE, VACUUM, a property
change) are not registered.

A RESTORE of the upstream table (its pipeline rolled back) undoes versions; when it undoes a
version this pipeline registered, the rows read from it are no longer upstream, and reading on
would build on data that no longer exists. The source stops the pipeline instead, naming the
RESTORE and the epoch to roll back to (the first one holding an undone version). The commits
come as ``protocol.TableCommit`` newest first, as ``sinks.delta.commit_lineage`` gives them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from sluice.errors import SourceError
from sluice.protocol import TableCommit

#: Operations that change no rows: their versions are not registered.
NO_DATA_CHANGE = frozenset({"OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES", "UNSET TBLPROPERTIES",
                            "ADD CONSTRAINT", "DROP CONSTRAINT", "CHANGE COLUMN", "ADD COLUMNS", "CREATE TABLE",
                            "REORG", "FSCK", "UPGRADE PROTOCOL", "ADD FEATURE", "DROP FEATURE", "RESTORE"})

_ENTRY = re.compile(r"^delta://(?P<table>.+)@(?P<version>\d+)$")


@dataclass(frozen=True)
class TableVersion:
    """One upstream version: one manifest entry."""

    table: str
    version: int

    @property
    def path(self) -> str:
        return f"delta://{self.table}@{self.version}"

    @classmethod
    def parse(cls, path: str) -> TableVersion:
        match = _ENTRY.match(path)
        if not match:
            raise SourceError(f"{path!r} is not a Delta table version (delta://<table path>@<version>)")
        return cls(match["table"], int(match["version"]))


def versions_to_register(commits: Iterable[TableCommit], registered_end: int | None) -> list[int]:
    """The versions after ``registered_end`` (the last one registered; None: none yet) that
    changed data and are still in the table's lineage, oldest first. ``commits`` newest first.
    A version a RESTORE undid before it was registered is not read at all."""
    found = []
    restored_to: int | None = None
    for commit in commits:
        if registered_end is not None and commit.version <= registered_end:
            break
        if restored_to is not None and commit.version > restored_to:
            continue  # undone by a later RESTORE
        if commit.operation == "RESTORE" and commit.restored_to is not None:
            restored_to = commit.restored_to
            continue
        if commit.operation not in NO_DATA_CHANGE:
            found.append(commit.version)
    return sorted(found)


@dataclass(frozen=True)
class UpstreamRestore:
    """A RESTORE of the upstream table that undid versions this pipeline read."""

    table: str
    restore_version: int  # the RESTORE's own commit
    restored_to: int
    undone: tuple[int, ...]  # registered versions it undid, oldest first
    first_epoch: int | None  # the first epoch holding one of them (None: none planned yet)

    def message(self, pipeline: str) -> str:
        entries = ", ".join(TableVersion(self.table, v).path for v in self.undone)
        roll = (f", then roll this pipeline back to epoch {self.first_epoch} (`make rollback PIPELINE={pipeline} "
                f"TO_EPOCH={self.first_epoch} REASON=\"upstream restore\"`, or sluice_rollback): its recompute "
                "reads those epochs again without them" if self.first_epoch is not None else "")
        return (f"pipeline {pipeline!r}: upstream table {self.table} was restored to version {self.restored_to} "
                f"(RESTORE at version {self.restore_version}), undoing versions {list(self.undone)} that this "
                f"pipeline registered; rows read from them are no longer upstream. To go on, skip their entries on "
                f"purpose ({entries}: sluice_skip_file or `make skip-file`){roll}. The versions written since the "
                "RESTORE are read next")


def undone_by_restore(table: str, commits: Iterable[TableCommit], registered: Sequence[int],
                      epoch_of_version: dict[int, int]) -> UpstreamRestore | None:
    """The newest RESTORE after the first registered version that undid any registered version,
    or None. ``commits`` newest first; ``registered`` the versions in the manifest;
    ``epoch_of_version`` the epoch each planned version belongs to."""
    if not registered:
        return None
    oldest = min(registered)
    for commit in commits:
        if commit.version <= oldest:
            return None
        if commit.operation == "RESTORE" and commit.restored_to is not None:
            undone = tuple(sorted(v for v in registered if commit.restored_to < v < commit.version))
            if undone:
                epochs = [epoch_of_version[v] for v in undone if v in epoch_of_version]
                return UpstreamRestore(table, commit.version, commit.restored_to, undone,
                                       min(epochs) if epochs else None)
    return None


# -- the upstream's log, read as files (a local table; no Spark) ---------------------------------


@dataclass(frozen=True)
class AddedFile:
    """A data file a version added: its absolute path, size and partition values."""

    path: str
    size: int
    partition_values: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionLog:
    """What one commit file of a table's ``_delta_log`` says: when, which operation, the data
    files it added (``dataChange``), and whether it removed any (an append adds only)."""

    version: int
    timestamp_s: float
    operation: str
    added: tuple[AddedFile, ...]
    removed: int

    @property
    def size(self) -> int:
        return sum(f.size for f in self.added)


def _log_dir(table: str) -> Path:
    return Path(table.removeprefix("file:")) / "_delta_log"


def read_version(table: str, version: int) -> VersionLog | None:
    """The commit file of ``version``, or None when the log no longer holds it (log retention
    cleaned it up; only a checkpoint remains)."""
    try:
        lines = (_log_dir(table) / f"{version:020d}.json").read_text().splitlines()
    except FileNotFoundError:
        return None
    added, removed, info = [], 0, {}
    for line in lines:
        action = json.loads(line) if line.strip() else {}
        if "commitInfo" in action:
            info = action["commitInfo"]
        elif "add" in action and action["add"].get("dataChange", True):
            add = action["add"]
            path = unquote(add["path"])
            added.append(AddedFile(path if "://" in path or path.startswith("/") else str(Path(table) / path),
                                   int(add.get("size") or 0), dict(add.get("partitionValues") or {})))
        elif "remove" in action and action["remove"].get("dataChange", True):
            removed += 1
    return VersionLog(version, float(info.get("timestamp") or 0) / 1000.0, str(info.get("operation") or ""),
                      tuple(added), removed)
