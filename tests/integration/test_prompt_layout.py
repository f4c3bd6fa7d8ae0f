"""Prompt's partitioning on real Spark and Delta: the hash predictor is Spark's, the placement is
exact and balanced, no row is lost or doubled, and pipelines with ``partitioning: prompt`` land
exactly the oracle's rows."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sluice import protocol
from sluice.control.prompt import hash_partition_sizes, imbalance, spark_hash
from sluice.errors import SpecError
from sluice.protocol.run import run_once
from sluice.sinks import layout
from sluice.store import EpochStore
from tests.integration.test_concurrency import table_views, view_oracle
from tests.pipelines import assert_matches_oracle, land, landed, make_pipeline


def zipf_keys(n_rows: int, n_keys: int, z: float, seed: int) -> list[str]:
    """Keys ``k0``.. drawn with P(rank r) proportional to r^-z (finite support, any z >= 0)."""
    weights = np.arange(1, n_keys + 1, dtype=float) ** -z
    ranks = np.random.default_rng(seed).choice(n_keys, size=n_rows, p=weights / weights.sum())
    return [f"k{r}" for r in ranks]


def partition_sizes(df) -> list[int]:
    from pyspark.sql import functions as F

    n = df.rdd.getNumPartitions()
    got = dict(df.groupBy(F.spark_partition_id().alias("p")).count().collect())
    return [got.get(p, 0) for p in range(n)]


def test_the_hash_predictor_is_sparks(spark):
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    values = [(i, i * 7_919_000_003, s) for i, s in enumerate(["", "a", "ab", "abc", "abcd", "campaign-17",
                                                                "Zürich", "日本語のキー", "x" * 37])]
    values += [(-5, -(2**62), "k0"), (2**31 - 1, 2**63 - 1, "k123")]
    schema = StructType([StructField("i", IntegerType()), StructField("l", LongType()),
                         StructField("s", StringType())])
    df = spark.createDataFrame(values, schema)
    got = df.select(F.hash("i"), F.hash("l"), F.hash("s")).collect()
    for (i, lng, s), row in zip(values, got, strict=True):
        assert (spark_hash(i, "int"), spark_hash(lng, "long"), spark_hash(s)) == tuple(row), (i, lng, s)
    # repartition(n, col) sends each block's token to that block's partition.
    for n in (1, 3, 8, 16):
        tokens = layout.block_tokens(n)
        placed = spark.createDataFrame([(t,) for t in tokens], "t int").repartition(n, "t")
        where = dict(placed.select("t", F.spark_partition_id()).collect())
        assert [where[t] for t in tokens] == list(range(n))


@pytest.mark.parametrize("z", [1.0, 2.0])
def test_prompt_places_rows_exactly_and_balanced(spark, z):
    from pyspark.sql import functions as F

    n, keys = 8, zipf_keys(40_000, 300, z, seed=int(z * 10))
    df = spark.createDataFrame([(k, i) for i, k in enumerate(keys)], "k string, v long").repartition(3)
    placed, stats = layout.place(df, ["k"], n, seed=7)
    placed = placed.persist()
    try:
        # Nothing lost, nothing doubled.
        assert sorted(tuple(r) for r in placed.select("k", "v").collect()) == sorted(
            (k, i) for i, k in enumerate(keys))
        frequencies = Counter(keys)
        assert stats["keys"] == len(frequencies) and stats["tuples"] == len(keys)
        assert stats["top"][0] == [[frequencies.most_common(1)[0][0]], frequencies.most_common(1)[0][1]]
        # Exact placement: each row sits in the partition of its planned block; an unsplit key in one.
        rows = placed.select("k", layout.BLOCK, F.spark_partition_id().alias("p")).collect()
        assert all(r["p"] == r[layout.BLOCK] for r in rows)
        homes: dict[str, set[int]] = {}
        for r in rows:
            homes.setdefault(r["k"], set()).add(r["p"])
        assert sum(len(h) > 1 for h in homes.values()) <= stats["split_keys"]
        sizes = partition_sizes(placed)
        # The plan is balanced to the tuple; a split key's rows are dealt by a random draw, so
        # the measured sizes are within a few standard deviations of the quotas.
        assert imbalance(sizes) <= 1.1, sizes
        # Spark's own hash partitioning of the same keys, measured and predicted.
        hashed = partition_sizes(df.repartition(n, "k"))
        assert hashed == hash_partition_sizes(frequencies, n, lambda k, m: spark_hash(k) % m)
        assert stats["imbalance_hash"] == pytest.approx(imbalance(hashed), abs=1e-3)
        assert imbalance(sizes) < imbalance(hashed)
    finally:
        placed.unpersist()


def test_two_phase_sums_equal_a_plain_group_by(spark):
    from pyspark.sql import functions as F

    keys = zipf_keys(20_000, 50, 1.5, seed=3)
    rng = np.random.default_rng(4)
    amounts = rng.integers(1, 100, len(keys))
    data = [(k, f"w{i % 3}", int(x)) for i, (k, x) in enumerate(zip(keys, amounts, strict=True))]
    df = spark.createDataFrame(data, "k string, w string, x long")
    summed, stats = layout.sums_by_key(df, ["k", "w"], ["x"], "prompt", 4, seed=1)
    assert stats["split_keys"] >= 1  # the heavy keys were split, so their fragments had to merge
    expected = Counter()
    for k, w, x in data:
        expected[(k, w)] += x
    got = {(r["k"], r["w"]): r["x"] for r in summed.collect()}
    assert got == dict(expected)
    assert summed.groupBy("k", "w").count().where(F.col("count") > 1).count() == 0


def test_placement_follows_the_plan_for_timestamp_keys(spark):
    """YSB's keys are (campaign, window start): the plan join must match timestamps exactly
    (a key it missed would silently fall back to Spark's hash)."""
    from datetime import datetime, timedelta

    from sluice.control.prompt import plan_blocks

    keys = zipf_keys(5_000, 40, 1.2, seed=9)
    start = datetime(2026, 1, 1)
    data = [(k, start + timedelta(seconds=10 * (i % 7)), 1) for i, k in enumerate(keys)]
    df = spark.createDataFrame(data, "campaign string, window_start timestamp, views long")
    placed, _ = layout.place(df, ["campaign", "window_start"], 4, seed=2)
    plan = plan_blocks(layout.key_frequencies(df, ["campaign", "window_start"]), 4)
    for r in placed.select("campaign", "window_start", layout.BLOCK).distinct().collect():
        key = (r["campaign"], r["window_start"])
        assert r[layout.BLOCK] in {b for b, _ in plan.fragments[key]}, key


def test_pipelines_with_prompt_partitioning_land_the_oracle(spark):
    log = EpochStore()
    # Aggregate-merge (YSB) with two-phase sums.
    agg = make_pipeline("prompt_agg", partitioning="prompt", **{"control.epoch_files": 2})
    land(agg, files=4, rate_per_file=400, malformed_fraction=0.02)
    run_once(agg, log, spark)
    assert [e.state for e in log.epochs(agg.name)] == [protocol.PUBLISHED] * 2
    assert_matches_oracle(spark, agg, log)
    # One commit per group: the group's last epoch holds the key statistics of the commit.
    stats = [e.rows["keys"]["campaign_views"] for e in log.epochs(agg.name) if "keys" in e.rows]
    assert len(stats) == 1, stats
    assert all(s["tuples"] > 0 and s["imbalance_prompt"] <= s["imbalance_hash"] + 1e-9 for s in stats), stats
    # Append to a Delta table partitioned by ad_type, rows placed by Prompt.
    app = make_pipeline("prompt_append", base="ysb_clean", partitioning="prompt", **{
        "control.epoch_files": 2,
        "sinks": [{"name": "view_events", "mode": "append", "partition_by": ["ad_type"],
                   "path": "${SLUICE_DATA_DIR}/prompt_append/tables/view_events"}]})
    land(app, files=4, rate_per_file=300)
    run_once(app, log, spark)
    assert [e.state for e in log.epochs(app.name)] == [protocol.PUBLISHED] * 2
    assert table_views(spark, app.sinks[0].path) == view_oracle(landed(app))
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{app.sinks[0].path}`").first()
    assert list(detail["partitionColumns"]) == ["ad_type"]
    assert "keys" in log.epochs(app.name)[-1].rows


def test_prompt_needs_a_keyed_sink():
    folder = Path(os.environ["SLUICE_PIPELINES_DIR"])
    try:
        with pytest.raises(SpecError, match="partitioning: prompt balances a keyed write"):
            make_pipeline("prompt_unkeyed", base="ysb_clean", partitioning="prompt")
        with pytest.raises(SpecError, match="`partition_by` is for append sinks"):
            make_pipeline("prompt_bad_sink", **{"sinks": [{
                "name": "c", "mode": "aggregate", "path": "/tmp/x", "keys": ["campaign_id"], "sums": ["views"],
                "partition_by": ["campaign_id"]}]})
    finally:  # the DAG factory reads every spec in the folder
        for name in ("prompt_unkeyed", "prompt_bad_sink"):
            (folder / f"{name}.yaml").unlink(missing_ok=True)
