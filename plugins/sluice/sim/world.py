"""One simulated world: a pipeline over a landing folder of JSON-lines files (on a RAM disk), the
real epoch store (a SQLite file copied from a migrated template, or a fresh Postgres database),
the Delta twin, virtual time, and the raw input every oracle is computed from."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sluice.dedup import EPOCH as DEDUP_EPOCH
from sluice.dedup import SEEN_AT
from sluice.delta.twin import TwinTables
from sluice.model import Lease
from sluice.protocol.runtime import Runtime
from sluice.sim.compute import AUDIT, INVALID, LATEST_DELETE, POISON, TwinCompute, parse
from sluice.sim.scheduler import Scheduler, current
from sluice.spec import PipelineSpec
from sluice.store import EpochStore

PIPELINE = "sim"
#: The share of drawn schedules in which the operator adds the sink ``audit`` to the spec.
AUDIT_P = 0.25
#: Of the group-commit schedules, the fraction that deduplicates: half of them by ``(k, n)``, once
#: ever (``DEDUP_ONCE``), half by ``k`` within a horizon measured on ``n`` as the records' own time
#: (``DEDUP_WITHIN``: a key's seen time moves with each record it keeps, so order matters).
DEDUP_P = 0.3
DEDUP_ONCE: dict[str, Any] = {"keys": ["k", "n"]}
DEDUP_WITHIN: dict[str, Any] = {"keys": ["k"], "within": 3, "time": "n"}
TTL_S = 60.0
#: Airflow calls a task whose heartbeats stopped this long a zombie (its run is then over).
ZOMBIE_AFTER_S = 300.0


# Where a zombie is made (Config.zombie_at): the steps between a fence and the write or
# RESTORE it guards, where a stopped process does harm if the fence does not hold.
# A RESTORE's steps are listed twice: a rollback reaches them in few schedules.
ZOMBIE_STEPS = ("delta.w.restore:begin", "delta.w.restore:commit", "delta.w.restore:begin", "delta.w.restore:commit",
                "delta.w.write:begin", "delta.w.write:commit", "delta.w.fence:commit", "store.w.mark_committed",
                "store.w.finish_rollback")


@dataclass(frozen=True)
class Config:
    """What one schedule's pipeline and faults look like, drawn from its seed."""

    commit: str
    epoch_files: int
    group_epochs: int
    files: int
    lines: int
    malformed_p: float
    poison: bool
    invalid: bool
    chaos_steps: int
    kill_p: float
    pause_p: float
    vanish_p: float
    store_loss: bool
    skew_s: float
    zombie_at: str | None = None  # the first actor to reach this step is stopped there past its lease

    @classmethod
    def draw(cls, rng: random.Random) -> Config:
        return cls(commit=rng.choice(["group", "group", "epoch"]), epoch_files=rng.choice([1, 2, 3]),
                   group_epochs=rng.choice([1, 2, 3]), files=rng.randint(0, 4), lines=rng.randint(1, 3),
                   malformed_p=rng.choice([0.0, 0.3]), poison=rng.random() < 0.03,
                   invalid=rng.random() < 0.05, chaos_steps=rng.randint(10, 60), kill_p=rng.choice([0.0, 0.04, 0.1]),
                   pause_p=rng.choice([0.0, 0.02, 0.05]), vanish_p=rng.choice([0.0, 0.0, 0.03]),
                   store_loss=rng.random() < 0.04, skew_s=rng.choice([0.0, 0.0, TTL_S / 2, 3 * TTL_S]),
                   zombie_at=rng.choice(ZOMBIE_STEPS) if rng.random() < 0.4 else None)


def sim_spec(root: Path, config: Config, table_root: str | None = None, audit: bool = False,
             dedup: dict[str, Any] | None = None) -> PipelineSpec:
    """The simulated pipeline; ``table_root``: where its tables are (another storage's paths,
    such as ``s3a://bucket``; the twin does not care); ``audit``: with the sink an operator adds
    to the spec during a schedule (an append of every valid record, first in the commit order);
    ``dedup``: the spec's ``dedup`` block (``DEDUP_ONCE`` or ``DEDUP_WITHIN``; ``commit: group`` only)."""
    tables = table_root or str(root / "tables")
    added = [{"name": AUDIT, "mode": "append", "path": f"{tables}/{AUDIT}"}] if audit else []
    return PipelineSpec.model_validate({
        **({"dedup": dedup} if dedup else {}),
        "name": PIPELINE, "schedule": "@continuous", "transform": "sim.transform",
        "source": {"type": "files", "path": str(root / "landing"), "format": "json", "pattern": "*.json",
                   "settle_s": 0,  # files are renamed into place whole
                   "schema": {"k": "string", "n": "long"}, "required": ["k", "n"], "unknown_fields": "ignore"},
        "sinks": [*added,
                  {"name": "counts", "mode": "aggregate", "path": f"{tables}/counts", "keys": ["k"], "sums": ["n"]},
                  {"name": "clean", "mode": "append", "path": f"{tables}/clean"},
                  # The highest n per k; n = 9 deletes k (sluice.delta.upsert: a tombstone).
                  {"name": "latest", "mode": "upsert", "path": f"{tables}/latest", "keys": ["k"],
                   "sequence_by": "n", "delete_when": f"n = {LATEST_DELETE}"}],
        "commit": config.commit,
        "control": {"adaptive": False, "epoch_files": config.epoch_files, "group_epochs": config.group_epochs,
                    "lease_ttl_s": TTL_S, "max_attempts": 3, "max_crashes": 10},
        "spark": {"mode": "in_process"},
    })


class World:
    """The shared state of one schedule; its actors live in ``sched``."""

    def __init__(self, seed: int, root: Path, store_url: str, config: Config | None = None,
                 table_root: str | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = Config.draw(self.rng) if config is None else config
        self.sched = Scheduler(self.rng)
        self.root = root
        (root / "landing").mkdir(parents=True)
        self.url = store_url
        self.tables = TwinTables()
        self.table_root = table_root
        # An operator adds the sink ``audit`` to the spec at this point of the chaos phase (a
        # fraction of it; ``None``: never). Drawn apart, so each seed's schedule stays what it was.
        side = random.Random(seed * 1_000_003 + 36)
        self.audit_at = side.random() if config is None and side.random() < AUDIT_P else None
        self.audit_added = False
        # Deduplication in a fraction of the group-commit schedules: the seen keys are a table of
        # the pipeline, read as the group starts, restored with the epochs. Drawn apart too, from
        # a stream that leaves the seeds in test_simulation's FOUND without it (their schedules,
        # which found the bugs before dedup was simulated, stay what they were); its second draw
        # picks the rule (DEDUP_ONCE or DEDUP_WITHIN), so the first stays what it was.
        side = random.Random(seed * 1_000_003 + 54)
        drawn = config is None and self.config.commit == "group" and side.random() < DEDUP_P
        self.dedup = (DEDUP_WITHIN if side.random() < 0.5 else DEDUP_ONCE) if drawn else None
        self.spec = sim_spec(root, self.config, table_root, dedup=self.dedup)
        self.chaos_epochs: set[tuple[int, int]] = set()  # (epoch, written generation) before the runbook
        self.contents: dict[str, list[str]] = {}  # every file ever landed: its lines (the oracle's input)
        self.vanished: set[str] = set()
        self.store_lost = False  # set by lose_store: until a rebuild, the store cannot say what was read
        self.dag_runs: dict[str, Any] = {}  # owner -> the actor of that DAG run
        self.fixed = False  # the operator deployed the check that rejects INVALID records
        self.runtime = Runtime(self.tables,
                               lambda spec, store, tables: TwinCompute(spec, store, lambda: self.fixed, tables),
                               keeper=self.keeper, alive=self.alive)
        self.events: list[dict[str, Any]] = []  # the Asset events the DAGs emitted
        self._files = 0
        self.sched.renew = self._renew
        self.sched.kill_p, self.sched.pause_p = self.config.kill_p, self.config.pause_p
        self.sched.pause_s = (1.3 * TTL_S, 4 * TTL_S)
        self.sched.skew_s = self.config.skew_s
        self.sched.zombie_at = self.config.zombie_at

    # -- the store and the leases ---------------------------------------------------------------------

    def clock(self) -> datetime:
        return datetime.fromtimestamp(self.sched.now, UTC).replace(tzinfo=None)

    def store(self) -> EpochStore:
        """The epoch store as a task opens it (a lost and replaced store is a new one)."""
        return EpochStore(self.url, clock=self.clock)

    def _renew(self, lease: Lease, ttl: float) -> None:
        self.store().renew_lease(lease, ttl)

    @contextmanager
    def keeper(self, store: EpochStore, lease: Lease, ttl_s: float) -> Any:
        """``LeaseKeeper`` of the simulation: renewed by the scheduler as virtual time passes,
        while the actor is neither paused nor dead (its renewal thread)."""
        actor = current()
        keeper = [lease, ttl_s, self.sched.now]
        if actor is not None:
            actor.keepers.append(keeper)
        try:
            yield keeper
        finally:
            if actor is not None and keeper in actor.keepers:
                actor.keepers.remove(keeper)

    def alive(self, owner: str) -> bool:
        """Airflow's view of the DAG run behind a lease owner: running until its actor ends, or
        until its paused task has missed heartbeats long enough to be called a zombie."""
        actor = self.dag_runs.get(owner)
        if actor is None or actor.finished:
            return False
        return not (actor.paused_at is not None and self.sched.now - actor.paused_at > ZOMBIE_AFTER_S)

    # -- the source ----------------------------------------------------------------------------------

    def land(self, files: int = 1) -> None:
        """New files in the landing folder (written whole, then renamed), dated now."""
        for _ in range(files):
            self._files += 1
            name = f"f{self._files:05d}.json"
            lines = []
            for i in range(self.config.lines):
                roll = self.rng.random()
                if roll < self.config.malformed_p / 2:
                    lines.append("{not json")
                elif roll < self.config.malformed_p:
                    lines.append(json.dumps({"k": f"k{i}"}))
                elif self.config.poison and self._files == 3 and i == 0:
                    lines.append(json.dumps({"k": POISON, "n": 1}))
                elif self.config.invalid and self._files == 2 and i == 0:
                    lines.append(json.dumps({"k": INVALID, "n": 1}))
                else:
                    lines.append(json.dumps({"k": self.rng.choice("abcde"), "n": self.rng.randint(1, 9)}))
            path = self.root / "landing" / name
            tmp = self.root / "landing" / f".{name}"
            tmp.write_text("\n".join(lines) + "\n")
            os.utime(tmp, (self.sched.now, self.sched.now))
            tmp.replace(path)
            self.contents[str(path)] = lines

    def vanish(self) -> None:
        """A landed file is deleted before any epoch read it (it is in no planned range)."""
        store = self.store()
        if self.store_lost and not store.knows(PIPELINE):
            return  # the lost store's ranges are unknown until the rebuild: any file may have been read
        planned_end = store.next_offset(PIPELINE) if store.has_pipeline(PIPELINE) else 0
        registered = {e.path: e.position for e in store.manifest(PIPELINE)} if store.has_pipeline(PIPELINE) else {}
        pending = [p for p in self.contents if p not in self.vanished and registered.get(p, planned_end) >= planned_end
                   and os.path.exists(p)]
        if pending:
            path = self.rng.choice(sorted(pending))
            os.unlink(path)
            self.vanished.add(path)

    def lose_store(self, template: Path) -> None:
        """The epoch store is lost: an empty one replaces it (a rebuild must follow)."""
        self.store_lost = True
        path = Path(self.url.removeprefix("sqlite:///"))
        tmp = path.with_name(".lost")
        shutil.copy(template, tmp)
        os.replace(tmp, path)
        for suffix in ("-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)

    def emit(self, owner: str, change: str, changes: dict[str, dict[str, Any]]) -> None:
        """The Asset events a task's success emits: per sink, the table versions they report."""
        for sink, fields in changes.items():
            if fields.get("versions"):
                self.events.append({"owner": owner, "change": change, "table": self.spec.sink(sink).path,
                                    "versions": tuple(fields["versions"]), "at": self.sched.now})

    def add_audit(self) -> None:
        """The operator deploys the spec with the sink ``audit``: runs started from now on write
        it (made by their first group), runs already going carry on with the spec they read."""
        self.spec = sim_spec(self.root, self.config, self.table_root, audit=True, dedup=self.dedup)
        self.audit_added = True

    # -- the oracle ----------------------------------------------------------------------------------

    def published_lines(self, store: EpochStore) -> Iterator[tuple[int, str, int, dict[str, Any] | None]]:
        """``(epoch, file, line, record)`` for every non-blank raw line of the published epochs'
        files (less those skipped on purpose), in source order (epoch, file, line); ``record`` is
        ``None`` where the line does not parse or holds the key the fix rejects. Under ``dedup``,
        a valid record is not there at all (dropped) when an earlier kept one had its key, at a
        time at most ``within`` from its own (``within`` absent: ever); a kept record's time
        becomes its key's seen time. The one walk every oracle reads."""
        manifest = store.manifest(PIPELINE)
        seen: dict[tuple[Any, ...], Any] = {}  # key -> time of its last kept record
        within = self.dedup.get("within") if self.dedup else None
        for epoch in store.epochs(PIPELINE):
            if epoch.state != "published":
                continue
            for path in sorted(e.path for e in manifest[epoch.start:epoch.end] if e.skipped is None):
                for n, text in enumerate([t for t in self.contents.get(path, []) if t.strip()], start=1):
                    record, _ = parse(text)
                    if record is None or record["k"] == INVALID:  # rejected once the fix runs
                        yield epoch.epoch_id, path, n, None
                        continue
                    if self.dedup:
                        key, t = self._dedup_key(record)
                        if key in seen and (within is None or abs(t - seen[key]) <= within):
                            continue
                        seen[key] = t
                    yield epoch.epoch_id, path, n, record

    def _dedup_key(self, record: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
        """A record's dedup key and its time (``None`` without one)."""
        assert self.dedup is not None
        time = self.dedup.get("time")
        return tuple(record[f] for f in self.dedup["keys"]), (record[time] if time else None)

    def oracle(self, store: EpochStore) -> dict[str, Counter[Any]]:
        """What every table must hold: computed from the raw lines of the published epochs'
        files (less those skipped on purpose), never from sluice's own reading."""
        counts: Counter[Any] = Counter()
        clean: Counter[Any] = Counter()
        rejected: Counter[Any] = Counter()
        highest: dict[str, int] = {}
        last: dict[tuple[Any, ...], tuple[Any, int]] = {}  # under dedup: key -> (time, epoch) last kept
        for epoch_id, path, n, record in self.published_lines(store):
            if record is None:
                rejected[(path, n)] += 1
            else:
                counts[record["k"]] += record["n"]
                clean[(path, n)] += 1
                highest[record["k"]] = max(highest.get(record["k"], record["n"]), record["n"])
                if self.dedup:
                    key, t = self._dedup_key(record)
                    last[key] = (t, epoch_id)
        latest = Counter({(k, n, n == LATEST_DELETE): 1 for k, n in highest.items()})
        seen = Counter((*key, t, e) for key, (t, e) in last.items())  # one row per key, as _dedup holds
        return {"counts": counts, "clean": clean, "_rejected": rejected, "latest": latest, "_dedup": seen}

    def valid_lines(self, store: EpochStore) -> dict[int, set[tuple[str, int]]]:
        """Each published epoch's valid records, as ``(file, line)``, from the raw lines."""
        out: dict[int, set[tuple[str, int]]] = {e.epoch_id: set() for e in store.epochs(PIPELINE)
                                                if e.state == "published"}
        for epoch_id, path, n, record in self.published_lines(store):
            if record is not None:
                out[epoch_id].add((path, n))
        return out

    def held(self) -> dict[str, Counter[Any]]:
        """What the tables hold now (the twin's rows, as a reader sees them)."""
        counts: Counter[Any] = Counter()
        for row in self.tables.rows(self.spec.sink("counts").path):
            counts[row["k"]] += row["n"]
        clean = Counter((r["file"], r["line"]) for r in self.tables.rows(self.spec.sink("clean").path))
        rejected = Counter((r["file"], r["line"]) for r in self.tables.rows(self.spec.rejected_table))
        latest = Counter((r["k"], r["n"], r["_deleted"]) for r in self.tables.rows(self.spec.sink("latest").path))
        table = self.spec.dedup_table
        keys = self.dedup["keys"] if self.dedup else []
        seen = Counter((*(r[f] for f in keys), r[SEEN_AT], r[DEDUP_EPOCH]) for r in self.tables.rows(table)) \
            if table is not None and self.tables.exists(table) else Counter()
        return {"counts": +counts, "clean": clean, "_rejected": rejected, "latest": latest, "_dedup": seen}
