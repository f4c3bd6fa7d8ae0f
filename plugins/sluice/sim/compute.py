"""The simulation's data plane: ``Compute`` in plain Python over the landed JSON-lines files,
through the real ``FileSource`` (its manifest, its retention checks). Frames are lists of row
dicts, as the Delta twin takes them.

The transform: a record ``{"k": <key>, "n": <int>}`` is valid; the ``counts`` sink adds ``n``
per ``k`` (aggregate), the ``clean`` sink appends the record with its file and line. A line that
is not a JSON object, or lacks ``k``/``n``, goes to ``_rejected``. A record whose ``k`` is
``"POISON"`` makes the transform fail (a poison record: only skipping its file helps).
"""

from __future__ import annotations

import json
import time
from typing import Any

from sluice.compute import QUARANTINE, REJECTED, Compute, Prepared
from sluice.model import Epoch, EpochRange

POISON = "POISON"


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
    """The data plane of the simulation's pipelines (sinks ``counts`` and ``clean``)."""

    def empty(self) -> dict[str, Any]:
        return {REJECTED: [], QUARANTINE: [], **{s.name: [] for s in self.spec.sinks}}

    def _records(self, start: int, end: int) -> list[tuple[str, int, str]]:
        entries = self.source.check_retained(start, end)  # the real source's checks: gone, changed
        return [(e.path, n, text) for e in entries for n, text in enumerate(file_lines(e.path), start=1)]

    def _prepare(self, epochs: list[Epoch]) -> Prepared:
        prepared = Prepared(list(epochs), time.monotonic(), {})
        rejected: list[dict[str, Any]] = []
        outputs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in self.spec.sinks}
        for epoch in epochs:
            records = self._records(epoch.start, epoch.end)
            prepared.n_input[epoch.epoch_id] = len(records)
            bad = 0
            for path, line, text in records:
                record, why = parse(text)
                if record is None:
                    bad += 1
                    rejected.append({"pipeline": self.spec.name, "epoch": epoch.epoch_id,
                                     "generation": epoch.generation, "file": path, "line": line, "reason": why,
                                     "record": text})
                    continue
                if record["k"] == POISON:
                    raise PoisonError(f"the transform failed on {path} line {line}")
                for sink in self.spec.sinks:
                    row = dict(record) if sink.mode == "aggregate" else dict(record, file=path, line=line)
                    outputs[sink.name].append(row)
            prepared.n_rejected[epoch.epoch_id] = bad
        prepared.rejected = rejected
        prepared.outputs = outputs
        prepared.counts = {name: len(rows) for name, rows in outputs.items()}
        prepared.committing = list(epochs)
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
