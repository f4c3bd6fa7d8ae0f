"""`make demo`: YSB end to end through Airflow on the embedded defaults.

1. generates YSB events into ``var/landing/ysb`` (more on every run);
2. runs the ``ysb`` DAG with Airflow's ``dag.test()`` (SQLite metadata DB under ``var/airflow``,
   the epoch store in ``var/airflow/sluice.db``, Spark ``local[*]`` via spark-submit), one DAG
   run per group, until the backlog is empty;
3. reads the per-campaign window counts back from Delta, checks them against an oracle
   computed from the raw files, and prints a summary of the epoch log.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "var" / "airflow"))
for path in (ROOT / "plugins", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

RATE, DURATION, FILES_PER_SECOND = 2000, 24, 1  # 24 files of 2,000 events


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


def main() -> int:
    from include.generators.ysb import expected_window_counts, generate
    from sluice.sources import FileSource
    from sluice.spec import get_spec
    from sluice.store import EpochLog

    spec = get_spec("ysb")
    step(f"generating {RATE * DURATION:,} YSB events into {spec.landing_dir}")
    generate(spec.landing_dir, rate=RATE, duration=DURATION, files_per_second=FILES_PER_SECOND,
             seed=int(time.time()) % 10_000, late_fraction=0.02, late_max_s=20, malformed_fraction=0.001,
             progress=True)

    step("preparing Airflow's metadata database (SQLite under var/airflow)")
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    db.initdb()
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    if bag.import_errors:
        print(bag.import_errors, file=sys.stderr)
        return 1
    dag = bag.dags["ysb"]
    epoch_log = EpochLog()
    source = FileSource(spec, epoch_log)
    run = 0
    while source.backlog().files:
        run += 1
        backlog = source.backlog()
        step(f"DAG run {run} of 'ysb': backlog {backlog.files} files ({backlog.bytes / 1e6:.1f} MB); "
             "wait_for_backlog -> plan_group -> run_group (spark-submit) -> checkpoint")
        started = time.monotonic()
        dag_run = dag.test(run_conf={"drain": False})
        states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
        print(f"    {dag_run.state} in {time.monotonic() - started:.1f} s: {states}", flush=True)
        if dag_run.state != "success":
            print(f"DAG run failed; task logs are under {os.environ['AIRFLOW_HOME']}/logs", file=sys.stderr)
            return 1

    step("reading the per-campaign window counts back from Delta")
    from sluice.spark import get_session

    spark = get_session("sluice-demo")
    spark.sparkContext.setLogLevel("ERROR")
    table = spec.sinks[0].path
    rows = spark.read.format("delta").load(table).orderBy("window_start", "campaign_id").collect()
    counts = {(r["campaign_id"], int(r["window_start"].timestamp() * 1000)): r["views"] for r in rows}
    expected = expected_window_counts(sorted(spec.landing_dir.glob("*.json")))
    campaigns = sorted({c for c, _ in counts})
    windows = sorted({w for _, w in counts})
    print(f"{len(rows)} rows: {len(campaigns)} campaigns x {len(windows)} windows of 10 s, "
          f"{sum(counts.values()):,} views")
    print(f"{'campaign_id':<38} {'window_start (UTC)':<21} {'views':>6}")
    for r in rows[:12]:
        print(f"{r['campaign_id']:<38} {r['window_start']:%Y-%m-%d %H:%M:%S}  {r['views']:>6}")
    print(f"... ({len(rows) - 12} more rows)" if len(rows) > 12 else "")
    per_campaign = sorted(((sum(v for (c, _), v in counts.items() if c == camp), camp) for camp in campaigns),
                          reverse=True)[:5]
    print("top campaigns by views: " + ", ".join(f"{c[:8]}…={v}" for v, c in per_campaign))
    match = counts == dict(expected)
    print(f"matches the oracle computed from the raw files: {'yes' if match else 'NO'}")
    rejected = spark.read.format("delta").load(spec.rejected_table).count() if Path(spec.rejected_table).exists() else 0
    spark.stop()  # before the summary, so Spark's shutdown lines do not follow it

    step("epoch log")
    summary = epoch_log.summary("ysb")
    print(f"{'epoch':>5} {'group':>5} {'files':>9} {'state':>10} {'input':>8} {'rejected':>8} {'version':>7} "
          f"{'seconds':>7}")
    for e in epoch_log.epochs("ysb"):
        print(f"{e.epoch_id:>5} {e.group_id:>5} {f'[{e.start},{e.end})':>9} {e.state:>10} {e.rows.get('input', 0):>8} "
              f"{e.rows.get('rejected', 0):>8} {e.delta_versions.get('campaign_views')!s:>7} "
              f"{e.timings.get('epoch_s', 0):>7.2f}")
    print(f"{summary['epochs']} epochs in {summary['groups']} groups, generation {summary['generation']}, "
          f"states {summary['by_state']}, {summary['rows']['input']:,} records read, {rejected} rejected "
          f"(table {spec.rejected_table})")
    print(f"\nlanding: {spec.landing_dir}")
    print(f"table: {table}")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
