"""A superlinear YSB transform for the adaptive-control benchmark: co-views per campaign.

A band self-join of an epoch's view events: every pair of views of the same campaign at most
``BAND_MS`` apart, the earlier one counted in its 10-second window. The join's key has 100
values (the campaigns) and the band is wider than an epoch, so an epoch of ``n`` views builds
about ``n^2 / 200`` pairs: its cost grows with the square of the epoch (DyBBS's Join workload),
which is what ``bench.control_e2e --workload join`` puts under a burst. Pairs are counted within
an epoch (whose range is recorded, so a rerun counts the same ones).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from .ysb import WINDOW_MS, views

BAND_MS = 300_000


def campaign_coviews(events: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    """Per campaign and 10-second window: the views in it paired with every view of the same
    campaign in the epoch up to ``BAND_MS`` later (itself included, ties both ways)."""
    ads = F.broadcast(refs["ads"].select("ad_id", F.col("campaign_id").cast("string").alias("campaign_id")))
    v = views(events).join(ads, "ad_id").select("campaign_id", "event_time_ms")
    a, b = v.alias("a"), v.alias("b")
    pairs = a.join(b, (F.col("a.campaign_id") == F.col("b.campaign_id"))
                   & (F.col("b.event_time_ms") >= F.col("a.event_time_ms"))
                   & (F.col("b.event_time_ms") - F.col("a.event_time_ms") <= BAND_MS))
    window_start = F.timestamp_millis(F.floor(F.col("a.event_time_ms") / WINDOW_MS) * WINDOW_MS)
    return (pairs.groupBy(F.col("a.campaign_id").alias("campaign_id"), window_start.alias("window_start"))
            .agg(F.count(F.lit(1)).cast("long").alias("coviews")))
