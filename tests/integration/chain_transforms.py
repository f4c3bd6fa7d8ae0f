"""A downstream pipeline's transform for the chained-pipeline test: views per ad."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def views_per_ad(events: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    return events.groupBy("ad_id").agg(F.count(F.lit(1)).cast("long").alias("views"))
