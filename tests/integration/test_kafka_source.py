"""The Kafka source on a real broker (KRaft, from Maven Central jars; ``include/kafka``), against
an oracle computed by consuming the topic with a plain Kafka client (confluent-kafka, not
Spark, not sluice's reader): exactly-once under SIGKILL at each step of the protocol, new
partitions picked up, a rollback's replay reading the same records, and what retention took
refused with a message naming the partition and offsets."""

from __future__ import annotations

import re
import time

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

from include.generators.ysb import classify, consume, produce, window_counts
from sluice import protocol
from sluice.errors import SourceError
from sluice.protocol import operations
from sluice.protocol.leases import acquire_lease
from sluice.protocol.run import PipelineRun, cli_owner, run_once
from sluice.protocol.runtime import Runtime
from sluice.sources import source_for
from sluice.spec import PipelineSpec
from sluice.store import EpochStore
from tests.integration.test_exactly_once import assert_crashed_at, assert_records_complete, kill_at
from tests.pipelines import make_pipeline, rejected_lines, table_counts

pytestmark = pytest.mark.kafka


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


def kafka_pipeline(name: str, broker, **overrides) -> PipelineSpec:
    return make_pipeline(name, base="ysb_kafka", **{
        "source.bootstrap_servers": broker.bootstrap, "source.topic": name, "source.chunk_records": 100,
        "control.epoch_max_records": None, "control.adaptive": False, **overrides})


def send(spec: PipelineSpec, broker, *, events: int, seed: int, partitions: int = 3,
         malformed_fraction: float = 0.03) -> None:
    produce(broker.bootstrap, spec.source.topic, partitions=partitions, rate=events, duration=1,
            seed=seed, start_ms=1_767_225_600_000 + 10_000 * seed, malformed_fraction=malformed_fraction,
            late_fraction=0.05, late_max_s=25)


def assert_matches_kafka_oracle(spark, spec: PipelineSpec, store: EpochStore, broker) -> None:
    records = consume(broker.bootstrap, spec.source.topic)
    events = list(classify(records))
    expected = window_counts(events)
    got = table_counts(spark, spec)
    assert got == expected, (f"{spec.name}: {sum(1 for k in expected if got.get(k) != expected[k])} windows "
                             f"differ from the oracle over {len(records)} records")
    rejected = rejected_lines(spark, spec)
    assert len(rejected) == len(set(rejected)), f"{spec.name}: a rejected record was written twice"
    assert set(rejected) == {(where, n) for where, n, event in events if event is None}
    summary = store.summary(spec.name)  # raises on a gap or an overlap
    manifest = store.manifest(spec.name)
    assert summary["offsets"] == [0, len(manifest)], f"{spec.name}: epochs do not cover every chunk"
    assert sum(e.size for e in manifest) == len(records), "the chunks do not hold every record once"


# The protocol's four kill points run on files (test_exactly_once); on Kafka CI runs one whose rerun
# restores a committed table and replays a read of the recorded offsets (after_delta_commit); the
# others are further variants (make test-all): mid_write replays the same offsets from the same
# chunks, and the simulation kills at every step.
@pytest.mark.parametrize("point", [pytest.param("after_plan", marks=pytest.mark.variant),
                                   pytest.param("mid_write", marks=pytest.mark.variant),
                                   "after_delta_commit", pytest.param("before_publish", marks=pytest.mark.variant)])
def test_sigkill_then_rerun_is_exactly_once_on_kafka(point, kafka, spark, store):
    spec = kafka_pipeline(f"kafka_kill_{point}", kafka, **{"control.epoch_files": 2, "control.group_epochs": 2})
    send(spec, kafka, events=600, seed=1)  # 3 partitions x 2 chunks of 100
    kill_at(spec, point)
    assert_crashed_at(point, spark, spec, store)
    send(spec, kafka, events=300, seed=2)  # more arrives meanwhile
    groups = run_once(spec, store, spark, drain=True)
    if point != "before_publish":
        assert groups[0]["group"]["plan"]["reason"].startswith("reprocess epochs")
    assert_matches_kafka_oracle(spark, spec, store, kafka)
    assert {e.state for e in store.epochs(spec.name)} == {protocol.PUBLISHED}
    assert_records_complete(spec, store)


def test_new_partitions_are_picked_up_and_a_rollback_replays_the_same_records(kafka, spark, store):
    spec = kafka_pipeline("kafka_grow", kafka, **{"control.epoch_files": 2, "control.group_epochs": 2,
                                                  "control.epoch_max_records": 150, "spark.mode": "in_process"})
    send(spec, kafka, events=200, seed=3, partitions=2)
    run_once(spec, store, spark, drain=True)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.create_partitions([NewPartitions(spec.source.topic, 4)]).values():
        future.result()
    send(spec, kafka, events=400, seed=4)  # now over 4 partitions
    run_once(spec, store, spark, drain=True)
    assert_matches_kafka_oracle(spark, spec, store, kafka)
    epochs = store.epochs(spec.name)
    source = source_for(spec, store)
    described = [source.describe(store.manifest(spec.name, e.start, e.end)) for e in epochs]
    assert {p for d in described for p in d["partitions"]} == {"0", "1", "2", "3"}
    # epoch_max_records: 150 over chunks of at most 100 records: one chunk per epoch.
    assert all(sum(e.size for e in store.manifest(spec.name, x.start, x.end)) <= 150 for x in epochs)

    # Roll back to epoch 1 and recompute: the replay reads the recorded offsets again.
    before = table_counts(spark, spec)
    owner = cli_owner()
    lease = acquire_lease(store, spec.name, owner)
    report = operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=1, reason="replay", recompute=True)
    PipelineRun(spec, store, owner, Runtime.spark(spark)).process(report["group_id"])
    PipelineRun(spec, store, owner).validate()
    PipelineRun(spec, store, owner, Runtime.spark(spark)).publish()
    assert table_counts(spark, spec) == before
    replayed = store.epochs(spec.name)
    assert [(e.start, e.end) for e in replayed] == [(e.start, e.end) for e in epochs]
    assert store.generation(spec.name) == 1
    assert_matches_kafka_oracle(spark, spec, store, kafka)


def test_what_retention_deleted_is_refused_and_named(kafka, spark, store):
    spec = kafka_pipeline("kafka_retention", kafka, **{"control.epoch_files": 1, "control.group_epochs": 2,
                                                       "spark.mode": "in_process"})
    send(spec, kafka, events=600, seed=5)
    run_once(spec, store, spark, drain=True)
    generation, before = store.generation(spec.name), table_counts(spark, spec)
    # Retention (here: delete-records) takes partition 0's first 150 records.
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.delete_records([TopicPartition(spec.source.topic, 0, 150)]).values():
        future.result()
    lease = acquire_lease(store, spec.name, "operator")
    with pytest.raises(operations.RollbackRefusedError,
                       match=r"records \[\d+, \d+\) of partition 0 .* no longer in the topic.*start to 150"):
        operations.rollback(spec, store, Runtime.spark(spark), lease, to_epoch=0, reason="test", recompute=True)
    store.release_lease(lease)
    assert store.generation(spec.name) == generation and store.pending_rollback(spec.name) is None
    assert table_counts(spark, spec) == before

    # Records deleted before sluice registered them: the pipeline stops, naming them.
    send(spec, kafka, events=300, seed=6)  # partition 1: offsets 200..299, not registered yet
    for future in admin.delete_records([TopicPartition(spec.source.topic, 1, 300)]).values():
        future.result()
    with pytest.raises(SourceError, match=r"records \[200, 300\) of partition 1 were deleted .*fail_on_data_loss"):
        source_for(spec, store).discover()
    end = len(store.manifest(spec.name))
    lenient = kafka_pipeline(spec.name, kafka, **{"source.fail_on_data_loss": False})
    # Logged, and the other partitions' new records (100 each, one chunk) are registered.
    assert source_for(lenient, store).discover() == end + 2


def delete_topic(spec: PipelineSpec, broker) -> None:
    """Delete the pipeline's topic and wait until the broker no longer lists it."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.delete_topics([spec.source.topic]).values():
        future.result()
    deadline = time.monotonic() + 30
    while spec.source.topic in admin.list_topics(timeout=15).topics:  # deletion is asynchronous
        assert time.monotonic() < deadline, "the topic was not deleted"
        time.sleep(0.5)


def test_a_topic_deleted_and_recreated_stops_discovery_and_names_it(kafka, store, monkeypatch):
    """Issue 37: a topic deleted and re-created with fewer records than were registered was
    followed silently: nothing registered while its offsets stayed below the old end, then
    ``[old_end, high)``, so the new topic's first records were never processed. Discovery now
    stops and says why, and registers nothing. Here as on a broker that reports no topic ID
    (before KIP-516), where the offsets that went back are what tells. No Spark: about 10 s."""
    from sluice.sources.kafka import KafkaSource

    monkeypatch.setattr(KafkaSource, "_topic_id", lambda self: None)
    spec = kafka_pipeline("kafka_recreated", kafka)
    send(spec, kafka, events=600, seed=7)
    registered = source_for(spec, store).discover()
    assert registered > 0 and store.chunk_ends(spec.name, f"kafka://{spec.source.topic}/")
    delete_topic(spec, kafka)
    send(spec, kafka, events=150, seed=8)  # re-created: 50 records a partition, below the 200 registered
    with pytest.raises(SourceError, match=r"offsets went back \(partition 0 ends at offset 50, below the 200"):
        source_for(spec, store).discover()
    assert len(store.manifest(spec.name)) == registered, "nothing of the new topic was registered"


def test_a_topic_recreated_with_more_records_than_before_is_told_by_its_id(kafka, store):
    """Issue 37 item 3: a topic deleted and re-created that already holds more records than
    were registered has offsets that did not go back; registering ``[old_end, high)`` would skip
    the new topic's first records unseen. The topic ID recorded with the first registration
    differs: discovery and the backlog stop, naming both IDs, and register nothing. No Spark:
    about 10 s on the broker."""
    spec = kafka_pipeline("kafka_recreated_larger", kafka)
    send(spec, kafka, events=150, seed=9)  # 50 records a partition
    registered = source_for(spec, store).discover()
    first_id = (store.source_identity(spec.name) or {}).get("topic_id")
    assert registered > 0 and first_id, "the topic ID is recorded with the first registration"
    delete_topic(spec, kafka)
    send(spec, kafka, events=600, seed=10)  # re-created: 200 records a partition, above the 50 registered
    source = source_for(spec, store)
    with pytest.raises(SourceError, match=re.escape(f"registered its records (its topic ID was {first_id}, it is")):
        source.discover()
    with pytest.raises(SourceError, match="topic ID was"):
        source.backlog()
    assert len(store.manifest(spec.name)) == registered, "nothing of the new topic was registered"
