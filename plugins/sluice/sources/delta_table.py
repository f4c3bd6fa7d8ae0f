"""A Delta-table source (``source.type: delta``): pipelines chained by table versions.

Each upstream version that changed data is one manifest entry, ``delta://<table>@<version>``,
registered oldest first (``delta_versions.versions_to_register``), its size the bytes of the
files it added. An epoch is a range of them, so a rerun or a recompute reads exactly the same
versions: the files each added (an append-only upstream, the default), or the version's change
data feed (``source.change_feed``: inserts and update post-images). The rows are handed to the
transform through the same parse as a file's lines (each row as a JSON object, ``_file`` its
version and data file, ``_line`` its row in that file), so the schema, required fields, checks
and ``_rejected`` work as for any source.

Only versions the upstream *published* are registered, when the upstream is a sluice pipeline
of the same epoch store: a version its group committed but has not published yet (a group
running, or one whose driver died after the Delta commit) waits, and the upstream's own rerun
RESTOREs a crashed attempt's version before it publishes the group again, so that version is
never read and a chained pipeline needs no skip for its upstream's crash. An upstream the store
does not know (another store, or not sluice) is read as its log says.

An upstream RESTORE (its pipeline rolled back) that undid registered versions stops the
pipeline before anything is read, with what to do (``UpstreamRestore.message``). The upstream's
``_delta_log`` is read as files: the table must be on a local or mounted file system.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import SourceError
from sluice.model import PUBLISHED
from sluice.sources.base import Backlog, EntrySource, lookup
from sluice.sources.delta_versions import (
    TableVersion,
    VersionLog,
    read_version,
    undone_by_restore,
    versions_to_register,
)
from sluice.spec import DeltaSourceSpec, PipelineSpec
from sluice.store import EpochStore, ManifestEntry

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from sluice.model import TableCommit

log = logging.getLogger(__name__)

SKIP_HINT = ("Skip the version on purpose (recorded, through sluice_skip_file): the console's skip-file action "
             "with the delta:// path above, or `make skip-file PIPELINE=<name> FILE=<path> REASON=<why>`")
RECENT_ENTRIES = 64  # the arrivals the controllers see
#: Timestamps cross the JSON text with their microseconds (to_json's default keeps milliseconds).
TIMESTAMP_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"


class DeltaTableSource(EntrySource):
    parse_options = {"timestampFormat": TIMESTAMP_FORMAT}

    def __init__(self, spec: PipelineSpec, store: EpochStore) -> None:
        super().__init__(spec, store)
        assert isinstance(spec.source, DeltaSourceSpec)
        self.delta: DeltaSourceSpec = spec.source
        self.table = spec.source.table
        if "://" in self.table.removeprefix("file:"):
            raise SourceError(f"pipeline {spec.name!r}: source.table {self.table} is not on a local or mounted file "
                              "system; the Delta source reads the upstream's _delta_log as files")

    def _where(self) -> str:
        return f"pipeline {self.spec.name!r}, upstream table {self.table}"

    def _commits(self) -> list[TableCommit]:
        """The upstream's retained commits, newest first."""
        from sluice.delta.spark import local_lineage

        if not (Path(self.table.removeprefix("file:")) / "_delta_log").is_dir():
            raise SourceError(f"{self._where()}: no Delta table there (no _delta_log); has the upstream pipeline "
                              "published anything yet?")
        return list(local_lineage(self.table))  # a local table's log is read as files: no Spark

    def _check_restores(self, commits: list[TableCommit]) -> None:
        """Stop when a RESTORE undid versions this pipeline registered and has not skipped."""
        first = self.store.manifest(self.spec.name, 0, 1)
        if not first:
            return
        oldest = TableVersion.parse(first[0].path).version
        if not any(c.operation == "RESTORE" and c.version > oldest for c in commits):
            return  # the usual case: no need to read the whole manifest
        entries = [e for e in self.store.manifest(self.spec.name) if e.skipped is None]
        version_at = {TableVersion.parse(e.path).version: e.position for e in entries}
        epoch_of = {}
        for epoch in self.store.epochs(self.spec.name):
            for version, position in version_at.items():
                if epoch.start <= position < epoch.end:
                    epoch_of[version] = epoch.epoch_id
        restore = undone_by_restore(self.table, commits, sorted(version_at), epoch_of)
        if restore is not None:
            raise SourceError(restore.message(self.spec.name))

    def _last_registered(self) -> int | None:
        tail = self.store.manifest_tail(self.spec.name, 1 << 62, 1)
        return TableVersion.parse(tail[-1].path).version if tail else None

    def _upstream(self) -> str | None:
        """The sluice pipeline that writes the upstream table, if this store knows it (its newest
        commit that names one)."""
        from sluice.delta.spark import local_lineage

        if not (Path(self.table.removeprefix("file:")) / "_delta_log").is_dir():
            return None
        name = next((c.pipeline for c in local_lineage(self.table) if c.pipeline), None)
        return name if name and self.store.knows(name) else None

    def _published(self) -> tuple[str, set[tuple[str, int]]] | None:
        """``(upstream pipeline, {(sink, version)} it published)``, read *before* the upstream's
        log is listed: a group published by then had its crashed attempts' versions RESTOREd
        before, so no version listed afterwards can be an undone one that looks published.
        ``None``: the store does not know the upstream (nothing to hold its versions to)."""
        upstream = self._upstream()
        if upstream is None:
            return None
        return upstream, {(sink, int(version)) for e in self.store.epochs(upstream) if e.state == PUBLISHED
                          for sink, version in e.delta_versions.items() if version is not None}

    def _unregistered(self, commits: list[TableCommit],
                      published: tuple[str, set[tuple[str, int]]] | None = None) -> list[VersionLog]:
        """The versions to register next, oldest first: those the upstream published (see
        ``_published``), up to the first it has not (later ones wait behind it, in order)."""
        found = []
        by_version = {c.version: c for c in commits}
        for version in versions_to_register(self.table, commits, self._last_registered()):
            commit = by_version.get(version)
            if (published is not None and commit is not None and commit.pipeline == published[0]
                    and commit.epochs and not _published_version(commit, published[1])):
                log.debug("%s: version %d holds epochs %s that pipeline %r has not published yet; it waits",
                         self._where(), version, list(commit.epochs), commit.pipeline)
                break
            entry = read_version(self.table, version)
            if entry is None:
                raise SourceError(f"{self._where()}: version {version} is no longer in the upstream's log (log "
                                  "retention cleaned it up before sluice registered it); it cannot be read")
            found.append(entry)
        return found

    # -- discovery and backlog ---------------------------------------------------------------

    def discover(self) -> int:
        """Register the upstream versions committed since the last discovery, oldest first."""
        published = self._published()
        commits = self._commits()
        self._check_restores(commits)
        new = [(TableVersion(self.table, v.version).path, v.size, v.timestamp_s)
               for v in self._unregistered(commits, published)]
        return self.store.register_files(self.spec.name, new)

    def backlog(self) -> Backlog:
        """Versions registered and not planned, plus those not registered yet: their count,
        the bytes they added and the age of the oldest (its commit time)."""
        next_offset = self.store.next_offset(self.spec.name)
        entries = self.store.manifest_tail(self.spec.name, next_offset, RECENT_ENTRIES)
        pending = [e for e in entries if e.position >= next_offset]
        published = self._published()
        unregistered = self._unregistered(self._commits(), published)
        times = [e.mtime for e in pending] + [v.timestamp_s for v in unregistered]
        return Backlog(files=len(pending) + len(unregistered),
                       bytes=sum(e.size for e in pending) + sum(v.size for v in unregistered),
                       next_offset=next_offset, oldest_age_s=max(0.0, time.time() - min(times)) if times else None,
                       arrivals=tuple(e.mtime for e in entries[-RECENT_ENTRIES:])
                       + tuple(v.timestamp_s for v in unregistered))

    # -- ranges ------------------------------------------------------------------------------

    def describe(self, entries: list[ManifestEntry]) -> dict[str, Any]:
        return {"table": self.table,
                "versions": [TableVersion.parse(e.path).version for e in entries if e.skipped is None],
                "skipped": [e.path for e in entries if e.skipped is not None]}

    def check_retained(self, start: int, end: int) -> list[ManifestEntry]:
        """The versions of ``[start, end)`` (less any skipped on purpose); ``SourceError`` when a
        RESTORE undid one, its commit left the log, or a file it added was vacuumed."""
        entries = [e for e in self.entries(start, end) if e.skipped is None]
        if not entries:
            return entries
        self._check_restores(self._commits())
        for entry in entries:
            version = TableVersion.parse(entry.path).version
            found = read_version(self.table, version)
            if found is None:
                raise SourceError(f"{self._where()}: version {version} ({entry.path}, offset {entry.position}) is "
                                  "no longer in the upstream's log (delta.logRetentionDuration); a rerun must read "
                                  f"the same rows, so it cannot be read again. {SKIP_HINT}")
            gone = [f.path for f in found.added if not Path(f.path.removeprefix("file:")).exists()]
            if gone and not self.delta.change_feed:
                raise SourceError(f"{self._where()}: {len(gone)} data file(s) version {version} added are gone "
                                  f"(VACUUM), e.g. {gone[0]} ({entry.path}, offset {entry.position}). {SKIP_HINT}")
            if found.removed and not self.delta.change_feed:
                raise SourceError(f"{self._where()}: version {version} ({found.operation}) removed rows; only an "
                                  "append-only upstream is read by its added files. Set source.change_feed: true "
                                  f"(and delta.enableChangeDataFeed upstream), or skip the version. {SKIP_HINT}")
        return entries

    def _read(self, spark: SparkSession, entries: list[ManifestEntry], epoch_of: dict[int, int] | None) -> DataFrame:
        """The rows of the versions in one scan, as numbered lines (each row as JSON) parsed like
        a file's: ``_file`` is the version's entry and the data file (or ``change_feed``), ``_line``
        the row's index in it; with ``epoch_of`` (manifest position -> epoch), each row's ``_epoch``."""
        from pyspark.sql import functions as F

        if not entries:  # every version of the range was skipped on purpose
            return self.empty_records(spark, epoch_of is not None)
        position = {TableVersion.parse(e.path).version: e.position for e in entries}
        table = spark.read.format("delta").load(self.table)  # the schema only: no rows are read here
        if self.delta.change_feed:
            rows = (spark.read.format("delta").option("readChangeFeed", "true")
                    .option("startingVersion", min(position)).option("endingVersion", max(position))
                    .load(self.table)
                    .where(F.col("_change_type").isin("insert", "update_postimage")
                           & F.col("_commit_version").isin(*position)))
            version, where = F.col("_commit_version"), F.lit("change_feed")
            # A row's number in its version, by content: the same in every read of the version.
            from pyspark.sql import Window

            index = F.row_number().over(Window.partitionBy("_commit_version").orderBy(_as_json(table.columns)))
        else:
            added = {v: read_version(self.table, v) for v in position}
            files = {Path(f.path).name: (v, f) for v, found in added.items() if found for f in found.added}
            if not files:  # versions that added no file (a delete-free empty append)
                return self.empty_records(spark, epoch_of is not None)
            partitions = [f.name for f in table.schema if any(f.name in a.partition_values
                                                                for _, a in files.values())]
            data_schema = type(table.schema)([f for f in table.schema if f.name not in partitions])
            rows = spark.read.schema(data_schema).parquet(*[a.path for _, a in files.values()])
            name = F.element_at(F.split(F.col("_metadata.file_path"), "/"), -1)
            version = lookup(name, {n: v for n, (v, _) in files.items()})
            for column in partitions:  # not in the files: from the log, typed as the table has it
                typ = table.schema[column].dataType
                rows = rows.withColumn(column, lookup(name, {n: a.partition_values.get(column)
                                                            for n, (_, a) in files.items()}).cast(typ))
            where, index = name, F.col("_metadata.row_index") + 1  # lines count from 1, as a file's
        data = list(table.columns)
        epoch = ([lookup(version, {v: epoch_of[p] for v, p in position.items()}).alias("_epoch")]
                 if epoch_of is not None else [])
        lines = rows.select(
            F.concat(F.lit(f"delta://{self.table}@"), version.cast("string"), F.lit("/"), where).alias("_file"),
            index.alias("_line"),
            _as_json(data).alias("_text"),
            *epoch)
        return self.parse_lines(lines)


def _published_version(commit: TableCommit, published: set[tuple[str, int]]) -> bool:
    """Whether ``commit`` is a version its pipeline published (by sink and version; by version
    alone for a commit that does not name its sink)."""
    if commit.sink is None:
        return any(version == commit.version for _, version in published)
    return (commit.sink, commit.version) in published


def _as_json(columns: list[str]) -> Any:
    """The row as a JSON object, timestamps with their microseconds."""
    from pyspark.sql import functions as F

    return F.to_json(F.struct(*[F.col(f"`{c}`") for c in columns]), {"timestampFormat": TIMESTAMP_FORMAT})
