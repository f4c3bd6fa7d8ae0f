"""``SparkTables``: the Delta facade (``sluice.delta``) on real Delta Lake 4.4 through a
SparkSession.

Under Spark Connect (``sluice.spark.is_connect``) there is no JVM in this process and the Delta
Connect server plugin is not available for Spark 4.2 / Delta 4.4, so the py4j snapshot and the
``DeltaTable`` API are replaced by the ``_delta_log`` listing (local tables) and Delta's SQL:
``DESCRIBE HISTORY``, ``CREATE TABLE``, ``MERGE INTO``, ``OPTIMIZE``.

The fenced restore: Delta's own ``RESTORE`` carries no txn and checks no token. Classic Spark
commits the restore itself, through Delta's JVM API, as one ``OptimisticTransaction`` that reads
the table's recorded txn for the app id (refusing a newer token), reads the whole table, and
commits RESTORE's actions (the target version's files added back, the others removed, its
metadata) with a ``SetTransaction``: a concurrent fence of the same app id, or any concurrent
data change, fails it (Delta's conflict checker). Under Spark Connect the restore is an overwrite
with the target version's rows carrying ``txnAppId``/``txnVersion`` (Delta skips or refuses it
like any fenced write); it rewrites the table's files, where RESTORE re-adds the old ones.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from sluice import boundary
from sluice.delta import Restored, Tables, TableShape, Written, commit_of, upsert
from sluice.errors import FencedError, SluiceError
from sluice.model import TableCommit, Txn
from sluice.protocol.rules import txn_token
from sluice.sinks import layout
from sluice.spark import is_connect

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_TXN_CONFS = ("spark.databricks.delta.write.txnAppId", "spark.databricks.delta.write.txnVersion",
              "spark.databricks.delta.commitInfo.userMetadata")
_COMMIT_FILE = re.compile(r"^(\d{20})\.(json|checkpoint\b.*\.parquet)$")


class ConcurrentCommit(SluiceError):
    """A commit lost a race Delta's conflict checker does not resolve."""


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file:")


def local_versions(path: str) -> list[int]:
    """Versions named by the commit and checkpoint files of a local table's ``_delta_log``."""
    try:
        names = [e.name for e in (Path(path.removeprefix("file:")) / "_delta_log").iterdir()]
    except OSError:
        return []
    return sorted({int(m.group(1)) for m in map(_COMMIT_FILE.match, names) if m})


def table_ref(path: str) -> str:
    """The SQL name of the Delta table at ``path``: delta.`path` (backticks doubled)."""
    return "delta.`" + path.replace("`", "``") + "`"


def _commits(found: Iterable[tuple[int, dict[str, Any]]]) -> Iterator[TableCommit]:
    for version, info in found:
        yield commit_of(version, str(info.get("operation") or ""), info.get("userMetadata"),
                        info.get("operationParameters") or {})


def local_commit_info(path: str, version: int) -> dict[str, Any] | None:
    """The ``commitInfo`` of commit ``version`` of a local table (``None``: the file has none).
    Raises ``OSError`` (no such commit file: cleaned up, or a checkpoint-only version) or
    ``ValueError``/``KeyError`` (not a Delta commit file)."""
    with open(Path(path.removeprefix("file:")) / "_delta_log" / f"{version:020d}.json") as fh:
        return next((json.loads(line)["commitInfo"] for line in fh if '"commitInfo"' in line), None)


def local_lineage(path: str) -> Iterator[TableCommit]:
    """The retained commits of a table on the local file system, newest first, read from its
    ``_delta_log`` lazily, one commit file at a time (no Spark)."""

    def infos() -> Iterator[tuple[int, dict[str, Any]]]:
        for version in reversed(local_versions(path)):
            try:
                info = local_commit_info(path, version)
            except (OSError, ValueError, KeyError):
                return  # a checkpoint-only version: older commits are cleaned up
            if info is not None:
                yield version, info

    return _commits(infos())


class SparkTables(Tables):
    """Delta tables through ``spark`` (classic or Spark Connect), or a factory of it, called
    when a table is first touched (side files need no Spark)."""

    def __init__(self, spark: SparkSession | Callable[[], SparkSession]) -> None:
        self._spark = spark
        self._connect: bool | None = None

    @property
    def spark(self) -> SparkSession:
        if type(self._spark).__name__ != "SparkSession":  # a factory
            self._spark = self._spark()  # type: ignore[operator]
        return self._spark  # type: ignore[return-value]

    @property
    def connect(self) -> bool:
        if self._connect is None:
            self._connect = is_connect(self.spark)
        return self._connect

    # -- py4j handles ------------------------------------------------------------------------

    def _delta_log(self, path: str) -> Any:
        jvm = self.spark._jvm
        return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(self.spark._jsparkSession, path)

    def _snapshot(self, path: str) -> Any:
        jvm = self.spark._jvm
        return self._delta_log(path).update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty())

    def history(self, path: str, limit: int | None = None) -> DataFrame:
        """``DeltaTable.forPath(spark, path).history(limit)``, also under Spark Connect."""
        if not self.connect:
            from delta.tables import DeltaTable

            return DeltaTable.forPath(self.spark, path).history(limit)
        return self.spark.sql(f"DESCRIBE HISTORY {table_ref(path)}" + (f" LIMIT {int(limit)}" if limit else ""))

    # -- reads -------------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        if is_local(path) and not local_versions(path):  # no _delta_log: no table (and no JVM asked)
            return False
        if not self.connect:
            from delta.tables import DeltaTable

            return bool(DeltaTable.isDeltaTable(self.spark, path))
        if is_local(path):
            return bool(local_versions(path))
        return self.version(path) is not None

    def version(self, path: str) -> int | None:
        """The latest version (a listing of ``_delta_log`` under Connect, no Spark job)."""
        if self.connect:
            if is_local(path):
                versions = local_versions(path)
                return versions[-1] if versions else None
            from pyspark.errors import AnalysisException

            try:
                row = self.history(path, 1).select("version").first()
            except AnalysisException:  # not a Delta table (yet)
                return None
            return None if row is None else int(row["version"])
        version = self._snapshot(path).version()
        return None if version < 0 else int(version)

    def txn_version(self, path: str, app_id: str) -> int | None:
        """Under Spark Connect: the newest ``txn`` action of ``app_id`` in the retained commit
        files of a local table, else the newest sluice ``userMetadata`` naming ``app_id``."""
        if not self.connect:
            if not self.exists(path):
                return None
            version = self._snapshot(path).transactions().get(app_id)
            return int(version.get()) if version.isDefined() else None
        if is_local(path):
            log_dir = Path(path.removeprefix("file:")) / "_delta_log"
            for version in reversed(local_versions(path)):
                try:
                    with open(log_dir / f"{version:020d}.json") as fh:
                        for line in fh:
                            txn = json.loads(line).get("txn")
                            if txn and txn.get("appId") == app_id:
                                return int(txn["version"])
                except (OSError, ValueError):
                    continue
            return None
        if self.version(path) is None:
            return None
        for row in self.history(path).select("userMetadata").collect():
            try:
                meta = json.loads(row["userMetadata"] or "null")
            except ValueError:
                continue
            if meta and meta.get("app_id") == app_id:
                return int(meta["txn_version"]) if "txn_version" in meta else int(meta["epoch"])
        return None

    def lineage(self, path: str) -> Iterator[TableCommit]:
        """A local table's ``_delta_log`` is read directly and lazily, one commit file at a time."""
        if is_local(path):
            return local_lineage(path)
        found = [(int(row["version"]), {"operation": row["operation"], "userMetadata": row["userMetadata"],
                                        "operationParameters": row["operationParameters"] or {}})
                 for row in self.history(path).select("version", "operation", "operationParameters",
                                                      "userMetadata").collect()]
        return _commits(found)

    def commit_rows(self, path: str, version: int) -> int:
        """From Delta's operation metrics (no Spark job to count them first)."""
        metrics: dict[str, Any] = {}
        if is_local(path):
            try:
                with open(Path(path.removeprefix("file:")) / "_delta_log" / f"{version:020d}.json") as fh:
                    info = next((json.loads(line)["commitInfo"] for line in fh if '"commitInfo"' in line), {})
                metrics = info.get("operationMetrics") or {}
            except (OSError, ValueError, KeyError):
                metrics = {}
        else:
            from pyspark.sql import functions as F

            row = self.history(path).where(F.col("version") == version).select("operationMetrics").first()
            metrics = dict(row["operationMetrics"] or {}) if row is not None else {}
        for key in ("numSourceRows", "numOutputRows"):
            if metrics.get(key) not in (None, ""):
                return int(metrics[key])
        return 0

    def restorable(self, path: str, version: int) -> str | None:
        """Why ``version`` cannot be restored (log or data files vacuumed), or None."""
        try:
            files = self.spark.read.format("delta").option("versionAsOf", version).load(path).inputFiles()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            return f"table {path}: version {version} is no longer in the Delta log ({first})"
        missing = []
        for uri in files:
            parsed = urlparse(uri)
            if parsed.scheme in ("", "file") and not Path(unquote(parsed.path)).exists():
                missing.append(unquote(parsed.path))
        if missing:
            return (f"table {path}: version {version} was vacuumed: {len(missing)} of its {len(files)} data files "
                    f"are gone (e.g. {missing[0]})")
        return None

    def holds_no_files(self, path: str) -> bool:
        """Whether the table has no data files (a new table, or one restored to before its first
        write): no key of a MERGE into it can match."""
        if self.connect:
            return int(self.spark.sql(f"DESCRIBE DETAIL {table_ref(path)}").first()["numFiles"] or 0) == 0
        return int(self._snapshot(path).numOfFiles()) == 0

    # -- writes ------------------------------------------------------------------------------

    def create(self, path: str, like: Any, partition_by: Sequence[str] = (), metadata: str | None = None,
               shape: TableShape | None = None, txn: Txn | None = None) -> bool:
        if self.exists(path):
            return False
        if shape is not None and shape.mode == "upsert" and upsert.DELETED not in like.columns:
            from pyspark.sql import functions as F

            like = like.withColumn(upsert.DELETED, F.lit(False))  # the tombstone flag
            if shape.history == "scd2":
                seq = F.col(f"`{shape.sequence_by}`")
                like = (like.withColumn(upsert.VALID_FROM, seq).withColumn(upsert.VALID_TO, seq)
                        .withColumn(upsert.CURRENT, F.lit(False)))
        if txn is not None:
            return self._create_fenced(path, like, partition_by, metadata, txn)
        conf = self.spark.conf
        if metadata is not None:
            conf.set(_TXN_CONFS[2], metadata)
        try:
            if self.connect:
                partitioned = f" PARTITIONED BY ({', '.join(f'`{c}`' for c in partition_by)})" if partition_by else ""
                self.spark.sql(f"CREATE TABLE IF NOT EXISTS {table_ref(path)} ({like.schema.toDDL()}) "
                               f"USING delta{partitioned}")
                return True
            from delta.tables import DeltaTable

            builder = DeltaTable.createIfNotExists(self.spark).location(path).addColumns(like.schema)
            (builder.partitionedBy(*partition_by) if partition_by else builder).execute()
            return True
        except Exception:
            if not self.exists(path):  # created by a concurrent run: what IF NOT EXISTS means
                raise
            return False
        finally:
            if metadata is not None:
                conf.unset(_TXN_CONFS[2])

    def _create_fenced(self, path: str, like: Any, partition_by: Sequence[str], metadata: str | None,
                       txn: Txn) -> bool:
        """Create the table by an empty append carrying ``txn``: Delta records a txn only in a
        write (a ``CREATE TABLE`` takes none), so the table's version 0 holds the token and no
        separate fence commit, with its own snapshot state to compute, is needed. (Columns are
        nullable in a table created by a write.) A table a concurrent run created meanwhile gets
        the append as a fence; ours is then not its version 0."""
        writer = (like.limit(0).write.format("delta").mode("append").option("txnAppId", txn.app_id)
                  .option("txnVersion", txn.version))
        if metadata is not None:
            writer = writer.option("userMetadata", metadata)
        (writer.partitionBy(*partition_by) if partition_by else writer).save(path)
        return self._commit_metadata(path, 0) == metadata

    def _commit_metadata(self, path: str, version: int) -> str | None:
        """The ``userMetadata`` of commit ``version`` (a local table's log file, else the history)."""
        if is_local(path):
            try:
                info = local_commit_info(path, version)
            except (OSError, ValueError, KeyError):
                return None
            return (info or {}).get("userMetadata")
        row = self.history(path).where(f"version = {int(version)}").select("userMetadata").first()
        return None if row is None else row["userMetadata"]

    def warm(self, path: str) -> None:
        """Load the table's snapshot with its state (protocol, metadata, transactions: Spark jobs
        of their own, ~0.4 s per table), which Delta keeps for the next write of this session."""
        if not self.connect and self.exists(path):
            self._snapshot(path).transactions()

    def write(self, path: str, frame: Any, shape: TableShape, *, txn: Txn, metadata: str,
              rows: int | None = None) -> Written:
        """An append, an aggregate's MERGE adding the per-key sums, or an upsert (``_upsert``).
        Into a table without rows
        (new, or restored to before its first write) an aggregate's sums are appended: no key
        can match, so MERGE's join is saved."""
        df = frame
        n = int(self.spark.conf.get("spark.sql.shuffle.partitions") or 200)
        keys = None
        if shape.mode == "upsert":
            return self._upsert(path, df, shape, txn, metadata)
        if shape.mode == "append" or self.holds_no_files(path):
            # The layouts deal split keys' rows by a constant seed, not by the epoch: a seed is
            # written into the Java source Spark generates, and a new one made each write new classes.
            if shape.mode != "append":
                from pyspark.sql import functions as F

                schema = self.spark.read.format("delta").load(path).schema  # a sum may widen a type
                df, keys = layout.sums_by_key(df, list(shape.keys), list(shape.sums), shape.partitioning, n)
                df = df.select(*[F.col(f"`{f.name}`").cast(f.dataType).alias(f.name) for f in schema.fields])
            writer = df.write
            if shape.partition_by:
                laid, keys = layout.by_partition_columns(df, list(shape.partition_by), shape.partitioning, n)
                writer = laid.write.partitionBy(*shape.partition_by)
            (writer.format("delta").mode("append")
             .option("txnAppId", txn.app_id).option("txnVersion", txn.version).option("userMetadata", metadata)
             .save(path))
        else:
            source, keys = layout.sums_by_key(df, list(shape.keys), list(shape.sums), shape.partitioning, n)
            self._merge_add(path, source, shape, txn, metadata)
        return Written(keys)

    def _upsert(self, path: str, frame: DataFrame, shape: TableShape, txn: Txn, metadata: str) -> Written:
        """An upsert (``sluice.delta.upsert``): the group's changes reduced to the greatest per
        key, then MERGEd, replacing a held row only by a greater one, in one commit with the txn.
        Into a table without rows the reduced changes are appended (no key can match)."""
        table = self.spark.read.format("delta").load(path)
        schema = table.schema
        if shape.history == "scd2":  # the touched keys' versions, recomputed: MERGE on (keys, valid_from)
            source = upsert.spark_history(frame, shape, table)
        else:
            source = upsert.spark_changes(frame, shape, schema)
        if self.holds_no_files(path):
            (source.write.format("delta").mode("append").option("txnAppId", txn.app_id)
             .option("txnVersion", txn.version).option("userMetadata", metadata).save(path))
        elif shape.history == "scd2":
            on = upsert.merge_clauses(schema, shape)[0] + f" AND t.`{upsert.VALID_FROM}` <=> s.`{upsert.VALID_FROM}`"
            self._merge(path, source, txn, metadata, on, update=None)
        else:
            on, greater = upsert.merge_clauses(schema, shape)
            self._merge(path, source, txn, metadata, on, update=None, matched_if=greater)
        return Written()

    def _merge_add(self, path: str, source: DataFrame, shape: TableShape, txn: Txn, metadata: str) -> None:
        """MERGE the per-key sums (unique keys, as MERGE requires), adding ``sums`` on matched
        keys."""
        cond = " AND ".join(f"t.`{k}` = s.`{k}`" for k in shape.keys)
        update = {f"`{c}`": f"t.`{c}` + s.`{c}`" for c in shape.sums}
        self._merge(path, source, txn, metadata, cond, update=update)

    def _merge(self, path: str, source: DataFrame, txn: Txn, metadata: str, cond: str,
               update: dict[str, str] | None, matched_if: str | None = None) -> None:
        """MERGE ``source`` (unique keys) on ``cond``: matched rows get ``update`` (``None``:
        every column from the source), where ``matched_if`` holds; unmatched ones are inserted.
        MERGE takes no writer options, so the txn identifiers go through the session confs
        Delta reads for DML, set only for this one statement."""
        conf = self.spark.conf
        view = f"sluice_merge_{uuid.uuid4().hex}"  # Spark Connect: MERGE INTO ... USING a temp view
        try:
            conf.set(_TXN_CONFS[0], txn.app_id)
            conf.set(_TXN_CONFS[1], str(txn.version))
            conf.set(_TXN_CONFS[2], metadata)
            if self.connect:
                source.createOrReplaceTempView(view)
                sets = "*" if update is None else ", ".join(f"t.{col} = {expr}" for col, expr in update.items())
                when = f" AND {matched_if}" if matched_if else ""
                self.spark.sql(f"MERGE INTO {table_ref(path)} t USING {view} s ON {cond} "
                               f"WHEN MATCHED{when} THEN UPDATE SET {sets} WHEN NOT MATCHED THEN INSERT *")
            else:
                from delta.tables import DeltaTable

                merge = DeltaTable.forPath(self.spark, path).alias("t").merge(source.alias("s"), cond)
                merge = (merge.whenMatchedUpdateAll(condition=matched_if) if update is None
                         else merge.whenMatchedUpdate(condition=matched_if, set=update))
                merge.whenNotMatchedInsertAll().execute()
        finally:
            for key in _TXN_CONFS:
                conf.unset(key)
            if self.connect:
                self.spark.catalog.dropTempView(view)

    def fence(self, path: str, txn: Txn, metadata: str) -> None:
        (self.spark.read.format("delta").load(path).where("false").write.format("delta").mode("append")
         .option("txnAppId", txn.app_id).option("txnVersion", txn.version).option("userMetadata", metadata)
         .save(path))

    def restore(self, path: str, version: int, *, txn: Txn, metadata: str) -> Restored:
        if self.connect:
            return self._restore_by_overwrite(path, version, txn, metadata)
        return self._restore_in_one_transaction(path, version, txn, metadata)

    def _restore_in_one_transaction(self, path: str, version: int, txn: Txn, metadata: str) -> Restored:
        jvm = self.spark._jvm
        delta = jvm.org.apache.spark.sql.delta
        dlog = self._delta_log(path)
        otx = dlog.startTransaction()
        snapshot = otx.snapshot()
        recorded = int(otx.txnVersion(txn.app_id))  # registers the read: a concurrent same-app commit conflicts
        recorded_or_none = None if recorded < 0 else recorded
        self.refuse_restore(path, version, recorded_or_none, txn)
        none = jvm.scala.Option.empty()
        target = dlog.getSnapshotAt(version, none, none, False)
        otx.readWholeTable()  # any concurrent data change conflicts with the restore
        boundary.step("delta.w.restore:commit")  # (a step of the conformance test: a commit may race it)

        def files(snap: Any) -> dict[tuple[str, str], dict[str, Any]]:
            found = {}
            for text in snap.allFiles().toJSON().collectAsList():
                add = json.loads(text)
                found[(add["path"], json.dumps(add.get("deletionVector"), sort_keys=True))] = add
            return found

        live, wanted = files(snapshot), files(target)
        now = int(time.time() * 1000)
        actions = [json.dumps({"add": dict(add, dataChange=True)}) for key, add in wanted.items() if key not in live]
        for key, add in live.items():
            if key in wanted:
                continue
            remove = {"path": add["path"], "deletionTimestamp": now, "dataChange": True,
                      "extendedFileMetadata": True, "partitionValues": add.get("partitionValues") or {},
                      "size": add.get("size")}
            for optional in ("tags", "deletionVector", "baseRowId", "defaultRowCommitVersion", "stats"):
                if add.get(optional) is not None:
                    remove[optional] = add[optional]
            actions.append(json.dumps({"remove": remove}))
        kept = txn.version if recorded_or_none is None or recorded < txn.version else recorded
        actions.append(json.dumps({"txn": {"appId": txn.app_id, "version": kept, "lastUpdated": now}}))
        if target.metadata().schemaString() != snapshot.metadata().schemaString():
            otx.updateMetadata(target.metadata(), False)
        seq = jvm.scala.jdk.javaapi.CollectionConverters.asScala(
            jvm.java.util.ArrayList([delta.actions.Action.fromJson(a) for a in actions])).toSeq()
        restore_op = getattr(delta, "DeltaOperations$Restore")(jvm.scala.Some(jvm.java.lang.Long.valueOf(str(version))),
                                                                none)
        conf = self.spark.conf
        conf.set(_TXN_CONFS[2], metadata)
        try:
            committed = int(otx.commit(seq, restore_op))
        except Exception as exc:
            if "Concurrent" in str(exc) or "ProtocolChanged" in str(exc) or "MetadataChanged" in str(exc):
                raise ConcurrentCommit(f"table {path}: the restore to version {version} lost a race: "
                                       f"{str(exc).splitlines()[0][:300]}") from None
            raise
        finally:
            conf.unset(_TXN_CONFS[2])
        removed = sum(1 for a in actions if a.startswith('{"remove"'))
        return Restored(version, committed, {"num_restored_files": len(actions) - removed - 1,
                                             "num_removed_files": removed})

    def _restore_by_overwrite(self, path: str, version: int, txn: Txn, metadata: str) -> Restored:
        recorded = self.txn_version(path, txn.app_id)
        self.refuse_restore(path, version, recorded, txn)
        before = self.version(path)
        meta = dict(json.loads(metadata), restore_to=version)
        kept = txn.version if recorded is None or recorded < txn.version else recorded + 1
        (self.spark.read.format("delta").option("versionAsOf", version).load(path)
         .write.format("delta").mode("overwrite").option("txnAppId", txn.app_id).option("txnVersion", kept)
         .option("userMetadata", json.dumps(meta, sort_keys=True)).save(path))
        after = self.version(path)
        if after == before:
            recorded = self.txn_version(path, txn.app_id)
            raise FencedError(f"table {path}: the restore to version {version} was refused by Delta: token "
                              f"{txn_token(recorded or 0)} is recorded ({txn.app_id})")
        return Restored(version, after, {})

    def optimize(self, path: str) -> Any:
        if self.connect:
            return self.spark.sql(f"OPTIMIZE {table_ref(path)}").first()
        from delta.tables import DeltaTable

        return DeltaTable.forPath(self.spark, path).optimize().executeCompaction().first()

    # -- side files (local file system) ----------------------------------------------------------

    def put_file(self, path: str, relative: str, text: str) -> None:
        LocalFiles().put_file(path, relative, text)

    def list_files(self, path: str, folder: str) -> list[tuple[str, str]]:
        return LocalFiles().list_files(path, folder)


class LocalFiles:
    """Side files next to a table on the local file system (or a mount): what ``SparkTables``
    keeps beside real Delta tables, usable without Spark."""

    def put_file(self, path: str, relative: str, text: str) -> None:
        target = Path(str(path).removeprefix("file:")) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name("." + target.name)
        tmp.write_text(text)
        tmp.replace(target)

    def list_files(self, path: str, folder: str) -> list[tuple[str, str]]:
        where = Path(str(path).removeprefix("file:")) / folder
        found = []
        for file in sorted(where.glob("*.json")):
            try:
                found.append((file.name, file.read_text()))
            except OSError as exc:
                raise SluiceError(f"{file} cannot be read: {exc}") from None
        return found
