"""The upsert tests' transform: the change records as they are (id, seq, op, val)."""

from __future__ import annotations

from pyspark.sql import DataFrame


def changes(records: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
    return records.select("id", "seq", "op", "val")
