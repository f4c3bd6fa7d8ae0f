"""Seeded change logs for upsert sinks, and their oracle: the log replayed in plain Python.

A change is ``{"id", "seq", "op", "val"}``: ``op`` is ``u`` (upsert) or ``d`` (delete), ``seq``
is unique per key (a log sequence number), and the changes land in a random order, so older
changes of a key often arrive after newer ones, in the same file, epoch or group, or later.
The oracle knows nothing of sluice: it parses the raw files itself and replays the changes in
sequence order.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA = {"id": "string", "seq": "long", "op": "string", "val": "long"}
MALFORMED = "{not json"


def change_log(seed: int, keys: int = 30, max_changes: int = 8, delete_p: float = 0.3) -> list[dict[str, Any]]:
    """Every key's changes, sequence numbers unique across the log, in a random arrival order."""
    rng = random.Random(seed)
    seqs = iter(rng.sample(range(1, 10 * keys * max_changes), keys * max_changes))
    changes = []
    for k in range(keys):
        for _ in range(rng.randint(1, max_changes)):
            op = "d" if rng.random() < delete_p else "u"
            val = None if op == "d" or rng.random() < 0.1 else rng.randint(0, 1000)
            changes.append({"id": f"k{k:03d}", "seq": next(seqs), "op": op, "val": val})
    rng.shuffle(changes)
    return changes


def land_changes(folder: Path, changes: list[dict[str, Any]], files: int, prefix: str = "c",
                 malformed_every: int = 0) -> list[Path]:
    """Write ``changes`` into ``files`` JSON-lines files, renamed into place (whole at once);
    every ``malformed_every``-th file gets an unparseable line too."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    per_file = -(-len(changes) // files)
    for i in range(files):
        lines = [json.dumps(c) for c in changes[i * per_file:(i + 1) * per_file]]
        if malformed_every and i % malformed_every == 0:
            lines.insert(len(lines) // 2, MALFORMED)
        path = folder / f"{prefix}{i:04d}.json"
        tmp = folder / f".{path.name}"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        paths.append(path)
    return paths


def parse(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The valid changes of the raw files (a line that is not a JSON object with an id and a
    sequence is not a change)."""
    found = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("id") is not None and record.get("seq") is not None:
                found.append(record)
    return found


def replay(changes: Iterable[dict[str, Any]]) -> dict[str, tuple[int, str, int | None, bool]]:
    """The table a clean run must leave: the log replayed in sequence order, each change
    replacing its key's state; a delete leaves a tombstone. ``{id: (seq, op, val, deleted)}``."""
    state: dict[str, tuple[int, str, int | None, bool]] = {}
    for c in sorted(changes, key=lambda c: c["seq"]):
        state[c["id"]] = (c["seq"], c["op"], c.get("val"), c["op"] == "d")
    return state


def live(state: dict[str, tuple[int, str, int | None, bool]]) -> dict[str, int | None]:
    """The rows a reader sees (``NOT _deleted``): id -> val."""
    return {k: v[2] for k, v in state.items() if not v[3]}


def table_state(rows: Iterable[dict[str, Any]]) -> dict[str, tuple[int, str, int | None, bool]]:
    """An upsert table's rows in the oracle's shape; a key held twice fails."""
    state: dict[str, tuple[int, str, int | None, bool]] = {}
    for r in rows:
        assert r["id"] not in state, f"key {r['id']!r} is held twice"
        state[r["id"]] = (r["seq"], r["op"], r["val"], r["_deleted"])
    return state


Versions = dict[tuple[str, int], tuple[str, int | None, bool, int | None, bool]]


def history(changes: Iterable[dict[str, Any]]) -> Versions:
    """``history: scd2``'s table a clean run must leave: every change a version of its key, valid
    until the key's next change in sequence order, the last one current unless it is a delete.
    ``{(id, seq): (op, val, deleted, valid_to, current)}``."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for c in changes:
        by_id.setdefault(c["id"], []).append(c)
    found = {}
    for key, versions in by_id.items():
        versions.sort(key=lambda c: c["seq"])
        for i, c in enumerate(versions):
            last = i == len(versions) - 1
            found[(key, c["seq"])] = (c["op"], c.get("val"), c["op"] == "d",
                                      None if last else versions[i + 1]["seq"], last and c["op"] != "d")
    return found


def table_history(rows: Iterable[dict[str, Any]]) -> Versions:
    """An scd2 upsert table's rows in ``history``'s shape; a version held twice fails."""
    found = {}
    for r in rows:
        assert r["valid_from"] == r["seq"], f"valid_from {r['valid_from']} is not the sequence {r['seq']}"
        version = (r["id"], r["seq"])
        assert version not in found, f"version {version} is held twice"
        found[version] = (r["op"], r["val"], r["_deleted"], r["valid_to"], r["current"])
    return found
