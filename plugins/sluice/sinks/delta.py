"""Idempotent, fenced Delta sinks: ``append`` and ``aggregate`` (merge-add of counts and sums).

A group's epochs (or one epoch, under ``commit: epoch``) are written in one Delta transaction
per table, tagged ``txnAppId = sluice:<pipeline>:<table>:g<generation>``, ``txnVersion =
token << 32 | (last epoch + 1)`` (``sluice.protocol.txn_version``: the writer's lease token
above the epoch) and ``userMetadata`` = JSON ``{pipeline, sink, generation, token, epoch (the
last), epochs [[id, start, end], ...], range}``. Delta itself skips a write whose txnVersion
is not above the one it recorded: a replay of the same run, and any write of an older token
once a newer owner's token is in the table (``DeltaSink.fence``), concurrent or not.

Under Spark Connect (``sluice.spark.is_connect``) there is no JVM in this process and the
Delta Connect server plugin is not available for Spark 4.2 / Delta 4.4, so the py4j snapshot
and the ``DeltaTable`` API are replaced by the ``_delta_log`` listing (local tables) and Delta's
SQL: ``DESCRIBE HISTORY``, ``CREATE TABLE``, ``MERGE INTO``, ``RESTORE``, ``OPTIMIZE``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice import protocol
from sluice.errors import FencedError
from sluice.sinks import layout
from sluice.spark import is_connect
from sluice.spec import SinkSpec

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from pyspark.sql import DataFrame, SparkSession

_TXN_CONFS = ("spark.databricks.delta.write.txnAppId", "spark.databricks.delta.write.txnVersion",
              "spark.databricks.delta.commitInfo.userMetadata")


@dataclass(frozen=True)
class EpochRange:
    """One epoch of a commit: its id and source range."""

    epoch_id: int
    start: int
    end: int


@dataclass(frozen=True)
class SinkCommit:
    sink: str
    version: int | None  # Delta version holding the epoch; None when there was nothing to write
    rows: int
    replayed: bool  # True when the table already held the epoch and nothing was written
    keys: dict[str, Any] | None = None  # the epoch's key statistics under ``partitioning: prompt``


def _snapshot(spark: SparkSession, path: str) -> Any:  # a py4j handle on Delta's Snapshot
    jvm = spark._jvm
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
    return log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty())


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file:")


def _table_ref(path: str) -> str:
    """The SQL name of the Delta table at ``path``: delta.`path` (backticks doubled)."""
    return "delta.`" + path.replace("`", "``") + "`"


_COMMIT_FILE = re.compile(r"^(\d{20})\.(json|checkpoint\b.*\.parquet)$")


def _local_versions(path: str) -> list[int]:
    """Versions named by the commit and checkpoint files of a local table's ``_delta_log``."""
    try:
        names = [e.name for e in (Path(path.removeprefix("file:")) / "_delta_log").iterdir()]
    except OSError:
        return []
    return sorted({int(m.group(1)) for m in map(_COMMIT_FILE.match, names) if m})


def holds_no_files(spark: SparkSession, path: str) -> bool:
    """Whether the Delta table at ``path`` has no data files (a new table, or one restored to
    before its first write): no key of a MERGE into it can match."""
    if is_connect(spark):
        return int(spark.sql(f"DESCRIBE DETAIL {_table_ref(path)}").first()["numFiles"] or 0) == 0
    return int(_snapshot(spark, path).numOfFiles()) == 0


def history(spark: SparkSession, path: str, limit: int | None = None) -> DataFrame:
    """``DeltaTable.forPath(spark, path).history(limit)``, also under Spark Connect."""
    if not is_connect(spark):
        from delta.tables import DeltaTable

        return DeltaTable.forPath(spark, path).history(limit)
    return spark.sql(f"DESCRIBE HISTORY {_table_ref(path)}" + (f" LIMIT {int(limit)}" if limit else ""))


def is_delta_table(spark: SparkSession, path: str) -> bool:
    """``DeltaTable.isDeltaTable``, also under Spark Connect."""
    if not is_connect(spark):
        from delta.tables import DeltaTable

        return bool(DeltaTable.isDeltaTable(spark, path))
    if _is_local(path):
        return bool(_local_versions(path))
    return table_version(spark, path) is not None


def table_version(spark: SparkSession, path: str) -> int | None:
    """The table's latest version (a listing of ``_delta_log``, no Spark job), or None when
    there is no Delta table at ``path``."""
    if is_connect(spark):
        if _is_local(path):
            versions = _local_versions(path)
            return versions[-1] if versions else None
        from pyspark.errors import AnalysisException

        try:
            row = history(spark, path, 1).select("version").first()
        except AnalysisException:  # not a Delta table (yet)
            return None
        return None if row is None else int(row["version"])
    version = _snapshot(spark, path).version()
    return None if version < 0 else int(version)


def committed_txn_version(spark: SparkSession, path: str, app_id: str) -> int | None:
    """The last txnVersion Delta recorded for ``app_id`` in the table at ``path``.

    Under Spark Connect: the newest ``txn`` action of ``app_id`` in the retained commit files
    of a local table, else the newest sluice ``userMetadata`` naming ``app_id`` (every sluice
    commit records its epoch, which is its txnVersion, there)."""
    if not is_connect(spark):
        from delta.tables import DeltaTable

        if not DeltaTable.isDeltaTable(spark, path):
            return None
        version = _snapshot(spark, path).transactions().get(app_id)
        return int(version.get()) if version.isDefined() else None
    if _is_local(path):
        log_dir = Path(path.removeprefix("file:")) / "_delta_log"
        for version in reversed(_local_versions(path)):
            try:
                with open(log_dir / f"{version:020d}.json") as fh:
                    for line in fh:
                        txn = json.loads(line).get("txn")
                        if txn and txn.get("appId") == app_id:
                            return int(txn["version"])
            except (OSError, ValueError):
                continue
        return None
    if table_version(spark, path) is None:
        return None
    for row in history(spark, path).select("userMetadata").collect():
        try:
            meta = json.loads(row["userMetadata"] or "null")
        except ValueError:
            continue
        if meta and meta.get("app_id") == app_id:
            return int(meta["txn_version"]) if "txn_version" in meta else int(meta["epoch"])
    return None


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


def commit_rows(spark: SparkSession, path: str, version: int) -> int:
    """Rows commit ``version`` wrote, from Delta's operation metrics (an append's output rows, a
    MERGE's source rows): no Spark job to count them first."""
    metrics: dict[str, Any] = {}
    if _is_local(path):
        try:
            with open(Path(path.removeprefix("file:")) / "_delta_log" / f"{version:020d}.json") as fh:
                info = next((json.loads(line)["commitInfo"] for line in fh if '"commitInfo"' in line), {})
            metrics = info.get("operationMetrics") or {}
        except (OSError, ValueError, KeyError):
            metrics = {}
    else:
        from pyspark.sql import functions as F

        row = history(spark, path).where(F.col("version") == version).select("operationMetrics").first()
        metrics = dict(row["operationMetrics"] or {}) if row is not None else {}
    for key in ("numSourceRows", "numOutputRows"):
        if metrics.get(key) not in (None, ""):
            return int(metrics[key])
    return 0


def find_epoch_version(spark: SparkSession, path: str, app_id: str, epoch_id: int,
                       limit: int | None = None) -> int | None:
    """The Delta version whose userMetadata records ``epoch_id`` for ``app_id`` (searching the
    newest ``limit`` commits, or the whole retained history)."""
    from pyspark.sql import functions as F

    def matches(meta: dict[str, Any] | None) -> bool:
        return bool(meta) and meta.get("app_id") == app_id and meta.get("epoch") == epoch_id

    if _is_local(path):  # local table: read the newest commits directly
        latest = table_version(spark, path)
        if latest is None:
            return None
        local = path.removeprefix("file:")
        for version in range(latest, max(-1, latest - (limit or latest + 1)), -1):
            if matches(_commit_metadata(local, version)):
                return version
        return None  # history() would read the same commit files
    hist = history(spark, path, limit).where(F.col("userMetadata").isNotNull())
    for row in hist.select("version", "userMetadata").collect():
        try:
            meta = json.loads(row["userMetadata"])
        except (TypeError, ValueError):
            continue
        if matches(meta):
            return int(row["version"])
    return None


class DeltaSink:
    def __init__(self, pipeline: str, spec: SinkSpec, partitioning: str = "hash") -> None:
        self.pipeline = pipeline
        self.spec = spec
        self.path = spec.path
        self.partitioning = partitioning  # see sluice.sinks.layout

    def app_id(self, generation: int) -> str:
        return protocol.sink_app_id(self.pipeline, self.spec.name, generation)

    def metadata(self, epochs: list[EpochRange], generation: int, token: int) -> str:
        last = epochs[-1].epoch_id if epochs else -1
        return json.dumps({"pipeline": self.pipeline, "sink": self.spec.name, "generation": generation,
                           "token": token, "epoch": last, "epochs": [[e.epoch_id, e.start, e.end] for e in epochs],
                           "range": [epochs[0].start, epochs[-1].end] if epochs else None,
                           "app_id": self.app_id(generation),
                           "txn_version": protocol.txn_version(token, last)}, sort_keys=True)

    def write(self, spark: SparkSession, df: DataFrame, *, epochs: list[EpochRange], generation: int,
              token: int, skip_empty: bool = False, rows: int | None = None) -> SinkCommit:
        """Write ``epochs`` (contiguous, in order) in one Delta transaction, exactly once; a
        replay changes nothing and reports the old version. ``rows``: the frame's row count
        when the caller knows it already (saves a Spark job).

        Delta itself skips a commit whose txnVersion is not above the one it recorded for the
        app id, so the write is simply attempted: if the table's version did not move, either
        this run wrote the epochs already (its version is looked up in the history) or a newer
        owner's fence is in the table (``FencedError``). (Asking the snapshot for the app's txn
        version first costs a state reconstruction, a Spark job of ~1 s per write, measured.)
        """
        app_id = self.app_id(generation)
        last = epochs[-1].epoch_id
        if rows == 0 and skip_empty:  # the same ranges always yield the same rows: nothing to replay
            return SinkCommit(self.spec.name, None, 0, replayed=False)
        before = table_version(spark, self.path)
        if before is None:  # created empty first: a rerun can always RESTORE to the version before a commit
            self._ensure_table(spark, df)
            before = table_version(spark, self.path)
        meta = self.metadata(epochs, generation, token)
        version_tag = protocol.txn_version(token, last)
        n = int(spark.conf.get("spark.sql.shuffle.partitions") or 200)
        keys = None
        if self.spec.mode == "append" or holds_no_files(spark, self.path):
            # An append, or an aggregate's write into a table without rows (new, made ready
            # ahead by ``prepare``, or restored to before its first write): no key can match,
            # so the per-key sums are appended, saving MERGE's join.
            if self.spec.mode != "append":
                from pyspark.sql import functions as F

                schema = spark.read.format("delta").load(self.path).schema  # a sum may widen a type
                df, keys = layout.sums_by_key(df, self.spec.keys, self.spec.sums, self.partitioning, n, last)
                df = df.select(*[F.col(f"`{f.name}`").cast(f.dataType).alias(f.name) for f in schema.fields])
            writer = df.write
            if self.spec.partition_by:
                laid, keys = layout.by_partition_columns(df, self.spec.partition_by, self.partitioning, n, last)
                writer = laid.write.partitionBy(*self.spec.partition_by)
            (writer.format("delta").mode("append")
             .option("txnAppId", app_id).option("txnVersion", version_tag).option("userMetadata", meta)
             .save(self.path))
        else:
            source, keys = layout.sums_by_key(df, self.spec.keys, self.spec.sums, self.partitioning, n, last)
            self._merge_add(spark, source, app_id, version_tag, meta)
        after = table_version(spark, self.path)
        if after is not None and before is not None and after > before:
            # This run holds the pipeline's lease and its fence is in the table: the new commits are its own.
            version = find_epoch_version(spark, self.path, app_id, last, limit=after - before)
            if version is not None:
                rows = commit_rows(spark, self.path, version) if rows is None else rows
                return SinkCommit(self.spec.name, version, rows, replayed=False, keys=keys)
        recorded = committed_txn_version(spark, self.path, app_id)
        if protocol.fenced_out(recorded, token):
            raise FencedError(
                f"pipeline {self.pipeline!r} table {self.path}: the commit of epochs {epochs[0].epoch_id}..{last} "
                f"(lease token {token}) was refused by Delta: a newer owner's token "
                f"{protocol.txn_token(recorded)} is in the table ({app_id}); this run must stop")
        version = find_epoch_version(spark, self.path, app_id, last)
        if version is None:
            raise RuntimeError(f"pipeline {self.pipeline!r} sink {self.spec.name!r}: Delta recorded no commit "
                               f"for epoch {last} ({app_id}) in {self.path}")
        rows = commit_rows(spark, self.path, version) if rows is None else rows
        return SinkCommit(self.spec.name, version, rows, replayed=True, keys=keys)

    def fence(self, spark: SparkSession, generation: int, token: int) -> int | None:
        """Record ``token`` in the table under the generation's app id (an empty commit): from
        then on Delta skips or refuses every write of an older token. Returns the fence's
        version, or ``None`` when there is no table yet (nothing to protect)."""
        if not is_delta_table(spark, self.path):
            return None
        app_id = self.app_id(generation)
        version_tag = protocol.txn_version(token, -1)
        recorded = committed_txn_version(spark, self.path, app_id)
        if recorded is not None and recorded >= version_tag:
            if protocol.fenced_out(recorded, token):
                raise FencedError(f"pipeline {self.pipeline!r} table {self.path}: a newer owner's token "
                                  f"{protocol.txn_token(recorded)} is in the table; lease token {token} must stop")
            return table_version(spark, self.path)  # this token's fence (or a commit) is there already
        meta = json.dumps({"pipeline": self.pipeline, "sink": self.spec.name, "generation": generation,
                           "token": token, "fence": True, "epochs": [], "app_id": app_id,
                           "txn_version": version_tag}, sort_keys=True)
        (spark.read.format("delta").load(self.path).where("false").write.format("delta").mode("append")
         .option("txnAppId", app_id).option("txnVersion", version_tag).option("userMetadata", meta)
         .save(self.path))
        recorded = committed_txn_version(spark, self.path, app_id)
        if protocol.fenced_out(recorded, token):
            raise FencedError(f"pipeline {self.pipeline!r} table {self.path}: a newer owner's token "
                              f"{protocol.txn_token(recorded)} is in the table; lease token {token} must stop")
        return table_version(spark, self.path)

    def prepare(self, spark: SparkSession, df: DataFrame) -> None:
        """Make the table ready for a commit of frames like ``df`` (its schema only; nothing is
        computed): create it empty if it is missing, and load its snapshot with its state
        (protocol, metadata, transactions: Spark jobs of their own, ~0.4 s per table), which
        Delta keeps for the next write of this session. ``runner`` calls it in the background
        while the group is read, so a commit does not wait for it."""
        self._ensure_table(spark, df)
        if not is_connect(spark):
            _snapshot(spark, self.path).transactions()

    def _ensure_table(self, spark: SparkSession, df: DataFrame) -> None:
        if is_delta_table(spark, self.path):
            return
        columns = self.spec.partition_by
        if is_connect(spark):
            partitioned = f" PARTITIONED BY ({', '.join(f'`{c}`' for c in columns)})" if columns else ""
            spark.sql(f"CREATE TABLE IF NOT EXISTS {_table_ref(self.path)} ({df.schema.toDDL()}) "
                      f"USING delta{partitioned}")
            return
        from delta.tables import DeltaTable

        builder = DeltaTable.createIfNotExists(spark).location(self.path).addColumns(df.schema)
        (builder.partitionedBy(*columns) if columns else builder).execute()

    def _merge_add(self, spark: SparkSession, source: DataFrame, app_id: str, version_tag: int, meta: str) -> None:
        """MERGE the epoch's per-key sums (unique keys, as MERGE requires) into the table,
        adding ``sums`` on matched keys.

        MERGE takes no writer options, so the txn identifiers go through the session confs
        Delta reads for DML, set only for this one statement.
        """
        from delta.tables import DeltaTable

        cond = " AND ".join(f"t.`{k}` = s.`{k}`" for k in self.spec.keys)
        update = {f"`{c}`": f"t.`{c}` + s.`{c}`" for c in self.spec.sums}
        conf = spark.conf
        view = f"sluice_merge_{uuid.uuid4().hex}"  # Spark Connect: MERGE INTO ... USING a temp view
        try:
            conf.set(_TXN_CONFS[0], app_id)
            conf.set(_TXN_CONFS[1], str(version_tag))
            conf.set(_TXN_CONFS[2], meta)
            if is_connect(spark):
                source.createOrReplaceTempView(view)
                sets = ", ".join(f"t.{col} = {expr}" for col, expr in update.items())
                spark.sql(f"MERGE INTO {_table_ref(self.path)} t USING {view} s ON {cond} "
                          f"WHEN MATCHED THEN UPDATE SET {sets} WHEN NOT MATCHED THEN INSERT *")
            else:
                (DeltaTable.forPath(spark, self.path).alias("t").merge(source.alias("s"), cond)
                 .whenMatchedUpdate(set=update).whenNotMatchedInsertAll().execute())
        finally:
            for key in _TXN_CONFS:
                conf.unset(key)
            if is_connect(spark):
                spark.catalog.dropTempView(view)


def restore(spark: SparkSession, path: str, version: int) -> dict[str, Any] | None:
    """RESTORE the table at ``path`` to ``version``; Delta's metrics row as a dict."""
    if is_connect(spark):
        row = spark.sql(f"RESTORE TABLE {_table_ref(path)} TO VERSION AS OF {int(version)}").first()
    else:
        from delta.tables import DeltaTable

        row = DeltaTable.forPath(spark, path).restoreToVersion(version).first()
    return row.asDict(recursive=True) if row is not None else None


def restore_conflict(spark: SparkSession, path: str, pipeline: str, version: int) -> str | None:
    """Why ``pipeline`` must not RESTORE the table at ``path`` to ``version``: other pipelines
    committed to it since (their rows would be undone too); ``None`` when none did."""
    foreign = protocol.foreign_commits(commit_lineage(spark, path), pipeline, version)
    if not foreign:
        return None
    writers = "; ".join(f"pipeline {name!r} (versions {', '.join(map(str, versions))})"
                        for name, versions in sorted(foreign.items()))
    return (f"table {path} also holds rows of {writers} written after version {version}: a RESTORE by "
            f"pipeline {pipeline!r} would remove them too. Give each pipeline its own tables (`rejected_path`, "
            f"`quarantine_path`, the sinks' `path`; the defaults are per pipeline)")


def optimize(spark: SparkSession, path: str) -> Any:
    """Compact the table at ``path`` (OPTIMIZE); the row with its ``metrics``."""
    if is_connect(spark):
        return spark.sql(f"OPTIMIZE {_table_ref(path)}").first()
    from delta.tables import DeltaTable

    return DeltaTable.forPath(spark, path).optimize().executeCompaction().first()


def rejected_sink(pipeline: str, path: str) -> DeltaSink:
    """The rejected-records table: malformed input with its epoch, file and line."""
    return DeltaSink(pipeline, SinkSpec.model_construct(name="_rejected", mode="append", path=path,
                                                        keys=[], sums=[]))


def describe(commit: SinkCommit) -> dict[str, Any]:
    return {"sink": commit.sink, "version": commit.version, "rows": commit.rows, "replayed": commit.replayed}


def commit_lineage(spark: SparkSession, path: str) -> Iterator[protocol.TableCommit]:
    """The table's retained commits, newest first, as reconcile reads them (operation, RESTORE
    target, sluice userMetadata, token). A local table's ``_delta_log`` is read directly and
    lazily, one commit file at a time."""
    if _is_local(path):
        log_dir = Path(path.removeprefix("file:")) / "_delta_log"

        def infos() -> Iterator[tuple[int, dict[str, Any]]]:
            for version in reversed(_local_versions(path)):
                try:
                    with open(log_dir / f"{version:020d}.json") as fh:
                        info = next((json.loads(line)["commitInfo"] for line in fh if '"commitInfo"' in line), None)
                except (OSError, ValueError, KeyError):
                    return  # a checkpoint-only version: older commits are cleaned up
                if info is not None:
                    yield version, info
        found: Iterable[tuple[int, dict[str, Any]]] = infos()
    else:
        found = [(int(row["version"]), {"operation": row["operation"], "userMetadata": row["userMetadata"],
                                        "operationParameters": row["operationParameters"] or {}})
                 for row in history(spark, path).select("version", "operation", "operationParameters",
                                                        "userMetadata").collect()]
    for version, info in found:
        try:
            meta = json.loads(info.get("userMetadata") or "null")
        except ValueError:
            meta = None
        meta = meta if isinstance(meta, dict) else {}
        params = info.get("operationParameters") or {}
        restored = params.get("version") if info.get("operation") == "RESTORE" else None
        epochs = tuple(int(e[0]) for e in meta.get("epochs") or []) or (
            (int(meta["epoch"]),) if "epoch" in meta and "epochs" not in meta else ())
        yield protocol.TableCommit(
            version, str(info.get("operation") or ""), int(restored) if restored not in (None, "") else None,
            meta.get("app_id"), meta.get("generation"), epochs, int(meta.get("token") or 0), meta.get("pipeline"))
