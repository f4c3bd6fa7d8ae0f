"""Deduplication across epochs (``dedup`` in the spec): a valid record whose key was kept
before, with a time within the horizon of its own, is dropped before the transform.

The rule, in source order (epoch, then ``_file``, then ``_line``; across groups, the groups'
order): each key has at most one **seen time**, the time of its last kept record. A record of
a key with a seen time ``s`` is dropped when ``|t - s| <= within`` (``within`` null: always);
otherwise it is kept and ``t`` becomes the key's seen time. The horizon is measured on the
records' own time, so the outcome is a function of the records and their order alone: a rerun
or a recompute after a rollback drops exactly the same records.

The seen keys are a Delta table of the pipeline (``spec.dedup_table``, ``_dedup``): the keys,
``_seen_at`` (the time field's type) and ``_epoch`` (of the last kept record), one row per key,
MERGEd by the keys in the group's commit as an upsert table whose ``sequence_by`` is ``_epoch``
(a group's rows always come from later epochs than the table's). A group reads it at the
version it had when the group started (after any reconcile's RESTORE), so a rerun after a crash
and a recompute after a rollback see the state as of the group's start.

``dedup_rows`` is the pure rule (the tests' reference); ``spark_dedup`` the same on Spark: the
group's valid records grouped by key, each key's records sorted in source order and folded
(``aggregate``) from the table's seen time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sluice.spec import PipelineSpec, SinkSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

DEDUP = "_dedup"
SEEN_AT = "_seen_at"
EPOCH = "_epoch"


def dedup_sink(spec: PipelineSpec) -> SinkSpec:
    """The seen-keys table, as an upsert table keyed by the dedup keys, newest epoch wins."""
    assert spec.dedup is not None and spec.dedup_table is not None
    return SinkSpec.model_construct(name=DEDUP, mode="upsert", path=spec.dedup_table, keys=list(spec.dedup.keys),
                                    sums=[], partition_by=[], expectations=None, sequence_by=EPOCH,
                                    delete_when=None, history="none")


# -- pure: the rule ---------------------------------------------------------------------------------


def dedup_rows(rows: Iterable[dict[str, Any]], seen: dict[tuple[Any, ...], Any], keys: Sequence[str],
               within: float | None, time: str | None) -> tuple[list[dict[str, Any]], dict[tuple[Any, ...], Any]]:
    """``rows`` (valid records, in source order) after the rule, from the seen times ``seen``
    (key tuple -> time; a key without time: ``None``): the kept rows, and the seen times of the
    keys they changed. Times are numbers (seconds) here."""
    state = dict(seen)
    changed: dict[tuple[Any, ...], Any] = {}
    kept = []
    for row in rows:
        key = tuple(row[k] for k in keys)
        t = row[time] if time else None
        if key in state and (within is None or abs(t - state[key]) <= within):
            continue
        state[key] = changed[key] = t
        kept.append(row)
    return kept, changed


# -- Spark -----------------------------------------------------------------------------------------


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def time_type(spec: PipelineSpec) -> str:
    dedup = spec.dedup
    assert dedup is not None
    return spec.source.schema_[dedup.time].lower() if dedup.time else "long"


def _as_number(column: Column, typ: str) -> Column:
    """A time as a long the horizon is compared on: microseconds of a timestamp, else seconds."""
    from pyspark.sql import functions as F

    return F.unix_micros(column) if typ == "timestamp" else column.cast("long")


def _from_number(column: Column, typ: str) -> Column:
    from pyspark.sql import functions as F

    return F.timestamp_micros(column) if typ == "timestamp" else column.cast("int" if typ in ("int", "integer")
                                                                              else "long")


def state_schema(spec: PipelineSpec) -> str:
    """The seen-keys table's columns (before the upsert's own ``_deleted``), as a DDL string."""
    dedup = spec.dedup
    assert dedup is not None
    keys = ", ".join(f"{_q(k)} {spec.source.schema_[k]}" for k in dedup.keys)
    typ = time_type(spec)
    return f"{keys}, {SEEN_AT} {'int' if typ == 'integer' else typ}, {EPOCH} int"


def empty_state(spark: SparkSession, spec: PipelineSpec) -> DataFrame:
    return spark.createDataFrame([], state_schema(spec))


def spark_dedup(valid: DataFrame, state: DataFrame, spec: PipelineSpec, carry: Sequence[str]) -> DataFrame:
    """One row per key of the group's ``valid`` records (which carry ``_epoch``, ``_file``,
    ``_line`` and the ``carry`` columns): the keys, and ``_d``, a struct of ``seen`` (the key's
    seen time after the group, as a number), ``kept`` (the kept records, in source order, each a
    struct ``e`` (epoch), ``f``, ``l``, ``t``, ``r`` (the ``carry`` columns)). ``state``: the
    seen-keys table as of the group's start. Persist it: ``kept_records`` and ``new_state``
    both read it."""
    from pyspark.sql import functions as F

    dedup = spec.dedup
    assert dedup is not None
    typ = time_type(spec)
    keys = list(dedup.keys)
    t = _as_number(F.col(_q(dedup.time)), typ) if dedup.time else F.lit(None).cast("long")
    item = F.struct(F.col("_epoch").cast("int").alias("e"), F.col("_file").alias("f"),
                    F.col("_line").cast("long").alias("l"), t.alias("t"),
                    F.struct(*[F.col(_q(c)) for c in carry]).alias("r"))
    per_key = (valid.select(*[F.col(_q(k)) for k in keys], item.alias("_x"))
               .groupBy(*[F.col(_q(k)) for k in keys]).agg(F.array_sort(F.collect_list("_x")).alias("_xs")))
    held = state.select(*[F.col(_q(k)) for k in keys], _as_number(F.col(SEEN_AT), typ).alias("_seen"),
                        F.lit(True).alias("_known"))
    joined = per_key.join(held, on=keys, how="left")
    unit = 1_000_000 if typ == "timestamp" else 1
    within = None if dedup.within is None else F.lit(dedup.within * unit)

    def step(acc: Column, x: Column) -> Column:
        duplicate = acc["present"] if within is None else acc["present"] & (F.abs(x["t"] - acc["seen"]) <= within)
        taken = F.struct(x["t"].alias("seen"), F.lit(True).alias("present"),
                         F.concat(acc["kept"], F.array(x)).alias("kept"))
        return F.when(duplicate, acc).otherwise(taken)

    start = F.struct(F.col("_seen").alias("seen"), F.coalesce(F.col("_known"), F.lit(False)).alias("present"),
                     F.filter(F.col("_xs"), lambda _: F.lit(False)).alias("kept"))
    return joined.select(*[F.col(_q(k)) for k in keys], F.aggregate(F.col("_xs"), start, step).alias("_d"))


def kept_records(folded: DataFrame, carry: Sequence[str]) -> DataFrame:
    """The kept records: the ``carry`` columns."""
    from pyspark.sql import functions as F

    return folded.select(F.explode("_d.kept").alias("_x")).select(*[F.col("_x.r")[c].alias(c) for c in carry])


def new_state(folded: DataFrame, spec: PipelineSpec, epochs: Sequence[int] | None = None) -> DataFrame:
    """The seen-keys rows the group changes (keys with a kept record): the MERGE's source. With
    ``epochs``, as after those epochs only (a group cut short by a failed validation): the fold
    runs in epoch order, so the kept records of earlier epochs do not depend on later ones."""
    from pyspark.sql import functions as F

    dedup = spec.dedup
    assert dedup is not None
    typ = time_type(spec)
    kept = F.col("_d.kept")
    if epochs is not None:
        kept = F.filter(kept, lambda x: x["e"].isin(list(epochs)))
    last = F.element_at(F.col("_k"), -1)
    seen = _from_number(last["t"], typ) if dedup.time else F.lit(None).cast("long")
    return folded.select(*[F.col(_q(k)) for k in dedup.keys], kept.alias("_k")).where(F.size("_k") > 0).select(
        *[F.col(_q(k)) for k in dedup.keys], seen.alias(SEEN_AT), last["e"].alias(EPOCH))


def kept_per_epoch(folded: DataFrame) -> dict[int, int]:
    """How many records each epoch keeps (one job over the persisted fold)."""
    from pyspark.sql import functions as F

    rows = (folded.select(F.explode("_d.kept.e").alias("e")).groupBy("e").count().collect())
    return {int(r["e"]): int(r["count"]) for r in rows}
