"""Unit tests of ``dedup``: the spec's validation (each error names the file and the field), the
seen-keys table among the pipeline's tables, and the pure rule (``sluice.dedup.dedup_rows``)
against a reference written here from the rule's words."""

from __future__ import annotations

import random
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PLUGINS = str(ROOT / "plugins")
if _PLUGINS not in sys.path:
    sys.path.insert(0, _PLUGINS)

from sluice.dedup import DEDUP, dedup_rows  # noqa: E402
from sluice.errors import SpecError  # noqa: E402
from sluice.protocol.tables import pipeline_tables  # noqa: E402
from sluice.spec import load_spec, parse_duration  # noqa: E402

BASE = """\
source:
  path: /data/landing/{name}
  schema: {{id: string, at: timestamp, n: long, label: string}}
  required: [id, at, n]
transform: demo.clean
sinks:
  - {{name: out, mode: append, path: /data/tables/{name}/out}}
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("SLUICE_DATA_DIR", "SLUICE_HOME", "SLUICE_PIPELINES_DIR"):
        monkeypatch.delenv(var, raising=False)


def write(tmp_path: Path, extra: str, name: str = "dd") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(BASE.format(name=name) + textwrap.dedent(extra))
    return path


def spec_error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_a_dedup_spec_loads_with_its_horizon_in_seconds_and_adds_the_seen_keys_table(tmp_path):
    spec = load_spec(write(tmp_path, "dedup: {keys: [id], within: 24h, time: at}\n"))
    assert spec.dedup is not None and spec.dedup.within == 86400.0 and spec.dedup.keys == ["id"]
    assert spec.dedup_table == "/data/tables/dd/_dedup"
    (table,) = [t for t in pipeline_tables(spec) if t.name == DEDUP]
    assert (table.path, table.shape.mode, table.shape.keys, table.shape.sequence_by) == (
        "/data/tables/dd/_dedup", "upsert", ("id",), "_epoch")
    assert spec.table_writers()["/data/tables/dd/_dedup"] == ["_dedup"]  # a rollback restores it
    plain = load_spec(write(tmp_path, "", name="plain"))
    assert plain.dedup is None and plain.dedup_table is None
    assert DEDUP not in {t.name for t in pipeline_tables(plain)}
    forever = load_spec(write(tmp_path, "dedup: {keys: [id, n]}\n", name="forever"))
    assert forever.dedup is not None and forever.dedup.within is None and forever.dedup.time is None


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("24h", 86400), ("7d", 604800),
                                           ("1.5h", 5400), (60, 60), ("45", 45)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("extra, words", [
    ("dedup: {keys: [nope], within: 1h, time: at}\n", ["dedup.keys", "nope"]),
    ("dedup: {keys: [id], within: 1h}\n", ["dedup", "within", "time"]),
    ("dedup: {keys: [id], within: 1h, time: label}\n", ["dedup.time", "label", "timestamp or a long/int"]),
    ("dedup: {keys: [id], within: 1h, time: ghost}\n", ["dedup.time", "ghost"]),
    ("dedup: {keys: [id], within: 1 week, time: at}\n", ["dedup.within", "not a duration"]),
    ("dedup: {keys: [id], within: 0s, time: at}\n", ["dedup", "above zero"]),
    ("dedup: {keys: [label]}\n", ["dedup", "label", "source.required"]),
    ("dedup: {keys: [], within: 1h, time: at}\n", ["dedup.keys"]),
    ("dedup: {keys: [id, id]}\n", ["dedup", "twice"]),
    ("dedup: {keys: [id], horizon: 1h}\n", ["dedup.horizon", "Extra inputs"]),
    ("dedup: {keys: [id]}\ncommit: epoch\n", ["dedup", "commit: group"]),
])
def test_dedup_errors_name_the_file_and_the_field(tmp_path, extra, words):
    message = spec_error(write(tmp_path, extra))
    for word in words:
        assert word in message, (word, message)


def test_the_time_must_be_a_required_timestamp_or_unix_seconds(tmp_path):
    path = tmp_path / "tt.yaml"
    path.write_text(BASE.format(name="tt").replace("label: string", "label: string, d: double").replace(
        "required: [id, at, n]", "required: [id, at, n, d]") + "dedup: {keys: [id], within: 1h, time: d}\n")
    assert "timestamp or a long/int" in spec_error(path)
    path.write_text(BASE.format(name="tt").replace("label: string", "label: string, u: long")
                    + "dedup: {keys: [id], within: 1h, time: u}\n")
    message = spec_error(path)
    assert "dedup: fields ['u'] must be in source.required" in message, message


# -- the rule -------------------------------------------------------------------------------------


def reference(records, within):
    """The rule in its words, over records already in source order: a record is dropped when
    its key was kept before with a time at most ``within`` from its own (the key's last kept
    time); otherwise it is kept and its time becomes the key's seen time."""
    last_kept: dict[str, float] = {}
    out = []
    for r in records:
        seen = last_kept.get(r["id"], None)
        if seen is not None and (within is None or -within <= r["t"] - seen <= within):
            continue
        out.append(r)
        last_kept[r["id"]] = r["t"]
    return out, last_kept


def test_the_rule_on_a_hand_made_case():
    rows = [{"id": "a", "t": 100}, {"id": "a", "t": 150}, {"id": "a", "t": 50},  # 150, 50: within 60 of 100
            {"id": "a", "t": 161}, {"id": "a", "t": 221}, {"id": "a", "t": 222},  # 161 kept; 221 within of it
            {"id": "b", "t": 0}, {"id": "a", "t": 101}, {"id": "a", "t": 130}]
    # 101: 121 from the seen time 222 (only the last kept time counts), kept; 130 then dropped
    kept, changed = dedup_rows(rows, {}, ["id"], 60, "t")
    assert [(r["id"], r["t"]) for r in kept] == [("a", 100), ("a", 161), ("a", 222), ("b", 0), ("a", 101)]
    assert changed == {("a",): 101, ("b",): 0}
    kept, changed = dedup_rows(rows, {("b",): 30}, ["id"], None, None)  # no horizon: once ever
    assert [(r["id"], r["t"]) for r in kept] == [("a", 100)] and changed == {("a",): None}


def test_the_rule_equals_the_reference_split_anywhere_into_groups():
    """Applied group by group from the previous groups' seen times, the rule gives what the
    reference gives in one pass: a recompute of any suffix from the state at its start agrees."""
    rng = random.Random(38)
    for case in range(300):
        within = rng.choice([None, 0, 5, 30])
        records = [{"id": f"k{rng.randrange(6)}", "t": rng.randrange(100), "n": i} for i in range(rng.randrange(40))]
        expected, last = reference(records, within)
        seen: dict = {}
        kept = []
        cuts = sorted(rng.sample(range(len(records) + 1), min(3, len(records) + 1)))
        for lo, hi in zip([0, *cuts], [*cuts, len(records)], strict=True):
            part, changed = dedup_rows(records[lo:hi], seen, ["id"], within, "t")
            kept += part
            seen.update(changed)
        assert kept == expected, case
        assert seen == {(k,): v for k, v in last.items()}, case
