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
from sluice.model import TableCommit
from sluice.protocol.rules import current_lineage

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


def versions_to_register(table: str, commits: Iterable[TableCommit], registered_end: int | None) -> list[int]:
    """The versions after ``registered_end`` (the last one registered; None: none yet) that
    changed data and are still in the table's lineage, oldest first. ``commits`` newest first,
    the retained ones (``sinks.delta.commit_lineage``). A version a RESTORE undid before it was
    registered is not read at all. Raises when the log no longer holds versions that were never
    registered: they cannot be read by version, and going on would skip their rows silently."""
    commits = list(commits)
    first_needed = 0 if registered_end is None else registered_end + 1
    if commits and commits[-1].version > first_needed:
        raise SourceError(f"upstream table {table}: its log no longer holds versions {first_needed} to "
                          f"{commits[-1].version - 1} (log retention, delta.logRetentionDuration), and this pipeline "
                          "has not read them; they cannot be read by version. Nothing was registered")
    found = []
    for commit in current_lineage(commits):
        if registered_end is not None and commit.version <= registered_end:
            break
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
    """The registered versions no longer in the table's lineage (a RESTORE undid them and no
    later RESTORE brought them back), with the newest RESTORE that undid the first of them; None
    when every registered version the log still holds is in the lineage. ``commits`` newest
    first; ``registered`` the versions in the manifest (not skipped); ``epoch_of_version`` the
    epoch each planned version belongs to."""
    if not registered:
        return None
    oldest = min(registered)
    retained = []
    for commit in commits:
        if commit.version < oldest:
            break
        retained.append(commit)
    held = {c.version for c in retained}
    live = {c.version for c in current_lineage(retained)}
    undone = tuple(sorted(v for v in registered if v in held and v not in live))
    if not undone:
        return None
    restore = next(c for c in retained if c.operation == "RESTORE" and c.restored_to is not None
                   and c.restored_to < undone[0] < c.version)
    epochs = [epoch_of_version[v] for v in undone if v in epoch_of_version]
    return UpstreamRestore(table, restore.version, restore.restored_to or 0, undone, min(epochs) if epochs else None)


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
