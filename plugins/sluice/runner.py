"""Run one group's epochs in one SparkSession: read exactly each range, transform, write the
sinks exactly once, record the commit (steps 3 and 4 of the protocol; ``sluice.execution``
tells the whole story and calls this).

This is the Spark side of sluice; ``sluice run-group`` is its command line (under spark-submit,
``sluice/jobs/run_group.py``), used by ``spark-submit`` and in-process alike.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sluice import faults, protocol, validation
from sluice.errors import FencedError, PipelineHaltedError, SharedTableError, SluiceError
from sluice.paths import transforms_dir
from sluice.sinks.delta import DeltaSink, EpochRange, SinkCommit, describe, rejected_sink
from sluice.sources import source_for
from sluice.spark import MemoryProbe, is_connect
from sluice.spec import PipelineSpec, SinkSpec
from sluice.store import Epoch, EpochLog, Group, Lease

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("sluice.runner")

REJECTED_COLUMNS = ("pipeline", "epoch", "generation", "file", "line", "reason", "record")


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


def load_reference(spark: SparkSession, spec: PipelineSpec) -> dict[str, DataFrame]:
    from pyspark.sql import functions as F

    refs = {}
    for name, path in spec.reference.items():
        if not Path(path).is_file():
            raise SluiceError(f"pipeline {spec.name!r}: reference table {name!r} file {path} does not exist")
        refs[name] = F.broadcast(spark.read.option("header", True).csv(path).cache())
    return refs


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


MAX_POOL_WEIGHT = 8  # FAIR pools sluice_w1 .. sluice_w8 (jobs/fairscheduler.xml)
_GX_LOCK = threading.Lock()


@dataclass
class PreparedEpoch:
    """An epoch read, split, transformed and validated, not yet written."""

    epoch: Epoch
    t0: float
    timings: dict[str, float]
    cached: list[DataFrame] = field(default_factory=list)
    n_input: int = 0
    n_rejected: int = 0
    rejected: DataFrame | None = None
    outputs: dict[str, DataFrame] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    results: dict[str, validation.SinkValidation] = field(default_factory=dict)
    quarantined: list[DataFrame] = field(default_factory=list)

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()


@dataclass
class PreparedGroup:
    """A group's epochs read in one scan, split, transformed and validated, not yet written."""

    epochs: list[Epoch]
    t0: float
    timings: dict[str, float]
    cached: list[DataFrame] = field(default_factory=list)
    n_input: dict[int, int] = field(default_factory=dict)
    n_rejected: dict[int, int] = field(default_factory=dict)
    rejected: DataFrame | None = None
    quarantined: DataFrame | None = None
    outputs: dict[str, DataFrame] = field(default_factory=dict)
    results: dict[int, dict[str, validation.SinkValidation]] = field(default_factory=dict)
    committing: list[Epoch] = field(default_factory=list)  # the epochs to write (before ``failed``)
    failed: Epoch | None = None  # the first epoch that failed validation under ``fail``
    tables_ready: list[threading.Thread] = field(default_factory=list)  # ``GroupRunner.ready_tables``

    def release(self) -> None:
        for thread in self.tables_ready:
            thread.join()
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()


def epoch_range(epoch: Epoch) -> EpochRange:
    return EpochRange(epoch.epoch_id, epoch.start, epoch.end)


class LeaseKeeper:
    """Renews a lease every third of its TTL from a thread while a group is processed, so a
    long epoch does not let it expire. A renewal that finds the lease taken over stops; the
    run's next store write, or Delta (the token in every commit), then refuses it."""

    def __init__(self, epoch_log: EpochLog, lease: Lease, ttl_s: float) -> None:
        self.log, self.lease, self.ttl_s = epoch_log, lease, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"sluice-lease-{lease.pipeline}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self.log.renew_lease(self.lease, self.ttl_s)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with faults.STORE_WRITE:
                    self.log.renew_lease(self.lease, self.ttl_s)
            except FencedError as exc:
                log.warning("%s", exc)
                return
            except Exception:  # the store is briefly unreachable: try again next time
                log.exception("pipeline %s: could not renew the lease", self.lease.pipeline)


class GroupRunner:
    """Processes the epochs of one planned group, in order, under a lease."""

    def __init__(self, spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession) -> None:
        self.spec = spec
        self.log = epoch_log
        self.spark = spark
        self.source = source_for(spec, epoch_log)
        self.sinks = [DeltaSink(spec.name, s, spec.partitioning) for s in spec.sinks]
        self.rejected = rejected_sink(spec.name, spec.rejected_table)
        self.transform = load_transform(spec.transform)
        self.suites = {s.name: validation.load_suite(s.expectations) for s in spec.sinks if s.expectations}
        self._refs: dict[str, DataFrame] | None = None
        self.memory = MemoryProbe(spark, spec.name)  # per group (or epoch): the controllers' memory budget

    @property
    def refs(self) -> dict[str, DataFrame]:
        if self._refs is None:
            self._refs = load_reference(self.spark, self.spec)
        return self._refs

    def run(self, lease: Lease, group: Group, concurrency: int = 1) -> Group:
        """Process the group's unwritten epochs in order (the ``process`` and ``commit`` steps).

        ``commit: group`` (the default): the epochs are read in one scan, transformed and
        written together, one Delta commit per table (``run_group``). ``commit: epoch``: one
        after the other, each with its own commits; with ``concurrency`` > 1 (independent
        epochs only: append sinks, A-scheduler) up to that many are computed at once in FAIR
        pools weighted towards the oldest, and committed one by one in epoch order.

        Under the ``fail`` policy an epoch that fails validation is recorded as failed and the
        group stops there: nothing of it or of later epochs is written, and the ``validate``
        step halts the pipeline.
        """
        faults.maybe_fail("after_plan")
        partitions = group.plan.get("partitions")
        if partitions and self.spec.control.adaptive:  # the controllers' partition count (DyBBS hill climb)
            self.spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
        todo = [e for e in group.epochs if e.state not in (protocol.COMMITTED, protocol.PUBLISHED)]
        with LeaseKeeper(self.log, lease, self.spec.control.lease_ttl_s):
            if todo and self.attempted_before(todo):
                self.reconcile_tables(lease, todo)
            if self.spec.commit == "group" and todo:
                self.run_group(lease, todo)
            elif concurrency > 1 and len(todo) > 1:
                self._run_concurrently(lease, todo, concurrency)
            else:
                for epoch in todo:
                    self._start_attempt(lease, epoch)
                    try:
                        committed = self.commit(lease, self.prepare(epoch))
                    except Exception as exc:
                        self._fail(lease, [epoch], exc)
                    if committed is None:
                        break
        self.maybe_optimize(group)
        return self.log.group(self.spec.name, group.group_id)

    # -- all-or-nothing: what an earlier attempt left in the tables ----------------------------

    def attempted_before(self, epochs: list[Epoch]) -> bool:
        """Whether an earlier attempt may have written any of these epochs: one started (or
        failed), or a table holds one (after ``sluice_recover`` reset the attempt counts). A
        local table's log is read newest first and the walk stops within a few commits."""
        from sluice.sinks.delta import _is_local, _local_versions, commit_lineage

        if any(e.attempts > 0 or e.state == protocol.FAILED for e in epochs):
            return True
        generation, first = epochs[0].generation, epochs[0].epoch_id
        return any(_is_local(t.path) and _local_versions(t.path) and protocol.first_commit_holding(
            commit_lineage(self.spark, t.path), t.app_id(generation), generation, first) is not None
            for t in pipeline_tables(self.spec))

    def reconcile_tables(self, lease: Lease, epochs: list[Epoch]) -> dict[str, int]:
        """Before an epoch that was attempted already is written again: record this run's lease
        token in every table (from then on no earlier attempt, a zombie included, can commit),
        then RESTORE each table that holds any of these epochs to the version before the first
        commit holding them. The rerun then writes every table afresh: nothing an earlier
        attempt wrote survives beside the rerun's output (a fix that now rejects a record
        cannot leave it in neither table). Returns the restored versions by table path."""
        from sluice.sinks.delta import commit_lineage, restore, restore_conflict

        generation, first = epochs[0].generation, epochs[0].epoch_id
        restored: dict[str, int] = {}
        for table in pipeline_tables(self.spec):
            if table.fence(self.spark, generation, lease.fence) is None:
                continue
            holding = protocol.first_commit_holding(commit_lineage(self.spark, table.path), table.app_id(generation),
                                                    generation, first)
            if holding is None:
                continue
            conflict = restore_conflict(self.spark, table.path, self.spec.name, holding - 1)
            if conflict:
                raise SharedTableError(f"pipeline {self.spec.name!r}: epochs from {first} cannot be written again: "
                                       f"{conflict}")
            restore(self.spark, table.path, holding - 1)
            restored[table.path] = holding - 1
            log.warning("pipeline %s: %s held epochs >= %s of an earlier attempt (version %s); restored to "
                        "version %s before writing them again", self.spec.name, table.path, first, holding,
                        holding - 1)
            faults.maybe_fail("mid_reconcile", first)
        self.log.check_lease(lease)
        return restored

    # -- commit: group -----------------------------------------------------------------------

    def run_group(self, lease: Lease, epochs: list[Epoch]) -> None:
        for epoch in epochs:
            self._start_attempt(lease, epoch)
        try:
            self.commit_group(lease, self.prepare_group(epochs))
        except Exception as exc:
            self._fail(lease, epochs, exc)

    def prepare_group(self, epochs: list[Epoch]) -> PreparedGroup:
        """Read the epochs' ranges in one scan, split off rejected records, transform and
        validate. Without expectation suites the group is transformed as one frame (one
        shuffle); with them each epoch is transformed and validated on its own (epochs stay
        the unit of validation and quarantine) and the outputs are unioned for the commit."""
        from functools import reduce

        from pyspark.sql import functions as F

        t0 = time.monotonic()
        timings: dict[str, float] = {}
        self.memory.start()
        records = self.source.read_epochs(self.spark, [epoch_range(e) for e in epochs]).persist()
        prepared = PreparedGroup(list(epochs), t0, timings, cached=[records])
        try:
            tagged = tag_rejected(records, self.spec)
            valid, rejected = split_rejected(records, self.spec, epochs[0].generation, tagged=tagged)
            outputs = self._outputs(valid)
            prepared.tables_ready = self.ready_tables(
                [(self.rejected, rejected), *[(sink, outputs[sink.spec.name]) for sink in self.sinks]])
            # One job reads the ranges into the cache and counts input and rejected records per epoch.
            counts = tagged.groupBy("_epoch").agg(F.count(F.lit(1)).alias("n"), F.count("_reason").alias("r"))
            for row in counts.collect():
                prepared.n_input[int(row["_epoch"])], prepared.n_rejected[int(row["_epoch"])] = row["n"], row["r"]
            timings["read_s"] = round(time.monotonic() - t0, 3)
            policy = self.spec.validation.policy
            if not self.suites:
                prepared.rejected, prepared.outputs = rejected, outputs
            else:
                per_sink: dict[str, list[DataFrame]] = {}
                quarantined: list[DataFrame] = []
                for epoch in epochs:
                    valid, _ = split_rejected(records.where(F.col("_epoch") == epoch.epoch_id), self.spec,
                                              epoch.generation, epoch.epoch_id)
                    outputs = self._outputs(valid)
                    results: dict[str, validation.SinkValidation] = {}
                    for sink in self.sinks:
                        suite = self.suites.get(sink.spec.name)
                        if suite is None:
                            continue
                        t_val = time.monotonic()
                        with _GX_LOCK:
                            result, outputs[sink.spec.name], bad = validation.validate(
                                sink.spec.name, outputs[sink.spec.name], suite, locate_rows=policy == "quarantine")
                        if bad is not None:
                            result = replace(result, quarantined=bad.count())
                            quarantined.append(quarantine_rows(bad, self.spec, sink.spec.name, epoch))
                        results[sink.spec.name] = result
                        timings[f"validate_{sink.spec.name}_s"] = round(
                            timings.get(f"validate_{sink.spec.name}_s", 0) + time.monotonic() - t_val, 3)
                    prepared.results[epoch.epoch_id] = results
                    if policy == "fail" and any(not r.success for r in results.values()):
                        prepared.failed = epoch  # it and later epochs are not written
                        break
                    for name, frame in outputs.items():
                        per_sink.setdefault(name, []).append(frame)
                    prepared.committing.append(epoch)
                written = [e.epoch_id for e in prepared.committing]
                prepared.rejected = rejected.where(F.col("epoch").isin(written))
                prepared.outputs = {name: reduce(lambda a, b: a.unionByName(b), frames)
                                    for name, frames in per_sink.items()}
                if quarantined:
                    prepared.quarantined = reduce(lambda a, b: a.unionByName(b), quarantined)
            if not self.suites or prepared.failed is None:
                prepared.committing = list(epochs)
        except BaseException:
            prepared.release()
            raise
        return prepared

    def ready_tables(self, tables: list[tuple[DeltaSink, DataFrame]]) -> list[threading.Thread]:
        """``DeltaSink.prepare`` of the group's tables, each in a background thread, started while
        the group is read: their driver-side work overlaps the read, and their small jobs run on
        the first free cores (a FAIR pool of their own), side by side. Best effort: each write
        makes its table ready itself when this did not."""
        def run(table: DeltaSink, frame: DataFrame) -> None:
            if not is_connect(self.spark):  # Spark Connect: no per-thread pool reaches the server
                self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", f"sluice_w{MAX_POOL_WEIGHT}")
            try:
                table.prepare(self.spark, frame)
            except Exception as exc:  # the write reports it, with its context
                log.debug("pipeline %s: table %s not prepared ahead: %s", self.spec.name, table.path, exc)

        threads = [threading.Thread(target=run, args=(table, frame), daemon=True,
                                    name=f"sluice-ready-{self.spec.name}-{table.spec.name}")
                   for table, frame in tables]
        for thread in threads:
            thread.start()
        return threads

    def commit_group(self, lease: Lease, prepared: PreparedGroup) -> None:
        """Write the group's epochs (those before one that failed validation under ``fail``):
        at most one Delta transaction per table, ``_rejected`` and ``_quarantine`` first, a
        table with nothing to write skipped; then record them committed in one store
        transaction (step 4). A crash in between is repaired by ``reconcile_tables``."""
        epochs, timings = prepared.committing, prepared.timings
        token = lease.fence
        try:
            t_wait = time.monotonic()
            for thread in prepared.tables_ready:
                thread.join()
            timings["tables_wait_s"] = round(time.monotonic() - t_wait, 3)
            commits: list[SinkCommit] = []
            if epochs:
                ranges = [epoch_range(e) for e in epochs]
                generation = epochs[0].generation
                n_rejected = sum(prepared.n_rejected.get(e.epoch_id, 0) for e in epochs)
                quarantined = sum(r.quarantined for e in epochs for r in prepared.results.get(e.epoch_id, {}).values())
                writes: list[tuple[DeltaSink, DataFrame | None, int | None]] = [
                    (self.rejected, prepared.rejected, n_rejected),
                    (quarantine_sink(self.spec), prepared.quarantined, quarantined)]
                # A group without a valid record writes no sink; otherwise the sinks' rows are
                # counted by Delta's commit metrics, not by a job of their own.
                valid = sum(prepared.n_input.get(e.epoch_id, 0) - prepared.n_rejected.get(e.epoch_id, 0)
                            for e in epochs)
                writes += [(sink, prepared.outputs[sink.spec.name] if valid else None, None) for sink in self.sinks]
                timings["compute_s"] = round(time.monotonic() - prepared.t0, 3)
                for table, frame, rows in writes:
                    if frame is None or rows == 0:
                        continue  # nothing to write: no commit
                    if commits:
                        faults.maybe_fail("mid_write", epochs[-1].epoch_id)
                    t_sink = time.monotonic()
                    commits.append(table.write(self.spark, frame, epochs=ranges, generation=generation, token=token,
                                               skip_empty=True, rows=rows))
                    timings[f"write_{table.spec.name}_s"] = round(time.monotonic() - t_sink, 3)
            record_memory(timings, self.memory)  # before the release: the group's cache counts
        finally:
            prepared.release()
        if epochs:
            faults.maybe_fail("after_delta_commit", epochs[-1].epoch_id)
            self._record_group_commit(lease, prepared, commits)
        if prepared.failed is not None:
            results = {name: r.as_dict() for name, r in prepared.results[prepared.failed.epoch_id].items()}
            self.log.mark_failed(lease, prepared.failed, "validation failed: " + validation.describe(results),
                                 validation=results, rows={"input": prepared.n_input.get(prepared.failed.epoch_id, 0)})
            for name, r in results.items():
                if not r["success"]:
                    log.warning("pipeline %s epoch %s: sink %s failed validation (fail)", self.spec.name,
                                prepared.failed.epoch_id, name)

    def _record_group_commit(self, lease: Lease, prepared: PreparedGroup, commits: list[SinkCommit]) -> None:
        epochs = prepared.committing
        group_s = time.monotonic() - prepared.t0
        files = sum(e.end - e.start for e in epochs)
        sink_names = {s.spec.name for s in self.sinks}
        versions = {c.sink: c.version for c in commits}
        output = sum(c.rows for c in commits if c.sink in sink_names)
        keys = {c.sink: c.keys for c in commits if c.keys}
        records = []
        for i, epoch in enumerate(epochs):
            results = prepared.results.get(epoch.epoch_id, {})
            last = i == len(epochs) - 1
            rows: dict[str, Any] = {
                "input": prepared.n_input.get(epoch.epoch_id, 0),
                "rejected": prepared.n_rejected.get(epoch.epoch_id, 0),
                "quarantined": sum(r.quarantined for r in results.values()),
                # Output rows are counted per commit: the group's last epoch holds them.
                "output": output if last else 0, "commit": [epochs[0].epoch_id, epochs[-1].epoch_id]}
            if keys and last:  # Prompt's key statistics (sluice.sinks.layout), of the whole commit
                rows["keys"] = keys
            # The group's wall time shared by files: the controllers see seconds per file (DyBBS).
            timings = dict(prepared.timings, epoch_s=round(group_s * (epoch.end - epoch.start) / max(files, 1), 3),
                           group_s=round(group_s, 3), group_epochs=len(epochs))
            records.append((epoch, versions, rows, timings, {n: r.as_dict() for n, r in results.items()} or None))
        self.log.mark_group_committed(lease, records)
        log.info("pipeline %s epochs %s..%s committed in one commit per table: %s", self.spec.name,
                 epochs[0].epoch_id, epochs[-1].epoch_id,
                 json.dumps({"commits": [describe(c) for c in commits], "timings": prepared.timings}))

    def _run_concurrently(self, lease: Lease, epochs: list[Epoch], level: int) -> None:
        """Compute up to ``level`` epochs at once (worker threads, one FAIR pool each), commit
        in order from this thread: the epoch log is written here only."""
        from concurrent.futures import Future, ThreadPoolExecutor

        from sluice.control.concurrency import pool_weights

        weights = pool_weights([e.epoch_id for e in epochs])
        queue: list[tuple[Epoch, Future[PreparedEpoch]]] = []
        upcoming = iter(epochs)
        with ThreadPoolExecutor(max_workers=level, thread_name_prefix="sluice-epoch") as pool:

            def submit() -> None:
                epoch = next(upcoming, None)
                if epoch is not None:
                    self._start_attempt(lease, epoch)
                    queue.append((epoch, pool.submit(self._prepare_in_pool, epoch, weights[epoch.epoch_id], level)))

            for _ in range(level):
                submit()
            last_commit = time.monotonic()
            try:
                while queue:
                    epoch, future = queue.pop(0)
                    try:
                        prepared = future.result()
                        # epoch_s is the wall time this epoch added to the group: its compute
                        # overlapped the previous epochs', and the controllers (DyBBS) must see
                        # the group's real pace, not the sum of overlapping spans.
                        prepared.t0 = max(prepared.t0, last_commit)
                        committed = self.commit(lease, prepared)
                        last_commit = time.monotonic()
                    except Exception as exc:
                        self._fail(lease, [epoch], exc)
                    if committed is None:
                        break
                    submit()
            finally:  # a failure or a stop: let the epochs in flight finish, drop their caches
                for _, future in queue:
                    try:
                        future.result().release()
                    except Exception:
                        pass

    def _prepare_in_pool(self, epoch: Epoch, weight: int, level: int) -> PreparedEpoch:
        # Spark Connect has no SparkContext here (getattr gives None): no per-thread local
        # property reaches the server, so concurrent epochs share the server's default pool.
        sc = None if is_connect(self.spark) else getattr(self.spark, "sparkContext", None)
        if sc is not None:  # classic Spark: this thread's jobs go to the epoch's FAIR pool
            sc.setLocalProperty("spark.scheduler.pool", f"sluice_w{min(weight, MAX_POOL_WEIGHT)}")
        prepared = self.prepare(epoch, materialize=True)
        prepared.timings["concurrency"] = level
        return prepared

    def _start_attempt(self, lease: Lease, epoch: Epoch) -> None:
        """Count an attempt, unless the epoch has used up ``control.max_attempts``: then the
        pipeline is halted until an operator acts (recover, skip a file, roll back)."""
        limit = self.spec.control.max_attempts
        if epoch.attempts >= limit:
            raise PipelineHaltedError(
                f"pipeline {self.spec.name!r} is halted: epoch {epoch.epoch_id} (offsets [{epoch.start}, "
                f"{epoch.end})) failed {epoch.attempts} times (control.max_attempts = {limit}); last error: "
                f"{epoch.error}. Fix the cause, then trigger sluice_recover (or sluice_skip_file for a file "
                "that is gone or unreadable)")
        self.log.start_attempt(lease, epoch)

    def _fail(self, lease: Lease, epochs: list[Epoch], exc: Exception) -> NoReturn:
        """Record the epochs' failure with its real cause and their files, pointing at the
        poison record when one record alone makes the transform fail, and raise."""
        if isinstance(exc, FencedError):
            raise exc
        span = replace(epochs[0], end=epochs[-1].end)
        what = (f"epoch {span.epoch_id}" if len(epochs) == 1 else f"epochs {span.epoch_id}..{epochs[-1].epoch_id}")
        what += f" (offsets [{span.start}, {span.end}))"
        message = _short_error(exc)

        def mark(message: str) -> None:
            for epoch in epochs:
                self.log.mark_failed(lease, epoch, message)

        if isinstance(exc, SluiceError | faults.InjectedFault):
            mark(message)
            raise exc
        if driver_died(exc):
            # No probe: the session is gone. Say what killed it, not the socket error it left.
            message = (f"the Spark driver died while processing files {self._file_names(span)} ({message}); "
                       "most often it ran out of memory: raise spark.driver.memory, or lower "
                       "source.max_record_bytes or control.epoch_files")
            mark(message)
            raise SluiceError(f"pipeline {self.spec.name!r} {what} failed: {message}") from exc
        poison = self.locate_poison(span)
        if poison:
            holder = next((e.epoch_id for e in epochs
                           if any(f.path == poison[0] for f in self.log.manifest(self.spec.name, e.start, e.end))),
                          None)
            message += f" -- poison record at {poison[0]} line {poison[1]} (epoch {holder}): {poison[2][:500]}"
        else:
            message += f" -- files {self._file_names(span)}"
        mark(message)
        raise SluiceError(f"pipeline {self.spec.name!r} {what} failed: {message}") from exc

    def _file_names(self, epoch: Epoch, limit: int = 5) -> str:
        paths = [e.path for e in self.log.manifest(self.spec.name, epoch.start, epoch.end)]
        more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
        return ", ".join(paths[:limit]) + more

    def _outputs(self, valid: DataFrame) -> dict[str, DataFrame]:
        outputs = self.transform(valid, self.refs)
        if not isinstance(outputs, dict):
            outputs = {self.sinks[0].spec.name: outputs}
        return outputs

    def prepare(self, epoch: Epoch, materialize: bool = False) -> PreparedEpoch:
        """Read the range, split off rejected records, transform and validate: everything
        before the first commit. With ``materialize`` the outputs are computed and cached
        now (a concurrent epoch's work), so committing them later is only the Delta write."""
        from pyspark.sql import functions as F

        timings: dict[str, float] = {}
        t0 = time.monotonic()
        if not materialize:  # concurrent epochs' jobs run in pool threads: not measured
            self.memory.start()
        records = self.source.read(self.spark, epoch.start, epoch.end).persist()
        prepared = PreparedEpoch(epoch, t0, timings, cached=[records])
        try:
            tagged = tag_rejected(records, self.spec)
            # One job reads the range into the cache and counts input and rejected records.
            prepared.n_input, prepared.n_rejected = tagged.agg(F.count(F.lit(1)), F.count("_reason")).first()
            valid, prepared.rejected = split_rejected(records, self.spec, epoch.generation, epoch.epoch_id, tagged)
            outputs = self._outputs(valid)
            timings["read_s"] = round(time.monotonic() - t0, 3)
            policy = self.spec.validation.policy
            for sink in self.sinks:
                suite = self.suites.get(sink.spec.name)
                if suite is None:
                    continue
                t_val = time.monotonic()
                with _GX_LOCK:  # one validation at a time: GX's context is shared by the process
                    result, outputs[sink.spec.name], bad = validation.validate(
                        sink.spec.name, outputs[sink.spec.name], suite, locate_rows=policy == "quarantine")
                if bad is not None:
                    result = replace(result, quarantined=bad.count())
                    prepared.quarantined.append(quarantine_rows(bad, self.spec, sink.spec.name, epoch))
                prepared.results[sink.spec.name] = result
                timings[f"validate_{sink.spec.name}_s"] = round(time.monotonic() - t_val, 3)
            if materialize:
                for name, frame in outputs.items():
                    outputs[name] = frame.persist()
                    prepared.cached.append(outputs[name])
                    prepared.counts[name] = outputs[name].count()
                timings["compute_s"] = round(time.monotonic() - t0, 3)
            prepared.outputs = outputs
        except BaseException:
            prepared.release()
            raise
        return prepared

    def commit(self, lease: Lease, prepared: PreparedEpoch) -> dict[str, Any] | None:
        """Write a prepared epoch's sinks (``_rejected`` and ``_quarantine`` first) and record
        the commit; ``None`` when it failed validation under ``fail`` (nothing written)."""
        from functools import reduce

        epoch, timings, results = prepared.epoch, prepared.timings, prepared.results
        policy = self.spec.validation.policy
        recorded = {name: r.as_dict() for name, r in results.items()} or None
        try:
            failures = {name: r for name, r in results.items() if not r.success}
            for name, r in failures.items():
                log.warning("pipeline %s epoch %s: sink %s failed validation (%s): %s", self.spec.name,
                            epoch.epoch_id, name, policy, r.describe())
            if failures and policy == "fail":
                self.log.mark_failed(lease, epoch, "validation failed: " + validation.describe(recorded),
                                     validation=recorded, rows={"input": prepared.n_input})
                return None
            commits: list[SinkCommit] = []
            quarantined = ([(quarantine_sink(self.spec), reduce(lambda a, b: a.unionByName(b), prepared.quarantined),
                             True, None)] if prepared.quarantined else [])
            writes = ([(self.rejected, prepared.rejected, True, prepared.n_rejected)] + quarantined
                      + [(s, prepared.outputs[s.spec.name], False, prepared.counts.get(s.spec.name))
                         for s in self.sinks])
            for i, (sink, frame, skip_empty, rows) in enumerate(writes):
                if i > 0 and any(c.version is not None for c in commits):
                    faults.maybe_fail("mid_write", epoch.epoch_id)
                t_sink = time.monotonic()
                commits.append(sink.write(self.spark, frame, epochs=[epoch_range(epoch)],
                                          generation=epoch.generation, token=lease.fence,
                                          skip_empty=skip_empty, rows=rows))
                timings[f"write_{sink.spec.name}_s"] = round(time.monotonic() - t_sink, 3)
            record_memory(timings, self.memory)  # before the release: the epoch's cache counts
        finally:
            prepared.release()
        faults.maybe_fail("after_delta_commit", epoch.epoch_id)
        sink_names = {s.spec.name for s in self.sinks}
        timings["epoch_s"] = round(time.monotonic() - prepared.t0, 3)
        rows = {"input": prepared.n_input, "rejected": commits[0].rows,
                "quarantined": sum(r.quarantined for r in results.values()),
                "output": sum(c.rows for c in commits if c.sink in sink_names)}
        keys = {c.sink: c.keys for c in commits if c.keys}
        if keys:  # Prompt's per-epoch key statistics (sluice.sinks.layout)
            rows["keys"] = keys
        self.log.mark_committed(lease, epoch, delta_versions={c.sink: c.version for c in commits},
                                rows=rows, timings=timings, validation=recorded)
        result = {"epoch": epoch.epoch_id, "range": [epoch.start, epoch.end], "rows": rows,
                  "commits": [describe(c) for c in commits], "timings": timings}
        log.info("pipeline %s epoch %s committed: %s", self.spec.name, epoch.epoch_id, json.dumps(result))
        return result

    def locate_poison(self, epoch: Epoch, max_probes: int = 40) -> tuple[str, int, str] | None:
        """The first record of the epoch that alone makes the transform fail, by bisection
        over its files, then its lines (each probe evaluates the transform on a subset without
        writing). ``None`` when the failure does not come from one record."""
        from pyspark.sql import functions as F

        probes = 0
        try:
            records = self.source.read(self.spark, epoch.start, epoch.end).persist()
        except Exception:
            return None

        def fails(cond: Any) -> bool:
            nonlocal probes
            probes += 1
            valid, _ = split_rejected(records.where(cond), self.spec, epoch.generation, epoch.epoch_id)
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

    def maybe_optimize(self, group: Group) -> None:
        """Compact the sinks every ``control.optimize_every_groups`` groups (many small epochs
        leave many small files). OPTIMIZE commits carry no txn id and change no rows."""
        every = self.spec.control.optimize_every_groups
        if not every or (group.group_id + 1) % every:
            return
        from sluice.sinks.delta import is_delta_table, optimize

        for sink in self.sinks:
            if is_delta_table(self.spark, sink.path):
                t0 = time.monotonic()
                metrics = optimize(self.spark, sink.path)
                log.info("pipeline %s: OPTIMIZE %s after group %s in %.1f s: %s", self.spec.name, sink.path,
                         group.group_id, time.monotonic() - t0, metrics["metrics"] if metrics else None)


class _QuietErrors:
    """Silence Spark's error logs (JVM and PySpark's query-context logger) for a while."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self.py_logger = logging.getLogger("DataFrameQueryContextLogger")
        self.saved: tuple[Any, int] | None = None

    def __enter__(self) -> None:
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


def _short_error(exc: BaseException) -> str:
    """The first line of an exception (Spark's carry a JVM stack trace), capped."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:1000] if text else ''}"


def pipeline_tables(spec: PipelineSpec) -> list[DeltaSink]:
    """Every table the pipeline writes, each once, as its writer (``_rejected``, the quarantine
    table under one app id, the sinks)."""
    return [rejected_sink(spec.name, spec.rejected_table), quarantine_sink(spec),
            *[DeltaSink(spec.name, s, spec.partitioning) for s in spec.sinks]]


def fence_tables(spark: SparkSession, spec: PipelineSpec, generation: int, token: int) -> None:
    """Record the lease token in every existing table of the pipeline (``DeltaSink.fence``)."""
    for table in pipeline_tables(spec):
        table.fence(spark, generation, token)


def quarantine_sink(spec: PipelineSpec) -> DeltaSink:
    """The quarantine table (one per pipeline, rows of every sink): one txn app id, one commit."""
    return DeltaSink(spec.name, SinkSpec.model_construct(name="_quarantine", mode="append",
                                                         path=spec.quarantine_table, keys=[], sums=[]))


def quarantine_rows(bad: DataFrame, spec: PipelineSpec, sink: str, epoch: Epoch) -> DataFrame:
    """Rows that failed validation, with where they came from and what they broke."""
    from pyspark.sql import functions as F

    columns = [c for c in bad.columns if c != "expectations"]
    return bad.select(
        F.lit(spec.name).alias("pipeline"), F.lit(sink).alias("sink"), F.lit(epoch.epoch_id).alias("epoch"),
        F.lit(epoch.generation).alias("generation"), F.lit(epoch.start).cast("long").alias("range_start"),
        F.lit(epoch.end).cast("long").alias("range_end"), F.col("expectations"),
        F.to_json(F.struct(*[F.col(f"`{c}`") for c in columns]), {"ignoreNullFields": "false"}).alias("record"))


def record_memory(timings: dict[str, float], memory: MemoryProbe) -> None:
    """Add what the group (or epoch) held in Spark's memory since ``memory.start`` to its timings."""
    reading = memory.read()
    if reading is not None:
        timings.update(memory_peak_mb=reading.peak_mb, memory_spilled_mb=reading.spilled_mb,
                       memory_budget_mb=reading.budget_mb)
