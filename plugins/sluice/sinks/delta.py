"""Idempotent Delta sinks: ``append`` and ``aggregate`` (merge-add of counts and sums).

Every epoch is written in one Delta transaction tagged ``txnAppId = sluice:<pipeline>:<sink>:
g<generation>``, ``txnVersion = epoch`` and ``userMetadata`` = JSON ``{pipeline, epoch,
generation, range}``. Delta itself skips a replay whose txnVersion it has already recorded,
and the sink checks first so that a replay can report the version that holds the epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice import protocol
from sluice.spec import SinkSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_TXN_CONFS = ("spark.databricks.delta.write.txnAppId", "spark.databricks.delta.write.txnVersion",
              "spark.databricks.delta.commitInfo.userMetadata")


@dataclass(frozen=True)
class SinkCommit:
    sink: str
    version: int | None  # Delta version holding the epoch; None when there was nothing to write
    rows: int
    replayed: bool  # True when the table already held the epoch and nothing was written


def _snapshot(spark: SparkSession, path: str) -> Any:  # a py4j handle on Delta's Snapshot
    jvm = spark._jvm
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
    return log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty())


def committed_txn_version(spark: SparkSession, path: str, app_id: str) -> int | None:
    """The last txnVersion Delta recorded for ``app_id`` in the table at ``path``."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, path):
        return None
    version = _snapshot(spark, path).transactions().get(app_id)
    return int(version.get()) if version.isDefined() else None


def _commit_metadata(path: str, version: int) -> dict[str, Any] | None:
    """userMetadata of commit ``version`` of a table on the local file system, read straight
    from its ``_delta_log`` JSON (no Spark job); None if unreadable or absent."""
    log_file = Path(path) / "_delta_log" / f"{version:020d}.json"
    try:
        with open(log_file) as fh:
            for line in fh:
                info = json.loads(line).get("commitInfo")
                if info is not None:
                    return json.loads(info["userMetadata"]) if info.get("userMetadata") else None
    except (OSError, ValueError):
        return None
    return None


def find_epoch_version(spark: SparkSession, path: str, app_id: str, epoch_id: int,
                       limit: int | None = None) -> int | None:
    """The Delta version whose userMetadata records ``epoch_id`` for ``app_id`` (searching the
    newest ``limit`` commits, or the whole retained history)."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    def matches(meta: dict[str, Any] | None) -> bool:
        return bool(meta) and meta.get("app_id") == app_id and meta.get("epoch") == epoch_id

    if "://" not in path or path.startswith("file:"):  # local table: read the newest commits directly
        latest = int(_snapshot(spark, path).version())
        local = path.removeprefix("file:")
        for version in range(latest, max(-1, latest - (limit or latest + 1)), -1):
            if matches(_commit_metadata(local, version)):
                return version
        return None  # history() would read the same commit files
    hist = DeltaTable.forPath(spark, path).history(limit).where(F.col("userMetadata").isNotNull())
    for row in hist.select("version", "userMetadata").collect():
        try:
            meta = json.loads(row["userMetadata"])
        except (TypeError, ValueError):
            continue
        if matches(meta):
            return int(row["version"])
    return None


class DeltaSink:
    def __init__(self, pipeline: str, spec: SinkSpec) -> None:
        self.pipeline = pipeline
        self.spec = spec
        self.path = spec.path

    def app_id(self, generation: int) -> str:
        return protocol.sink_app_id(self.pipeline, self.spec.name, generation)

    def metadata(self, epoch_id: int, generation: int, start: int, end: int) -> str:
        return json.dumps({"pipeline": self.pipeline, "sink": self.spec.name, "epoch": epoch_id,
                           "generation": generation, "range": [start, end],
                           "app_id": self.app_id(generation)}, sort_keys=True)

    def write(self, spark: SparkSession, df: DataFrame, *, epoch_id: int, generation: int,
              start: int, end: int, skip_empty: bool = False) -> SinkCommit:
        """Write one epoch exactly once; a replay changes nothing and reports the old version."""
        app_id = self.app_id(generation)
        if protocol.already_written(committed_txn_version(spark, self.path, app_id), epoch_id):
            version = find_epoch_version(spark, self.path, app_id, epoch_id)
            return SinkCommit(self.spec.name, version, df.count(), replayed=True)
        rows = df.count()
        if rows == 0 and skip_empty:
            return SinkCommit(self.spec.name, None, 0, replayed=False)
        self._ensure_table(spark, df)
        meta = self.metadata(epoch_id, generation, start, end)
        if self.spec.mode == "append":
            (df.write.format("delta").mode("append")
             .option("txnAppId", app_id).option("txnVersion", epoch_id).option("userMetadata", meta)
             .save(self.path))
        else:
            self._merge_add(spark, df, app_id, epoch_id, meta)
        # This run holds the pipeline's lease, so the newest commits are its own.
        version = find_epoch_version(spark, self.path, app_id, epoch_id, limit=10)
        return SinkCommit(self.spec.name, version, rows, replayed=False)

    def _ensure_table(self, spark: SparkSession, df: DataFrame) -> None:
        from delta.tables import DeltaTable

        if DeltaTable.isDeltaTable(spark, self.path):
            return
        DeltaTable.createIfNotExists(spark).location(self.path).addColumns(df.schema).execute()

    def _merge_add(self, spark: SparkSession, df: DataFrame, app_id: str, epoch_id: int, meta: str) -> None:
        """MERGE the epoch's partial aggregates into the table, adding ``sums`` on matched keys.

        MERGE takes no writer options, so the txn identifiers go through the session confs
        Delta reads for DML, set only for this one statement.
        """
        from delta.tables import DeltaTable

        # Keys must be unique in the source of a MERGE: pre-aggregate the epoch's rows.
        from pyspark.sql import functions as F

        source = df.groupBy(*self.spec.keys).agg(*[F.sum(c).alias(c) for c in self.spec.sums])
        cond = " AND ".join(f"t.`{k}` = s.`{k}`" for k in self.spec.keys)
        update = {f"`{c}`": f"t.`{c}` + s.`{c}`" for c in self.spec.sums}
        conf = spark.conf
        try:
            conf.set(_TXN_CONFS[0], app_id)
            conf.set(_TXN_CONFS[1], str(epoch_id))
            conf.set(_TXN_CONFS[2], meta)
            (DeltaTable.forPath(spark, self.path).alias("t").merge(source.alias("s"), cond)
             .whenMatchedUpdate(set=update).whenNotMatchedInsertAll().execute())
        finally:
            for key in _TXN_CONFS:
                conf.unset(key)


def rejected_sink(pipeline: str, path: str) -> DeltaSink:
    """The rejected-records table: malformed input with its epoch, file and line."""
    return DeltaSink(pipeline, SinkSpec.model_construct(name="_rejected", mode="append", path=path,
                                                        keys=[], sums=[]))


def describe(commit: SinkCommit) -> dict[str, Any]:
    return {"sink": commit.sink, "version": commit.version, "rows": commit.rows, "replayed": commit.replayed}
