"""``dedup`` on real Spark and Delta, against a plain-Python oracle of the raw landed files:
seeded records whose keys repeat within a file, an epoch, a group and across groups, with
out-of-order times, some beyond the horizon, and malformed lines. The oracle parses the files
itself (not with sluice's reader) and folds the rule over them in landing order (file name,
then line: the epochs' order, as the files land sorted and are registered in that order).
The seed is printed; ``SLUICE_DEDUP_SEED`` replays one."""

from __future__ import annotations

import json
import os
import random
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice import protocol
from sluice.protocol.run import run_once
from sluice.spec import PipelineSpec, load_spec
from sluice.store import EpochStore
from tests.integration.test_exactly_once import GroupJob, app_txn
from tests.pipelines import roll_back

ROOT = Path(__file__).resolve().parents[2]
MALFORMED = "{not json"
WITHIN_S = 60


@pytest.fixture
def store():
    log = EpochStore()
    yield log
    log.close()


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("SLUICE_DEDUP_SEED") or random.SystemRandom().randrange(1_000_000))
    print(f"dedup seed: {value} (SLUICE_DEDUP_SEED={value} replays it)")
    return value


def dedup_pipeline(name: str, time_type: str = "long") -> PipelineSpec:
    """A files source, a SQL identity transform, one append sink, ``dedup`` by ``id`` within
    60 s of ``at``; epochs of two files, groups of two epochs."""
    data = Path(os.environ["SLUICE_DATA_DIR"]) / name
    path = Path(os.environ["SLUICE_PIPELINES_DIR"]) / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "schedule": None,
        "source": {"path": str(data / "landing"), "settle_s": 0,
                   "schema": {"id": "string", "at": time_type, "rid": "long"}, "required": ["id", "at", "rid"]},
        "transform": {"sql": "SELECT id, at, rid FROM records"},
        "sinks": [{"name": "kept", "mode": "append", "path": str(data / "tables" / "kept")}],
        "dedup": {"keys": ["id"], "within": f"{WITHIN_S}s", "time": "at"},
        "control": {"adaptive": False, "epoch_files": 2, "group_epochs": 2, "freshness_sla_s": 5},
        "spark": {"mode": "in_process", "conf": {"spark.sql.shuffle.partitions": "2"}},
    }, sort_keys=False))
    return load_spec(path)


def land(folder: Path, records: list[dict[str, Any]], files: int, malformed_in: set[int] = frozenset(),
         prefix: str = "r") -> None:
    """JSON-lines files named in landing order, each renamed into place whole."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(records) // files)
    for i in range(files):
        lines = [json.dumps(r) for r in records[i * per_file:(i + 1) * per_file]]
        if i in malformed_in:
            lines.insert(len(lines) // 2, MALFORMED)
        path = folder / f"{prefix}{i:04d}.json"
        tmp = folder / f".{path.name}"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)


def records(seed: int, n: int = 160, keys: int = 15, span: int = 300) -> list[dict[str, Any]]:
    """Keys repeating everywhere, times in random order over ``span`` seconds (so a key comes
    back both within and beyond the 60 s horizon, earlier and later than its seen time)."""
    rng = random.Random(seed)
    return [{"id": f"k{rng.randrange(keys):02d}", "at": 1_800_000_000 + rng.randrange(span), "rid": i}
            for i in range(n)]


# -- the oracle: plain Python over the raw files ---------------------------------------------------


def parse_landed(folder: Path) -> list[dict[str, Any]]:
    """The valid records of the landed files in landing order (file name, then line)."""
    found = []
    for path in sorted(folder.glob("*.json")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and all(record.get(f) is not None for f in ("id", "at", "rid")):
                found.append(record)
    return found


def oracle(valid: list[dict[str, Any]], within: float) -> tuple[list[int], dict[str, Any]]:
    """The rule in its words: a record is dropped when its key's last kept time is at most
    ``within`` from its own; else it is kept and its time becomes the key's. The kept record
    ids, and the seen time per key."""
    seen: dict[str, Any] = {}
    kept = []
    for r in valid:
        t = r["at"]
        if r["id"] in seen and abs(t - seen[r["id"]]) <= within:
            continue
        kept.append(r["rid"])
        seen[r["id"]] = t
    return sorted(kept), seen


def assert_equals_oracle(spark, spec: PipelineSpec, store: EpochStore, to_time=lambda t: t) -> None:
    """The sink holds exactly the oracle's kept records (each once), the seen-keys table holds
    exactly its seen times, and the epochs' counts add up."""
    valid = [{**r, "at": to_time(r["at"])} for r in parse_landed(spec.landing_dir)]
    kept, seen = oracle(valid, WITHIN_S if isinstance(valid[0]["at"], int) else timedelta(seconds=WITHIN_S))
    got = sorted(r["rid"] for r in spark.read.format("delta").load(spec.sinks[0].path).select("rid").collect())
    assert got == kept, (f"sink differs from the oracle: missing {sorted(set(kept) - set(got))[:10]}, extra "
                         f"{sorted(set(got) - set(kept))[:10]}, {len(got)} rows vs {len(kept)}")
    state = {r["id"]: r["_seen_at"] for r in spark.read.format("delta").load(spec.dedup_table).collect()}
    assert state == seen, {k: (state.get(k), v) for k, v in seen.items() if state.get(k) != v}
    epochs = store.epochs(spec.name)
    assert {e.state for e in epochs} == {protocol.PUBLISHED}
    assert sum(e.rows["deduplicated"] for e in epochs) == len(valid) - len(kept)
    assert 0 < len(kept) < len(valid)  # the data exercises the rule both ways


@pytest.mark.spark_crash
def test_sigkill_between_sink_and_state_commit_rerun_then_rollback_equal_the_oracle(spark, store, seed):
    """The run-once driver is SIGKILLed in its second group after the sink's commit, before the
    seen-keys table's (``mid_write@3``; the group has no malformed line, so the sink is its first
    commit): the rerun restores the sink and writes the group again from the state as of the
    first group. Then a rollback to epoch 3 RESTOREs the sink and the state to the first group's
    versions and recomputes epochs 2 and 3 under generation 1: with a state that did not roll
    back, every key would count as seen and the recompute would drop them (checked: with the
    state left out of the rollback's tables the sink differs from the oracle). Cost: ~57 s
    (measured 58.6 and 56.1 s at load 2-5 on 2 cores: a run-once Spark process of its own for
    two groups, then a group and a rollback in the test's session)."""
    spec = dedup_pipeline("dedup_kill")
    land(spec.landing_dir, records(seed), files=8, malformed_in={0, 3})
    job = GroupJob(spec.name, "--plan", "--drain", env={
        "SLUICE_FAULT": "mid_write@3", "SLUICE_FAULT_MODE": "kill",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    _, err = job.communicate(timeout=300)
    assert job.returncode == -signal.SIGKILL, f"the job was not killed: rc={job.returncode}\n{err[-3000:]}"
    epochs = {e.epoch_id: e.state for e in store.epochs(spec.name)}
    assert epochs[1] == protocol.PUBLISHED and epochs[3] in protocol.UNFINISHED, epochs
    assert app_txn(spark, spec, spec.sinks[0].path, "kept") == 3, "epochs 2..3 in the sink"
    assert app_txn(spark, spec, spec.dedup_table, "_dedup") == 1, "the state as of the first group only"
    groups = run_once(spec, store, spark, drain=True)
    assert groups[0]["group"]["plan"]["reason"].startswith("reprocess epochs")
    assert_equals_oracle(spark, spec, store)
    report = roll_back(spark, spec, store, to_epoch=3, recompute=True, reason="dedup test")
    assert (report["to_epoch"], report["restored_to_epoch"], report["generation"]) == (3, 2, 1)
    assert_equals_oracle(spark, spec, store)


def test_timestamps_across_groups_and_new_files_equal_the_oracle(spark, store, seed):
    """A timestamp time: one group, then new files (a second group reading the state the first
    left). Cost: ~16 s after another Spark test in the session (measured 16.1 s; more as the
    session's first)."""
    spec = dedup_pipeline("dedup_ts", time_type="timestamp")
    stamp = lambda s: datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    batch = records(seed + 1, n=150)
    land(spec.landing_dir, [{**r, "at": stamp(r["at"])} for r in batch[:100]], files=4, malformed_in={3})
    run_once(spec, store, spark, drain=True)
    # Spark returns a timestamp as a naive datetime in the session's time zone.
    zone = spark.conf.get("spark.sql.session.timeZone")
    from zoneinfo import ZoneInfo

    local = lambda text: datetime.fromisoformat(text).astimezone(ZoneInfo(zone)).replace(tzinfo=None)  # noqa: E731
    assert_equals_oracle(spark, spec, store, to_time=local)
    land(spec.landing_dir, [{**r, "at": stamp(r["at"])} for r in batch[100:]], files=2, prefix="s")
    run_once(spec, store, spark, drain=True)
    assert_equals_oracle(spark, spec, store, to_time=local)
    assert max(e.epoch_id for e in store.epochs(spec.name)) == 2
