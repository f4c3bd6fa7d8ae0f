"""The Delta twin (``sluice.delta.twin``) against real Delta Lake 4.4 (``sluice.delta.spark``):
the same scenarios, step by step, through the one facade; what each step observes (versions,
recorded transactions, rows, the commits as the protocol reads them, refusals) must be the same.
The simulation is only as good as this agreement. Cost: ~40 s of local Spark."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from sluice import boundary
from sluice.delta import APPEND, TableShape
from sluice.delta.spark import ConcurrentCommit as SparkConflict
from sluice.delta.spark import SparkTables
from sluice.delta.twin import ConcurrentCommit as TwinConflict
from sluice.delta.twin import TwinTables
from sluice.errors import FencedError
from sluice.model import Txn
from sluice.protocol import rules

AGGREGATE = TableShape("aggregate", ("k",), ("n",))
UPSERT = TableShape("upsert", ("k",), sequence_by="seq", delete_when="op = 'd'")
SCD2 = TableShape("upsert", ("k",), sequence_by="seq", delete_when="op = 'd'", history="scd2")
APP = "sluice:conf:t:g0"


def token(t: int, epoch: int = -1) -> int:
    return rules.txn_version(t, epoch)


class Side:
    """One implementation, and how to observe it the same way as the other."""

    def __init__(self, tables: Any, frame: Callable[[list[dict[str, Any]]], Any], rows: Callable[[str], list]) -> None:
        self.tables, self.frame, self.rows = tables, frame, rows
        self.seen: list[tuple[str, Any]] = []

    def look(self, label: str, path: str) -> None:
        t = self.tables
        lineage = [(c.operation, c.restored_to, c.app_id, c.epochs, c.token, c.fence) for c in t.lineage(path)]
        self.seen.append((label, (t.version(path), t.txn_version(path, APP), sorted(
            json.dumps(r, sort_keys=True) for r in self.rows(path)), lineage)))

    def attempt(self, label: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            self.seen.append((label, "ok"))
        except FencedError:
            self.seen.append((label, "fenced"))
        except (SparkConflict, TwinConflict):
            self.seen.append((label, "conflict"))


def meta(**fields: Any) -> str:
    return json.dumps({"pipeline": "conf", "app_id": APP, "generation": 0, **fields}, sort_keys=True)


def scenario(side: Side, root: str) -> list[tuple[str, Any]]:
    """Create, txn skip, fence, an older token refused, RESTORE (fenced, keeping the txn), a
    restore under an older token refused, merge-add, a table born fenced (made under a txn), a
    restore raced by a concurrent commit."""
    t, path, agg = side.tables, f"{root}/t", f"{root}/agg"
    t.create(path, side.frame([]), metadata=meta(token=1, created=True, epochs=[]))
    side.look("created", path)
    t.write(path, side.frame([{"k": "a", "n": 1}]), APPEND, txn=Txn(APP, token(1, 0)),
            metadata=meta(token=1, epoch=0, epochs=[[0, 0, 1]]))
    side.look("written", path)
    t.write(path, side.frame([{"k": "a", "n": 1}]), APPEND, txn=Txn(APP, token(1, 0)),
            metadata=meta(token=1, epoch=0, epochs=[[0, 0, 1]]))
    side.look("a replay is skipped", path)
    t.fence(path, Txn(APP, token(2)), meta(token=2, fence=True, epochs=[]))
    side.look("fenced", path)
    t.write(path, side.frame([{"k": "b", "n": 2}]), APPEND, txn=Txn(APP, token(1, 1)),
            metadata=meta(token=1, epoch=1, epochs=[[1, 1, 2]]))
    side.look("an older token's write is skipped", path)
    t.write(path, side.frame([{"k": "c", "n": 3}]), APPEND, txn=Txn(APP, token(2, 1)),
            metadata=meta(token=2, epoch=1, epochs=[[1, 1, 2]]))
    side.look("the fencing token writes", path)
    side.attempt("restore under token 3", lambda: t.restore(path, 1, txn=Txn(APP, token(3)),
                                                            metadata=meta(token=3, restore_to=1, epochs=[])))
    side.look("restored: rows of version 1, the txn kept at token 3", path)
    side.attempt("restore under an older token", lambda: t.restore(path, 0, txn=Txn(APP, token(2)),
                                                                   metadata=meta(token=2, restore_to=0, epochs=[])))
    side.look("nothing changed", path)
    t.create(agg, side.frame([]), metadata=meta(token=1, created=True, epochs=[]))
    for epoch, rows in enumerate([[{"k": "a", "n": 1}, {"k": "a", "n": 2}], [{"k": "a", "n": 4}, {"k": "b", "n": 1}]]):
        t.write(agg, side.frame(rows), AGGREGATE, txn=Txn(APP, token(1, epoch)),
                metadata=meta(token=1, epoch=epoch, epochs=[[epoch, epoch, epoch + 1]]))
        side.look(f"merge-add {epoch}", agg)

    def racing_fence(step: str) -> None:  # a newer owner's fence lands while the restore reads
        if step == "delta.w.restore:commit":
            boundary.HOOK = None
            t.fence(agg, Txn(APP, token(4)), meta(token=4, fence=True, epochs=[]))

    born = f"{root}/born"
    side.seen.append(("a table made under a txn", t.create(
        born, side.frame([]), metadata=meta(token=5, created=True, epochs=[]), txn=Txn(APP, token(5)))))
    side.look("born fenced at token 5", born)
    t.write(born, side.frame([{"k": "z", "n": 9}]), APPEND, txn=Txn(APP, token(4, 0)),
            metadata=meta(token=4, epoch=0, epochs=[[0, 0, 1]]))
    side.look("an older token's first write is skipped", born)
    side.seen.append(("made again", t.create(
        born, side.frame([]), metadata=meta(token=6, created=True, epochs=[]), txn=Txn(APP, token(6)))))
    side.look("a table that exists is left as it is", born)

    boundary.HOOK = racing_fence
    try:
        side.attempt("a restore raced by a newer owner's fence", lambda: t.restore(
            agg, 1, txn=Txn(APP, token(3)), metadata=meta(token=3, restore_to=1, epochs=[])))
    finally:
        boundary.HOOK = None
    side.look("the fence landed, the restore did not", agg)
    return side.seen


def test_the_twin_observes_what_real_delta_does(spark, tmp_path):
    schema = "k string, n long"
    real = Side(SparkTables(spark), lambda rows: spark.createDataFrame(rows, schema),
                lambda path: [r.asDict() for r in spark.read.format("delta").load(path).collect()])
    twin_tables = TwinTables()
    twin = Side(twin_tables, lambda rows: rows, twin_tables.rows)
    expected = scenario(real, str(tmp_path / "real"))
    found = scenario(twin, str(tmp_path / "twin"))
    assert len(found) == len(expected)
    for (label, want), (_, got) in zip(expected, found, strict=True):
        assert got == want, f"{label}: real Delta {want}, twin {got}"
    outcomes = dict(expected)
    assert outcomes["restore under an older token"] == "fenced"
    assert outcomes["a restore raced by a newer owner's fence"] == "conflict"


def test_vacuumed_versions_cannot_be_restored_in_either(spark, tmp_path):
    """Retention: once VACUUM removed a version's files, both refuse to restore it."""
    real = SparkTables(spark)
    frame = spark.createDataFrame([{"k": "a", "n": 1}], "k string, n long")
    twin = TwinTables()
    for tables, path, data in ((real, str(tmp_path / "v"), frame), (twin, "v", [{"k": "a", "n": 1}])):
        tables.create(path, data)
        for epoch in range(2):
            tables.write(path, data, APPEND, txn=Txn(APP, token(1, epoch)), metadata=meta(token=1, epoch=epoch))
        tables.restore(path, 0, txn=Txn(APP, token(2)), metadata=meta(token=2, restore_to=0))  # every file removed
        assert tables.restorable(path, 1) is None
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        spark.sql(f"VACUUM delta.`{tmp_path / 'v'}` RETAIN 0 HOURS")
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    twin.vacuum("v")
    assert "vacuumed" in (real.restorable(str(tmp_path / "v"), 1) or "")
    assert "vacuumed" in (twin.restorable("v", 1) or "")


def change(k: str | None, seq: int | None, v: int | None = None, op: str = "u") -> dict[str, Any]:
    return {"k": k, "seq": seq, "op": op, "v": v}


UPSERT_WRITES = [
    # One write: two changes of a (the newer first), b deleted after an older upsert, c.
    [change("a", 2, 2), change("a", 1, 1), change("b", 5, op="d"), change("b", 3, 3), change("c", 1, 1)],
    # An older a (ignored), a newer c, an older b upsert after its delete (no resurrection), a
    # null sequence, a delete of a key never seen (a tombstone), a null key.
    [change("a", 1, 9), change("c", 4, 4), change("b", 4, 4), change("d", None, 1), change("e", 1, op="d"),
     change(None, 1, 1)],
    # Ties: at sequence 4 c's delete wins; at 2 a's greater value wins; b comes back newer; d gets
    # a sequence; the null key is a key (matched null-safely).
    [change("c", 4, op="d"), change("a", 2, 1), change("a", 2, 3), change("b", 6, 6), change("d", 0, 0),
     change(None, 2, 2)],
]


def upsert_scenario(side: Side, root: str, shape: TableShape = UPSERT) -> list[tuple[str, Any]]:
    """Upserts (``sluice.delta.upsert``): the greatest change per key by (sequence, delete, the
    other columns) wins within a write and across writes, tombstones stay, a replay is skipped.
    (Restores are the other scenario's; a restore and recompute of upserts is
    ``tests/integration/test_upsert.py``'s, and regrouping the twin's, ``tests/unit/test_upsert_rules.py``.)"""
    t, path = side.tables, f"{root}/ups"
    t.create(path, side.frame([]), metadata=meta(token=1, created=True, epochs=[]), shape=shape)
    for epoch, rows in enumerate(UPSERT_WRITES):
        t.write(path, side.frame(rows), shape, txn=Txn(APP, token(1, epoch)),
                metadata=meta(token=1, epoch=epoch, epochs=[[epoch, epoch, epoch + 1]]))
        side.look(f"upsert {epoch}", path)
    t.write(path, side.frame(UPSERT_WRITES[1]), shape, txn=Txn(APP, token(1, 1)),
            metadata=meta(token=1, epoch=1, epochs=[[1, 1, 2]]))
    side.look("an upsert replay is skipped", path)
    return side.seen


def test_the_twin_upserts_as_real_delta_does(spark, tmp_path):
    """Cost: ~15 s of local Spark (measured 15.3 s at load 2, up to 26 s under load 5-7: three
    writes and a replay)."""
    real = Side(SparkTables(spark), lambda rows: spark.createDataFrame(rows, "k string, seq long, op string, v long"),
                lambda path: [r.asDict() for r in spark.read.format("delta").load(path).collect()])
    twin_tables = TwinTables()
    twin = Side(twin_tables, lambda rows: rows, twin_tables.rows)
    expected = upsert_scenario(real, str(tmp_path / "real"))
    found = upsert_scenario(twin, str(tmp_path / "twin"))
    for (label, want), (_, got) in zip(expected, found, strict=True):
        assert got == want, f"{label}: real Delta {want}, twin {got}"
    final = {r["k"]: r for r in map(json.loads, dict(expected)["upsert 2"][2])}
    assert {k: (r["seq"], r["_deleted"], r["v"]) for k, r in final.items()} == {
        "a": (2, False, 3), "b": (6, False, 6), "c": (4, True, None), "d": (0, False, 0), "e": (1, True, None),
        None: (2, False, 2)}


@pytest.mark.variant
def test_the_twin_keeps_scd2_history_as_real_delta_does(spark, tmp_path):
    """``history: scd2``: the same writes keep every version, late ones put in their place.
    Cost: ~19 s of local Spark (measured 18.8 s; a variant: the twin's scd2 is also held to a plain-Python
    history of random change logs in ``tests/unit/test_upsert_rules.py``)."""
    real = Side(SparkTables(spark), lambda rows: spark.createDataFrame(rows, "k string, seq long, op string, v long"),
                lambda path: [r.asDict() for r in spark.read.format("delta").load(path).collect()])
    twin_tables = TwinTables()
    twin = Side(twin_tables, lambda rows: rows, twin_tables.rows)
    expected = upsert_scenario(real, str(tmp_path / "real"), SCD2)
    found = upsert_scenario(twin, str(tmp_path / "twin"), SCD2)
    for (label, want), (_, got) in zip(expected, found, strict=True):
        assert got == want, f"{label}: real Delta {want}, twin {got}"
    final = {(r["k"], r["valid_from"]): (r["v"], r["_deleted"], r["valid_to"], r["current"])
             for r in map(json.loads, dict(expected)["upsert 2"][2])}
    assert {v: final[v] for v in final if v[0] in ("a", "c")} == {
        ("a", 1): (9, False, 2, False), ("a", 2): (3, False, None, True),
        ("c", 1): (1, False, 4, False), ("c", 4): (None, True, None, False)}


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    boundary.HOOK = None
