"""The Kafka source's pure parts: chunks of a partition's offsets, their ranges per partition,
and the spec rules of a Kafka source (no broker, no Spark)."""

from __future__ import annotations

from contextlib import nullcontext
from itertools import pairwise

import pytest
import yaml

from sluice.errors import SourceError, SpecError
from sluice.paths import project_root
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.sources.kafka import Chunk, chunk_ranges, chunk_times, merge_adjacent, partition_ranges
from sluice.spec import load_spec
from sluice.store import EpochStore


def test_offsets_are_cut_into_chunks_that_cover_them_once():
    assert chunk_ranges(0, 250, 100) == [(0, 100), (100, 200), (200, 250)]
    assert chunk_ranges(7, 7, 100) == []
    ranges = chunk_ranges(13, 1013, 37)
    assert ranges[0][0] == 13 and ranges[-1][1] == 1013
    assert all(a < b <= a + 37 for a, b in ranges) and all(x[1] == y[0] for x, y in pairwise(ranges))


def test_chunk_times_interpolate_between_the_two_read_and_never_go_back():
    ranges = chunk_ranges(100, 450, 100)  # starts 100, 200, 300, 400
    assert chunk_times(ranges, 10.0, 16.0) == [10.0, 12.0, 14.0, 16.0]  # exact at both reads
    assert chunk_times(ranges, 10.0, 7.0) == [10.0] * 4  # a producer's clock went back
    assert chunk_times([(5, 9)], 3.0, 3.0) == [3.0] and chunk_times([], 1.0, 2.0) == []


def test_a_chunk_is_named_by_its_path_and_parsed_back():
    chunk = Chunk("ysb.events-1", 3, 200, 300)
    assert chunk.path == "kafka://ysb.events-1/3/200-300" and Chunk.parse(chunk.path) == chunk
    with pytest.raises(SourceError, match="not a Kafka chunk"):
        Chunk.parse("/landing/ysb-000001.json")


def test_partition_ranges_and_adjacent_chunks_of_one_epoch_merge():
    chunks = [Chunk("t", 0, 0, 100), Chunk("t", 1, 0, 50), Chunk("t", 0, 100, 200), Chunk("t", 1, 50, 90)]
    assert partition_ranges(chunks) == {0: (0, 200), 1: (0, 90)}
    tagged = [(chunks[0], 5), (chunks[2], 5), (chunks[1], 5), (chunks[3], 6)]
    assert merge_adjacent(tagged) == [(Chunk("t", 0, 0, 200), 5), (chunks[1], 5), (chunks[3], 6)]
    # A chunk skipped on purpose leaves a hole: its neighbours stay apart.
    assert merge_adjacent([(Chunk("t", 0, 0, 100), 1), (Chunk("t", 0, 200, 300), 1)]) == [
        (Chunk("t", 0, 0, 100), 1), (Chunk("t", 0, 200, 300), 1)]


def test_the_stores_chunk_ends_are_each_partitions_highest_end(db_url):
    """``EpochStore.chunk_ends`` (one SQL aggregate, SQLite and Postgres) against a scan of the
    chunks parsed in Python: numeric ends (not text order), chunks registered out of offset
    order (by first-record timestamp), other topics and pipelines left out."""
    topic = "ysb.events-1"
    chunks = [Chunk(topic, 0, a, b) for a, b in chunk_ranges(0, 1234, 100)] + \
        [Chunk(topic, 1, a, b) for a, b in chunk_ranges(99_990, 100_011, 10)] + \
        [Chunk(topic, 12, 5, 9), Chunk(topic, 2, 7, 8)]
    ts = [1000.0 - i for i in range(len(chunks))]  # the last chunks' records are the oldest
    others = [Chunk("ysb", 0, 0, 5000).path, Chunk("YSB.EVENTS-1", 3, 0, 10).path, Chunk("ysb.events", 0, 0, 9).path,
              "/landing/ysb-000001.json"]
    log = EpochStore(db_url)
    try:
        assert log.chunk_ends("k", Chunk.prefix(topic)) == {}
        log.register_files("k", [(c.path, c.end - c.start, t) for c, t in zip(chunks, ts, strict=True)]
                           + [(path, 1, 1.0) for path in others])
        log.register_files("k2", [(Chunk(topic, 0, 0, 99_999).path, 1, 1.0)])
        scanned: dict[int, int] = {}
        for c in chunks:
            scanned[c.partition] = max(scanned.get(c.partition, 0), c.end)
        assert log.chunk_ends("k", Chunk.prefix(topic)) == scanned == {0: 1234, 1: 100_011, 12: 9, 2: 8}
        assert log.chunk_ends("k", Chunk.prefix("ysb")) == {0: 5000}
    finally:
        log.close()


def kafka_spec(tmp_path, **control):
    raw = yaml.safe_load((project_root() / "include" / "pipelines" / "ysb_kafka.yaml").read_text())
    raw["control"].update(control)
    path = tmp_path / "ysb_kafka.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_kafka_spec_bounds_epochs_in_records_not_bytes(tmp_path):
    spec = load_spec(kafka_spec(tmp_path))
    assert spec.source.type == "kafka" and spec.epoch_size_bound == spec.control.epoch_max_records == 20000
    with pytest.raises(SpecError, match=r"epoch_max_bytes bounds files.*epoch_max_records"):
        load_spec(kafka_spec(tmp_path, epoch_max_bytes="1MiB"))
    with pytest.raises(SpecError, match="reads the Kafka topic 'ysb', not a landing folder"):
        _ = spec.landing_dir


def test_a_kafka_spec_error_names_the_field_as_the_yaml_does(tmp_path):
    path = kafka_spec(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["source"]["chunk_records"] = 0
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"ysb_kafka.yaml: invalid pipeline spec: source.chunk_records: "):
        load_spec(path)


class FakeBroker:
    """Partitions and their watermarks, and each record's timestamp (5000 s + 10 s per partition
    + 1 ms per offset), in place of the broker calls of ``KafkaSource``."""

    def __init__(self, marks: dict[int, tuple[int, int]]) -> None:
        self.marks = marks

    def install(self, monkeypatch, source) -> None:
        monkeypatch.setattr(source, "_consumer", lambda: nullcontext(None))
        monkeypatch.setattr(source, "_partitions", lambda consumer: sorted(self.marks))
        monkeypatch.setattr(source, "_watermarks", lambda consumer, ps: {p: self.marks[p] for p in ps})
        monkeypatch.setattr(source, "_timestamp", lambda consumer, p, offset: 5000.0 + 10 * p + offset / 1000)


@pytest.mark.parametrize("recent", [2, 4, 500])
def test_backlog_counts_planned_registered_and_unregistered_chunks(tmp_path, monkeypatch, recent):
    """``KafkaSource.backlog`` from the manifest and a fake broker: chunks registered and not
    planned, records not registered yet (a partition's growth, a new partition), the oldest
    record's age, and the recent chunks' arrival times (``RECENT_CHUNKS`` of them)."""
    from sluice.sources import kafka

    monkeypatch.setattr(kafka, "RECENT_CHUNKS", recent)
    monkeypatch.setattr(kafka.time, "time", lambda: 6000.0)
    spec = load_spec(kafka_spec(tmp_path))  # topic ysb, chunk_records 1000
    log = EpochStore(f"sqlite:///{tmp_path}/s.db")
    try:
        source = kafka.KafkaSource(spec, log)
        broker = FakeBroker({0: (0, 2500), 1: (0, 1000), 2: (0, 300)})
        broker.install(monkeypatch, source)
        assert source.discover() == 5
        assert [e.path for e in log.manifest(spec.name)] == [
            "kafka://ysb/0/0-1000", "kafka://ysb/0/1000-2000", "kafka://ysb/0/2000-2500", "kafka://ysb/1/0-1000",
            "kafka://ysb/2/0-300"]
        lease = acquire_lease(log, spec.name, "run")
        plan_group(log, lease, epoch_size=2, k=1)  # [0, 2) planned
        broker.marks.update({0: (0, 3100), 3: (0, 50)})  # partition 0 grew; partition 3 is new
        backlog = source.backlog()
        assert (backlog.files, backlog.records, backlog.next_offset) == (5, 500 + 1000 + 300 + 600 + 50, 2)
        assert backlog.oldest_age_s == 6000.0 - 5002.0
        mtimes = [5000.0, 5001.0, 5002.0, 5010.0, 5020.0]
        assert backlog.arrivals == (*mtimes[-recent:], 5002.5, 5030.0)
        assert source.discover() == 7 and source._registered_ends() == {0: 3100, 1: 1000, 2: 300, 3: 50}
    finally:
        log.close()
