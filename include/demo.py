"""The demos (`make demo`, `demo-kafka`, `demo-chain`, `demo-cdc`), end to end through Airflow on the embedded defaults.

1. lands YSB events: files into ``var/landing/ysb`` (``make demo``), or messages into the
   Kafka topic ``ysb`` (``make demo-kafka``: the broker at ``$KAFKA``, 127.0.0.1:9092, is used
   if one answers there; otherwise one is started on that port with its data under
   ``var/kafka``, as ``make kafka`` does, and stopped at the end). More on every run;
2. runs the pipeline's DAG (``ysb`` or ``ysb_kafka``) with Airflow's ``dag.test()`` (SQLite
   metadata DB under ``var/airflow``, the epoch store in ``var/airflow/sluice.db``, Spark
   ``local[*]`` via spark-submit), one DAG run per group, until the backlog is empty;
3. reads the per-campaign window counts back from Delta, checks them against an oracle
   computed from the raw input (the files' bytes, or the topic read by a plain Kafka consumer),
   and prints a summary of the epoch log.

``make demo-chain`` lands files as ``make demo`` does, runs ``ysb_clean`` (parse, keep views,
append to Delta), then ``ysb_campaign_hourly``, a pipeline whose source is ``ysb_clean``'s
table (each version it published is an entry) and whose transform is one SQL query: hourly
views per campaign, checked against an oracle from the raw landed files.

``make demo-cdc`` produces Debezium-shaped change events of a ``customers`` table (inserts,
updates, deletes, re-inserts, some out of lsn order; ``include/generators/cdc.py``) to the topic
``customers_cdc``, drains the ``customers_cdc`` pipeline (a SQL transform flattens the envelope,
an upsert sink keeps the latest change per id by lsn, deletes as tombstones) and checks the table
against a plain-Python replay of every change event the topic holds. It exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "var" / "airflow"))
for path in (ROOT / "plugins", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

RATE, DURATION, FILES_PER_SECOND = 2000, 24, 1  # 24 files (or seconds of messages) of 2,000 events


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


@dataclass
class Input:
    """What differs between the two demos: the pipeline, how events land, the oracle over them,
    and where the raw input is."""

    pipeline: str
    land: Callable[[], None]
    oracle: Callable[[], Counter]
    where: str
    unit: str  # what a manifest entry is: a file, or a chunk of a partition's records


def file_input() -> Input:
    from include.generators.ysb import expected_window_counts, generate
    from sluice.spec import get_spec

    spec = get_spec("ysb")

    def land() -> None:
        step(f"generating {RATE * DURATION:,} YSB events into {spec.landing_dir}")
        generate(spec.landing_dir, rate=RATE, duration=DURATION, files_per_second=FILES_PER_SECOND,
                 seed=int(time.time()) % 10_000, late_fraction=0.02, late_max_s=20, malformed_fraction=0.001,
                 progress=True)

    return Input("ysb", land, lambda: expected_window_counts(sorted(spec.landing_dir.glob("*.json"))),
                 f"landing: {spec.landing_dir}", "files")


def kafka_input(bootstrap: str) -> Input:
    from include.generators.ysb import classify, consume, produce, window_counts
    from sluice.spec import get_spec

    spec = get_spec("ysb_kafka")
    topic = spec.source.topic

    def land() -> None:
        step(f"producing {RATE * DURATION:,} YSB events to the Kafka topic {topic} on {bootstrap}")
        produce(bootstrap, topic, partitions=3, rate=RATE, duration=DURATION, files_per_second=FILES_PER_SECOND,
                seed=int(time.time()) % 10_000, late_fraction=0.02, late_max_s=20, malformed_fraction=0.001)

    return Input("ysb_kafka", land, lambda: window_counts(classify(consume(bootstrap, topic))),
                 f"topic: {topic} on {bootstrap}", "chunks")


def answers(bootstrap: str) -> bool:
    """Whether a Kafka broker serves ``bootstrap`` now."""
    from confluent_kafka.admin import AdminClient

    host, port = bootstrap.rsplit(":", 1)
    with socket.socket() as s:  # a client on a closed port would log every refused connect
        if s.connect_ex((host, int(port))):
            return False
    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        return True
    except Exception:
        return False


@contextmanager
def kafka_broker(bootstrap: str) -> Iterator[None]:
    """The broker at ``bootstrap``: the user's (``make kafka``) if one answers, else one started
    here on that port with ``make kafka``'s data folder, stopped on the way out."""
    if answers(bootstrap):
        print(f"using the Kafka broker on {bootstrap}", flush=True)
        yield
        return
    from include.kafka.broker import start
    from sluice.paths import data_dir

    host, port = bootstrap.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"no Kafka broker answers on {bootstrap}, and the demo starts one on 127.0.0.1 only")
    folder = data_dir() / "kafka"
    step(f"starting a Kafka broker on 127.0.0.1:{port} (data under {folder}; jars from Maven Central once)")
    broker = start(folder, int(port))
    try:
        yield
    finally:
        broker.stop()
        print(f"\nstopped the Kafka broker on {broker.bootstrap}", flush=True)


def dag_bag():
    """Airflow's metadata database (SQLite under var/airflow) and the DAGs of ``dags/``; ``None``
    (and the import errors printed) if a DAG does not load."""
    step("preparing Airflow's metadata database (SQLite under var/airflow)")
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    db.initdb()
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    if bag.import_errors:
        print(bag.import_errors, file=sys.stderr)
        return None
    return bag


def drain(bag, pipeline: str, unit: str, store) -> bool:
    """Run ``pipeline``'s DAG (``dag.test()``), one DAG run per group, until its backlog is
    empty; whether every run succeeded."""
    from sluice.sources import source_for
    from sluice.spec import get_spec

    dag = bag.dags[pipeline]
    source = source_for(get_spec(pipeline), store)
    run = 0
    while (backlog := source.backlog()).files:
        run += 1
        size = (f"{backlog.records:,} records" if backlog.records is not None
                else f"{backlog.bytes / 1e6:.1f} MB")
        step(f"DAG run {run} of '{pipeline}': backlog {backlog.files} {unit} ({size}); "
             "wait_for_backlog -> plan_group -> run_group -> checkpoint")
        started = time.monotonic()
        dag_run = dag.test(run_conf={"drain": False})
        states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
        print(f"    {dag_run.state} in {time.monotonic() - started:.1f} s: {states}", flush=True)
        if dag_run.state != "success":
            print(f"DAG run failed; task logs are under {os.environ['AIRFLOW_HOME']}/logs", file=sys.stderr)
            return False
    return True


def chain() -> int:
    """``make demo-chain``: ysb_clean, then ysb_campaign_hourly on its table (see the module)."""
    from include.generators.ysb import load_ads, raw_events
    from sluice.spec import get_spec
    from sluice.store import EpochStore

    file_input().land()
    upstream, downstream = get_spec("ysb_clean"), get_spec("ysb_campaign_hourly")
    bag = dag_bag()
    if bag is None:
        return 1
    store = EpochStore()
    if not drain(bag, upstream.name, "files", store):
        return 1
    if not drain(bag, downstream.name, "versions", store):
        return 1

    step("reading the hourly views per campaign back from Delta")
    from sluice.spark import get_session

    spark = get_session("sluice-demo")
    spark.sparkContext.setLogLevel("ERROR")
    table = downstream.sinks[0].path
    rows = spark.read.format("delta").load(table).collect()
    spark.stop()
    counts = {(r["campaign_id"], int(r["hour"].timestamp() * 1000)): r["views"] for r in rows}
    ads = load_ads()
    hour_ms = 3_600_000
    expected: Counter = Counter()  # the oracle: valid view events of known ads in the landed files
    for _, _, event in raw_events(sorted(upstream.landing_dir.glob("*.json"))):
        if event is not None and event["event_type"] == "view" and event["ad_id"] in ads:
            t = int(event["event_time"])
            expected[(ads[event["ad_id"]], t - t % hour_ms)] += 1
    hours = sorted({h for _, h in counts})
    print(f"{len(rows)} rows: {len({c for c, _ in counts})} campaigns x {len(hours)} hours, "
          f"{sum(counts.values()):,} views (from {len(store.manifest(downstream.name))} upstream versions)")
    match = counts == dict(expected)
    print(f"matches the oracle computed from the raw landed files: {'yes' if match else 'NO'}")
    summary = store.summary(downstream.name)
    print(f"{downstream.name}: {summary['epochs']} epochs in {summary['groups']} groups, states "
          f"{summary['by_state']}; upstream {upstream.name}: {store.summary(upstream.name)['epochs']} epochs")
    print(f"\nupstream table: {upstream.sinks[0].path}\ntable: {table}")
    return 0 if match else 1


def cdc(bootstrap: str) -> int:
    """``make demo-cdc``: Debezium-shaped change events of a customers table into the topic
    ``customers_cdc``, the ``customers_cdc`` pipeline (SQL flattening, an upsert sink by id and
    lsn) drained, its table checked against a plain-Python replay of everything the topic holds."""
    from include.generators.cdc import change_events, live, out_of_order, parse, produce, replay, table_state
    from include.generators.ysb import consume
    from sluice.spec import get_spec
    from sluice.store import EpochStore

    spec = get_spec("customers_cdc")
    topic = spec.source.topic
    # Each run's log sequence numbers follow the earlier runs' (microseconds since the epoch).
    messages = change_events(int(time.time()) % 10_000, customers=40, changes=300, start_lsn=time.time_ns() // 1000,
                             start_ms=int(time.time() * 1000), malformed=2)
    ops = Counter(e["op"] for e in parse(v for _, v in messages))
    step(f"producing {len(messages)} change events of customers to the Kafka topic {topic} on {bootstrap}: "
         f"{dict(ops)} (r snapshot, c insert, u update, d delete), {out_of_order(messages)} of them after a "
         f"newer change of their key, {sum(v is None for _, v in messages)} Kafka tombstones (no value) after "
         "the deletes, 2 malformed")
    produce(bootstrap, topic, messages)
    bag = dag_bag()
    if bag is None:
        return 1
    store = EpochStore()
    if not drain(bag, spec.name, "chunks", store):
        return 1

    step("reading the customers table back from Delta")
    from sluice.spark import get_session

    spark = get_session("sluice-demo")
    spark.sparkContext.setLogLevel("ERROR")
    table = spec.sinks[0].path
    rows = [r.asDict() for r in spark.read.format("delta").load(table).orderBy("id").collect()]
    rejected = spark.read.format("delta").load(spec.rejected_table).count() if Path(spec.rejected_table).exists() else 0
    spark.stop()
    current = [r for r in rows if not r["_deleted"]]
    print(f"{len(current)} customers, {len(rows) - len(current)} deleted (tombstones, _deleted true); "
          f"{rejected} malformed messages in {spec.rejected_table}")
    print(f"{'id':>4} {'name':<14} {'email':<28} {'tier':<9} {'op':<2} {'lsn':>17}")
    for r in current[:12]:
        print(f"{r['id']:>4} {r['name']:<14} {r['email'] or '-':<28} {r['tier']:<9} {r['op']:<2} {r['lsn']:>17}")
    print(f"... ({len(current) - 12} more)" if len(current) > 12 else "")
    events = parse(v for _, _, v in consume(bootstrap, topic))  # the oracle's input: the whole topic
    expected = replay(events)
    try:
        got = table_state(rows)
    except ValueError as e:
        print(f"the table holds a key twice: {e}")
        got = {}
    match = got == expected and live(got) == live(expected)
    print(f"matches the oracle (the topic's {len(events)} change events replayed in lsn order): "
          f"{'yes' if match else 'NO'}")
    if not match:
        wrong = [(k, got.get(k), v) for k, v in expected.items() if got.get(k) != v]
        print(f"{len(wrong)} keys differ (table, oracle), e.g. {wrong[:3]}; "
              f"unexpected keys {sorted(got.keys() - expected.keys())[:5]}")
    summary = store.summary(spec.name)
    print(f"{spec.name}: {summary['epochs']} epochs in {summary['groups']} groups, states {summary['by_state']}")
    print(f"\ntopic: {topic} on {bootstrap}\ntable: {table}")
    return 0 if match else 1


def run(demo: Input) -> int:
    from sluice.spec import get_spec
    from sluice.store import EpochStore

    spec = get_spec(demo.pipeline)
    demo.land()
    bag = dag_bag()
    if bag is None:
        return 1
    store = EpochStore()
    if not drain(bag, demo.pipeline, demo.unit, store):
        return 1

    step("reading the per-campaign window counts back from Delta")
    from sluice.spark import get_session

    spark = get_session("sluice-demo")
    spark.sparkContext.setLogLevel("ERROR")
    table = spec.sinks[0].path
    rows = spark.read.format("delta").load(table).orderBy("window_start", "campaign_id").collect()
    counts = {(r["campaign_id"], int(r["window_start"].timestamp() * 1000)): r["views"] for r in rows}
    expected = demo.oracle()
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
    print(f"matches the oracle computed from the raw input: {'yes' if match else 'NO'}")
    rejected = spark.read.format("delta").load(spec.rejected_table).count() if Path(spec.rejected_table).exists() else 0
    spark.stop()  # before the summary, so Spark's shutdown lines do not follow it

    step("epoch log")
    summary = store.summary(demo.pipeline)
    sink = spec.sinks[0].name
    print(f"{'epoch':>5} {'group':>5} {demo.unit:>9} {'state':>10} {'input':>8} {'rejected':>8} {'version':>7} "
          f"{'seconds':>7}")
    for e in store.epochs(demo.pipeline):
        print(f"{e.epoch_id:>5} {e.group_id:>5} {f'[{e.start},{e.end})':>9} {e.state:>10} {e.rows.get('input', 0):>8} "
              f"{e.rows.get('rejected', 0):>8} {e.delta_versions.get(sink)!s:>7} "
              f"{e.timings.get('epoch_s', 0):>7.2f}")
    print(f"{summary['epochs']} epochs in {summary['groups']} groups, generation {summary['generation']}, "
          f"states {summary['by_state']}, {summary['rows']['input']:,} records read, {rejected} rejected "
          f"(table {spec.rejected_table})")
    print(f"\n{demo.where}")
    print(f"table: {table}")
    return 0 if match else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kafka", metavar="HOST:PORT", help="the Kafka demo (ysb_kafka), its broker here")
    parser.add_argument("--chain", action="store_true", help="ysb_clean, then ysb_campaign_hourly on its table")
    parser.add_argument("--cdc", metavar="HOST:PORT",
                        help="change events (Debezium-shaped) into an upsert sink (customers_cdc), the broker here")
    args = parser.parse_args(argv)
    if args.chain:
        return chain()
    if not args.kafka and not args.cdc:
        return run(file_input())
    bootstrap = args.cdc or args.kafka
    # The spec reads its brokers from this variable; the DAG's tasks and spark-submit inherit it.
    os.environ["SLUICE_KAFKA_BOOTSTRAP"] = bootstrap
    with kafka_broker(bootstrap):
        return cdc(bootstrap) if args.cdc else run(kafka_input(bootstrap))


if __name__ == "__main__":
    sys.exit(main())
