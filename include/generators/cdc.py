"""Debezium-shaped change events for a small ``customers`` table, and their oracle.

A change event is one Kafka message, keyed by ``{"id": <id>}`` (JSON), its value Debezium's
envelope (``value.converter.schemas.enable=false``)::

    {"before": {...} | null, "after": {...} | null, "op": "r" | "c" | "u" | "d",
     "ts_ms": <ms>, "source": {"connector": "postgresql", "table": "customers", "lsn": <long>, ...}}

``r`` is a snapshot read, ``c`` an insert, ``u`` an update (``before`` the old row), ``d`` a
delete (``after`` null), followed by a *tombstone*, a message of its key without a value (for
log compaction; Debezium's ``tombstones.on.delete``). ``source.lsn`` increases along the table's history; the *arrival*
order is not that order: some events are held back and sent after newer changes of their key
(the log sequence number orders them, not the topic). A deleted customer may come back (a
re-insert, ``c`` after ``d``). ``malformed`` adds messages that are not change events (not JSON,
an envelope without a key or without ``source.lsn``): a pipeline rejects them, the oracle skips
them.

The oracle (``replay``) knows nothing of sluice or Spark: it replays the events (as produced, or
as a plain consumer reads them back) in lsn order; each key's last change wins, a delete leaves
a tombstone.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable
from typing import Any

TABLE = "customers"
TIERS = ("free", "silver", "gold", "platinum")
NAMES = ("Ada", "Grace", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Radia", "Leslie", "Margaret",
         "Tony", "Shafi", "Niklaus", "Jean", "John", "Sophie", "Alan", "Katherine", "Dennis", "Lynn")
MALFORMED = ("{not json", '{"before": null, "after": {"id": 999999, "name": "no lsn", "email": null, "tier": "free"}, '
             '"op": "c", "ts_ms": 0, "source": {"table": "customers"}}',
             '{"before": null, "after": null, "op": "c", "ts_ms": 0, "source": {"lsn": 1}}')

#: Per key: (lsn, op, deleted, name, email, tier); a tombstone's row fields are None.
State = dict[int, tuple[int, str, bool, str | None, str | None, str | None]]


def _row(rng: random.Random, cid: int) -> dict[str, Any]:
    name = f"{rng.choice(NAMES)} {chr(ord('A') + rng.randrange(26))}."
    email = None if rng.random() < 0.1 else f"{name.split()[0].lower()}.{cid}@example.com"
    return {"id": cid, "name": name, "email": email, "tier": rng.choice(TIERS)}


def change_events(seed: int, *, customers: int = 40, changes: int = 200, start_lsn: int = 1_000_000,
                  start_ms: int = 1_767_225_600_000, held_back: float = 0.1,
                  malformed: int = 0, tombstones: bool = True) -> list[tuple[bytes | None, bytes | None]]:
    """``(key, value)`` messages in arrival order: a snapshot (``r``) of ``customers // 2`` rows,
    then ``changes`` inserts, updates and deletes at increasing lsns (at least one delete
    followed by a re-insert of its key), ``held_back`` of them sent later than newer changes of
    their key, each delete followed by its tombstone (``tombstones``), and ``malformed``
    messages that are not change events."""
    rng = random.Random(seed)
    lsn, ts = start_lsn, start_ms
    rows: dict[int, dict[str, Any]] = {}
    deleted: list[int] = []
    events: list[dict[str, Any]] = []

    def emit(op: str, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        nonlocal lsn, ts
        lsn += rng.randint(8, 400)
        ts += rng.randint(1, 2_000)
        events.append({"before": before, "after": after, "op": op, "ts_ms": ts,
                       "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "shop",
                                  "db": "shop", "schema": "public", "table": TABLE, "snapshot": op == "r",
                                  "txId": 700 + len(events), "lsn": lsn, "ts_ms": ts - rng.randint(0, 50)}})

    for cid in range(1, customers // 2 + 1):
        rows[cid] = _row(rng, cid)
        emit("r", None, rows[cid])
    for i in range(changes):
        cid = rng.randint(1, customers)
        if i == changes // 3 and deleted:  # one re-insert for sure, whatever the dice say
            cid = deleted[0]
        if cid not in rows:
            rows[cid] = _row(rng, cid)
            emit("c", None, rows[cid])
        elif rng.random() < 0.2:
            emit("d", rows.pop(cid), None)
            deleted.append(cid)
        else:
            new = dict(rows[cid])
            field = rng.choice(("name", "email", "tier"))
            new[field] = _row(rng, cid)[field]
            emit("u", rows[cid], new)
            rows[cid] = new
    # Arrival: some events are held back, and sent after 1..60 later events.
    order = [(float(i), e) for i, e in enumerate(events)]
    order = [(p + rng.uniform(1, 60) if p >= len(events) // 4 and rng.random() < held_back else p, e)
             for p, e in order]
    arrival = [e for _, e in sorted(order, key=lambda pe: pe[0])]
    messages: list[tuple[bytes | None, bytes | None]] = []
    for e in arrival:
        key = json.dumps({"id": _key(e)}).encode()
        messages.append((key, json.dumps(e, separators=(",", ":")).encode()))
        if tombstones and e["op"] == "d":
            messages.append((key, None))
    for i in range(malformed):
        messages.insert(rng.randrange(len(messages) + 1), (None, MALFORMED[i % len(MALFORMED)].encode()))
    return messages


def _key(event: dict[str, Any]) -> int | None:
    row = event.get("after") or event.get("before") or {}
    return row.get("id") if isinstance(row, dict) else None


def parse(values: Iterable[bytes | str | None]) -> list[dict[str, Any]]:
    """The change events among message values: JSON objects with a key and ``source.lsn`` (not
    a tombstone's missing value, not a malformed message)."""
    found = []
    for value in values:
        try:
            event = json.loads(value)
        except (ValueError, TypeError):
            continue
        if (isinstance(event, dict) and isinstance(event.get("source"), dict)
                and event["source"].get("lsn") is not None and _key(event) is not None):
            found.append(event)
    return found


def replay(events: Iterable[dict[str, Any]]) -> State:
    """The table an upsert by ``id`` sequenced by lsn must hold: each key's change of the
    greatest lsn; a delete is a tombstone (deleted, its row fields None)."""
    state: State = {}
    for e in sorted(events, key=lambda e: e["source"]["lsn"]):
        after = e.get("after") or {}
        state[_key(e)] = (e["source"]["lsn"], e["op"], e["op"] == "d",
                          after.get("name"), after.get("email"), after.get("tier"))
    return state


def live(state: State) -> dict[int, tuple[str | None, str | None, str | None]]:
    """What a reader of the live rows sees: id -> (name, email, tier)."""
    return {k: v[3:] for k, v in state.items() if not v[2]}


def table_state(rows: Iterable[dict[str, Any]]) -> State:
    """The sink's rows (``id, name, email, tier, op, lsn, _deleted``) in ``replay``'s shape; a
    key held twice raises ``ValueError``."""
    state: State = {}
    for r in rows:
        if r["id"] in state:
            raise ValueError(f"key {r['id']!r} is held twice")
        state[r["id"]] = (r["lsn"], r["op"], r["_deleted"], r["name"], r["email"], r["tier"])
    return state


def out_of_order(messages: Iterable[tuple[bytes | None, bytes | None]]) -> int:
    """How many events arrive after a newer change of their key (what the sink must survive)."""
    newest: dict[int, int] = {}
    late = 0
    for e in parse(v for _, v in messages):
        key, lsn = _key(e), e["source"]["lsn"]
        late += lsn < newest.get(key, -1)
        newest[key] = max(lsn, newest.get(key, -1))
    return late


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes | None]], *,
            partitions: int = 3, unkeyed_partition: int | None = None) -> int:
    """Send ``messages`` in order to ``topic`` (created with ``partitions`` partitions if
    missing), partitioned by key as Kafka Connect does (a key's events share a partition);
    ``unkeyed_partition``: where messages without a key go (else a random partition); returns
    how many were sent."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic not in admin.list_topics(timeout=15).topics:
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result()
    deadline = time.monotonic() + 30  # a new topic may list no partitions for a moment
    while not admin.list_topics(topic, timeout=15).topics[topic].partitions:
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic!r} on {bootstrap} still lists no partitions after 30 s")
        time.sleep(0.2)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True,
                         "partitioner": "murmur2_random"})  # the Java client's partitioner
    for key, value in messages:
        if key is None and unkeyed_partition is not None:
            producer.produce(topic, key=key, value=value, partition=unkeyed_partition)
        else:
            producer.produce(topic, key=key, value=value)
        producer.poll(0)
    if producer.flush(30):
        raise RuntimeError(f"{topic}: messages still unsent after 30 s")
    return len(messages)
