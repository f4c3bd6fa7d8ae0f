"""Yahoo Streaming Benchmark event generator, and an independent oracle of the YSB query.

    python -m include.generators.ysb --out var/landing/ysb --rate 2000 --duration 60 \
        --files-per-second 1 --seed 7 [--late-fraction 0.05 --late-max-s 30] [--realtime]

Events are JSON lines ``{user_id, page_id, ad_id, ad_type, event_type, event_time, ip_address}``
with ``event_time`` in epoch milliseconds as a string; 100 campaigns x 10 ads come from
``include/reference/ysb_ads.csv``. Files are written under a hidden name and renamed, so a
reader never sees half a file.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ADS_CSV = ROOT / "include" / "reference" / "ysb_ads.csv"
AD_TYPES = ("banner", "modal", "sponsored-search", "mail", "mobile")
EVENT_TYPES = ("view", "click", "purchase")
WINDOW_MS = 10_000


def load_ads(path: Path = ADS_CSV) -> dict[str, str]:
    with open(path, newline="") as fh:
        return {row["ad_id"]: row["campaign_id"] for row in csv.DictReader(fh)}


def write_ads(path: Path = ADS_CSV, campaigns: int = 100, ads_per_campaign: int = 10, seed: int = 0) -> None:
    """The reference table (deterministic: the same ids for the same seed)."""
    rnd = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["ad_id", "campaign_id"])
        for _ in range(campaigns):
            campaign = str(uuid.UUID(int=rnd.getrandbits(128), version=4))
            for _ in range(ads_per_campaign):
                out.writerow([str(uuid.UUID(int=rnd.getrandbits(128), version=4)), campaign])


def event_batches(*, rate: float = 1000, duration: float = 10, files_per_second: float = 1, seed: int = 0,
                  start_ms: int | None = None, late_fraction: float = 0.0, late_max_s: float = 30.0,
                  malformed_fraction: float = 0.0) -> Iterator[list[str]]:
    """``duration * files_per_second`` batches (a file's lines, or a burst of messages) of
    ``rate * duration`` events in all.

    Event times advance uniformly from ``start_ms``; a ``late_fraction`` of events carries an
    event time up to ``late_max_s`` seconds older (it lands in a later batch than its window).
    ``malformed_fraction`` of lines are broken on purpose (bad JSON, a missing field or a
    non-numeric time) to exercise the rejected-records table.
    """
    rnd = random.Random(seed)
    ads = list(load_ads())
    users = [str(uuid.UUID(int=rnd.getrandbits(128), version=4)) for _ in range(100)]
    pages = [str(uuid.UUID(int=rnd.getrandbits(128), version=4)) for _ in range(100)]
    start_ms = int(time.time() * 1000) if start_ms is None else start_ms
    n_batches = max(1, round(duration * files_per_second))
    per_batch = max(1, round(rate * duration / n_batches))
    span_ms = 1000.0 / files_per_second
    for f in range(n_batches):
        lines = []
        base = start_ms + f * span_ms
        for i in range(per_batch):
            t = int(base + i * span_ms / per_batch)
            if late_fraction and rnd.random() < late_fraction:
                t -= int(rnd.uniform(0, late_max_s * 1000))
            event = {"user_id": rnd.choice(users), "page_id": rnd.choice(pages), "ad_id": rnd.choice(ads),
                     "ad_type": rnd.choice(AD_TYPES), "event_type": rnd.choice(EVENT_TYPES),
                     "event_time": str(t), "ip_address": "1.2.3.4"}
            line = json.dumps(event)
            if malformed_fraction and rnd.random() < malformed_fraction:
                line = rnd.choice([line[: len(line) // 2],
                                   json.dumps({k: v for k, v in event.items() if k != "ad_id"}),
                                   line.replace(f'"{t}"', '"not-a-time"')])
            lines.append(line)
        yield lines


def generate(out: str | Path, *, rate: float = 1000, duration: float = 10, files_per_second: float = 1,
             seed: int = 0, start_ms: int | None = None, late_fraction: float = 0.0, late_max_s: float = 30.0,
             malformed_fraction: float = 0.0, realtime: bool = False, prefix: str = "ysb",
             progress: bool = False) -> list[Path]:
    """Write ``rate * duration`` events into ``duration * files_per_second`` files
    (``event_batches``), each written to a hidden name and renamed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    existing = len(list(out.glob(f"{prefix}-*.json")))
    paths = []
    batches = event_batches(rate=rate, duration=duration, files_per_second=files_per_second, seed=seed,
                            start_ms=start_ms, late_fraction=late_fraction, late_max_s=late_max_s,
                            malformed_fraction=malformed_fraction)
    n_files = max(1, round(duration * files_per_second))
    for f, lines in enumerate(batches):
        if realtime:
            time.sleep(max(0.0, 1.0 / files_per_second))
        path = out / f"{prefix}-{existing + f:06d}.json"
        tmp = out / f".{path.name}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        paths.append(path)
        if progress and (f + 1) % max(1, n_files // 10) == 0:
            print(f"  generated {f + 1}/{n_files} files", file=sys.stderr, flush=True)
    return paths


def produce(bootstrap: str, topic: str, *, partitions: int = 3, rate: float = 1000, duration: float = 10,
            files_per_second: float = 1, seed: int = 0, start_ms: int | None = None, late_fraction: float = 0.0,
            late_max_s: float = 30.0, malformed_fraction: float = 0.0, realtime: bool = False) -> int:
    """Send the events of ``event_batches`` to a Kafka topic (created with ``partitions``
    partitions if missing), one message per event, spread over the partitions in turn.
    Returns the number of messages sent."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic not in admin.list_topics(timeout=15).topics:
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result()
    # A topic just created can be listed before its partitions' leaders are known (its metadata
    # then shows no partitions): ask again until they are, rather than send to partition 0 of 0.
    deadline = time.monotonic() + 30
    while not (n_partitions := len(admin.list_topics(topic, timeout=15).topics[topic].partitions)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic!r} on {bootstrap} still lists no partitions after 30 s")
        time.sleep(0.2)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True})
    sent = 0
    for lines in event_batches(rate=rate, duration=duration, files_per_second=files_per_second, seed=seed,
                               start_ms=start_ms, late_fraction=late_fraction, late_max_s=late_max_s,
                               malformed_fraction=malformed_fraction):
        if realtime:
            time.sleep(max(0.0, 1.0 / files_per_second))
        for line in lines:
            producer.produce(topic, value=line.encode(), partition=sent % n_partitions)
            sent += 1
            producer.poll(0)
        producer.flush(30)
    if producer.flush(30):
        raise RuntimeError(f"{topic}: messages still unsent after 30 s")
    return sent


def consume(bootstrap: str, topic: str) -> list[tuple[str, int, bytes]]:
    """Every record ``topic`` holds now, as ``(kafka://topic/partition, offset, value)``, read
    with a plain consumer (not Spark, not sluice's reader): the oracle's input for Kafka."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "oracle", "enable.auto.commit": False})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=15).topics[topic].partitions)
        ends = {p: _watermarks(consumer, TopicPartition(topic, p)) for p in partitions}
        consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
        records, remaining = [], {p for p, (low, high) in ends.items() if high > low}
        while remaining:
            msg = consumer.poll(10)
            if msg is None:
                raise RuntimeError(f"the oracle's consumer got nothing from {topic} (still expected {remaining})")
            if msg.error():
                continue
            p, offset = msg.partition(), msg.offset()
            if offset < ends[p][1]:
                records.append((f"kafka://{topic}/{p}", offset, msg.value() or b""))
            if offset >= ends[p][1] - 1:
                remaining.discard(p)
        return records
    finally:
        consumer.close()


def _watermarks(consumer: Any, partition: Any, timeout_s: float = 60.0) -> tuple[int, int]:
    """A partition's low and high offsets. A broker that has just (re)started on its old data
    answers "not leader" (or "leader not available") until the partition's leader is elected:
    those are retried for ``timeout_s``; any other error is raised."""
    from confluent_kafka import KafkaError, KafkaException

    retriable = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.get_watermark_offsets(partition, timeout=15)
        except KafkaException as exc:
            if exc.args[0].code() not in retriable or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def parse_valid(line: str) -> dict | None:
    """The oracle's own validity rule: a JSON object with ad_id, event_type and a numeric
    event_time (the same contract as ``include/pipelines/ysb.yaml``, written independently)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    if not all(isinstance(event.get(k), str) for k in ("ad_id", "event_type", "event_time")):
        return None
    if not event["event_time"].isdigit():
        return None
    return event


#: The oracle's record size limit: the spec default of ``source.max_record_bytes``.
MAX_RECORD_BYTES = 1024 * 1024


def classify(records: Iterable[tuple[str, int, bytes]]) -> Iterator[tuple[str, int, dict | None]]:
    """``(where, line, event)`` for every non-blank raw record ``(where, line, bytes)``;
    ``event`` is None for a bad one: not UTF-8, above ``MAX_RECORD_BYTES``, or not valid by
    ``parse_valid``."""
    for where, n, raw in records:
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield where, n, None
            continue
        yield where, n, None if len(raw) > MAX_RECORD_BYTES else parse_valid(text)


def raw_events(paths: Iterable[str | Path]) -> Iterator[tuple[str, int, dict | None]]:
    """``classify`` of the raw files' lines, read as bytes: ``(file, line, event)``."""
    return classify((str(path), n, raw) for path in paths
                    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), start=1))


def window_counts(events: Iterable[tuple[str, int, dict | None]], ads: dict[str, str] | None = None) -> Counter:
    """Oracle: views per (campaign_id, window start in epoch ms) of classified events."""
    ads = load_ads() if ads is None else ads
    counts: Counter = Counter()
    for _, _, event in events:
        if event is None or event["event_type"] != "view" or event["ad_id"] not in ads:
            continue
        t = int(event["event_time"])
        counts[(ads[event["ad_id"]], t - t % WINDOW_MS)] += 1
    return counts


def expected_window_counts(paths: Iterable[str | Path], ads: dict[str, str] | None = None) -> Counter:
    """Oracle: views per (campaign_id, window start in epoch ms), from the raw files."""
    return window_counts(raw_events(paths), ads)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate YSB ad events as JSON-lines files, or into a Kafka topic.")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="landing folder")
    target.add_argument("--topic", help="a Kafka topic instead (created if missing)")
    p.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka brokers, with --topic")
    p.add_argument("--partitions", type=int, default=3, help="partitions of a topic created, with --topic")
    p.add_argument("--rate", type=float, default=1000, help="events per second of event time")
    p.add_argument("--duration", type=float, default=10, help="seconds of event time")
    p.add_argument("--files-per-second", type=float, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-ms", type=int, help="event time of the first event (default: now)")
    p.add_argument("--late-fraction", type=float, default=0.0, help="share of events arriving late")
    p.add_argument("--late-max-s", type=float, default=30.0, help="how late, at most, in seconds")
    p.add_argument("--malformed-fraction", type=float, default=0.0)
    p.add_argument("--realtime", action="store_true", help="sleep between files, as a live source would")
    a = p.parse_args(argv)
    if a.topic:
        sent = produce(a.bootstrap, a.topic, partitions=a.partitions, rate=a.rate, duration=a.duration,
                       files_per_second=a.files_per_second, seed=a.seed, start_ms=a.start_ms,
                       late_fraction=a.late_fraction, late_max_s=a.late_max_s,
                       malformed_fraction=a.malformed_fraction, realtime=a.realtime)
        print(f"sent {sent} events to Kafka topic {a.topic} on {a.bootstrap}")
        return 0
    paths = generate(a.out, rate=a.rate, duration=a.duration, files_per_second=a.files_per_second, seed=a.seed,
                     start_ms=a.start_ms, late_fraction=a.late_fraction, late_max_s=a.late_max_s,
                     malformed_fraction=a.malformed_fraction, realtime=a.realtime, progress=True)
    total = sum(1 for path in paths for _ in open(path))
    print(f"wrote {len(paths)} files, {total} events, into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
