"""Fields a source's schema does not name are never dropped silently: ``source.unknown_fields:
reject`` (the default) sends the record to ``_rejected`` naming them; ``rescue`` keeps them in
``_rescued_data`` for the transform. Both against an oracle computed with ``json`` from the
raw file."""

from __future__ import annotations

import json
import random
from pathlib import Path

from include.generators.ysb import raw_events, window_counts
from sluice.protocol.run import run_once
from sluice.sources import source_for
from sluice.store import EpochStore
from tests.pipelines import land, landed, make_pipeline, rejected_lines, table_counts

EXTRAS = [{"campaign_hint": "spring"}, {"score": 7, "nested": {"a": [1, 2]}}, {"flag": True}]


def land_drifting(spec, name: str = "drift-000100.json", events: int = 200, seed: int = 5) -> Path:
    """A file of valid YSB events, every fourth one carrying fields the schema does not name."""
    rnd = random.Random(seed)
    template = json.loads(land(spec, files=1, seed=seed, prefix="template")[0].read_text().splitlines()[0])
    lines = []
    for i in range(events):
        event = dict(template, event_type=rnd.choice(["view", "click"]), event_time=str(1_767_225_600_000 + i * 97))
        if i % 4 == 0:
            event.update(EXTRAS[i % len(EXTRAS)])
        lines.append(json.dumps(event))
    path = spec.landing_dir / name
    path.write_text("\n".join(lines) + "\n")
    return path


def extras_of(line: str, schema: dict[str, str]) -> dict:
    return {k: v for k, v in json.loads(line).items() if k not in schema}


def test_unknown_fields_send_the_record_to_rejected_naming_them(spark):
    spec = make_pipeline("drift_reject", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                            "spark.mode": "in_process"})
    assert spec.source.unknown_fields == "reject"
    land(spec, files=3, malformed_fraction=0.03)
    drifting = land_drifting(spec)
    log = EpochStore()
    run_once(spec, log, spark, drain=True)

    schema = spec.source.schema_
    drifted = {(str(drifting), n) for n, line in enumerate(drifting.read_text().splitlines(), start=1)
               if extras_of(line, schema)}
    events = [(where, n, None if (where, n) in drifted else event) for where, n, event in raw_events(landed(spec))]
    assert table_counts(spark, spec) == window_counts(events)
    rejected = rejected_lines(spark, spec)
    assert set(rejected) == {(w, n) for w, n, e in events if e is None} and len(rejected) == len(set(rejected))
    reasons = {(r["file"], r["line"]): r["reason"] for r in spark.read.format("delta").load(spec.rejected_table)
               .where(f"file = '{drifting}'").collect()}
    for (_, n), reason in reasons.items():
        line = drifting.read_text().splitlines()[n - 1]
        assert reason.startswith("fields not in source.schema"), reason
        assert all(f'"{k}"' in reason for k in extras_of(line, schema)), reason


def test_unknown_fields_are_rescued_for_the_transform(spark):
    spec = make_pipeline("drift_rescue", **{"source.unknown_fields": "rescue"})
    drifting = land_drifting(spec, seed=6)
    log = EpochStore()
    source = source_for(spec, log)
    end = source.discover()  # the drifting file and the template file it was made from
    rows = {(r["_file"], r["_line"]): r for r in source.read(spark, 0, end)
            .select("_file", "_line", "_rescued_data", "_corrupt_record").collect()}
    for n, line in enumerate(drifting.read_text().splitlines(), start=1):
        expected = extras_of(line, spec.source.schema_)
        got = rows[(str(drifting), n)]["_rescued_data"]
        assert rows[(str(drifting), n)]["_corrupt_record"] is None
        if not expected:
            assert got is None, (n, got)
            continue
        rescued = json.loads(got)
        assert set(rescued) == set(expected), (n, rescued)
        for key, value in expected.items():  # strings as they were, other JSON values as their text
            assert (rescued[key] if isinstance(value, str) else json.loads(rescued[key])) == value, (n, key)
