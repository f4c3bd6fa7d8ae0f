"""The Kafka source's pure parts: chunks of a partition's offsets, their ranges per partition,
the spec rules of a Kafka source (the two clients' settings, no secrets in a spec) and the
clients' settings made from an Airflow connection (no broker, no Spark)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from itertools import pairwise

import pytest
import yaml

from sluice.errors import SourceError, SpecError
from sluice.paths import project_root
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.sources.kafka import (
    Chunk,
    KafkaSource,
    chunk_ranges,
    chunk_times,
    connection_settings,
    merge_adjacent,
    partition_ranges,
)
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


def kafka_spec(tmp_path, source=None, **control):
    raw = yaml.safe_load((project_root() / "include" / "pipelines" / "ysb_kafka.yaml").read_text())
    raw["control"].update(control)
    raw["source"].update(source or {})
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


def test_each_client_gets_its_own_settings_and_options_go_to_both(tmp_path):
    spec = load_spec(kafka_spec(tmp_path, source={
        "options": {"security.protocol": "SSL", "ssl.ca.location": "/ca.pem"},
        "discovery_options": {"ssl.endpoint.identification.algorithm": "none"},
        "spark_options": {"ssl.truststore.location": "/trust.p12", "ssl.truststore.type": "PKCS12"}}))
    source = spec.source
    assert source.librdkafka_options() == {"security.protocol": "SSL", "ssl.ca.location": "/ca.pem",
                                           "ssl.endpoint.identification.algorithm": "none"}
    # ssl.ca.location is librdkafka's alone: as before, options reach both, less what Java lacks.
    assert source.java_options() == {"security.protocol": "SSL", "ssl.truststore.location": "/trust.p12",
                                     "ssl.truststore.type": "PKCS12"}
    plain = load_spec(kafka_spec(tmp_path, source={"options": {"security.protocol": "PLAINTEXT"}})).source
    assert plain.librdkafka_options() == plain.java_options() == {"security.protocol": "PLAINTEXT"}


@pytest.mark.parametrize(("field", "key", "value", "says"), [
    ("discovery_options", "sasl.jaas.config", "org.example.Login required;", "Java Kafka client only"),
    ("options", "ssl.truststore.location", "/t.jks", "put it in source.spark_options"),
    ("spark_options", "ssl.ca.location", "/ca.pem", "put it in source.discovery_options"),
    ("spark_options", "sasl.mechanisms", "PLAIN", "librdkafka setting"),
    ("spark_options", "kafka.security.protocol", "SSL", "without the kafka. prefix"),
    ("options", "sasl.password", "hunter2-secret-value", "holds a secret"),
    ("discovery_options", "ssl.key.password", "hunter2-secret-value", "holds a secret"),
    ("spark_options", "ssl.keystore.password", "hunter2-secret-value", "holds a secret"),
    ("spark_options", "sasl.jaas.config",
     'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="hunter2-secret-value";',
     "holds a secret"),
])
def test_a_setting_for_the_other_client_or_a_secret_is_refused_naming_the_field(tmp_path, field, key, value, says):
    """Issue 37 item 4: librdkafka refused Java settings that came in the shared options, and a
    password had nowhere to go but the spec. The error names the pipeline's file and the field,
    and never repeats the value."""
    with pytest.raises(SpecError) as raised:
        load_spec(kafka_spec(tmp_path, source={field: {key: value}}))
    message = str(raised.value)
    assert f"ysb_kafka.yaml: invalid pipeline spec: source.{field}:" in message and repr(key) in message, message
    assert says in message, message
    assert "hunter2" not in message


def test_a_connection_gives_both_clients_their_security_settings():
    rd, java = connection_settings("alice", 'p"w\\x', {"security_protocol": "SASL_SSL", "ssl_ca_location": "/ca.pem"})
    assert rd == {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN", "sasl.username": "alice",
                  "sasl.password": 'p"w\\x', "ssl.ca.location": "/ca.pem"}
    assert java == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                    "sasl.jaas.config": 'org.apache.kafka.common.security.plain.PlainLoginModule required '
                                        'username="alice" password="p\\"w\\\\x";',
                    "ssl.truststore.location": "/ca.pem", "ssl.truststore.type": "PEM"}
    # The protocol follows from what the connection holds; SCRAM takes its own login module; a
    # truststore of its own (with its password) is the Java client's; librdkafka-style keys work.
    rd, java = connection_settings("bob", "pw", {"sasl.mechanism": "scram-sha-512", "ssl_check_hostname": "false",
                                                 "ssl_truststore_location": "/t.jks", "ssl_truststore_password": "tp"})
    assert rd["security.protocol"] == java["security.protocol"] == "SASL_SSL"
    assert rd["sasl.mechanisms"] == "SCRAM-SHA-512"
    assert java["sasl.jaas.config"].startswith("org.apache.kafka.common.security.scram.ScramLoginModule required")
    assert (java["ssl.truststore.type"], java["ssl.truststore.password"]) == ("JKS", "tp")
    assert rd["ssl.endpoint.identification.algorithm"] == "none" and java["ssl.endpoint.identification.algorithm"] == ""
    plaintext = {"security.protocol": "PLAINTEXT"}
    assert connection_settings(None, None, {}) == (plaintext, plaintext)
    assert connection_settings(None, None, {"ssl_ca_location": "/ca.pem"})[0] == {"security.protocol": "SSL",
                                                                              "ssl.ca.location": "/ca.pem"}
    with pytest.raises(ValueError, match="needs the SASL username and password"):
        connection_settings("alice", None, {"security_protocol": "SASL_PLAINTEXT"})
    with pytest.raises(ValueError, match="'GSSAPI' is not one of") as raised:
        connection_settings("alice", "secret-pw", {"sasl_mechanism": "GSSAPI"})
    assert "secret-pw" not in str(raised.value)


def test_a_missing_connection_is_named_with_where_to_define_it(tmp_path, monkeypatch):
    from sluice.airflow import hooks

    def missing(conn_id):
        raise LookupError("AirflowNotFoundException looking it up")

    monkeypatch.setattr(hooks, "kafka_connection", missing)
    spec = load_spec(kafka_spec(tmp_path, source={"connection": "kafka_prod"}))
    with pytest.raises(SourceError, match=r"pipeline 'ysb_kafka': .*no Airflow connection 'kafka_prod' "
                                          r"\(source.connection\).*AIRFLOW_CONN_KAFKA_PROD"):
        _ = KafkaSource(spec, None)._settings  # type: ignore[arg-type]
    monkeypatch.setattr(hooks, "kafka_connection", lambda conn_id: ("u", "the-pw", {"security_protocol": "NOPE"}))
    with pytest.raises(SourceError, match=r"pipeline 'ysb_kafka'.*connection 'kafka_prod'.*'NOPE' is not one of"):
        _ = KafkaSource(spec, None)._settings  # type: ignore[arg-type]


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
        # the topic's ID: without it each discovery waited out an AdminClient's timeout (~45 s a test)
        monkeypatch.setattr(source, "_topic_id", lambda: "fake-topic-id")


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


def test_a_kafka_connection_resolves_from_its_environment_variable_and_passes_on_to_a_job(monkeypatch):
    """``kafka_connection`` reads an Airflow connection (here ``AIRFLOW_CONN_<ID>``, as a job
    outside Airflow does); ``kafka_connection_env`` is what such a job needs to read it too."""
    from sluice.airflow.hooks import kafka_connection, kafka_connection_env

    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_UNIT", json.dumps({
        "conn_type": "generic", "login": "alice", "password": "pw-1234567",
        "extra": {"security_protocol": "SASL_SSL", "ssl_ca_location": "/c"}}))
    found = kafka_connection("kafka_unit")
    assert found == ("alice", "pw-1234567", {"security_protocol": "SASL_SSL", "ssl_ca_location": "/c"})
    env = kafka_connection_env("kafka_unit")
    assert list(env) == ["AIRFLOW_CONN_KAFKA_UNIT"]
    monkeypatch.delenv("AIRFLOW_CONN_KAFKA_UNIT")
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_UNIT2", env["AIRFLOW_CONN_KAFKA_UNIT"])
    assert kafka_connection("kafka_unit2") == found
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_BROKEN", "{not json pw-1234567")
    for conn_id in ("kafka_unit", "kafka_broken"):
        with pytest.raises(LookupError) as raised:
            kafka_connection(conn_id)
        assert "pw-1234567" not in str(raised.value)


def test_the_submit_task_hands_the_kafka_connection_to_its_job(tmp_path, monkeypatch):
    """``RunGroupSubmitOperator`` puts ``AIRFLOW_CONN_<ID>`` in the spark-submit job's environment
    (the job runs outside the task and resolves the connection from it), and nothing of it in
    the command's conf."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from sluice.airflow.submit import RunGroupSubmitOperator

    secret = "pw-submit-98765"
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_SUBMIT", json.dumps({
        "conn_type": "kafka", "login": "alice", "password": secret, "extra": {"security_protocol": "SASL_PLAINTEXT"}}))
    monkeypatch.setenv("SLUICE_STORE_URL", f"sqlite:///{tmp_path}/s.db")
    spec = load_spec(kafka_spec(tmp_path, source={"connection": "kafka_submit"}))
    monkeypatch.setattr("sluice.airflow.submit.get_spec", lambda name: spec)
    seen = {}
    monkeypatch.setattr(SparkSubmitOperator, "execute", lambda self, context: seen.update(env=dict(self.env_vars),
                                                                                          conf=dict(self.conf)))

    class TI:
        def xcom_pull(self, task_ids):
            return {}

    op = RunGroupSubmitOperator(task_id="run_group", pipeline=spec.name, application="x.py", conf={"a": "b"})
    op.execute({"ti": TI()})
    conn = json.loads(seen["env"]["AIRFLOW_CONN_KAFKA_SUBMIT"])
    assert (conn["login"], conn["password"]) == ("alice", secret)
    assert secret not in json.dumps(seen["conf"])
