"""The simulation's data plane: ``Compute`` in plain Python over the landed JSON-lines files,
through the real ``FileSource`` (its manifest, its retention checks). Frames are lists of row
dicts, as the Delta twin takes them.

The transform: a record ``{"k": <key>, "n": <int>}`` is valid; the ``counts`` sink adds ``n``
per ``k`` (aggregate), the ``clean`` sink appends the record with its file and line, the
``latest`` sink upserts it (the highest ``n`` per ``k``; ``n = 9`` deletes ``k``); ``audit``,
a sink an operator may add to the spec during a schedule, appends it as ``clean`` does (the
transform always yields it; a run of a spec without it does not write it). A line that
is not a JSON object, or lacks ``k``/``n``, goes to ``_rejected``. A record whose ``k`` is
``"POISON"`` makes the transform fail (a poison record: only skipping its file helps). A record
whose ``k`` is ``"INVALID"`` passes the transform but fails the ``counts`` sink's expectation
(``k`` not in ``{"INVALID"}``) under the ``fail`` policy: the epoch fails validation and the
pipeline halts, until the operator's fix (``fixed()``: a new check) sends it to ``_rejected``.
Under ``dedup`` (keys ``k`` and ``n``), the valid records are deduplicated before the transform by
the product's rule (``sluice.dedup.dedup_rows``), in source order, from the ``_dedup`` table as
the group starts (its version then, after any reconcile's RESTORE, as the Spark compute reads
it); the seen keys of the committed epochs are the group's ``_dedup`` MERGE.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from sluice.compute import QUARANTINE, REJECTED, Compute, Prepared
from sluice.dedup import DEDUP, EPOCH, SEEN_AT, dedup_rows
from sluice.model import Epoch, EpochRange
from sluice.validation import SinkValidation

POISON = "POISON"
LATEST_DELETE = 9  # the ``latest`` upsert sink's delete_when: n = 9
INVALID = "INVALID"
AUDIT = "audit"
#: The reason the fixed spec's check gives an INVALID record.
INVALID_REASON = "check failed: k <> 'INVALID'"


class PoisonError(RuntimeError):
    """The transform failed on a record (as a UDF raising would)."""


def parse(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a valid line, ``(None, why)`` for a malformed one."""
    try:
        record = json.loads(text)
    except ValueError:
        return None, "malformed record: not parseable as json"
    if not isinstance(record, dict):
        return None, "malformed record: not a JSON object"
    if not isinstance(record.get("k"), str):
        return None, "missing required field 'k'"
    if not isinstance(record.get("n"), int):
        return None, "missing required field 'n'"
    return {"k": record["k"], "n": record["n"]}, None


def file_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return [line for line in fh.read().split("\n") if line.strip()]


class TwinCompute(Compute):
    """The data plane of the simulation's pipelines (sinks ``counts``, ``clean``, ``latest``).
    ``fixed()``: whether the operator has deployed the check that rejects INVALID records."""

    def __init__(self, spec: Any, store: Any, fixed: Callable[[], bool] = lambda: False, tables: Any = None) -> None:
        super().__init__(spec, store)
        self.fixed = fixed
        self.tables = tables

    def empty(self) -> dict[str, Any]:
        return {REJECTED: [], QUARANTINE: [], AUDIT: [], DEDUP: [], **{s.name: [] for s in self.spec.sinks}}

    def _seen(self) -> dict[tuple[Any, ...], Any]:
        """The seen keys (``dedup``) at the table's version now, as the group starts (after any
        reconcile's RESTORE), as Spark reads them: key tuple -> seen time."""
        path = self.spec.dedup_table
        if self.tables is None or path is None or self.tables.version(path) is None:
            return {}
        keys = self.spec.dedup.keys
        return {tuple(r[k] for k in keys): r.get(SEEN_AT) for r in self.tables.rows(path)}

    def _modes(self) -> dict[str, str]:
        return {AUDIT: "append", **{s.name: s.mode for s in self.spec.sinks}}

    def _records(self, start: int, end: int) -> list[tuple[str, int, str]]:
        entries = self.source.check_retained(start, end)  # the real source's checks: gone, changed
        return [(e.path, n, text) for e in entries for n, text in enumerate(file_lines(e.path), start=1)]

    def _prepare(self, epochs: list[Epoch]) -> Prepared:
        prepared = Prepared(list(epochs), time.monotonic(), {})
        rejected: list[dict[str, Any]] = []
        modes = self._modes()
        outputs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
        fixed = self.fixed()
        dedup = self.spec.dedup
        seen = self._seen() if dedup is not None else {}
        changed: dict[tuple[Any, ...], int] = {}  # key -> epoch of its kept record, committed epochs only
        for epoch in epochs:
            # source order (sluice.dedup): file, then line, within the epoch
            records = sorted(self._records(epoch.start, epoch.end)) if dedup is not None else \
                self._records(epoch.start, epoch.end)
            prepared.n_input[epoch.epoch_id] = len(records)
            bad = invalid = 0
            epoch_rejected: list[dict[str, Any]] = []
            epoch_outputs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
            valid: list[tuple[str, int, dict[str, Any]]] = []
            for path, line, text in records:
                record, why = parse(text)
                if record is not None and record["k"] == INVALID and fixed:
                    record, why = None, INVALID_REASON
                if record is None:
                    bad += 1
                    epoch_rejected.append({"pipeline": self.spec.name, "epoch": epoch.epoch_id,
                                           "generation": epoch.generation, "file": path, "line": line,
                                           "reason": why, "record": text})
                    continue
                valid.append((path, line, record))
            new: dict[tuple[Any, ...], Any] = {}  # keys whose seen time this epoch set, with that time
            if dedup is not None:  # before the transform, on the valid records (the product's rule)
                kept, new = dedup_rows([dict(r, _path=p, _line=n) for p, n, r in valid], seen, dedup.keys,
                                       dedup.within, dedup.time)
                prepared.n_deduplicated[epoch.epoch_id] = len(valid) - len(kept)
                valid = [(r.pop("_path"), r.pop("_line"), r) for r in kept]
            for path, line, record in valid:
                if record["k"] == POISON:
                    raise PoisonError(f"the transform failed on {path} line {line}")
                invalid += record["k"] == INVALID
                for name, mode in modes.items():
                    row = dict(record) if mode != "append" else dict(record, file=path, line=line)
                    epoch_outputs[name].append(row)
            prepared.n_rejected[epoch.epoch_id] = bad
            counted = len(epoch_outputs["counts"])
            prepared.results[epoch.epoch_id] = {"counts": SinkValidation(
                "counts", invalid == 0, counted,
                failed=[{"expectation": "expect_column_values_to_not_be_in_set", "column": "k",
                         "unexpected_count": invalid}] if invalid else [])}
            if invalid:  # the ``fail`` policy: this epoch and the later ones are not written
                prepared.failed = epoch
                break
            prepared.committing.append(epoch)
            seen.update(new)
            changed.update(dict.fromkeys(new, epoch.epoch_id))
            rejected += epoch_rejected
            for name, rows in epoch_outputs.items():
                outputs[name] += rows
        prepared.rejected = rejected
        if dedup is not None:
            prepared.dedup_state = [{**dict(zip(dedup.keys, key, strict=True)), SEEN_AT: seen[key], EPOCH: e}
                                    for key, e in changed.items()]
        prepared.outputs = outputs
        prepared.counts = {name: len(rows) for name, rows in outputs.items()}
        return prepared

    def prepare_group(self, epochs: list[Epoch]) -> Prepared:
        return self._prepare(epochs)

    def prepare_epoch(self, epoch: Epoch, *, materialize: bool = False, weight: int = 1) -> Prepared:
        return self._prepare([epoch])

    def locate_poison(self, span: EpochRange) -> tuple[str, int, str] | None:
        try:
            records = self._records(span.start, span.end)
        except Exception:
            return None
        for path, line, text in records:
            record, _ = parse(text)
            if record is not None and record["k"] == POISON:
                return path, line, text
        return None
