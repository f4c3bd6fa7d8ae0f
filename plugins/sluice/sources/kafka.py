"""``KafkaSource``: a Kafka topic of JSON records as an offset source.

New records are registered in the manifest as *chunks*: at most ``source.chunk_records``
consecutive offsets of one partition, ``kafka://<topic>/<partition>/<start>-<end>``, with the
chunk's record count as its size and its first record's timestamp as its arrival time. Chunks
are registered oldest first, so an epoch (a range of manifest positions, as for files) is a
fixed set of per-partition offset ranges, read as a Spark *batch* with exact ``startingOffsets``
and ``endingOffsets``: a rerun or a recompute reads exactly the same records. Partitions added
to the topic are picked up at the next discovery, from their earliest offset.

Kafka deletes old records by retention. A range whose records are gone cannot be read again:
``check_retained`` refuses it (and with it a rollback or backfill that would need it), naming
the partition and offsets. Records deleted before sluice registered them stop the pipeline
(``source.fail_on_data_loss``), as Structured Streaming's ``failOnDataLoss`` does.

sluice's own client (discovery, backlog, retention checks) is confluent-kafka; it never joins a
consumer group or commits offsets: the epoch store holds the offsets.

Two clients, two settings maps: ``source.options`` go to both (librdkafka as is, Spark's Java
client prefixed with ``kafka.``), ``source.discovery_options`` to librdkafka alone,
``source.spark_options`` to the Java client alone. Credentials come from the Airflow connection
``source.connection`` (``connection_settings`` turns its login, password and extra into both
clients' settings), resolved here at run time: they are never in the spec, and errors and logs
name the connection, never its secrets.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from sluice.errors import SourceError
from sluice.sources.base import Backlog, EntrySource
from sluice.spec import KafkaSourceSpec, PipelineSpec
from sluice.store import EpochStore, ManifestEntry

if TYPE_CHECKING:
    from confluent_kafka import Consumer
    from pyspark.sql import DataFrame, SparkSession


log = logging.getLogger(__name__)

_CHUNK = re.compile(r"^kafka://(?P<topic>[^/]+)/(?P<partition>\d+)/(?P<start>\d+)-(?P<end>\d+)$")
#: How long sluice's client waits for the broker before it reports the source unreachable.
TIMEOUT_S = 15.0
#: Recent chunks whose arrival times feed the controllers' arrival rate.
RECENT_CHUNKS = 500

SKIP_HINT = ("Skip the chunk on purpose (recorded, through sluice_skip_file): the console's skip-file action "
             "with the kafka:// path above, or `make skip-file PIPELINE=<name> FILE=<path> REASON=<why>`")


#: The SASL mechanisms a connection may name, and the JAAS login module each needs in Java.
LOGIN_MODULES = {"PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
                 "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
                 "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule"}
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


def _jaas_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _false(value: Any) -> bool:
    return str(value).strip().lower() in ("false", "0", "no", "off")


def connection_settings(login: str | None, password: str | None,
                        extra: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """librdkafka's settings and the Java client's (without ``kafka.``) from an Airflow
    connection: login and password are the SASL username and password; ``extra`` (keys with
    ``_`` or ``.``) may set ``security_protocol``, ``sasl_mechanism``, ``ssl_ca_location`` (a
    PEM file: librdkafka's CA, and the Java client's truststore unless one is given),
    ``ssl_truststore_location``/``_type``/``_password``, ``ssl_check_hostname``. ``ValueError``
    (never quoting a secret) for what cannot work."""
    x = {str(k).replace(".", "_").lower(): v for k, v in (extra or {}).items()}
    username = login or x.get("sasl_username")
    password = password or x.get("sasl_password")
    ca = x.get("ssl_ca_location")
    truststore = x.get("ssl_truststore_location")
    tls = bool(ca or truststore)
    protocol = str(x.get("security_protocol") or
                   (("SASL_SSL" if tls else "SASL_PLAINTEXT") if username else ("SSL" if tls else "PLAINTEXT"))).upper()
    if protocol not in PROTOCOLS:
        raise ValueError(f"extra.security_protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    rd: dict[str, str] = {"security.protocol": protocol}
    java: dict[str, str] = {"security.protocol": protocol}
    if protocol.startswith("SASL"):
        mechanism = str(x.get("sasl_mechanism") or x.get("sasl_mechanisms") or "PLAIN").upper()
        if mechanism not in LOGIN_MODULES:
            raise ValueError(f"extra.sasl_mechanism {mechanism!r} is not one of {', '.join(LOGIN_MODULES)}")
        if not username or not password:
            raise ValueError(f"security protocol {protocol} needs the SASL username and password as the "
                             "connection's login and password")
        rd.update({"sasl.mechanisms": mechanism, "sasl.username": str(username), "sasl.password": str(password)})
        java.update({"sasl.mechanism": mechanism,
                     "sasl.jaas.config": f"{LOGIN_MODULES[mechanism]} required username={_jaas_quote(str(username))} "
                                         f"password={_jaas_quote(str(password))};"})
    if protocol.endswith("SSL"):
        if ca:
            rd["ssl.ca.location"] = str(ca)
        if truststore:
            java["ssl.truststore.location"] = str(truststore)
            kind = x.get("ssl_truststore_type") or ("JKS" if str(truststore).endswith(".jks") else
                                                     "PEM" if str(truststore).endswith((".pem", ".crt")) else "PKCS12")
            java["ssl.truststore.type"] = str(kind).upper()
            if x.get("ssl_truststore_password"):
                java["ssl.truststore.password"] = str(x["ssl_truststore_password"])
        elif ca:
            java.update({"ssl.truststore.location": str(ca), "ssl.truststore.type": "PEM"})
        if "ssl_check_hostname" in x and _false(x["ssl_check_hostname"]):
            rd["ssl.endpoint.identification.algorithm"] = "none"
            java["ssl.endpoint.identification.algorithm"] = ""
    return rd, java


@dataclass(frozen=True)
class Chunk:
    """Offsets ``[start, end)`` of one partition: one manifest entry."""

    topic: str
    partition: int
    start: int
    end: int

    @classmethod
    def parse(cls, path: str) -> Chunk:
        match = _CHUNK.match(path)
        if match is None:
            raise SourceError(f"{path!r} is not a Kafka chunk (kafka://<topic>/<partition>/<start>-<end>)")
        return cls(match["topic"], int(match["partition"]), int(match["start"]), int(match["end"]))

    @staticmethod
    def prefix(topic: str) -> str:
        """What the paths of a topic's chunks start with."""
        return f"kafka://{topic}/"

    @property
    def path(self) -> str:
        return f"{self.prefix(self.topic)}{self.partition}/{self.start}-{self.end}"


def chunk_ranges(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ranges of at most ``size`` offsets."""
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def chunk_times(ranges: list[tuple[int, int]], first_s: float, last_s: float) -> list[float]:
    """When each chunk's first record arrived, interpolated by offset between the first chunk's
    (``first_s``) and the last chunk's (``last_s``), both read from the broker: two reads per
    partition instead of one per chunk (12-15 ms each: 4 s for 320 chunks, measured). Never
    decreasing, so a partition's chunks stay in offset order whatever the producers' clocks."""
    if not ranges:
        return []
    start, last = ranges[0][0], ranges[-1][0]
    slope = max(0.0, (last_s - first_s) / (last - start)) if last > start else 0.0
    return [first_s + slope * (a - start) for a, _ in ranges]


def partition_ranges(chunks: list[Chunk]) -> dict[int, tuple[int, int]]:
    """Per partition, the offsets from the first chunk's start to the last one's end."""
    found: dict[int, tuple[int, int]] = {}
    for c in chunks:
        low, high = found.get(c.partition, (c.start, c.end))
        found[c.partition] = (min(low, c.start), max(high, c.end))
    return found


def merge_adjacent(chunks: list[tuple[Chunk, Any]]) -> list[tuple[Chunk, Any]]:
    """Consecutive chunks of one partition with the same tag (epoch) as one range: fewer
    rows in the chunks a read joins with."""
    merged: list[tuple[Chunk, Any]] = []
    for chunk, tag in sorted(chunks, key=lambda ct: (ct[0].partition, ct[0].start)):
        if merged:
            last, last_tag = merged[-1]
            if last.partition == chunk.partition and last.end == chunk.start and last_tag == tag:
                merged[-1] = (Chunk(last.topic, last.partition, last.start, chunk.end), tag)
                continue
        merged.append((chunk, tag))
    return merged


class KafkaSource(EntrySource):
    def __init__(self, spec: PipelineSpec, store: EpochStore) -> None:
        super().__init__(spec, store)
        assert isinstance(spec.source, KafkaSourceSpec)
        self.kafka: KafkaSourceSpec = spec.source
        self.topic = spec.source.topic

    # -- the broker --------------------------------------------------------------------------

    @cached_property
    def _settings(self) -> tuple[dict[str, str], dict[str, str]]:
        """librdkafka's settings and the Java client's (without ``kafka.``): the spec's, then
        the connection's (``source.connection``, resolved now: never stored or passed on)."""
        librdkafka, java = self.kafka.librdkafka_options(), self.kafka.java_options()
        conn_id = self.kafka.connection
        if conn_id:
            from sluice.airflow.hooks import kafka_connection

            try:
                login, password, extra = kafka_connection(conn_id)
            except LookupError as exc:
                raise SourceError(f"{self._where()}: no Airflow connection {conn_id!r} (source.connection) holds "
                                  f"the brokers' credentials ({exc}): define it in Airflow, or outside Airflow as "
                                  f"the environment variable AIRFLOW_CONN_{conn_id.upper()}") from None
            self._secrets = [str(v) for v in (password, *(v for k, v in extra.items()
                                                         if "password" in k.lower() or "secret" in k.lower()))
                             if v]
            try:
                rd, jv = connection_settings(login, password, extra)
            except ValueError as exc:
                raise SourceError(f"{self._where()}: {self._scrub(str(exc))}") from None
            librdkafka.update(rd)
            java.update(jv)
        return librdkafka, java

    _secrets: list[str] = []

    def _scrub(self, text: str) -> str:
        """``text`` (a client's error) with the connection's secrets masked."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _on_error(self, error: Any) -> None:
        """librdkafka's error callback (served by ``poll``): remember an authentication or TLS
        failure, which no retry mends, so the caller stops at once instead of timing out."""
        from confluent_kafka import KafkaError

        if error.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL):
            self._refused = error

    _refused: Any = None

    def _client_config(self, **base: Any) -> dict[str, Any]:
        return {"bootstrap.servers": self.kafka.bootstrap_servers, "socket.timeout.ms": int(TIMEOUT_S * 1000),
                "log_level": 3, **base, **self._settings[0], "error_cb": self._on_error}

    def _check_refused(self, client: Any) -> None:
        """``SourceError`` when the brokers refused the client (credentials, TLS), naming the
        pipeline and the connection, never its secrets."""
        client.poll(0)  # serves the error callback
        if self._refused is not None:
            conn = f"the Airflow connection {self.kafka.connection!r}" if self.kafka.connection else \
                "source.connection (none is set)"
            raise SourceError(f"{self._where()}: the brokers refused sluice's client: "
                              f"{self._scrub(self._refused.str())}. Check the credentials and TLS settings of {conn}")

    def _asked(self, client: Any, ask: Any, failed: type[BaseException] | tuple[type[BaseException], ...]) -> Any:
        """``ask(timeout)`` retried in short slices for up to ``TIMEOUT_S``, stopping at once when
        the brokers refuse the client; the last failure is raised when time runs out."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                return ask(min(1.0, max(0.1, deadline - time.monotonic())))
            except failed:
                self._check_refused(client)
                if time.monotonic() >= deadline:
                    raise

    @contextmanager
    def _consumer(self) -> Iterator[Consumer]:
        from confluent_kafka import Consumer

        # fetch.wait.max.ms: discovery reads single records partition after partition; with the
        # default 500 ms each re-assignment waited out the previous partition's pending fetch
        # (measured: 0.5 s per timestamp read, 0.02 s with 10 ms).
        consumer = Consumer(self._client_config(**{"group.id": f"sluice-{self.spec.name}", "enable.auto.commit": False,
                                                   "enable.partition.eof": False, "fetch.wait.max.ms": 10}))
        try:
            yield consumer
        finally:
            consumer.close()

    def _where(self) -> str:
        conn = f" (connection {self.kafka.connection!r})" if self.kafka.connection else ""
        return f"pipeline {self.spec.name!r}: Kafka topic {self.topic!r} on {self.kafka.bootstrap_servers}{conn}"

    def _partitions(self, consumer: Consumer) -> list[int]:
        from confluent_kafka import KafkaException

        try:
            metadata = self._asked(consumer, lambda t: consumer.list_topics(self.topic, timeout=t), KafkaException)
        except KafkaException as exc:
            raise SourceError(f"{self._where()}: the brokers did not answer: {self._scrub(str(exc))}") from None
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None:
            raise SourceError(f"{self._where()}: {topic.error if topic else 'no such topic'}")
        return sorted(topic.partitions)

    def _watermarks(self, consumer: Consumer, partitions: list[int]) -> dict[int, tuple[int, int]]:
        """Per partition, ``(low, high)``: the earliest offset held and the next to be written."""
        from confluent_kafka import KafkaException, TopicPartition

        found = {}
        for p in partitions:
            try:
                found[p] = consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=TIMEOUT_S)
            except KafkaException as exc:
                raise SourceError(f"{self._where()}: offsets of partition {p}: {self._scrub(str(exc))}") from None
        return found

    def _timestamp(self, consumer: Consumer, partition: int, offset: int) -> float:
        """The timestamp (epoch seconds) of the first record at or after ``offset``."""
        from confluent_kafka import TopicPartition

        consumer.assign([TopicPartition(self.topic, partition, offset)])
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error() is not None:
                continue
            if msg.partition() == partition and msg.offset() >= offset:
                return msg.timestamp()[1] / 1000.0
        raise SourceError(f"{self._where()}: could not read the record at offset {offset} of partition {partition} "
                          f"within {TIMEOUT_S:.0f} s")

    def _topic_id(self) -> str | None:
        """The topic's ID (Kafka's UUID of this incarnation of the name), ``None`` where the
        broker does not say (before KIP-516) or the client cannot ask."""
        from concurrent.futures import TimeoutError as FutureTimeout

        from confluent_kafka import KafkaException, TopicCollection
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self._client_config())
        try:
            found = admin.describe_topics(TopicCollection([self.topic]), request_timeout=TIMEOUT_S)
            # in slices: a client the brokers refuse (credentials, TLS) stops at once
            topic_id = self._asked(admin, found[self.topic].result, (FutureTimeout, TimeoutError)).topic_id
        except (KafkaException, KeyError, TimeoutError, FutureTimeout, TypeError, ValueError) as exc:
            log.debug("%s: no topic ID (%s)", self._where(), self._scrub(str(exc)))
            return None
        except SourceError as exc:
            # refused: an AdminClient has no close(); dropped here and from the error's traceback,
            # it stops retrying the brokers at once, not whenever the error is collected
            admin = found = None
            raise exc.with_traceback(None) from None
        text = str(topic_id) if topic_id is not None else ""
        return text if text and set(text) != {"0"} else None

    def _check_identity(self) -> tuple[str | None, str | None]:
        """Stop when the topic's ID is not the one its registered records came from (the topic
        was deleted and re-created: offsets from the old end on would skip the new topic's first
        records, even when it already holds more than the old one did). Returns the ID now and
        the one recorded."""
        now = self._topic_id()
        recorded = (self.store.source_identity(self.spec.name) or {}).get("topic_id")
        if now is not None and recorded is not None and now != recorded:
            raise SourceError(f"{self._where()}: the topic was deleted and re-created since sluice registered its "
                              f"records (its topic ID was {recorded}, it is {now}). Nothing new is registered, so "
                              "no record of the new topic is skipped unseen. To go on, point the pipeline at a new "
                              "topic name, or start a new pipeline on this topic.")
        return now, recorded

    def _registered_ends(self) -> dict[int, int]:
        """Per partition, the end of its last registered chunk (the store's aggregate over the
        topic's chunks, not a scan of the manifest)."""
        return self.store.chunk_ends(self.spec.name, Chunk.prefix(self.topic))

    def _unregistered(self, consumer: Consumer, ends: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Per partition, the offsets written and not registered yet, ``(start, high)``;
        records retention deleted before they were registered are reported (data loss)."""
        marks = self._watermarks(consumer, self._partitions(consumer))
        found = {}
        went_back = {p: (ends[p], high) for p, (_, high) in marks.items() if p in ends and high < ends[p]}
        if went_back:
            # The topic was deleted and re-created (or truncated): its offsets start again, and
            # registering from the old end would silently skip the new topic's first records.
            detail = ", ".join(f"partition {p} ends at offset {high}, below the {end} already registered"
                               for p, (end, high) in sorted(went_back.items()))
            raise SourceError(f"{self._where()}: the topic's offsets went back ({detail}): it was deleted and "
                              "re-created, or truncated, since sluice registered its records. Nothing new is "
                              "registered, so no record of the new topic is skipped unseen. To go on, point the "
                              "pipeline at a new topic name, or start a new pipeline on this topic.")
        for p, (low, high) in marks.items():
            start = ends.get(p, low)  # a partition never seen: from its earliest record
            if start < low:
                lost = (f"{self._where()}: records [{start}, {low}) of partition {p} were deleted (retention) before "
                        "sluice registered them")
                if self.kafka.fail_on_data_loss:
                    raise SourceError(f"{lost}. They cannot be processed. To go on from offset {low}, set "
                                      "source.fail_on_data_loss: false (the loss is then logged).")
                log.warning("%s; going on from offset %s (source.fail_on_data_loss: false)", lost, low)
                start = low
            if high > start:
                found[p] = (start, high)
        return found

    # -- discovery and backlog ---------------------------------------------------------------

    def discover(self) -> int:
        """Register the records written since the last discovery as chunks, oldest first."""
        topic_id, recorded = self._check_identity()
        with self._consumer() as consumer:
            new: list[tuple[float, int, int, Chunk]] = []
            for p, (start, high) in self._unregistered(consumer, self._registered_ends()).items():
                ranges = chunk_ranges(start, high, self.kafka.chunk_records)
                first = self._timestamp(consumer, p, start)
                last = self._timestamp(consumer, p, ranges[-1][0]) if len(ranges) > 1 else first
                for (a, b), at in zip(ranges, chunk_times(ranges, first, last), strict=True):
                    new.append((at, p, a, Chunk(self.topic, p, a, b)))
        new.sort(key=lambda chunk: chunk[:3])  # by time; a partition's chunks in offset order on ties
        if topic_id is not None and recorded is None:
            # first sight (a new pipeline, or one registered before IDs were recorded): recorded
            # before anything of this topic is registered under it
            self.store.record_source_identity(self.spec.name, {"topic_id": topic_id})
        return self.store.register_files(self.spec.name, [(c.path, c.end - c.start, at) for at, _, _, c in new])

    def backlog(self) -> Backlog:
        """Chunks registered and not planned, plus the records not registered yet: their count
        (the sum of the partitions' lags) and the age of the oldest (its timestamp)."""
        next_offset = self.store.next_offset(self.spec.name)
        # One read of the manifest: the unplanned chunks and the recent ones (for the arrivals).
        entries = self.store.manifest_tail(self.spec.name, next_offset, RECENT_CHUNKS)
        pending = [e for e in entries if e.position >= next_offset]
        recent = entries[-RECENT_CHUNKS:]
        self._check_identity()
        with self._consumer() as consumer:
            unregistered = self._unregistered(consumer, self._registered_ends())
            first = [self._timestamp(consumer, p, start) for p, (start, _) in unregistered.items()]
        records = sum(e.size for e in pending) + sum(high - start for start, high in unregistered.values())
        chunks = len(pending) + sum(math.ceil((high - start) / self.kafka.chunk_records)
                                    for start, high in unregistered.values())
        times = [e.mtime for e in pending] + first
        return Backlog(files=chunks, bytes=0, records=records, next_offset=next_offset,
                       oldest_age_s=max(0.0, time.time() - min(times)) if times else None,
                       arrivals=tuple(e.mtime for e in recent) + tuple(first))

    # -- ranges ------------------------------------------------------------------------------

    def describe(self, entries: list[ManifestEntry]) -> dict[str, Any]:
        chunks = [Chunk.parse(e.path) for e in entries if e.skipped is None]
        return {"topic": self.topic,
                "partitions": {str(p): list(r) for p, r in sorted(partition_ranges(chunks).items())},
                "skipped": [e.path for e in entries if e.skipped is not None]}

    def check_retained(self, start: int, end: int) -> list[ManifestEntry]:
        """The chunks of ``[start, end)`` (less any skipped on purpose); ``SourceError`` naming
        the first whose records the topic no longer holds."""
        entries = [e for e in self.entries(start, end) if e.skipped is None]
        if not entries:
            return entries
        with self._consumer() as consumer:
            present = set(self._partitions(consumer))
            chunks = [(e, Chunk.parse(e.path)) for e in entries]
            marks = self._watermarks(consumer, sorted({c.partition for _, c in chunks} & present))
        for entry, chunk in chunks:
            if chunk.partition not in marks:
                raise SourceError(f"{self._where()}: partition {chunk.partition} of {entry.path} (offset "
                                  f"{entry.position}) no longer exists. {SKIP_HINT}")
            low, high = marks[chunk.partition]
            if chunk.start < low:
                raise SourceError(
                    f"{self._where()}: records [{chunk.start}, {chunk.end}) of partition {chunk.partition} "
                    f"({entry.path}, offset {entry.position}) are no longer in the topic: retention (or a "
                    "delete-records) moved the "
                    f"partition's start to {low}. A rerun must read the same records, so this range cannot be read "
                    f"again. {SKIP_HINT}")
            if chunk.end > high:
                raise SourceError(
                    f"{self._where()}: partition {chunk.partition} ends at offset {high}, before {entry.path} "
                    f"(offset {entry.position}) ends: was the topic deleted and created again? {SKIP_HINT}")
        return entries

    def _read(self, spark: SparkSession, entries: list[ManifestEntry], epoch_of: dict[int, int] | None) -> DataFrame:
        """The records of the chunks, as numbered lines (``_file`` = ``kafka://topic/partition``,
        ``_line`` = offset, ``_text`` = the value) parsed like a file's; with ``epoch_of``
        (manifest position -> epoch), each record's ``_epoch``."""
        from pyspark.sql import functions as F

        if not entries:  # every chunk of the range was skipped on purpose
            return self.empty_records(spark, epoch_of is not None)
        tagged = merge_adjacent([(Chunk.parse(e.path), epoch_of[e.position] if epoch_of else 0) for e in entries])
        ranges = partition_ranges([c for c, _ in tagged])
        options = {
            "kafka.bootstrap.servers": self.kafka.bootstrap_servers,
            "assign": json.dumps({self.topic: sorted(ranges)}),
            "startingOffsets": json.dumps({self.topic: {str(p): r[0] for p, r in ranges.items()}}),
            "endingOffsets": json.dumps({self.topic: {str(p): r[1] for p, r in ranges.items()}}),
            "failOnDataLoss": "true",  # checked retained just before: a gap now is a real loss
            **{f"kafka.{k}": v for k, v in self._settings[1].items()},
        }
        records = spark.read.format("kafka").options(**options).load()
        # Each record takes its chunk's epoch by a broadcast join with the chunks, not by a CASE
        # of their offsets: Spark writes int literals into the Java source it generates, so the
        # offsets made each group's read new classes on a long-lived server. A chunk skipped on
        # purpose leaves a hole in its partition's range: the join keeps records inside a chunk.
        chunks = spark.createDataFrame([(c.partition, c.start, c.end, tag) for c, tag in tagged],
                                       "_chunk_partition int, _chunk_start long, _chunk_end long, _epoch int")
        inside = ((F.col("partition") == F.col("_chunk_partition")) & (F.col("offset") >= F.col("_chunk_start"))
                  & (F.col("offset") < F.col("_chunk_end")))
        lines = self.numbered_lines(records.join(F.broadcast(chunks), inside), "_epoch")
        if epoch_of is None:
            lines = lines.drop("_epoch")
        return self.parse_lines(lines)

    def numbered_lines(self, records: DataFrame, *keep: str) -> DataFrame:
        """Kafka's rows (batch or stream) as a file's numbered lines: ``_file`` =
        ``kafka://topic/partition``, ``_line`` = the offset, ``_text`` = the value."""
        from pyspark.sql import functions as F

        return records.select(
            F.concat(F.lit(f"kafka://{self.topic}/"), F.col("partition").cast("string")).alias("_file"),
            F.col("offset").alias("_line"),
            # A message without a value (a tombstone) holds no record, as a blank line does not.
            F.coalesce(F.col("value").cast("string"), F.lit("")).alias("_text"),
            *keep,
        )
