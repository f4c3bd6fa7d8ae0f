"""A deliberately broken release of the YSB transform, for the rollback story (Structured
Streaming §7.2): it loses the campaign of every ad whose id starts with 0-7 (about half)."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from transforms.ysb import campaign_views


def campaign_views_null_campaign(events: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    lost = F.substring("ad_id", 1, 1).isin(*"01234567")
    ads = refs["ads"].withColumn("campaign_id", F.when(lost, F.lit(None)).otherwise(F.col("campaign_id")))
    return campaign_views(events, {**refs, "ads": ads})
