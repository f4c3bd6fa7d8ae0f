"""A pipeline's tables as the protocol writes them: its sinks, ``_rejected`` and
``_quarantine`` (and ``_dedup``, the seen keys of ``dedup``). A group's epochs (or one epoch,
under ``commit: epoch``) are written in one Delta transaction per table, tagged
``txnAppId = sluice:<pipeline>:<table>:g<generation>``,
``txnVersion = token << 32 | (last epoch + 1)`` (``rules.txn_version``: the writer's lease token
above the epoch) and ``userMetadata`` = JSON ``{pipeline, sink, generation, token, epoch (the
last), epochs [[id, start, end], ...], range}``. Delta itself skips a write whose txnVersion is
not above the one it recorded: a replay of the same run, and any write of an older token once a
newer owner's token is in the table (``fence``, every fenced restore), concurrent or not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sluice.compute import QUARANTINE, REJECTED, quarantine_sink, rejected_sink
from sluice.delta import Tables, TableShape
from sluice.errors import FencedError
from sluice.model import EpochRange, Txn
from sluice.protocol import rules
from sluice.spec import PipelineSpec, SinkSpec


@dataclass(frozen=True)
class SinkCommit:
    """One table's part of a commit: the Delta version holding the epochs (``None`` when there
    was nothing to write), the rows written, whether the table held them already."""

    sink: str
    version: int | None
    rows: int
    replayed: bool
    keys: dict[str, Any] | None = None  # the key statistics under ``partitioning: prompt``

    def describe(self) -> dict[str, Any]:
        return {"sink": self.sink, "version": self.version, "rows": self.rows, "replayed": self.replayed}


class PipelineTable:
    """One table of a pipeline, as its writer."""

    def __init__(self, pipeline: str, spec: SinkSpec, partitioning: str = "hash") -> None:
        self.pipeline = pipeline
        self.spec = spec
        self.name = spec.name
        self.path = spec.path
        self.shape = TableShape.of(spec, partitioning)

    def app_id(self, generation: int) -> str:
        return rules.sink_app_id(self.pipeline, self.name, generation)

    def metadata(self, epochs: list[EpochRange], generation: int, token: int, **extra: Any) -> str:
        last = epochs[-1].epoch_id if epochs else -1
        return json.dumps({"pipeline": self.pipeline, "sink": self.name, "generation": generation,
                           "token": token, "epoch": last, "epochs": [[e.epoch_id, e.start, e.end] for e in epochs],
                           "range": [epochs[0].start, epochs[-1].end] if epochs else None,
                           "app_id": self.app_id(generation),
                           "txn_version": rules.txn_version(token, last), **extra}, sort_keys=True)

    def _refused(self, recorded: int | None, token: int, what: str, app_id: str) -> FencedError:
        return FencedError(f"pipeline {self.pipeline!r} table {self.path}: {what} (lease token {token}) was refused "
                           f"by Delta: a newer owner's token {rules.txn_token(recorded or 0)} is in the table "
                           f"({app_id}); this run must stop")

    def write(self, tables: Tables, frame: Any, *, epochs: list[EpochRange], generation: int, token: int,
              skip_empty: bool = False, rows: int | None = None) -> SinkCommit:
        """Write ``epochs`` (contiguous, in order) in one Delta transaction, exactly once; a
        replay changes nothing and reports the old version. ``rows``: the frame's row count
        when the caller knows it already (saves a Spark job).

        Delta itself skips a commit whose txnVersion is not above the one it recorded, so the
        write is simply attempted: if the table's version did not move, either this run wrote
        the epochs already (its version is looked up in the history) or a newer owner's token is
        in the table (``FencedError``). (Asking the snapshot for the app's txn version first
        costs a state reconstruction, a Spark job of ~1 s per write, measured.)
        """
        app_id = self.app_id(generation)
        last = epochs[-1].epoch_id
        if rows == 0 and skip_empty:  # the same ranges always yield the same rows: nothing to replay
            return SinkCommit(self.name, None, 0, replayed=False)
        before = tables.version(self.path)
        if before is None:  # tables are made ready before an attempt; this is a last resort
            self.create(tables, frame, generation=generation, token=token)
            before = tables.version(self.path)
        written = tables.write(self.path, frame, self.shape, txn=Txn(app_id, rules.txn_version(token, last)),
                               metadata=self.metadata(epochs, generation, token), rows=rows)
        after = tables.version(self.path)
        if after is not None and before is not None and after > before:
            # This run holds the pipeline's lease and its token is in the table: the new commits are its own.
            version = tables.find_commit(self.path, app_id, last, limit=after - before)
            if version is not None:
                rows = tables.commit_rows(self.path, version) if rows is None else rows
                return SinkCommit(self.name, version, rows, replayed=False, keys=written.keys)
        recorded = tables.txn_version(self.path, app_id)
        if rules.fenced_out(recorded, token):
            raise self._refused(recorded, token, f"the commit of epochs {epochs[0].epoch_id}..{last}", app_id)
        version = tables.find_commit(self.path, app_id, last)
        if version is None:
            raise RuntimeError(f"pipeline {self.pipeline!r} sink {self.name!r}: Delta recorded no commit "
                               f"for epoch {last} ({app_id}) in {self.path}")
        rows = tables.commit_rows(self.path, version) if rows is None else rows
        return SinkCommit(self.name, version, rows, replayed=True, keys=written.keys)

    def create(self, tables: Tables, like: Any, *, generation: int, token: int) -> bool:
        """Create the table empty (``like``'s schema) unless it exists; its creation names the
        pipeline and the token (a store that lost the pipeline can tell the tables are not new)
        and records the token as the fence does: a table this returns True for is fenced."""
        return tables.create(self.path, like, self.shape.partition_by,
                             metadata=self.metadata([], generation, token, created=True), shape=self.shape,
                             txn=Txn(self.app_id(generation), rules.txn_version(token, -1)))

    def fence(self, tables: Tables, generation: int, token: int) -> int | None:
        """Record ``token`` in the table under the generation's app id (an empty commit): from
        then on Delta skips or refuses every write of an older token. Returns the fence's
        version, or ``None`` when there is no table. (A table ``create`` made under the same
        token and generation was born fenced: it needs none.)"""
        if not tables.exists(self.path):
            return None
        app_id = self.app_id(generation)
        txn = Txn(app_id, rules.txn_version(token, -1))
        recorded = tables.txn_version(self.path, app_id)
        if recorded is None or recorded < txn.version:
            tables.fence(self.path, txn, self.metadata([], generation, token, fence=True))
            recorded = tables.txn_version(self.path, app_id)
        if rules.fenced_out(recorded, token):
            raise self._refused(recorded, token, "the fence", app_id)
        return tables.version(self.path)

    def restore(self, tables: Tables, version: int, *, generation: int, token: int) -> Any:
        """RESTORE the table to ``version`` under this token (``Tables.restore``: fenced)."""
        return tables.restore(self.path, version, txn=Txn(self.app_id(generation), rules.txn_version(token, -1)),
                              metadata=self.metadata([], generation, token, restore_to=version))


def pipeline_tables(spec: PipelineSpec) -> list[PipelineTable]:
    """Every table the pipeline writes, each once, as its writer (``_rejected``, the quarantine
    table under one app id, the sinks, and ``_dedup`` under ``dedup``)."""
    tables = [PipelineTable(spec.name, rejected_sink(spec)), PipelineTable(spec.name, quarantine_sink(spec)),
              *[PipelineTable(spec.name, s, spec.partitioning) for s in spec.sinks]]
    if spec.dedup is not None:  # the seen keys (sluice.dedup): rolled back with the epochs like the others
        from sluice.dedup import dedup_sink

        tables.append(PipelineTable(spec.name, dedup_sink(spec)))
    return tables


def table_of(spec: PipelineSpec, name: str) -> PipelineTable:
    """The pipeline's table named ``name`` (a sink, ``_rejected`` or ``_quarantine``)."""
    return next(t for t in pipeline_tables(spec) if t.name == name)


__all__ = ["QUARANTINE", "REJECTED", "PipelineTable", "SinkCommit", "pipeline_tables", "table_of"]
