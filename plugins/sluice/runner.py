"""Run one group's epochs in one SparkSession: read exactly each range, transform, write the
sinks exactly once, record the commit (steps 3 and 4 of the protocol), then publish.

This is the Spark side of sluice; ``jobs/run_group.py`` is its command line, used by
``spark-submit`` and in-process alike.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice import faults, protocol
from sluice.errors import FencedError, SluiceError
from sluice.paths import project_root
from sluice.sinks.delta import DeltaSink, SinkCommit, describe, rejected_sink
from sluice.sources import FileSource
from sluice.spec import PipelineSpec
from sluice.store import Epoch, EpochLog, Group, Lease

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("sluice.runner")

REJECTED_COLUMNS = ("pipeline", "epoch", "generation", "file", "line", "reason", "record")


def load_transform(name: str) -> Callable[..., Any]:
    """Import ``module.function`` from ``jobs/transforms``."""
    module_name, _, func = name.partition(".")
    jobs = str(project_root() / "jobs")
    if jobs not in sys.path:
        sys.path.insert(0, jobs)
    module = importlib.import_module(f"transforms.{module_name}")
    try:
        return getattr(module, func)
    except AttributeError:
        raise SluiceError(f"transform {name!r}: jobs/transforms/{module_name}.py has no {func}()") from None


def load_reference(spark: SparkSession, spec: PipelineSpec) -> dict[str, DataFrame]:
    from pyspark.sql import functions as F

    refs = {}
    for name, path in spec.reference.items():
        if not Path(path).is_file():
            raise SluiceError(f"pipeline {spec.name!r}: reference table {name!r} file {path} does not exist")
        refs[name] = F.broadcast(spark.read.option("header", True).csv(path).cache())
    return refs


def split_rejected(records: DataFrame, spec: PipelineSpec, epoch: Epoch) -> tuple[DataFrame, DataFrame]:
    """Separate malformed records (unparseable, missing a required field, failing a check).

    Rejected rows keep the pipeline, epoch, generation, file, line, reason and the raw record;
    nothing about them is non-deterministic, so a replayed epoch writes the same rows.
    """
    from pyspark.sql import functions as F

    fields = list(spec.source.schema_)
    rules = [(F.col("_corrupt_record").isNotNull(), F.lit("malformed record: not parseable as " + spec.source.format))]
    rules += [(F.col(f"`{f}`").isNull(), F.lit(f"missing required field {f!r}")) for f in spec.source.required]
    rules += [(~F.coalesce(F.expr(expr), F.lit(False)), F.lit(f"failed check {name!r}: {expr}"))
              for name, expr in spec.source.checks.items()]
    reason = F.coalesce(*[F.when(cond, msg) for cond, msg in rules])
    tagged = records.withColumn("_reason", reason)
    valid = tagged.where(F.col("_reason").isNull()).select(*[F.col(f"`{f}`") for f in fields])
    raw = F.coalesce(F.col("_corrupt_record"), F.to_json(F.struct(*[F.col(f"`{f}`") for f in fields])))
    rejected = tagged.where(F.col("_reason").isNotNull()).select(
        F.lit(spec.name).alias("pipeline"), F.lit(epoch.epoch_id).alias("epoch"),
        F.lit(epoch.generation).alias("generation"), F.col("_file").alias("file"),
        F.col("_line").cast("long").alias("line"), F.col("_reason").alias("reason"), raw.alias("record"))
    return valid, rejected


class GroupRunner:
    """Processes the epochs of one planned group, in order, under a lease."""

    def __init__(self, spec: PipelineSpec, epoch_log: EpochLog, spark: SparkSession) -> None:
        self.spec = spec
        self.log = epoch_log
        self.spark = spark
        self.source = FileSource(spec, epoch_log)
        self.sinks = [DeltaSink(spec.name, s) for s in spec.sinks]
        self.rejected = rejected_sink(spec.name, spec.rejected_table)
        self.transform = load_transform(spec.transform)
        self._refs: dict[str, DataFrame] | None = None

    @property
    def refs(self) -> dict[str, DataFrame]:
        if self._refs is None:
            self._refs = load_reference(self.spark, self.spec)
        return self._refs

    def run(self, lease: Lease, group: Group) -> Group:
        faults.maybe_fail("after_plan")
        for epoch in group.epochs:
            if epoch.state in (protocol.COMMITTED, protocol.PUBLISHED):
                continue
            self.log.renew_lease(lease, self.spec.control.lease_ttl_s)
            try:
                self.run_epoch(lease, epoch)
            except FencedError:
                raise
            except Exception as exc:
                self.log.mark_failed(lease, epoch, f"{type(exc).__name__}: {exc}")
                raise
        return self.log.group(self.spec.name, group.group_id)

    def run_epoch(self, lease: Lease, epoch: Epoch) -> dict[str, Any]:
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        self.log.start_attempt(lease, epoch)
        records = self.source.read(self.spark, epoch.start, epoch.end).persist()
        try:
            valid, rejected = split_rejected(records, self.spec, epoch)
            outputs = self.transform(valid, self.refs)
            if not isinstance(outputs, dict):
                outputs = {self.sinks[0].spec.name: outputs}
            n_input = records.count()
            timings["read_s"] = round(time.monotonic() - t0, 3)
            commits: list[SinkCommit] = []
            writes = [(self.rejected, rejected, True)] + [(s, outputs[s.spec.name], False) for s in self.sinks]
            for i, (sink, frame, skip_empty) in enumerate(writes):
                if i > 0 and any(c.version is not None for c in commits):
                    faults.maybe_fail("mid_write", epoch.epoch_id)
                t_sink = time.monotonic()
                commits.append(sink.write(self.spark, frame, epoch_id=epoch.epoch_id,
                                          generation=epoch.generation, start=epoch.start, end=epoch.end,
                                          skip_empty=skip_empty))
                timings[f"write_{sink.spec.name}_s"] = round(time.monotonic() - t_sink, 3)
        finally:
            records.unpersist()
        faults.maybe_fail("after_delta_commit", epoch.epoch_id)
        rejected_rows = commits[0].rows
        timings["epoch_s"] = round(time.monotonic() - t0, 3)
        rows = {"input": n_input, "rejected": rejected_rows,
                "output": sum(c.rows for c in commits[1:])}
        self.log.mark_committed(lease, epoch, delta_versions={c.sink: c.version for c in commits},
                                rows=rows, timings=timings)
        result = {"epoch": epoch.epoch_id, "range": [epoch.start, epoch.end], "rows": rows,
                  "commits": [describe(c) for c in commits], "timings": timings}
        log.info("pipeline %s epoch %s committed: %s", self.spec.name, epoch.epoch_id, json.dumps(result))
        return result


def write_epoch_records(spec: PipelineSpec, group: Group) -> list[str]:
    """Human-readable JSON records of published epochs next to each table
    (``<table>/_sluice/epochs/``): Delta ignores ``_``-prefixed folders, and the store can be
    rebuilt from them."""
    written = []
    for sink in spec.sinks:
        folder = Path(sink.path) / "_sluice" / "epochs"
        folder.mkdir(parents=True, exist_ok=True)
        for epoch in group.epochs:
            path = folder / f"{epoch.epoch_id:09d}-g{epoch.generation}.json"
            record = dict(epoch.as_record(), sink=sink.name, version=epoch.delta_versions.get(sink.name))
            tmp = path.with_name("." + path.name)
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
            tmp.replace(path)
            written.append(str(path))
    return written


def publish(spec: PipelineSpec, epoch_log: EpochLog, lease: Lease, group_id: int) -> Group:
    """Checkpoint: the group's committed epochs become ``published``, with JSON records."""
    group = epoch_log.finish_group(lease, group_id, protocol.PUBLISHED)
    write_epoch_records(spec, group)
    return group
