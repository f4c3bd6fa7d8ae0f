"""A transform whose UDF runs in the executors, for the Spark-cluster test: on a standalone
cluster with a clean environment the executors find this module, and ``sluice``, only in the
code the job ships (``sluice.spark.python_files``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql import functions as F
from pyspark.sql import types as T

from transforms.ysb import campaign_views

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


@F.udf(T.StringType())
def _event_kind(event_type: str | None) -> str | None:
    from sluice.protocol import PUBLISHED  # an executor imports sluice from the shipped zip

    assert PUBLISHED
    return None if event_type is None else event_type.strip().lower()


def campaign_views_udf(events: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    """``ysb.campaign_views`` after a Python UDF over ``event_type`` (an identity on YSB data)."""
    return campaign_views(events.withColumn("event_type", _event_kind("event_type")), refs)
