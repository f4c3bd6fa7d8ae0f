"""The Kafka source on a broker that wants credentials and TLS (issue 37 item 4): one KRaft JVM
(``include/kafka/broker.py``) with a PLAINTEXT listener, a SASL_PLAINTEXT one (mechanism PLAIN)
and an SSL one whose certificate a throw-away CA signed (``make_tls``, openssl, into tmp). The
credentials and the CA reach sluice only through an Airflow connection (``source.connection``,
here ``AIRFLOW_CONN_<ID>`` as Airflow itself reads it): sluice's discovery client (librdkafka) and
Spark's Java client each get their own settings from it. Each pipeline appends the records it
reads (a SQL transform, no aggregation, no suite: the cost is the clients', not the transform's);
its table is checked against what the test sent, parsed in the test (not read back through sluice
or Kafka): every record once. A wrong password stops discovery at once with a SourceError naming
the pipeline and the connection and not the password (as does a CA that did not sign the
broker's certificate); the password is nowhere in the spec, the
epoch store's file or sluice's log records.

Cost, measured on 2 shared cores (load 3-4): ~45 s alone, of which the broker ~5 s (its own
JVM with all three listeners, started once for the file), the Spark session's start ~5-10 s, the
SASL group ~20 s (the first group in the JVM), the TLS group ~11 s, the two refusals ~1.5 s
each; ~31 s in a run where Spark is already warm. Under heavy contention (load 8-10) the file
took 65-80 s alone.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

import sluice.airflow.hooks  # noqa: F401  Airflow sets logging up when imported: before caplog's handler
from include.generators.ysb import event_batches
from include.kafka.broker import make_tls, start
from sluice import protocol
from sluice.errors import SourceError
from sluice.protocol.run import run_once
from sluice.sources import source_for
from sluice.spec import PipelineSpec
from sluice.store import EpochStore
from tests.pipelines import make_pipeline, rejected_lines

pytestmark = pytest.mark.kafka

USER = "sluice"
COLUMNS = ("user_id", "ad_id", "event_type", "event_time")


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """One broker, three listeners: (broker, tls, the user's password)."""
    root = tmp_path_factory.mktemp("kafka-secure")
    password = f"pw-{uuid.uuid4().hex}"
    tls = make_tls(root / "tls")
    broker = start(root / "broker", sasl_users={"admin": f"admin-{uuid.uuid4().hex}", USER: password}, tls=tls)
    try:
        yield broker, tls, password
    finally:
        broker.stop()


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


def connect(monkeypatch, conn_id: str, **conn) -> str:
    """An Airflow connection as an environment variable (what BaseHook reads first)."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "kafka", **conn}))
    return conn_id


def send(config: dict, topic: str, seed: int, events: int = 300, partitions: int = 3) -> list[str]:
    """Create ``topic`` and send ``events`` YSB events through a plain client with ``config``
    (the secured listener's settings); returns the lines sent, the oracle's input."""
    admin = AdminClient(config)
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(timeout=30)
    deadline = time.monotonic() + 30
    while len(admin.list_topics(topic, timeout=15).topics[topic].partitions) < partitions:
        assert time.monotonic() < deadline, "the topic's partitions never showed"
        time.sleep(0.2)
    producer = Producer({**config, "linger.ms": 20})
    lines = [line for batch in event_batches(rate=events, duration=1, seed=seed,
                                             start_ms=1_767_225_600_000 + 10_000 * seed) for line in batch]
    for i, line in enumerate(lines):
        producer.produce(topic, value=line.encode(), partition=i % partitions)
    assert producer.flush(30) == 0, "messages unsent"
    return lines


def pipeline(name: str, bootstrap: str, conn_id: str) -> PipelineSpec:
    """ysb_kafka's source on the secured listener, appending the records as read."""
    return make_pipeline(name, base="ysb_kafka", **{
        "source.bootstrap_servers": bootstrap, "source.topic": name, "source.chunk_records": 100,
        "source.connection": conn_id, "control.epoch_max_records": None, "control.adaptive": False,
        "control.epoch_files": 6, "control.group_epochs": 1, "spark.mode": "in_process",
        "transform": {"sql": f"SELECT {', '.join(COLUMNS)} FROM records"}, "reference": {},
        "sinks": [{"name": "events", "mode": "append", "path": f"${{SLUICE_DATA_DIR}}/{name}/tables/events"}]})


def assert_matches_what_was_sent(spark, spec: PipelineSpec, store: EpochStore, sent: list[str], secret: str) -> None:
    expected = Counter(tuple(str(json.loads(line)[c]) for c in COLUMNS) for line in sent)
    got = Counter(tuple(str(r[c]) for c in COLUMNS) for r in spark.read.format("delta").load(spec.sinks[0].path)
                  .select(*COLUMNS).collect())
    assert len(sent) > 0 and sum(got.values()) == len(sent), f"{sum(got.values())} rows for {len(sent)} records sent"
    assert got == expected, f"{sum((expected - got).values())} records missing, {sum((got - expected).values())} extra"
    assert rejected_lines(spark, spec) == []  # every event sent was valid
    assert sum(e.size for e in store.manifest(spec.name)) == len(sent), "the chunks do not hold every record once"
    assert {e.state for e in store.epochs(spec.name)} == {protocol.PUBLISHED}
    assert secret not in Path(spec.path).read_text()
    db = Path(urlparse(store.url).path)
    assert db.is_file(), store.url
    for path in (db, db.with_name(db.name + "-wal")):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"the password is in the epoch store ({path.name})"


def test_a_group_over_sasl_with_credentials_from_an_airflow_connection(secure, spark, store, monkeypatch, caplog):
    broker, _, password = secure
    caplog.set_level(logging.DEBUG, logger="sluice")
    conn_id = connect(monkeypatch, "kafka_sasl_test", login=USER, password=password,
                      extra={"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"})
    spec = pipeline("kafka_sasl", broker.sasl_bootstrap, conn_id)
    sent = send({"bootstrap.servers": broker.sasl_bootstrap, "security.protocol": "SASL_PLAINTEXT",
                 "sasl.mechanisms": "PLAIN", "sasl.username": USER, "sasl.password": password}, spec.source.topic, 11)
    groups = run_once(spec, store, spark, drain=True)
    assert groups, "no group ran"
    assert_matches_what_was_sent(spark, spec, store, sent, password)
    assert "kafka_sasl" in caplog.text, "sluice's log records were not captured"
    assert password not in caplog.text and password not in json.dumps(groups, default=str)


def test_a_group_over_tls_trusting_the_connections_ca(secure, spark, store, monkeypatch):
    broker, tls, _ = secure
    conn_id = connect(monkeypatch, "kafka_tls_test", extra={"ssl_ca_location": str(tls.ca_pem)})  # SSL, inferred
    spec = pipeline("kafka_tls", broker.ssl_bootstrap, conn_id)
    sent = send({"bootstrap.servers": broker.ssl_bootstrap, "security.protocol": "SSL",
                 "ssl.ca.location": str(tls.ca_pem)}, spec.source.topic, 12, events=200)
    assert source_for(spec, store).discover() == 3  # 3 partitions of 67/67/66 records: a chunk each
    run_once(spec, store, spark, drain=True)
    assert_matches_what_was_sent(spark, spec, store, sent, "no secret here")


def test_a_wrong_password_fails_at_once_naming_the_pipeline_and_connection(secure, store, monkeypatch):
    broker, _, password = secure
    wrong = f"wrong-{uuid.uuid4().hex}"
    conn_id = connect(monkeypatch, "kafka_wrong_test", login=USER, password=wrong)  # SASL_PLAINTEXT, PLAIN
    spec = pipeline("kafka_wrong", broker.sasl_bootstrap, conn_id)
    started = time.monotonic()
    with pytest.raises(SourceError) as raised:
        source_for(spec, store).discover()
    message = str(raised.value)
    assert "pipeline 'kafka_wrong'" in message and "'kafka_wrong_test'" in message, message
    assert "refused" in message and "Authentication failed" in message, message
    assert wrong not in message and password not in message
    assert time.monotonic() - started < 5, "an authentication failure must not wait out the client's timeout"
    assert store.manifest(spec.name) == []

    # No such connection: named, with where to define it.
    monkeypatch.delenv("AIRFLOW_CONN_KAFKA_WRONG_TEST")
    with pytest.raises(SourceError, match=r"pipeline 'kafka_wrong'.*no Airflow connection 'kafka_wrong_test'.*"
                                          r"AIRFLOW_CONN_KAFKA_WRONG_TEST"):
        source_for(spec, store).discover()


def test_a_broker_certificate_the_connections_ca_did_not_sign_fails_at_once(secure, store, monkeypatch, tmp_path):
    broker, _, _ = secure
    stranger = make_tls(tmp_path / "stranger")  # another CA: the broker's certificate is not signed by it
    conn_id = connect(monkeypatch, "kafka_stranger_test", extra={"ssl_ca_location": str(stranger.ca_pem)})
    spec = pipeline("kafka_stranger", broker.ssl_bootstrap, conn_id)
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"pipeline 'kafka_stranger'.*connection 'kafka_stranger_test'.*refused.*"
                                          r"certificate verify failed"):
        source_for(spec, store).discover()
    assert time.monotonic() - started < 8, "a TLS failure must not wait out the client's timeout"
