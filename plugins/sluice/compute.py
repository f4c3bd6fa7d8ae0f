"""The data plane of a group: read exactly its ranges, split off rejected records, drop the
records ``dedup`` has seen (``sluice.dedup``), transform, validate each epoch's output;
everything that happens before the first commit, and nothing of the protocol. ``Compute`` is
what the protocol's group job (``sluice.protocol.group``) asks of it; ``SparkCompute`` does it
in a SparkSession, and the simulation's twin (``sluice.sim.compute``) in plain Python over the
same landed files.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice import validation
from sluice.errors import SluiceError
from sluice.model import Epoch, EpochRange
from sluice.paths import transforms_dir
from sluice.spec import PipelineSpec, SinkSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from sluice.delta.spark import SparkTables
    from sluice.store import EpochStore

log = logging.getLogger("sluice.compute")

REJECTED_COLUMNS = ("pipeline", "epoch", "generation", "file", "line", "reason", "record")
QUARANTINE_COLUMNS = ("pipeline", "sink", "epoch", "generation", "range_start", "range_end", "expectations", "record")
REJECTED = "_rejected"
QUARANTINE = "_quarantine"


@dataclass
class Prepared:
    """Epochs read, split, transformed and validated, not yet written: the frames each table
    gets (``rejected``, ``quarantined``, ``outputs`` by sink), the counts and the validation
    results per epoch. ``committing``: the epochs to write, those before ``failed`` (the first
    that failed validation under the ``fail`` policy)."""

    epochs: list[Epoch]
    t0: float
    timings: dict[str, float]
    n_input: dict[int, int] = field(default_factory=dict)
    n_rejected: dict[int, int] = field(default_factory=dict)
    n_deduplicated: dict[int, int] = field(default_factory=dict)  # valid records dropped by ``dedup``
    dedup_state: Any = None  # the seen keys the group changes (``sluice.dedup``): the _dedup MERGE's source
    rejected: Any = None
    quarantined: Any = None
    outputs: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # sink rows, when computed already
    results: dict[int, dict[str, validation.SinkValidation]] = field(default_factory=dict)
    committing: list[Epoch] = field(default_factory=list)
    failed: Epoch | None = None
    cached: list[Any] = field(default_factory=list)
    background: list[threading.Thread] = field(default_factory=list)

    def wait(self) -> None:
        for thread in self.background:
            thread.join()

    def release(self) -> None:
        self.wait()
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()


class Compute(ABC):
    """A group's data plane for one pipeline."""

    def __init__(self, spec: PipelineSpec, store: EpochStore) -> None:
        from sluice.sources import source_for

        self.spec = spec
        self.store = store
        self.source = source_for(spec, store)

    @abstractmethod
    def empty(self) -> dict[str, Any]:
        """A frame with no rows and each table's schema, by table name (the sinks', from the
        transform applied to empty input; ``_rejected`` and ``_quarantine``, fixed): what a
        table is created from before anything is written to it."""

    @abstractmethod
    def prepare_group(self, epochs: list[Epoch]) -> Prepared:
        """Read the epochs' ranges (one scan where possible), split, transform, validate."""

    def prefetch(self, epochs: list[Epoch]) -> None:  # noqa: B027  (a data plane may read in prepare_group only)
        """Start reading the epochs' ranges now, in the background, for ``prepare_group`` of the
        same epochs to take over. The group job calls it once their attempt is counted, before
        it makes the tables ready and reconciles them: neither reads the source, and nothing
        is written before both are done."""

    def drop_prefetch(self) -> None:  # noqa: B027
        """Wait for a read ``prefetch`` started that ``prepare_group`` did not take, and free it."""

    @abstractmethod
    def prepare_epoch(self, epoch: Epoch, *, materialize: bool = False, weight: int = 1) -> Prepared:
        """``prepare_group`` of one epoch; with ``materialize`` its outputs are computed and kept
        now (a concurrent epoch's work: committing it later is only the write)."""

    @abstractmethod
    def locate_poison(self, span: EpochRange) -> tuple[str, int, str] | None:
        """The first record of the range that alone makes the transform fail: (file, line,
        record); ``None`` when the failure does not come from one record."""

    def died(self, exc: BaseException) -> bool:
        """Whether the failure means the engine itself is gone (the driver died)."""
        return False

    def set_partitions(self, n: int) -> None:  # noqa: B027  (a data plane without partitions ignores it)
        """The controllers' shuffle partition count for this group (DyBBS)."""

    def read_memory(self, timings: dict[str, float]) -> None:  # noqa: B027  (nothing measured by default)
        """Add what the group held in memory since it started to its timings."""


# -- Spark -----------------------------------------------------------------------------------------

@dataclass
class _Read:
    """A group's ranges read into the cache and counted per epoch (``SparkCompute._read``)."""

    ranges: list[EpochRange]
    t0: float
    records: Any = None  # the cached records, each tagged with its epoch
    tagged: Any = None  # ``records`` with the reason each rejected one is rejected for
    n_input: dict[int, int] = field(default_factory=dict)
    n_rejected: dict[int, int] = field(default_factory=dict)
    read_s: float = 0.0
    thread: threading.Thread | None = None  # a prefetch's, its Spark jobs in job group ``job_group``
    job_group: str = ""
    error: BaseException | None = None

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def free(self) -> None:
        self.join()
        if self.records is not None:
            self.records.unpersist()
            self.records = None



def load_transform(name: str) -> Callable[..., Any]:
    """Import ``module.function`` from the transforms folder (``paths.transforms_dir``), or
    ``package.module.function`` from anywhere on the Python path."""
    module_name, _, func = name.rpartition(".")
    folder = transforms_dir()
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    where = str(folder / f"{module_name}.py") if "." not in module_name else module_name
    try:
        module = importlib.import_module(f"transforms.{module_name}" if "." not in module_name else module_name)
    except ModuleNotFoundError as exc:
        raise SluiceError(f"transform {name!r}: cannot import {where}: {exc}") from None
    try:
        return getattr(module, func)
    except AttributeError:
        raise SluiceError(f"transform {name!r}: {where} has no {func}()") from None


def transform_for(spec: PipelineSpec) -> Callable[..., Any]:
    """The spec's transform as one callable, ``(records, refs) -> output``: a Python
    ``module.function``, or a SQL query over the views ``records`` and the references."""
    if spec.transform_function is not None:
        return load_transform(spec.transform_function)
    from sluice.sql_transform import SqlTransform

    return SqlTransform(spec.name, spec.path, spec.transform.sql)  # type: ignore[union-attr]


def load_reference(spark: SparkSession, spec: PipelineSpec, broadcast: bool = True) -> dict[str, DataFrame]:
    """The reference tables by name, cached; broadcast-hinted unless ``broadcast`` is false (a
    SQL transform: Spark drops a frame's hint inside the CTE that names it, with a warning per
    query; the query may hint ``/*+ BROADCAST(name) */`` itself)."""
    from pyspark.sql import functions as F

    refs = {}
    for name, path in spec.reference.items():
        if not Path(path).is_file():
            raise SluiceError(f"pipeline {spec.name!r}: reference table {name!r} file {path} does not exist")
        frame = spark.read.option("header", True).csv(path).cache()
        refs[name] = F.broadcast(frame) if broadcast else frame
    return refs


#: A record's epoch's place in its group (0, 1, ...): what a group's per-epoch queries filter by.
SLOT = "_slot"


def with_slot(records: DataFrame, ranges: list[EpochRange]) -> DataFrame:
    """``records`` (with ``_epoch``) and their epoch's place in the group, ``_slot``. Spark writes
    an int literal into the Java source it generates: filtered by epoch id, each group's
    per-epoch queries (transform, GX, checkpoint) were new classes for a long-lived Connect
    server to compile and JIT-compile; slots repeat from group to group, and an equality with a
    literal still lets the cache skip other epochs' batches."""
    from pyspark.sql import functions as F

    from sluice.sources.base import lookup

    return records.withColumn(SLOT, lookup(F.col("_epoch"), {r.epoch_id: i for i, r in enumerate(ranges)}))


def tag_rejected(records: DataFrame, spec: PipelineSpec) -> DataFrame:
    """Add ``_reason``: why a record is malformed (unparseable, missing a required field,
    failing a check), NULL for a valid one."""
    from pyspark.sql import functions as F

    rules = [(F.col("_defect").isNotNull(), F.concat(F.lit("malformed record: "), F.col("_defect"))),
             (F.col("_corrupt_record").isNotNull(), F.lit("malformed record: not parseable as " + spec.source.format))]
    if spec.source.drift == "reject":
        rules.append((F.col("_rescued_data").isNotNull(),
                      F.concat(F.lit("fields not in source.schema (source.unknown_fields: reject): "),
                               F.col("_rescued_data"))))
    rules += [(F.col(f"`{f}`").isNull(), F.lit(f"missing required field {f!r}")) for f in spec.source.required]
    rules += [(~F.coalesce(F.expr(expr), F.lit(False)), F.lit(f"failed check {name!r}: {expr}"))
              for name, expr in spec.source.checks.items()]
    return records.withColumn("_reason", F.coalesce(*[F.when(cond, msg) for cond, msg in rules]))


def split_rejected(records: DataFrame, spec: PipelineSpec, generation: int, epoch_id: int | None = None,
                   tagged: DataFrame | None = None) -> tuple[DataFrame, DataFrame]:
    """Separate malformed records (``tag_rejected``; pass ``tagged`` if already computed).

    Rejected rows keep the pipeline, epoch (``epoch_id``, or the records' ``_epoch`` column),
    generation, file, line, reason and the raw record; nothing about them is non-deterministic,
    so a replayed epoch writes the same rows.
    """
    from pyspark.sql import functions as F

    fields = list(spec.source.schema_)
    tagged = tag_rejected(records, spec) if tagged is None else tagged
    rescued = ["_rescued_data"] if spec.source.drift == "rescue" else []
    valid = tagged.where(F.col("_reason").isNull()).select(*[F.col(f"`{f}`") for f in fields], *rescued)
    raw = F.coalesce(F.col("_corrupt_record"), F.to_json(F.struct(*[F.col(f"`{f}`") for f in fields])))
    epoch = F.col("_epoch").cast("int") if epoch_id is None else F.lit(epoch_id)
    rejected = tagged.where(F.col("_reason").isNotNull()).select(
        F.lit(spec.name).alias("pipeline"), epoch.alias("epoch"),
        F.lit(generation).alias("generation"), F.col("_file").alias("file"),
        F.col("_line").cast("long").alias("line"), F.col("_reason").alias("reason"), raw.alias("record"))
    return valid, rejected


def quarantine_rows(bad: DataFrame, spec: PipelineSpec, sink: str, epoch: Epoch) -> DataFrame:
    """Rows that failed validation, with where they came from and what they broke."""
    from pyspark.sql import functions as F

    columns = [c for c in bad.columns if c != "expectations"]
    return bad.select(
        F.lit(spec.name).alias("pipeline"), F.lit(sink).alias("sink"), F.lit(epoch.epoch_id).alias("epoch"),
        F.lit(epoch.generation).alias("generation"), F.lit(epoch.start).cast("long").alias("range_start"),
        F.lit(epoch.end).cast("long").alias("range_end"), F.col("expectations"),
        F.to_json(F.struct(*[F.col(f"`{c}`") for c in columns]), {"ignoreNullFields": "false"}).alias("record"))


def quarantine_sink(spec: PipelineSpec) -> SinkSpec:
    """The quarantine table (one per pipeline, rows of every sink)."""
    return SinkSpec.model_construct(name=QUARANTINE, mode="append", path=spec.quarantine_table, keys=[], sums=[],
                                    partition_by=[], expectations=None)


def rejected_sink(spec: PipelineSpec) -> SinkSpec:
    """The rejected-records table: malformed input with its epoch, file and line."""
    return SinkSpec.model_construct(name=REJECTED, mode="append", path=spec.rejected_table, keys=[], sums=[],
                                    partition_by=[], expectations=None)


MAX_POOL_WEIGHT = 8  # FAIR pools sluice_w1 .. sluice_w8 (jobs/fairscheduler.xml)
_GX_LOCK = threading.Lock()


class SparkCompute(Compute):
    """The data plane in a SparkSession (classic or Spark Connect)."""

    def __init__(self, spec: PipelineSpec, store: EpochStore, spark: SparkSession,
                 tables: SparkTables | None = None) -> None:
        from sluice.spark import MemoryProbe

        super().__init__(spec, store)
        self.spark = spark
        self.tables = tables
        self.transform = transform_for(spec)
        validation.warm_in_background(spec)  # GX's import and context, while this group waits on Spark
        self._suites: dict[str, Any] | None = None
        self._refs: dict[str, DataFrame] | None = None
        self._prefetched: _Read | None = None
        self.memory = MemoryProbe(spark, spec.name)  # per group (or epoch): the controllers' memory budget

    @property
    def suites(self) -> dict[str, Any]:
        """Each sink's expectation suite, read when first validated (GX is imported meanwhile)."""
        if self._suites is None:
            self._suites = {s.name: validation.load_suite(s.expectations) for s in self.spec.sinks if s.expectations}
        return self._suites

    @property
    def refs(self) -> dict[str, DataFrame]:
        if self._refs is None:
            self._refs = load_reference(self.spark, self.spec, broadcast=self.spec.transform_function is not None)
        return self._refs

    def set_partitions(self, n: int) -> None:
        self.spark.conf.set("spark.sql.shuffle.partitions", str(n))

    def died(self, exc: BaseException) -> bool:
        return driver_died(exc)

    def read_memory(self, timings: dict[str, float]) -> None:
        reading = self.memory.read()
        if reading is not None:
            timings.update(memory_peak_mb=reading.peak_mb, memory_spilled_mb=reading.spilled_mb,
                           memory_budget_mb=reading.budget_mb)

    def _outputs(self, valid: DataFrame) -> dict[str, DataFrame]:
        outputs = self.transform(valid, self.refs)
        if not isinstance(outputs, dict):
            outputs = {self.spec.sinks[0].name: outputs}
        return outputs

    def empty(self) -> dict[str, Any]:
        records = self.source.empty_records(self.spark, with_epoch=True)
        valid, rejected = split_rejected(records, self.spec, 0)
        frames: dict[str, Any] = {REJECTED: rejected}
        outputs = self._outputs(valid)
        for sink in self.spec.sinks:
            frames[sink.name] = outputs[sink.name]
        if self.spec.dedup is not None:
            from sluice.dedup import DEDUP, empty_state

            frames[DEDUP] = empty_state(self.spark, self.spec)
        frames[QUARANTINE] = self.spark.createDataFrame(
            [], "pipeline string, sink string, epoch int, generation int, range_start long, range_end long, "
                "expectations array<string>, record string")
        return frames

    def _warm(self) -> list[threading.Thread]:
        """Warm the tables' snapshots (their state: Spark jobs of their own, ~0.4 s per table)
        in background threads while the group is read: a commit does not wait for it. Best
        effort: each write loads what it needs itself (a table not made yet is skipped)."""
        from sluice.spark import is_connect

        if self.tables is None or is_connect(self.spark):
            return []
        paths = {REJECTED: self.spec.rejected_table, **{s.name: s.path for s in self.spec.sinks}}
        if self.spec.dedup_table is not None:
            paths["_dedup"] = self.spec.dedup_table

        def run(path: str) -> None:
            self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", f"sluice_w{MAX_POOL_WEIGHT}")
            try:
                self.tables.warm(path)
            except Exception as exc:  # the write reports it, with its context
                log.debug("pipeline %s: table %s not warmed ahead: %s", self.spec.name, path, exc)

        threads = [threading.Thread(target=run, args=(path,), daemon=True, name=f"sluice-ready-{self.spec.name}-{name}")
                   for name, path in paths.items()]
        for thread in threads:
            thread.start()
        return threads

    def _read(self, read: _Read) -> _Read:
        """One job reads the ranges into the cache and counts input and rejected records per
        epoch (a failed read frees its cache)."""
        from pyspark.sql import functions as F

        self.memory.start()
        read.records = with_slot(self.source.read_epochs(self.spark, read.ranges), read.ranges).persist()
        try:
            read.tagged = tag_rejected(read.records, self.spec)
            counts = read.tagged.groupBy("_epoch").agg(F.count(F.lit(1)).alias("n"), F.count("_reason").alias("r"))
            for row in counts.collect():
                read.n_input[int(row["_epoch"])], read.n_rejected[int(row["_epoch"])] = row["n"], row["r"]
        except BaseException:
            read.records.unpersist()
            read.records = None
            raise
        read.read_s = round(time.monotonic() - read.t0, 3)
        return read

    def prefetch(self, epochs: list[Epoch]) -> None:
        """``_read`` in a background thread (Spark runs jobs of several threads at once) while
        the group job makes the tables ready: a new pipeline's first group creates its tables
        during its read. A classic session only (a Connect client reads in ``prepare_group``)."""
        from sluice.spark import is_connect

        self.drop_prefetch()
        if is_connect(self.spark):
            return
        read = _Read([e.range for e in epochs], time.monotonic(), job_group=f"sluice-read-{uuid.uuid4().hex}")

        def run() -> None:
            self.spark.sparkContext.setJobGroup(read.job_group, f"sluice: read a group of {self.spec.name}", True)
            try:
                self._read(read)
            except BaseException as exc:  # raised where prepare_group takes it over
                read.error = exc

        read.thread = threading.Thread(target=run, daemon=True, name=f"sluice-read-{self.spec.name}")
        self._prefetched = read
        read.thread.start()

    def drop_prefetch(self) -> None:
        read, self._prefetched = self._prefetched, None
        if read is None:
            return
        if read.thread is not None and read.thread.is_alive():  # not taken: the group failed before it
            self.spark.sparkContext.cancelJobGroup(read.job_group)
        read.free()

    def _take_prefetch(self, epochs: list[Epoch]) -> _Read | None:
        """The prefetched read of exactly these epochs' ranges (its error raised), or None."""
        read = self._prefetched
        if read is None:
            return None
        if read.ranges != [e.range for e in epochs]:
            self.drop_prefetch()
            return None
        self._prefetched = None
        read.join()
        if read.error is not None:  # its cache freed by ``_read``
            raise read.error
        return read

    def prepare_group(self, epochs: list[Epoch]) -> Prepared:
        """Read the epochs' ranges in one scan, split off rejected records, transform and
        validate. Without expectation suites the group is transformed as one frame (one
        shuffle); with them each epoch is transformed and validated on its own (epochs stay
        the unit of validation and quarantine) and the outputs are unioned for the commit."""
        from functools import reduce

        from pyspark.sql import functions as F

        warming = self._warm()  # the tables exist by now (a prefetched read may still run)
        try:
            read = self._take_prefetch(epochs) or self._read(_Read([e.range for e in epochs], time.monotonic()))
        except BaseException:
            for thread in warming:
                thread.join()
            raise
        records, tagged, timings = read.records, read.tagged, {}
        prepared = Prepared(list(epochs), read.t0, timings, cached=[records], background=warming,
                            n_input=read.n_input, n_rejected=read.n_rejected)
        try:
            valid, rejected = split_rejected(records, self.spec, epochs[0].generation, tagged=tagged)
            kept = None
            if self.spec.dedup is not None:  # the valid records whose key was not seen within the horizon
                kept = self._deduplicate(tagged, valid.columns, prepared)
                valid = kept.drop("_epoch", SLOT)
            outputs = self._outputs(valid)
            if kept is not None:
                from sluice.dedup import kept_per_epoch

                held = kept_per_epoch(prepared.cached[-1])
                prepared.n_deduplicated = {e.epoch_id: prepared.n_input.get(e.epoch_id, 0)
                                           - prepared.n_rejected.get(e.epoch_id, 0) - held.get(e.epoch_id, 0)
                                           for e in epochs}
            timings["read_s"] = read.read_s
            if not self.suites:
                prepared.rejected, prepared.outputs, prepared.committing = rejected, outputs, list(epochs)
                return prepared
            per_sink: dict[str, list[DataFrame]] = {}
            quarantined: list[DataFrame] = []
            for slot, epoch in enumerate(epochs):
                if kept is not None:
                    valid = kept.where(F.col(SLOT) == slot).drop("_epoch", SLOT)
                else:
                    valid, _ = split_rejected(records.where(F.col(SLOT) == slot), self.spec,
                                              epoch.generation, epoch.epoch_id)
                outputs = self._outputs(valid)
                results = self._validate(epoch, outputs, quarantined, timings)
                prepared.results[epoch.epoch_id] = results
                if self.spec.validation.policy == "fail" and any(not r.success for r in results.values()):
                    prepared.failed = epoch  # it and later epochs are not written
                    break
                for name, frame in outputs.items():
                    per_sink.setdefault(name, []).append(frame)
                prepared.committing.append(epoch)
            # Filtered only when an epoch failed: an isin of epoch ids is literals in the Java
            # source Spark generates, a new class each group on a long-lived server.
            written = [e.epoch_id for e in prepared.committing]
            prepared.rejected = (rejected.where(F.col("epoch").isin(written)) if prepared.failed is not None
                                 else rejected)
            if prepared.dedup_state is not None and prepared.failed is not None:
                # The seen keys of the epochs written only: the failed epoch is read again next time.
                from sluice.dedup import new_state

                prepared.dedup_state = new_state(prepared.cached[-1], self.spec, written)
            prepared.outputs = {name: reduce(lambda a, b: a.unionByName(b), frames)
                                for name, frames in per_sink.items()}
            if quarantined:
                prepared.quarantined = reduce(lambda a, b: a.unionByName(b), quarantined)
        except BaseException:
            prepared.release()
            raise
        return prepared

    def _deduplicate(self, tagged: DataFrame, carry: list[str], prepared: Prepared) -> DataFrame:
        """``dedup`` on the group's valid records (``sluice.dedup``), from the seen-keys table at
        its current version (pinned: the group's own MERGE must not change what it read): the
        kept records (``carry``, ``_epoch`` and ``_slot``); the seen keys to MERGE go to ``prepared``."""
        from pyspark.sql import functions as F

        from sluice.dedup import empty_state, kept_records, new_state, spark_dedup

        path = self.spec.dedup_table
        tables = self.tables
        if tables is None:
            from sluice.delta.spark import SparkTables

            tables = SparkTables(self.spark)
        version = tables.version(path) if path else None
        state = (empty_state(self.spark, self.spec) if version is None
                 else self.spark.read.format("delta").option("versionAsOf", version).load(path))
        valid = tagged.where(F.col("_reason").isNull())
        folded = spark_dedup(valid, state, self.spec, [*carry, "_epoch", SLOT]).persist()
        prepared.cached.append(folded)
        prepared.dedup_state = new_state(folded, self.spec)
        return kept_records(folded, [*carry, "_epoch", SLOT])

    def _validate(self, epoch: Epoch, outputs: dict[str, DataFrame], quarantined: list[DataFrame],
                  timings: dict[str, float]) -> dict[str, validation.SinkValidation]:
        """Each sink's suite on the epoch's output (``outputs`` loses the quarantined rows)."""
        results: dict[str, validation.SinkValidation] = {}
        policy = self.spec.validation.policy
        for sink in self.spec.sinks:
            suite = self.suites.get(sink.name)
            if suite is None:
                continue
            t_val = time.monotonic()
            frame = outputs[sink.name]
            if sink.mode == "aggregate" and policy != "quarantine":  # (quarantine's validate materialises its own)
                # An aggregate's output is small and its plan long (the parse, the checks, the
                # transform, a shuffle): materialised once, GX's ~10 metric queries and the MERGE
                # read it rather than planning and running that plan each (bench/README.md).
                frame = frame.localCheckpoint()
            with _GX_LOCK:  # one validation at a time: GX's context is shared by the process
                result, outputs[sink.name], bad = validation.validate(
                    sink.name, frame, suite, locate_rows=policy == "quarantine")
            if bad is not None:
                result = replace(result, quarantined=bad.count())
                quarantined.append(quarantine_rows(bad, self.spec, sink.name, epoch))
            results[sink.name] = result
            key = f"validate_{sink.name}_s"
            timings[key] = round(timings.get(key, 0) + time.monotonic() - t_val, 3)
        return results

    def prepare_epoch(self, epoch: Epoch, *, materialize: bool = False, weight: int = 1) -> Prepared:
        from functools import reduce

        from pyspark.sql import functions as F

        from sluice.spark import is_connect

        if materialize:
            # Spark Connect has no SparkContext here: concurrent epochs share the server's pool.
            sc = None if is_connect(self.spark) else getattr(self.spark, "sparkContext", None)
            if sc is not None:  # classic Spark: this thread's jobs go to the epoch's FAIR pool
                sc.setLocalProperty("spark.scheduler.pool", f"sluice_w{min(weight, MAX_POOL_WEIGHT)}")
        if self.spec.dedup is not None:
            raise SluiceError(f"pipeline {self.spec.name!r}: dedup needs commit: group (an epoch alone does not "
                              "read the seen keys)")
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        if not materialize:  # concurrent epochs' jobs run in pool threads: not measured
            self.memory.start()
        records = self.source.read(self.spark, epoch.start, epoch.end).persist()
        prepared = Prepared([epoch], t0, timings, cached=[records])
        try:
            tagged = tag_rejected(records, self.spec)
            # One job reads the range into the cache and counts input and rejected records.
            n_input, n_rejected = tagged.agg(F.count(F.lit(1)), F.count("_reason")).first()
            prepared.n_input[epoch.epoch_id], prepared.n_rejected[epoch.epoch_id] = n_input, n_rejected
            valid, prepared.rejected = split_rejected(records, self.spec, epoch.generation, epoch.epoch_id, tagged)
            outputs = self._outputs(valid)
            timings["read_s"] = round(time.monotonic() - t0, 3)
            quarantined: list[DataFrame] = []
            results = self._validate(epoch, outputs, quarantined, timings)
            prepared.results[epoch.epoch_id] = results
            if quarantined:
                prepared.quarantined = reduce(lambda a, b: a.unionByName(b), quarantined)
            if self.spec.validation.policy == "fail" and any(not r.success for r in results.values()):
                prepared.failed = epoch
                return prepared
            if materialize:
                for name, frame in outputs.items():
                    outputs[name] = frame.persist()
                    prepared.cached.append(outputs[name])
                    prepared.counts[name] = outputs[name].count()
                timings["compute_s"] = round(time.monotonic() - t0, 3)
            prepared.outputs = outputs
            prepared.committing = [epoch]
        except BaseException:
            prepared.release()
            raise
        return prepared

    def locate_poison(self, span: EpochRange, max_probes: int = 40) -> tuple[str, int, str] | None:
        """The first record of the range that alone makes the transform fail, by bisection
        over its files, then its lines (each probe evaluates the transform on a subset without
        writing). ``None`` when the failure does not come from one record."""
        from pyspark.sql import functions as F

        probes = 0
        try:
            records = self.source.read(self.spark, span.start, span.end).persist()
        except Exception:
            return None

        def fails(cond: Any) -> bool:
            nonlocal probes
            probes += 1
            valid, _ = split_rejected(records.where(cond), self.spec, 0, span.epoch_id)
            try:
                for frame in self._outputs(valid).values():
                    frame.write.format("noop").mode("overwrite").save()
            except Exception:
                return True
            return False

        quiet = _QuietErrors(self.spark)  # each failing probe would log a full stack trace
        try:
            quiet.__enter__()
            files = [r["_file"] for r in records.select("_file").distinct().orderBy("_file").collect()]
            if not files or not fails(F.lit(True)):
                return None
            lo, hi = 0, len(files) - 1  # the first failing file: files[:i+1] fail, files[:i] do not
            while lo < hi and probes < max_probes:
                mid = (lo + hi) // 2
                if fails(F.col("_file").isin(files[: mid + 1])):
                    hi = mid
                else:
                    lo = mid + 1
            path = files[lo]
            in_file = F.col("_file") == path
            last = records.where(in_file).agg(F.max("_line")).first()[0]
            lo, hi = 1, int(last)
            while lo < hi and probes < max_probes:
                mid = (lo + hi) // 2
                if fails(in_file & (F.col("_line") <= mid)):
                    hi = mid
                else:
                    lo = mid + 1
            if probes >= max_probes or not fails(in_file & (F.col("_line") == lo)):
                return None
            row = records.where(in_file & (F.col("_line") == lo)).first()
            fields = {k: row[k] for k in self.spec.source.schema_}
            return path, lo, row["_corrupt_record"] or json.dumps(fields)
        finally:
            quiet.__exit__()
            records.unpersist()


class _QuietErrors:
    """Silence Spark's error logs (JVM and PySpark's query-context logger) for a while."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self.py_logger = logging.getLogger("DataFrameQueryContextLogger")
        self.saved: tuple[Any, int] | None = None

    def __enter__(self) -> None:
        from sluice.spark import is_connect

        if is_connect(self.spark):  # the JVM's log is the Connect server's, not this task's
            self.saved = (None, self.py_logger.level)
            self.py_logger.setLevel(logging.CRITICAL + 1)
            return
        try:
            jvm_root = self.spark._jvm.org.apache.logging.log4j.LogManager.getRootLogger()
            self.saved = (jvm_root.getLevel().toString(), self.py_logger.level)
        except Exception:  # no JVM to quiet
            return
        self.spark.sparkContext.setLogLevel("OFF")
        self.py_logger.setLevel(logging.CRITICAL + 1)

    def __exit__(self, *_: Any) -> None:
        if self.saved is not None:
            if self.saved[0] is not None:
                self.spark.sparkContext.setLogLevel(self.saved[0])
            self.py_logger.setLevel(self.saved[1])


def driver_died(exc: BaseException) -> bool:
    """Whether the Spark driver JVM is gone or out of memory: py4j then reports a refused or
    reset socket (or an empty answer), and ``locate_poison`` would only fail the same way."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if (isinstance(seen, ConnectionError | BrokenPipeError) or type(seen).__name__ == "Py4JNetworkError"
                or "Answer from Java side is empty" in text or "java.lang.OutOfMemoryError" in text):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
