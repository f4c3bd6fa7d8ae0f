"""The records kept next to each table, from which a lost epoch store is rebuilt.

As Spark's ``CommitLog`` beside its ``OffsetSeqLog``, this module only serialises: what goes
into a record is decided by the protocol (``PipelineRun.publish``, ``operations.rollback``), and
what a rebuild makes of the records by ``operations.rebuild_store``. The files are written and
read through the Delta facade (``Tables.put_file``, ``list_files``), as side files of the table.

Layout, under each sink's folder (Delta ignores ``_``-prefixed folders)::

    <table>/_sluice/epochs/<epoch id, 9 digits>-g<generation>.json   one per published epoch
    <table>/_sluice/rollbacks/g<new generation>.json                  one per rollback

Every record is one JSON object that starts with a version header, ``{"record": "epoch" |
"rollback", "format": 1, ...}``, followed by the record's fields at the top level (a person
reads it with ``jq``). Records written before the header existed (format 0) have the same
fields and no header; they are read as they are. A record of a newer format is refused, not
guessed at. Files are written to a hidden temporary name and renamed, so no reader sees half
of one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sluice.errors import SluiceError


class SideFiles(Protocol):
    """Where records are kept: the Delta facade's side files of a table (``Tables``)."""

    def put_file(self, path: str, relative: str, text: str) -> None: ...

    def list_files(self, path: str, folder: str) -> list[tuple[str, str]]: ...

FORMAT = 1
EPOCH, ROLLBACK = "epoch", "rollback"
_FOLDERS = {EPOCH: "epochs", ROLLBACK: "rollbacks"}
_HEADER = ("record", "format")


class RecordError(SluiceError):
    """A table-side record cannot be read: the message names the file."""


@dataclass(frozen=True)
class EpochRecord:
    """One published epoch as recorded next to one table: ``files`` are its range's
    ``(path, size, mtime)`` in offset order; ``fields`` the whole record without its header
    (the epoch as the store held it, its sink and Delta version)."""

    path: Path
    epoch_id: int
    generation: int
    start: int
    end: int
    files: tuple[tuple[str, int, float], ...]
    fields: dict[str, Any]


@dataclass(frozen=True)
class RollbackRecord:
    """A rollback to ``to_epoch`` that started ``generation``; ``restored_to_epoch`` is where
    its RESTORE went (before ``to_epoch`` when that fell inside a group commit)."""

    path: Path
    generation: int
    to_epoch: int
    restored_to_epoch: int
    fields: dict[str, Any]

    def undoes(self, record: EpochRecord) -> bool:
        """Whether this rollback removed ``record``'s epoch from the tables."""
        return self.generation > record.generation and record.epoch_id >= self.restored_to_epoch


def folder(kind: str) -> str:
    """The side folder of a table that holds records of ``kind``."""
    return f"_sluice/{_FOLDERS[kind]}"


def epoch_name(epoch_id: int, generation: int) -> str:
    return f"{epoch_id:09d}-g{generation}.json"


def epoch_path(table: str | Path, epoch_id: int, generation: int) -> Path:
    return Path(table) / folder(EPOCH) / epoch_name(epoch_id, generation)


def write_epoch(tables: SideFiles, table: str | Path, fields: dict[str, Any]) -> Path:
    """Write (or rewrite: idempotent) one epoch's record next to ``table``."""
    relative = f"{folder(EPOCH)}/{epoch_name(fields['epoch_id'], fields['generation'])}"
    tables.put_file(str(table), relative, _body(EPOCH, fields))
    return Path(table) / relative


def rollback_name(generation: int) -> str:
    return f"g{generation}.json"


def write_rollback(tables: SideFiles, table: str | Path, fields: dict[str, Any]) -> Path:
    """Write (or rewrite: idempotent) one rollback's record next to ``table``."""
    relative = f"{folder(ROLLBACK)}/{rollback_name(fields['generation'])}"
    tables.put_file(str(table), relative, _body(ROLLBACK, fields))
    return Path(table) / relative


def read(tables: SideFiles, paths: list[str]) -> tuple[list[EpochRecord], list[RollbackRecord]]:
    """Every epoch and rollback record found next to the tables at ``paths``, in name order."""
    epochs, rollbacks = [], []
    for table in map(str, paths):
        for name, text in tables.list_files(table, folder(EPOCH)):
            path = Path(table) / folder(EPOCH) / name
            fields = _read(path, text, EPOCH)
            try:
                epochs.append(EpochRecord(path, int(fields["epoch_id"]), int(fields["generation"]),
                                          int(fields["start"]), int(fields["end"]),
                                          tuple((str(p), int(s), float(m)) for p, s, m in fields["files"]), fields))
            except (KeyError, TypeError, ValueError) as exc:
                raise RecordError(f"epoch record {path}: missing or malformed field ({exc!r})") from None
        for name, text in tables.list_files(table, folder(ROLLBACK)):
            path = Path(table) / folder(ROLLBACK) / name
            fields = _read(path, text, ROLLBACK)
            try:
                to_epoch = int(fields["to_epoch"])
                rollbacks.append(RollbackRecord(path, int(fields["generation"]), to_epoch,
                                                int(fields.get("restored_to_epoch", to_epoch)), fields))
            except (KeyError, TypeError, ValueError) as exc:
                raise RecordError(f"rollback record {path}: missing or malformed field ({exc!r})") from None
    return epochs, rollbacks


def live(epochs: list[EpochRecord], rollbacks: list[RollbackRecord]) -> list[EpochRecord]:
    """The published epochs a rebuilt store must hold, in epoch order: for each epoch id the
    newest record that no later rollback undid."""
    best: dict[int, EpochRecord] = {}
    for record in epochs:
        if any(rollback.undoes(record) for rollback in rollbacks):
            continue
        current = best.get(record.epoch_id)
        if current is None or record.generation > current.generation:
            best[record.epoch_id] = record
    return [best[i] for i in sorted(best)]


def _body(kind: str, fields: dict[str, Any]) -> str:
    body = {"record": kind, "format": FORMAT, **{k: v for k, v in fields.items() if k not in _HEADER}}
    return json.dumps(body, indent=2, default=str)


def _read(path: Path, text: str, kind: str) -> dict[str, Any]:
    """A record's fields without its header; format 0 (no header) is read as it is."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{kind} record {path} cannot be read: {exc}") from None
    if not isinstance(body, dict):
        raise RecordError(f"{kind} record {path}: not a JSON object")
    version = body.get("format", 0)
    if body.get("record", kind) != kind:
        raise RecordError(f"{path}: a {body.get('record')!r} record in the {_FOLDERS[kind]} folder")
    if not isinstance(version, int) or version > FORMAT:
        raise RecordError(f"{kind} record {path} has format {version!r}; this sluice reads formats up to "
                          f"{FORMAT}: rebuild with the release that wrote it, or a newer one")
    return {k: v for k, v in body.items() if k not in _HEADER}
