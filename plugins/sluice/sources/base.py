"""What a source is to sluice: an append-only stream of data, registered in the epoch store's
manifest as entries (a file; a chunk of a Kafka partition) whose positions are the offsets an
epoch's range ``[start, end)`` names. A position never changes once given, so a rerun or a
rollback recompute reads exactly the same records.

Each source discovers new data (registers entries), reports its backlog, checks that a recorded
range can still be read (a rollback's precondition), reads ranges into numbered records
(``_file``, ``_line``, ``_text``: where a record came from, as a file path and line or a
``kafka://topic/partition`` and offset) and says what a range holds in its own terms
(``describe``: files, or per-partition Kafka offsets). Parsing the records is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.spec import PipelineSpec
from sluice.store import EpochStore, ManifestEntry

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from sluice.model import EpochRange, Group


def lookup(key: Column, mapping: dict[Any, Any]) -> Column:
    """``mapping[key]`` for a small mapping (a group's epochs, files or versions), as one map
    literal, not ``CASE key WHEN k THEN v``: Spark writes an int literal into the Java source it
    generates, so each group's ids made new classes for a long-lived Connect server to compile
    and JIT-compile; a map is passed by reference. Int keys are compared as longs (a commit
    version is one); a value may be a Column (``F.lit`` keeps it).

    >>> lookup(F.col("_file"), {"a.jsonl": 7, "b.jsonl": 8})  # doctest: +SKIP
    """
    from itertools import chain

    from pyspark.sql import functions as F

    if not mapping:
        return F.lit(None)
    ints = all(isinstance(k, int) for k in mapping)
    pairs = chain.from_iterable((F.lit(k).cast("long") if ints else F.lit(k), F.lit(v)) for k, v in mapping.items())
    return F.element_at(F.create_map(*pairs), key.cast("long") if ints else key)


#: How much of a record above ``source.max_record_bytes`` is kept in ``_rejected``.
RECORD_KEPT_CHARS = 1024


@dataclass(frozen=True)
class Backlog:
    """What waits at the source: unplanned entries (files, or Kafka chunks), their bytes (files)
    or records (Kafka), and the age of the oldest data."""

    files: int
    bytes: int
    oldest_age_s: float | None
    next_offset: int
    refused: tuple[str, ...] = field(default=())  # why landed entries are not read (see list_folder)
    records: int | None = None  # Kafka: the sum of the partitions' lags
    #: When entries arrived, processed or not (files' modification times, chunks' first records'
    #: timestamps), for the controllers' arrival rate over a recent window; not in ``as_dict``.
    arrivals: tuple[float, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"files": self.files, "bytes": self.bytes, "oldest_age_s": self.oldest_age_s,
                                 "next_offset": self.next_offset, "refused": list(self.refused)}
        if self.records is not None:
            found["records"] = self.records
        return found


#: A figure over the last epochs that have it is taken among this many times as many of the latest:
#: a poll reads a window, not every epoch the pipeline ever ran (epochs are never pruned).
HISTORY_WINDOW = 4


def read_history(spec: PipelineSpec, store: EpochStore, last: int = 8) -> list[tuple[int, int]]:
    """``(bytes, records)`` of the pipeline's last ``last`` published epochs that read any: the
    bytes of their manifest entries (less those skipped on purpose) and the records read, what
    a byte count of the source is worth in records (``sluice.control.jit.estimate_records``)."""
    published = [e for e in store.epochs(spec.name, states=["published"], last=HISTORY_WINDOW * last)
                 if e.rows.get("input")][-last:]
    if not published:
        return []
    entries = store.manifest(spec.name, min(e.start for e in published), max(e.end for e in published))
    return [(sum(m.size for m in entries if e.start <= m.position < e.end and m.skipped is None),
             int(e.rows["input"])) for e in published]


class Source(ABC):
    """A pipeline's source over the epoch store's manifest."""

    #: More options of the records' parse (``from_json``/``from_csv``), for a source that writes
    #: the text itself (the Delta source's rows, as JSON).
    parse_options: dict[str, str] = {}

    def __init__(self, spec: PipelineSpec, store: EpochStore) -> None:
        self.spec = spec
        self.store = store

    @abstractmethod
    def discover(self) -> int:
        """Register new data in the manifest; returns the manifest's end offset."""

    @abstractmethod
    def backlog(self) -> Backlog:
        """Unplanned data, registered or not. Read-only: the backlog trigger polls it."""

    @abstractmethod
    def check_retained(self, start: int, end: int) -> list[ManifestEntry]:
        """The entries of ``[start, end)`` to read (less any skipped on purpose); raise
        ``SourceError`` naming what is gone unless the source still holds all of it."""

    @abstractmethod
    def read(self, spark: SparkSession, start: int, end: int) -> DataFrame:
        """Exactly the records of ``[start, end)``: the spec's schema, ``_file``, ``_line``,
        ``_corrupt_record`` and ``_defect`` (see ``parse_lines``)."""

    @abstractmethod
    def read_epochs(self, spark: SparkSession, epochs: list[EpochRange]) -> DataFrame:
        """``read`` of a group's contiguous epochs in one scan, with each record's ``_epoch``."""

    @abstractmethod
    def describe(self, entries: list[ManifestEntry]) -> dict[str, Any]:
        """What manifest entries (an epoch's) hold, in the source's own terms: JSON-able, for the
        epoch API. From the manifest alone (no call to the source)."""

    def group_records(self, group: Group, history_epochs: int = 8) -> int | None:
        """About how many records ``group`` holds, from the manifest alone: a chunk's size counts
        records (Kafka), a file's or a version's counts bytes, at the bytes per record of the
        pipeline's last ``history_epochs`` published epochs; ``None`` before any was published.
        What the run-once driver's compiler is chosen by (``sluice.control.jit``)."""
        from sluice.control.jit import estimate_records
        from sluice.spec import KafkaSourceSpec

        sizes = [e.size for e in self.store.manifest(self.spec.name, group.epochs[0].start, group.epochs[-1].end)]
        return estimate_records(sizes, sizes_are_records=isinstance(self.spec.source, KafkaSourceSpec),
                                history=read_history(self.spec, self.store, history_epochs))

    def entries(self, start: int, end: int) -> list[ManifestEntry]:
        from sluice.errors import SourceError

        found = self.store.manifest(self.spec.name, start, end)
        if len(found) != end - start:
            raise SourceError(f"pipeline {self.spec.name!r}: the manifest holds {len(found)} entries for "
                              f"offsets [{start}, {end}); the store is incomplete")
        return found

    def parse_lines(self, lines: DataFrame) -> DataFrame:
        """Parse numbered lines (``_file``, a path, ``_line``, ``_text``; an ``_epoch`` is kept),
        so a bad record's file and line can be reported exactly. A line above
        ``source.max_record_bytes``, one that is not UTF-8 or (JSON) an array is not parsed at
        all: it is cut to its first KiB and tagged with its ``_defect``."""
        from pyspark.sql import functions as F

        source = self.spec.source
        schema = ", ".join(f"`{k}` {v}" for k, v in source.schema_.items())
        limit = source.max_record_bytes
        size = F.octet_length("_text")
        defect = F.when(size > limit, F.concat(F.lit("record of "), size.cast("string"),
                                               F.lit(f" bytes exceeds source.max_record_bytes = {limit}")))
        # Invalid bytes survive a line read as is, but become U+FFFD once a whole file is split.
        defect = defect.when(~F.is_valid_utf8("_text") | F.col("_text").contains("\ufffd"),
                             F.lit("not UTF-8 text (a byte sequence that is not valid UTF-8)"))
        if source.format == "json":
            defect = defect.when(F.ltrim("_text").startswith("["), F.lit("a JSON array, not an object"))
        lines = lines.where(F.trim("_text") != "")
        if source.format == "csv" and source.csv_header:
            lines = lines.where(F.col("_line") > 1)
        epoch = ["_epoch"] if "_epoch" in lines.columns else []
        lines = lines.select("_file", "_line", *epoch, defect.alias("_defect"),
                             F.when(size > limit, F.substring("_text", 1, RECORD_KEPT_CHARS))
                             .otherwise(F.col("_text")).alias("_text"))
        # Fields not in the schema (JSON): their keys are read for every record (json_object_keys,
        # cheaper than a full second parse); only a record that has some is parsed again, to keep
        # them (as a JSON object) for the _rejected reason or the transform.
        extra: list[Column] = []
        if source.drift != "ignore":
            known = F.array(*[F.lit(k) for k in source.schema_])
            unknown = F.array_except(F.json_object_keys(F.when(F.col("_defect").isNull(), F.col("_text"))), known)
            fields = F.from_json(F.col("_text"), "map<string,string>")
            extra = [F.when(F.size(unknown) > 0,
                            F.to_json(F.map_filter(fields, lambda k, _: ~F.array_contains(known, k))))
                     .alias("_rescued_data")]
        options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record", **self.parse_options}
        parse = F.from_json if source.format == "json" else F.from_csv
        parsed = lines.select(
            "_file", "_line", *epoch, "_text", "_defect", *extra,
            parse(F.when(F.col("_defect").isNull(), F.col("_text")), f"{schema}, _corrupt_record string",
                  options).alias("_r"),
        )
        return parsed.select(
            *[F.col(f"_r.`{c}`").alias(c) for c in source.schema_],
            "_file",
            "_line",
            # from_json yields a NULL struct for text that is not a JSON object at all.
            F.when(F.col("_r").isNull(), F.col("_text"))
            .otherwise(F.col("_r._corrupt_record")).alias("_corrupt_record"),
            "_defect",
            *(["_rescued_data"] if extra else []),
            *epoch,
        )

    def empty_records(self, spark: SparkSession, with_epoch: bool) -> DataFrame:
        """What ``read`` gives for a range whose every entry was skipped on purpose."""
        from pyspark.sql import functions as F

        schema = ", ".join(f"`{k}` {v}" for k, v in self.spec.source.schema_.items())
        rescued = ", _rescued_data string" if self.spec.source.drift != "ignore" else ""
        empty = spark.createDataFrame(
            [], f"{schema}, _file string, _line long, _corrupt_record string, _defect string{rescued}")
        return empty.withColumn("_epoch", F.lit(None).cast("int")) if with_epoch else empty




class EntrySource(Source):
    """A source whose entries are read together in one scan that tags each record with its
    entry's epoch (Kafka chunks, Delta versions): ``_read`` of the retained entries."""

    def read(self, spark: SparkSession, start: int, end: int) -> DataFrame:
        return self._read(spark, self.check_retained(start, end), None)

    def read_epochs(self, spark: SparkSession, epochs: list[EpochRange]) -> DataFrame:
        entries = self.check_retained(epochs[0].start, epochs[-1].end)
        owner = {e.position: next(epoch.epoch_id for epoch in epochs if epoch.start <= e.position < epoch.end)
                 for e in entries}
        return self._read(spark, entries, owner)

    @abstractmethod
    def _read(self, spark: SparkSession, entries: list[ManifestEntry], epoch_of: dict[int, int] | None) -> DataFrame:
        """The records of ``entries``; with ``epoch_of`` (manifest position -> epoch), each
        record's ``_epoch``."""


def source_for(spec: PipelineSpec, store: EpochStore) -> Source:
    """The source of ``spec`` (its ``source.type``)."""
    from sluice.spec import DeltaSourceSpec, KafkaSourceSpec

    if isinstance(spec.source, KafkaSourceSpec):
        from sluice.sources.kafka import KafkaSource

        return KafkaSource(spec, store)
    if isinstance(spec.source, DeltaSourceSpec):
        from sluice.sources.delta_table import DeltaTableSource

        return DeltaTableSource(spec, store)
    from sluice.sources.files import FileSource

    return FileSource(spec, store)
