"""The records kept next to each table, from which a lost epoch store is rebuilt.

As Spark's ``CommitLog`` beside its ``OffsetSeqLog``, this module only serialises: what goes
into a record is decided by the protocol (``execution.publish``, ``execution.rollback``), and
what a rebuild makes of the records by ``execution.rebuild_store``.

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
from typing import Any

from sluice.errors import SluiceError

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


def folder(table: str | Path, kind: str) -> Path:
    return Path(table) / "_sluice" / _FOLDERS[kind]


def epoch_path(table: str | Path, epoch_id: int, generation: int) -> Path:
    return folder(table, EPOCH) / f"{epoch_id:09d}-g{generation}.json"


def write_epoch(table: str | Path, fields: dict[str, Any]) -> Path:
    """Write (or rewrite: idempotent) one epoch's record next to ``table``."""
    path = epoch_path(table, fields["epoch_id"], fields["generation"])
    _write(path, EPOCH, fields)
    return path


def write_rollback(table: str | Path, fields: dict[str, Any]) -> Path:
    """Write one rollback's record next to ``table``."""
    path = folder(table, ROLLBACK) / f"g{fields['generation']}.json"
    _write(path, ROLLBACK, fields)
    return path


def read(tables: list[str]) -> tuple[list[EpochRecord], list[RollbackRecord]]:
    """Every epoch and rollback record found next to ``tables``, in file-name order."""
    epochs, rollbacks = [], []
    for table in tables:
        for path in sorted(folder(table, EPOCH).glob("*.json")):
            fields = _read(path, EPOCH)
            try:
                epochs.append(EpochRecord(path, int(fields["epoch_id"]), int(fields["generation"]),
                                          int(fields["start"]), int(fields["end"]),
                                          tuple((str(p), int(s), float(m)) for p, s, m in fields["files"]), fields))
            except (KeyError, TypeError, ValueError) as exc:
                raise RecordError(f"epoch record {path}: missing or malformed field ({exc!r})") from None
        for path in sorted(folder(table, ROLLBACK).glob("*.json")):
            fields = _read(path, ROLLBACK)
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


def _write(path: Path, kind: str, fields: dict[str, Any]) -> None:
    body = {"record": kind, "format": FORMAT, **{k: v for k, v in fields.items() if k not in _HEADER}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name)
    tmp.write_text(json.dumps(body, indent=2, default=str))
    tmp.replace(path)


def _read(path: Path, kind: str) -> dict[str, Any]:
    """A record's fields without its header; format 0 (no header) is read as it is."""
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
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
