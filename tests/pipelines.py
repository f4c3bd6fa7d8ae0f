"""Test pipelines: copies of the shipped YSB specs under new names, each with its own landing
folder and tables, written into the test session's pipelines folder (``$SLUICE_PIPELINES_DIR``)
so that subprocesses (spark-submit, Airflow) find them too."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from include.generators.ysb import expected_window_counts, generate, raw_events
from sluice.paths import project_root
from sluice.spec import PipelineSpec, load_spec


def make_pipeline(name: str, base: str = "ysb", tables: str | None = None, **overrides: Any) -> PipelineSpec:
    """``tables``: a folder the sinks share with other pipelines' (``<tables>/<name>_<sink>``);
    by default each pipeline has its own (``<data>/<name>/tables/<sink>``)."""
    raw = yaml.safe_load((project_root() / "include" / "pipelines" / f"{base}.yaml").read_text())
    raw["name"] = name
    if raw["source"].get("type", "files") == "files":
        raw["source"]["path"] = f"${{SLUICE_DATA_DIR}}/{name}/landing"
        raw["source"]["settle_s"] = 0  # land() renames files into place: they are whole at once
    for sink in raw["sinks"]:
        sink["path"] = (f"{tables}/{name}_{sink['name']}" if tables
                        else f"${{SLUICE_DATA_DIR}}/{name}/tables/{sink['name']}")
    # Tests pin the sizes (adaptive sizing has its own tests) and start a group a few seconds
    # after data lands, whatever its size.
    raw["control"].update({"adaptive": False, "freshness_sla_s": 5})
    for key, value in overrides.items():  # "control.epoch_files": 2, "spark.mode": "in_process", ...
        section, _, field = key.partition(".")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[section] = value
    path = Path(os.environ["SLUICE_PIPELINES_DIR"]) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        spec = load_spec(path)
    except Exception:  # an invalid spec a test expects must not break the session's DAG folder
        path.unlink()
        raise
    if spec.source.type == "files":
        spec.landing_dir.mkdir(parents=True, exist_ok=True)
    return spec


def land(spec: PipelineSpec, files: int, rate_per_file: int = 200, seed: int = 1, **kw: Any) -> list[Path]:
    """Generate YSB files into the pipeline's landing folder (one second of events each)."""
    kw.setdefault("start_ms", 1_767_225_600_000 + 10_000 * seed)
    return generate(spec.landing_dir, rate=rate_per_file, duration=files, files_per_second=1, seed=seed, **kw)


def landed(spec: PipelineSpec) -> list[Path]:
    return sorted(spec.landing_dir.glob("*.json"))


def table_counts(spark, spec: PipelineSpec) -> Counter:
    """Views per (campaign_id, window start ms) as the Delta table holds them."""
    rows = spark.read.format("delta").load(spec.sinks[0].path).collect()
    counts: Counter = Counter()
    for r in rows:
        key = (r["campaign_id"], int(r["window_start"].timestamp() * 1000))
        assert key not in counts, f"duplicate key {key} in the aggregate table"
        counts[key] = r["views"]
    return counts


def invalid_lines(paths: list[Path]) -> set[tuple[str, int]]:
    """(file, line) of every non-blank line the oracle rejects, computed from the raw files."""
    return {(path, n) for path, n, event in raw_events(paths) if event is None}


def rejected_lines(spark, spec: PipelineSpec) -> list[tuple[str, int]]:
    from sluice.delta.spark import SparkTables

    if not SparkTables(spark).exists(spec.rejected_table):
        return []
    return [(r["file"], r["line"]) for r in spark.read.format("delta").load(spec.rejected_table).collect()]


def assert_matches_oracle(spark, spec: PipelineSpec, store) -> None:
    """The table equals the oracle from the raw files, every bad line is rejected exactly once,
    and the epoch log is contiguous and covers every landed file."""
    paths = landed(spec)
    expected = expected_window_counts(paths)
    got = table_counts(spark, spec)
    missing = {k: v for k, v in expected.items() if got.get(k) != v}
    extra = {k: v for k, v in got.items() if k not in expected}
    assert not missing and not extra, (f"{spec.name}: {len(missing)} windows differ from the oracle "
                                       f"(e.g. {list(missing.items())[:3]}), {len(extra)} unexpected")
    rejected = rejected_lines(spark, spec)
    assert len(rejected) == len(set(rejected)), f"{spec.name}: a rejected record was written twice"
    assert set(rejected) == invalid_lines(paths), f"{spec.name}: rejected records differ from the oracle"
    summary = store.summary(spec.name)  # raises on a gap or an overlap
    assert summary["offsets"] == [0, len(paths)], f"{spec.name}: epochs cover {summary['offsets']}, not all files"


def roll_back(spark, spec: PipelineSpec, store, to_epoch: int, *, recompute: bool = False,
              reason: str = "test") -> dict:
    """``sluice_rollback`` step by step as its tasks run: the rollback, then its group processed,
    validated and published. Returns the rollback's report."""
    from sluice.protocol import operations
    from sluice.protocol.leases import acquire_lease
    from sluice.protocol.run import PipelineRun, cli_owner
    from sluice.protocol.runtime import Runtime

    owner = cli_owner()
    report = operations.rollback(spec, store, Runtime.spark(spark), acquire_lease(store, spec.name, owner),
                                 to_epoch=to_epoch, reason=reason, recompute=recompute)
    PipelineRun(spec, store, owner, Runtime.spark(spark)).process(report["group_id"])
    PipelineRun(spec, store, owner).validate()
    PipelineRun(spec, store, owner, Runtime.spark(spark)).publish()
    return report
