"""The Yahoo Streaming Benchmark query, and its stateless cousin ``ysb_clean``."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

WINDOW_MS = 10_000


def views(events: DataFrame) -> DataFrame:
    """Keep ``view`` events: ad_id and event_time (epoch milliseconds)."""
    return events.where(F.col("event_type") == "view").select(
        "ad_id", F.col("event_time").cast("long").alias("event_time_ms"))


def campaign_views(events: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    """Views per campaign per 10-second event-time window (mergeable counts).

    Joins ad -> campaign from the ``ads`` reference table; events of unknown ads are dropped,
    as in YSB.
    """
    ads = refs["ads"].select("ad_id", "campaign_id")
    window_start = F.timestamp_millis(F.floor(F.col("event_time_ms") / WINDOW_MS) * WINDOW_MS)
    return (views(events).join(ads, "ad_id")
            .groupBy(F.col("campaign_id").cast("string").alias("campaign_id"),
                     window_start.alias("window_start"))
            .agg(F.count(F.lit(1)).cast("long").alias("views")))


def clean_events(events: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    """Stateless parse + filter + project: view events with a typed event time."""
    return events.where(F.col("event_type") == "view").select(
        "user_id", "page_id", "ad_id", "ad_type",
        F.timestamp_millis(F.col("event_time").cast("long")).alias("event_time"),
        "ip_address")
