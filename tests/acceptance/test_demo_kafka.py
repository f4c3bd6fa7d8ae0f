"""The README's Kafka demo, `make demo-kafka`, as a new user runs it: in a copy of the checkout,
in the Makefile's environment only, with no broker running. The demo starts a broker (its data
under ``var/kafka``), produces, drains ``ysb_kafka`` through Airflow's ``dag.test()`` and stops
the broker. The test then starts a broker on the same data itself and compares the Delta table
with an oracle over the topic read by a plain consumer, and every bad record with ``_rejected``."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from include.generators.ysb import classify, consume, window_counts
from include.kafka.broker import start
from sluice.net import free_port
from tests.acceptance.test_readme_path import TEST_ONLY, copy_checkout

pytestmark = pytest.mark.kafka

DEFAULT_PORT = 9092  # the Makefile's KAFKA


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_make_demo_kafka_starts_a_broker_drains_the_topic_and_equals_the_oracle(spark, tmp_path: Path):
    root = copy_checkout(tmp_path / "sluice")
    env = {k: v for k, v in os.environ.items() if not k.startswith(TEST_ONLY)}
    # Word for word where the default port is free (a fresh machine); another port otherwise.
    args = ["make", "demo-kafka"] + ([] if not listening(DEFAULT_PORT) else [f"KAFKA=127.0.0.1:{free_port()}"])
    port = int(args[-1].rsplit(":", 1)[1]) if len(args) == 3 else DEFAULT_PORT
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{out[-5000:]}"
    assert "starting a Kafka broker" in out, out[-3000:]
    assert "matches the oracle computed from the raw input: yes" in out, out[-3000:]
    assert not listening(port), "the demo left its Kafka broker running"

    broker = start(root / "var" / "kafka")  # the demo's data, on a port of its own
    try:
        events = list(classify(consume(broker.bootstrap, "ysb")))
    finally:
        broker.stop()
    assert len(events) == 48_000
    table = root / "var" / "tables" / "ysb_kafka"
    got = {(r["campaign_id"], int(r["window_start"].timestamp() * 1000)): r["views"]
           for r in spark.read.format("delta").load(str(table / "campaign_views")).collect()}
    assert got == dict(window_counts(events)), "the demo's table differs from the oracle over the topic"
    rejected = [(r["file"], r["line"]) for r in spark.read.format("delta").load(str(table / "_rejected")).collect()]
    assert sorted(rejected) == sorted((where, n) for where, n, event in events if event is None)
    assert f"topic: ysb on 127.0.0.1:{port}" in out
