"""The validation gate: each sink's Great Expectations suite, checked on every epoch's output
*before* it is written, in the group's own SparkSession.

Checking before the Delta commit means an epoch that fails its suite is never visible in the
table, not even for a moment; the ``validate`` task of the DAG then applies the policy to the
recorded results (``fail`` halts the pipeline; ``quarantine`` and ``warn`` let it go on).

Suites are GX Core 1.x ``ExpectationSuite`` JSON files (``include/expectations/``)::

    {"name": "ysb.campaign_views",
     "expectations": [{"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "campaign_id"}}]}
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import OperatorActionRequired, SpecError

if TYPE_CHECKING:
    from great_expectations.core import ExpectationSuite
    from pyspark.sql import DataFrame

    from sluice.spec import PipelineSpec

ROW_ID = "_sluice_row"
log = logging.getLogger(__name__)
_CONTEXT_LOCK = threading.Lock()  # GX's context is made once, by the warm-up or the first validation
_WARM_LOCK = threading.Lock()
_warming: threading.Thread | None = None


class ValidationFailedError(OperatorActionRequired):
    """An epoch's output failed its expectation suite under the ``fail`` policy."""


@dataclass(frozen=True)
class SinkValidation:
    """The result of one sink's suite on one epoch's output."""

    sink: str
    success: bool
    evaluated: int
    failed: list[dict[str, Any]] = field(default_factory=list)
    quarantined: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"success": self.success, "evaluated": self.evaluated, "failed": self.failed,
                "quarantined": self.quarantined}

    def describe(self) -> str:
        """One line per failed expectation, e.g. ``expect_column_values_to_not_be_null(campaign_id):
        812 unexpected (100.0%)``."""
        return "; ".join(_describe_failure(f) for f in self.failed) or "ok"


def _describe_failure(f: dict[str, Any]) -> str:
    target = f"({f['column']})" if f.get("column") else ""
    if f.get("unexpected_count") is not None:
        pct = f.get("unexpected_percent")
        return f"{f['expectation']}{target}: {f['unexpected_count']} unexpected" + (
            f" ({pct:.1f}%)" if pct is not None else "")
    return f"{f['expectation']}{target}: observed {f.get('observed_value')!r}"


def describe(results: dict[str, dict[str, Any]] | None) -> str:
    """The failures of an epoch's recorded validation (``{sink: result}``), for messages."""
    return "; ".join(f"{sink}: " + "; ".join(_describe_failure(f) for f in r.get("failed", []))
                     for sink, r in (results or {}).items() if not r.get("success", True)) or "ok"


def load_suite(path: str | Path) -> ExpectationSuite:
    """Read a suite file; a broken one raises ``SpecError`` naming the file and the expectation."""
    import great_expectations as gx

    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: not a readable expectation suite: {exc}") from None
    expectations = raw.get("expectations") if isinstance(raw, dict) else None
    if not isinstance(expectations, list) or not expectations:
        raise SpecError(f"{path}: an expectation suite needs a non-empty `expectations` list")
    for i, e in enumerate(expectations):
        if not isinstance(e, dict) or "type" not in e:
            raise SpecError(f"{path}: expectations[{i}]: needs a `type` (e.g. expect_column_values_to_not_be_null)")
    try:
        return gx.ExpectationSuite(name=raw.get("name") or path.stem, expectations=expectations)
    except Exception as exc:  # GX names the unknown expectation or the bad argument
        raise SpecError(f"{path}: invalid expectation suite: {exc}") from None


@cache
def _context() -> Any:
    """GX imported and its ephemeral context made, once per process (seconds of CPU); no Spark
    is touched (``_batch_definition`` adds the Spark datasource, whose engine asks for a
    session)."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    from sluice.logs import quiet_libraries

    quiet_libraries()  # its modules, now imported, set some of their loggers to INFO
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return context


@cache
def _batch_definition() -> Any:
    """The whole-dataframe batch of the Spark datasource, in the process's context. Called by a
    validation, in the group's thread: GX's engine takes the session it finds (or would start
    one), so this runs only where the group's session is up."""
    with _CONTEXT_LOCK:
        asset = _context().data_sources.add_spark(name="sluice").add_dataframe_asset(name="epoch_output")
        return asset.add_batch_definition_whole_dataframe(name="epoch")


def warm_in_background(spec: PipelineSpec) -> threading.Thread | None:
    """Import GX and make its context (``_context``) in a thread of its own while the group's
    process waits on Spark (the tables' readiness, the group's read), so the first validation
    does not pay for them in the group's critical path. Nothing of Spark is touched there (a
    GX Spark engine made without the group's session would start a local one). ``None`` when no
    sink has a suite or it ran already in this process. Not a daemon: an exit waits for an
    import under way (a daemon thread killed mid-import at shutdown can abort the interpreter).
    A failure is left to the first validation to raise."""
    global _warming
    if not any(s.expectations for s in spec.sinks):
        return None
    with _WARM_LOCK:
        if _warming is not None or _context.cache_info().currsize:
            return None

        def build() -> None:
            try:
                with _CONTEXT_LOCK:
                    _context()
            except Exception as exc:  # the validation that needs it raises it, in context
                log.debug("pipeline %s: GX not loaded ahead: %s", spec.name, exc)

        _warming = threading.Thread(target=build, name=f"sluice-gx-{spec.name}")
        _warming.start()
        return _warming


def _failures(result: Any) -> list[dict[str, Any]]:
    failed = []
    for r in result.results:
        if r.success:
            continue
        config = r.expectation_config
        res = r.result or {}
        failed.append({
            "expectation": config.type, "column": config.kwargs.get("column"),
            "unexpected_count": res.get("unexpected_count"), "unexpected_percent": res.get("unexpected_percent"),
            "observed_value": _jsonable(res.get("observed_value")),
            "examples": _jsonable((res.get("partial_unexpected_list") or [])[:5]),
            "rows": [row[ROW_ID] for row in res.get("unexpected_index_list") or []]
            if "unexpected_index_list" in res else None,
        })
    return failed


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def validate(sink: str, frame: DataFrame, suite: ExpectationSuite, *, locate_rows: bool = False,
             ) -> tuple[SinkValidation, DataFrame, DataFrame | None]:
    """Run ``suite`` on ``frame``; returns the result, the rows to write, and (with
    ``locate_rows``, the quarantine policy) the failing rows, each with the expectations it
    broke. A failed table-level expectation (a row count, say) blames no single row, so it puts
    the whole epoch output in quarantine."""
    from pyspark.sql import functions as F

    if locate_rows:
        # Materialised once, so the row ids GX reports name the same rows when we split.
        frame = frame.withColumn(ROW_ID, F.monotonically_increasing_id()).localCheckpoint()
        result_format: Any = {"result_format": "COMPLETE", "unexpected_index_column_names": [ROW_ID],
                              "return_unexpected_index_query": False, "partial_unexpected_count": 5}
    else:
        result_format = "SUMMARY"
    result = _batch_definition().get_batch(batch_parameters={"dataframe": frame}).validate(
        suite, result_format=result_format)
    failed = _failures(result)
    good, bad = frame, None
    if locate_rows and failed:
        if any(f["rows"] is None for f in failed):
            names = [f["expectation"] for f in failed if f["rows"] is None]
            good, bad = frame.limit(0), frame.withColumn("expectations", F.array(*[F.lit(n) for n in names]))
        else:
            by_row: dict[int, list[str]] = {}
            for f in failed:
                for row_id in f["rows"]:
                    by_row.setdefault(row_id, []).append(
                        f["expectation"] + (f"({f['column']})" if f.get("column") else ""))
            ids = frame.sparkSession.createDataFrame(list(by_row.items()),
                                                     f"{ROW_ID} long, expectations array<string>")
            good = frame.join(F.broadcast(ids), ROW_ID, "left_anti")
            bad = frame.join(F.broadcast(ids), ROW_ID)
    if locate_rows:
        good = good.drop(ROW_ID)
        bad = bad.drop(ROW_ID) if bad is not None else None
    for f in failed:
        f.pop("rows", None)
    summary = SinkValidation(sink, bool(result.success), int(result.statistics["evaluated_expectations"]), failed)
    return summary, good, bad
