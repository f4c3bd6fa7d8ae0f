"""The shadow rollback preview: what a rollback with recompute would leave in each table, computed
before anything is restored.

1. Plan the rollback exactly as ``operations.rollback`` does (a rollback into a group commit goes
   back to the group's first epoch) and check its preconditions; a refused rollback is reported,
   with nothing computed.
2. Per sink, copy the table as it was before the rolled-back epochs (the version the rollback
   RESTOREs to) into a shadow table under ``<data>/previews/<pipeline>/<preview id>/``.
3. Recompute the rolled-back epochs' recorded ranges with the current code (read, reject split,
   transform, Great Expectations) and write them into the shadow tables with the sinks' own
   write (MERGE-add or append).
4. Compare each shadow table with the published one (at the version read): rows added, removed
   and changed (by the sink's keys; by whole row for an append sink), with a sample.

The published tables, the epoch store and the source are only read. The report is kept as JSON
beside the shadow tables (the console lists them); the last ``KEEP`` previews of a pipeline are
kept, older ones deleted.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from sluice.errors import SluiceError
from sluice.paths import data_dir
from sluice.spec import NAME, PipelineSpec, SinkSpec
from sluice.store import EpochStore

log = logging.getLogger(__name__)

KEEP = 3  # previews kept per pipeline
SAMPLE_ROWS = 20


@dataclass(frozen=True)
class SinkDiff:
    """One sink: the published table against what the rollback with recompute would leave."""

    sink: str
    path: str
    shadow_path: str
    published_version: int | None
    restored_version: int
    published_rows: int
    shadow_rows: int
    added: int  # rows (keys) only the shadow holds
    removed: int  # rows (keys) only the published table holds
    changed: int  # same key, other values (keyed sinks)
    compared_by: list[str]
    columns_added: list[str] = field(default_factory=list)
    columns_removed: list[str] = field(default_factory=list)
    sample: list[dict[str, Any]] = field(default_factory=list)

    @property
    def unchanged(self) -> bool:
        return not (self.added or self.removed or self.changed or self.columns_added or self.columns_removed)


@dataclass
class ShadowPreview:
    pipeline: str
    preview_id: str
    to_epoch: int
    created_at: float
    restored_to_epoch: int | None = None
    generation: int | None = None
    recomputed_epochs: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed_validation: dict[str, Any] | None = None  # the first epoch the fail policy would stop at
    rejected: dict[str, int] = field(default_factory=dict)  # records: published vs recomputed
    sinks: list[SinkDiff] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        found = asdict(self)
        found["unchanged"] = not self.problems and all(s.unchanged for s in self.sinks)
        return found


def previews_dir(pipeline: str) -> Path:
    if not re.match(NAME, pipeline):  # a name from a URL or a report: never a path
        raise SluiceError(f"{pipeline!r} is not a pipeline name")
    return data_dir() / "previews" / pipeline


def preview_folder(pipeline: str, preview_id: str) -> Path:
    """The folder of one preview's shadow tables: always a child of the pipeline's previews
    folder, whatever the id holds (an Airflow run id, or an id read back from a report)."""
    return previews_dir(pipeline) / safe_id(preview_id)


def remove_preview(pipeline: str, folder: Path) -> None:
    """Delete a preview's folder; refused (``SluiceError``) unless it is a child of the
    pipeline's previews folder, resolved (no ``..``), and not a symbolic link."""
    root = previews_dir(pipeline)
    if folder.is_symlink() or folder.resolve().parent != root.resolve():
        raise SluiceError(f"pipeline {pipeline!r}: {folder} is not a preview's folder under {root}: not deleted")
    shutil.rmtree(folder, ignore_errors=True)


def saved_previews(pipeline: str) -> list[dict[str, Any]]:
    """The kept previews of ``pipeline``, newest first."""
    folder = previews_dir(pipeline)
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # one being written, or damaged: the others still show
            continue
    return sorted(found, key=lambda p: p.get("created_at", 0), reverse=True)


def shadow_preview(spec: PipelineSpec, store: EpochStore, spark: SparkSession, to_epoch: int,
                   preview_id: str | None = None) -> ShadowPreview:
    """Steps 1-4 of the module's story; the report is saved and returned."""
    from sluice.compute import SparkCompute
    from sluice.delta.spark import SparkTables
    from sluice.protocol import operations
    from sluice.protocol.runtime import Runtime
    from sluice.protocol.tables import PipelineTable

    started = time.monotonic()
    # The report keeps the id as given (the console finds a run's preview by its run id); only
    # the folder and file names are made safe (preview_folder).
    report = ShadowPreview(spec.name, preview_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6],
                           to_epoch, time.time())
    folder = preview_folder(spec.name, report.preview_id)
    tables = SparkTables(spark)
    runtime = Runtime(tables, lambda s, st, t: SparkCompute(s, st, spark, tables))
    try:
        # 1. The rollback's plan and preconditions.
        try:
            plan, shared = operations.group_rollback_plan(store, spec.name, to_epoch)
            if shared:
                report.notes.append(operations.shared_commit_note(shared, to_epoch))
            operations.check_preconditions(spec, store, runtime, plan)
        except SluiceError as exc:  # a refused rollback (RollbackRefusedError) or no such epoch
            report.problems.append(str(exc))
            return report
        report.restored_to_epoch, report.generation = plan.to_epoch, plan.generation
        epochs = list(plan.rolled_back)  # the recompute plans every rolled-back range again
        report.recomputed_epochs = [e.epoch_id for e in epochs]
        if not epochs:
            report.notes.append("no epoch from this one on: the rollback would change nothing")
            return report

        # 2. Shadow tables as the rollback would leave them before its recompute (a cleared
        # task's rerun has the same id: it starts afresh).
        remove_preview(spec.name, folder)
        shadow = shadow_spec(spec, folder)
        restored: dict[str, int] = {}
        published: dict[str, int | None] = {}
        for sink, copy in zip(spec.sinks, shadow.sinks, strict=True):
            published[sink.name] = tables.version(sink.path)
            restored[sink.name] = operations.restore_target(plan, [sink.name])
            if published[sink.name] is not None:
                writer = (spark.read.format("delta").option("versionAsOf", restored[sink.name]).load(sink.path)
                          .write.format("delta"))
                (writer.partitionBy(*sink.partition_by) if sink.partition_by else writer).save(copy.path)

        # 3. The recompute, with the current code, into the shadow tables.
        prepared = SparkCompute(shadow, store, spark, tables).prepare_group(epochs)
        try:
            if prepared.failed is not None:
                failed = prepared.results.get(prepared.failed.epoch_id, {})
                report.failed_validation = {
                    "epoch_id": prepared.failed.epoch_id,
                    "sinks": {name: asdict(r) for name, r in failed.items() if not r.success}}
                report.notes.append(f"epoch {prepared.failed.epoch_id} fails validation with the current code: "
                                    "under policy fail the recompute stops there (the shadow holds the epochs "
                                    "before it)")
            ranges = [e.range for e in prepared.committing]
            for sink in shadow.sinks:
                frame = prepared.outputs.get(sink.name)
                if frame is not None and ranges:
                    PipelineTable(shadow.name, sink, shadow.partitioning).write(
                        tables, frame, epochs=ranges, generation=plan.generation + 1, token=1)
            report.rejected = {
                "published": sum(e.rows.get("rejected", 0) for e in epochs),
                "recomputed": sum(prepared.n_rejected.get(e.epoch_id, 0) for e in prepared.committing)}
        finally:
            prepared.release()

        # 4. The differences.
        for sink, copy in zip(spec.sinks, shadow.sinks, strict=True):
            shadow_frame = spark.read.format("delta").load(copy.path) if tables.exists(copy.path) else None
            version = published[sink.name]
            published_frame = (spark.read.format("delta").option("versionAsOf", version).load(sink.path)
                               if version is not None else None)
            report.sinks.append(diff_tables(sink, copy.path, published_frame, shadow_frame,
                                            version, restored[sink.name]))
        return report
    finally:
        report.seconds = round(time.monotonic() - started, 3)
        _save(report, folder)


def safe_id(preview_id: str) -> str:
    """A preview id usable as one folder name: an Airflow run id may hold ``:``, ``+``, ``/``
    or ``..``; only letters, digits, ``-`` and ``_`` are kept (the others become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", preview_id)[:200] or "preview"


def shadow_spec(spec: PipelineSpec, folder: Path) -> PipelineSpec:
    """``spec`` with every table it writes moved under ``folder``."""
    sinks = [s.model_copy(update={"path": str(folder / s.name)}) for s in spec.sinks]
    return spec.model_copy(update={"sinks": sinks, "rejected_path": str(folder / "_rejected"),
                                   "quarantine_path": str(folder / "_quarantine")})


def diff_tables(sink: SinkSpec, shadow_path: str, published: DataFrame | None, shadow: DataFrame | None,
                published_version: int | None, restored_version: int) -> SinkDiff:
    """Rows added, removed and changed from ``published`` to ``shadow``: by the sink's keys for
    an aggregate or an upsert (its tombstones included), by whole rows (as a multiset) for an append."""
    from pyspark.sql import functions as F

    empty = published if shadow is None else shadow
    if empty is None:
        return SinkDiff(sink.name, sink.path, shadow_path, published_version, restored_version, 0, 0, 0, 0, 0, [])
    published = published if published is not None else empty.limit(0)
    shadow = shadow if shadow is not None else empty.limit(0)
    before, after = published.columns, shadow.columns
    common = [c for c in after if c in before]
    added_cols, removed_cols = [c for c in after if c not in before], [c for c in before if c not in after]
    published, shadow = published.select(*common), shadow.select(*common)
    n_published, n_shadow = published.count(), shadow.count()
    sample: list[dict[str, Any]] = []
    by = [*(sink.keys or []), *(["valid_from"] if getattr(sink, "history", "none") == "scd2" else [])]  # a version
    keys = [k for k in by if k in common] if sink.mode in ("aggregate", "upsert") else []
    if keys:
        values = [c for c in common if c not in keys]
        joined = (published.select(*keys, *[F.col(c).alias(f"p_{c}") for c in values], F.lit(True).alias("_p"))
                  .join(shadow.select(*keys, *[F.col(c).alias(f"s_{c}") for c in values], F.lit(True).alias("_s")),
                        on=keys, how="full_outer"))
        differs = F.lit(False)
        for c in values:
            differs = differs | ~F.col(f"p_{c}").eqNullSafe(F.col(f"s_{c}"))
        change = (F.when(F.col("_p").isNull(), "added").when(F.col("_s").isNull(), "removed")
                  .when(differs, "changed"))
        diff = joined.withColumn("_change", change).where(F.col("_change").isNotNull()).persist()
        try:
            counts = {r["_change"]: r["count"] for r in diff.groupBy("_change").count().collect()}
            for r in diff.orderBy(*keys).limit(SAMPLE_ROWS).collect():
                sample.append({"change": r["_change"], "key": {k: _json(r[k]) for k in keys},
                               "published": None if r["_p"] is None else {c: _json(r[f"p_{c}"]) for c in values},
                               "shadow": None if r["_s"] is None else {c: _json(r[f"s_{c}"]) for c in values}})
        finally:
            diff.unpersist()
        added, removed, changed = counts.get("added", 0), counts.get("removed", 0), counts.get("changed", 0)
    else:
        only_shadow, only_published = shadow.exceptAll(published), published.exceptAll(shadow)
        added, removed, changed = only_shadow.count(), only_published.count(), 0
        for change, frame in (("added", only_shadow), ("removed", only_published)):
            for r in frame.limit(SAMPLE_ROWS // 2).collect():
                row = {c: _json(r[c]) for c in common}
                sample.append({"change": change, "key": None, "published": row if change == "removed" else None,
                               "shadow": row if change == "added" else None})
    return SinkDiff(sink.name, sink.path, shadow_path, published_version, restored_version, n_published, n_shadow,
                    added, removed, changed, keys or common, added_cols, removed_cols, sample)


def _json(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _save(report: ShadowPreview, folder: Path) -> None:
    """The report beside its shadow tables; the previews before the last ``KEEP`` are deleted."""
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{folder.name}.json.partial"
    partial.write_text(json.dumps(report.as_dict(), indent=1, default=str))
    partial.replace(root / f"{folder.name}.json")  # whole or not at all for the console's reader
    for old in saved_previews(report.pipeline)[KEEP:]:  # ids read back from files: sanitised again
        folder = preview_folder(report.pipeline, str(old.get("preview_id")))
        folder.with_name(f"{folder.name}.json").unlink(missing_ok=True)
        try:
            remove_preview(report.pipeline, folder)
        except SluiceError as exc:  # this preview's report is saved: pruning an old one may fail
            log.warning("%s", exc)
    log.info("pipeline %s: shadow preview of a rollback to epoch %s: %s", report.pipeline, report.to_epoch,
             "; ".join(f"{s.sink}: +{s.added} -{s.removed} ~{s.changed}" for s in report.sinks) or
             "; ".join(report.problems + report.notes))
