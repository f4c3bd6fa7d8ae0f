"""Where an epoch's rows go before a keyed write: Spark's hash partitioning, or Prompt's plan.

A keyed write is an aggregate sink's per-key sums (before its MERGE) or an append sink's Delta
``partition_by`` columns (one writer per key, so a table partition gets few files). With
``partitioning: hash`` Spark places each key by ``pmod(murmur3(key), P)``: a hot key lands whole
on one task. With ``partitioning: prompt`` (Abdelhamid et al., SIGMOD'20):

1. an exact pre-pass counts the epoch's keys (the run-once analogue of Prompt's buffering,
   §4.1: the range is bounded and already cached);
2. :func:`sluice.control.prompt.plan_blocks` (Alg. 2) splits the keys above the mean frequency
   and deals the rest into P blocks of equal size and cardinality;
3. every row gets its block through a broadcast join with the plan (a split key's rows are
   dealt to its fragments in proportion to their quotas by a seeded uniform draw), and the rows
   are placed **exactly** there: ``repartition(P, col)`` hashes the column, so the column holds,
   for block b, an integer whose Spark hash falls in partition b (:func:`block_tokens`);
4. an aggregate is computed in two phases: per (block, key) inside each partition, then per
   key over the few partial rows, which merges the fragments of split keys.

The key statistics of each write are returned (and kept in the epoch log as ``rows["keys"]`` of its
last epoch).
Spark's own partial aggregation already removes skew from sums and counts before their
shuffle; Prompt pays off where rows themselves must move by key, as in a partitioned write.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from sluice.control.prompt import BlockPlan, hash_imbalance, plan_blocks, spark_hash_partition

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

BLOCK = "_sluice_block"  # the planned block of a row
_TOKEN = "_sluice_token"  # an int that Spark's hash partitioning sends to that block
_DRAW = "_sluice_draw"  # uniform in [0, 1): which fragment of a split key a row joins
TOP_KEYS = 20  # the heaviest keys kept per epoch in the epoch log


@cache
def block_tokens(n: int) -> tuple[int, ...]:
    """``tokens[b]``: the smallest non-negative int that ``repartition(n, col)`` sends to
    partition b (Spark hashes an int column with Murmur3, seed 42, then ``pmod n``)."""
    tokens: dict[int, int] = {}
    value = 0
    while len(tokens) < n:
        tokens.setdefault(spark_hash_partition(value, n, "int"), value)
        value += 1
    return tuple(tokens[b] for b in range(n))


def key_frequencies(df: DataFrame, keys: list[str]) -> dict[tuple[Any, ...], int]:
    """Exact count of every key (a tuple of the ``keys`` columns' values) in ``df``."""
    return {tuple(row[:len(keys)]): int(row[-1]) for row in df.groupBy(*keys).count().collect()}


def key_stats(frequencies: dict[tuple[Any, ...], int], plan: BlockPlan, n: int) -> dict[str, Any]:
    """What the epoch log keeps of an epoch's keys: distinct keys, tuples, the heaviest keys,
    and the imbalance (max/mean tuples per partition) of hash partitioning and of the plan."""
    top = sorted(frequencies.items(), key=lambda kv: -kv[1])[:TOP_KEYS]
    return {
        "keys": len(frequencies), "tuples": sum(frequencies.values()), "partitions": n,
        "top": [[[v if isinstance(v, str | int | float | None) else str(v) for v in k], c] for k, c in top],
        "imbalance_hash": round(hash_imbalance(frequencies, n, _spark_hash_of_key), 4) if frequencies else 1.0,
        "imbalance_prompt": round(plan.imbalance, 4) if plan.total else 1.0,
        "split_keys": len(plan.split_keys), "ksr": round(plan.ksr, 4),
    }


def _spark_hash_of_key(key: tuple[Any, ...], n: int) -> int:
    """Spark's partition of a one-column string key (or bigint key); other keys (several
    columns, other types) are estimated with Python's hash, which spreads them alike."""
    if len(key) == 1 and isinstance(key[0], str | int) and not isinstance(key[0], bool):
        return spark_hash_partition(key[0], n)
    return abs(hash(key)) % n  # an estimate: Python's hash, not Spark's


def place(df: DataFrame, keys: list[str], n: int, seed: int = 0) -> tuple[DataFrame, dict[str, Any]]:
    """Prompt's placement of ``df`` over ``n`` partitions by ``keys``: the frame, repartitioned
    so that partition b holds exactly block b of the plan, with a ``_sluice_block`` column;
    and the epoch's key statistics. ``seed`` makes the split keys' deal reproducible."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType, IntegerType, StructField, StructType

    frequencies = key_frequencies(df, keys)
    plan = plan_blocks(frequencies, n)
    rows = []  # (key..., lo, hi, block): a row whose draw is in [lo, hi) goes to the block
    for key, fragments in plan.fragments.items():
        total, running = sum(c for _, c in fragments), 0
        for i, (block, count) in enumerate(fragments):
            low = running / total
            running += count
            rows.append((*key, low, 1.0 if i == len(fragments) - 1 else running / total, block))
    key_fields = [df.schema[k] for k in keys]
    schema = StructType([*(StructField(f"_plan_{f.name}", f.dataType) for f in key_fields),
                         StructField("_lo", DoubleType()), StructField("_hi", DoubleType()),
                         StructField(BLOCK, IntegerType())])
    plan_df = df.sparkSession.createDataFrame(rows, schema)
    drawn = df.withColumn(_DRAW, F.rand(seed))
    cond: Column = F.lit(True)
    for k in keys:
        cond = cond & drawn[k].eqNullSafe(plan_df[f"_plan_{k}"])
    cond = cond & (drawn[_DRAW] >= plan_df["_lo"]) & (drawn[_DRAW] < plan_df["_hi"])
    tokens = F.array(*[F.lit(t) for t in block_tokens(n)])
    placed = (drawn.join(F.broadcast(plan_df), cond, "left")
              # A key missing from the plan (a transform that is not deterministic) keeps Spark's hash.
              .withColumn(BLOCK, F.coalesce(F.col(BLOCK), F.pmod(F.hash(*keys), F.lit(n))))
              .withColumn(_TOKEN, F.element_at(tokens, F.col(BLOCK) + 1))
              .repartition(n, _TOKEN)
              .drop(_DRAW, _TOKEN, "_lo", "_hi", *(f"_plan_{k}" for k in keys)))
    return placed, key_stats(frequencies, plan, n)


def sums_by_key(df: DataFrame, keys: list[str], sums: list[str], partitioning: str,
                n: int, seed: int = 0) -> tuple[DataFrame, dict[str, Any] | None]:
    """Per-key sums of ``df`` (the source of an aggregate sink's MERGE). ``prompt``: placed by
    the plan, summed per (block, key) without another shuffle, then per key (split keys' partial
    sums merge here); ``hash``: Spark's partial and final aggregation."""
    from pyspark.sql import functions as F

    if partitioning != "prompt":
        return df.groupBy(*keys).agg(*[F.sum(c).alias(c) for c in sums]), None
    placed, stats = place(df, keys, n, seed)
    partial = placed.groupBy(BLOCK, *keys).agg(*[F.sum(c).alias(c) for c in sums])
    return partial.groupBy(*keys).agg(*[F.sum(c).alias(c) for c in sums]), stats


def by_partition_columns(df: DataFrame, columns: list[str], partitioning: str, n: int,
                         seed: int = 0) -> tuple[DataFrame, dict[str, Any] | None]:
    """``df`` laid out for a Delta write partitioned by ``columns``: ``hash`` gives each table
    partition one writer task (``repartition(n, *columns)``); ``prompt`` balances the tasks and
    splits only the hot keys' rows over a few tasks (files)."""
    if partitioning != "prompt":
        return df.repartition(n, *columns), None
    placed, stats = place(df, columns, n, seed)
    return placed.drop(BLOCK), stats
