"""One schedule of the simulation, from its seed: a chaos phase (DAG runs, backfills, a cleared
task, rollbacks, recover, previews, skips, a store rebuild and a sink added to the spec interleaved
at step boundaries, with kills, pauses past the lease, clock jumps, files landing and vanishing),
then a quiet phase in
which an operator follows the runbook (``docs/operating.md``: finish or withdraw a recorded
rollback, skip gone files and a genuinely poison one, recover, drain), then the invariants:

* ``tables``: every table equals the oracle of its published epochs' raw input (a sink added
  during the schedule: each epoch's records once or not at all, those the runbook wrote once);
* ``log``: the epoch log is dense and contiguous, every epoch published, the whole manifest covered;
* ``rejected``: every rejected record appears exactly once;
* ``halt``: the pipeline ends running (no permanent halt) unless a record is genuinely poison;
* ``records``: every published epoch and every finished rollback has its record next to each sink;
* ``preview``: a rollback preview changed nothing;
* ``events``: the Asset events name every version of the sinks that changed data;
* ``stuck``: no actor blocked outside a step boundary (a bug of the simulation or the code).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sluice.model import PUBLISHED, UNPUBLISHED
from sluice.protocol import planning, rules
from sluice.sim import actors
from sluice.sim.compute import AUDIT
from sluice.sim.scheduler import Actor, Stuck
from sluice.sim.world import PIPELINE, TTL_S, ZOMBIE_AFTER_S, World
from sluice.store import records
from sluice.store.epoch_store import _ENGINES, _ENGINES_LOCK

INVARIANTS = ("tables", "log", "rejected", "halt", "records", "preview", "events", "stuck")


@dataclass
class Outcome:
    seed: int
    steps: int = 0
    violations: dict[str, str] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


def run_schedule(seed: int, workdir: Path, template: Path, *, keep: bool = False,
                 store_url: Callable[[int], str] | None = None) -> Outcome:
    """Run the schedule of ``seed`` in a folder of its own under ``workdir``; ``template``: a
    migrated, empty SQLite store to copy; ``store_url(seed)``: another store for it (an empty
    Postgres database; the store is then never lost)."""
    root = workdir / f"s{seed}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if store_url is None:
        shutil.copy(template, root / "store.db")
        url = f"sqlite:///{root / 'store.db'}"
    else:
        url = store_url(seed)
    world = World(seed, root, url)
    if store_url is not None:
        world.config = replace(world.config, store_loss=False)
    outcome = Outcome(seed, config=vars(world.config))
    world.sched.install()
    try:
        _chaos(world, template)
        if _quiet(world, outcome):
            _check(world, outcome)
    except Stuck as exc:
        outcome.violations["stuck"] = str(exc)
    finally:
        world.sched.abandon()
        world.sched.uninstall()
        outcome.steps = world.sched.steps
        outcome.trace = world.sched.trace
        with _ENGINES_LOCK:
            for key in [k for k in _ENGINES if k[1] == url]:
                _ENGINES.pop(key)[0].dispose()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return outcome


EXTRA_STEPS = 150
STEPS_PER_EVENT = (1, 4, 12)
# A rollback twice as likely as the others: its RESTOREs are where a zombie does most harm.
OPERATIONS = ("backfill", "clear", "rollback", "rollback", "recover", "preview", "skip")


def _chaos(world: World, template: Path) -> None:
    """The chaos phase: files land (and some vanish), the pipeline's DAG runs one run after
    another, and 0 to 4 operator actions start at random steps; every step may kill or pause."""
    rng, sched, config = world.rng, world.sched, world.config
    world.land(config.files)
    runs = 0
    planned = {rng.randrange(config.chaos_steps): rng.choice(OPERATIONS) for _ in range(rng.randint(0, 4))}
    if config.zombie_at in ("delta.w.restore:begin", "delta.w.restore:commit", "store.w.finish_rollback"):
        planned[rng.randrange(config.chaos_steps // 2, config.chaos_steps)] = "zombie rollback"
    lose_at = rng.randrange(config.chaos_steps) if config.store_loss else -1
    retrying: list[tuple[Actor, tuple[int, bool], int]] = []  # an operator's rollbacks: (run, (to, recompute), tries)

    def roll_back(asked: tuple[int, bool], *, take_over: bool, tries: int) -> Actor:
        """The operator triggers sluice_rollback; a refused or dead one is retried (below)."""
        actor = actors.rollback_run(world, f"manual__{runs}", asked[0], recompute=asked[1], take_over=take_over)
        retrying.append((actor, asked, tries))
        return actor
    again: tuple[float, tuple[int, bool]] | None = None  # when the operator retries a zombie's rollback, and how
    n = 0
    # The chaos goes on past its planned steps while an actor is stopped (a zombie) or an
    # operator retries, up to EXTRA_STEPS more: the pipeline keeps running around a zombie, so
    # a newer owner can take its lease over and publish before it resumes (what the fence must
    # survive).
    while n < config.chaos_steps or (n < config.chaos_steps + EXTRA_STEPS
                                     and (retrying or again or max(planned, default=-1) >= n
                                          or any(a.state == "paused" for a in sched.actors))):
        sched.tick(rng.expovariate(1 / 2.0))
        roll = rng.random()
        if roll < 0.15:
            world.land(rng.randint(1, 2))
        elif roll < 0.15 + config.vanish_p:
            world.vanish()
        elif roll < 0.17 + config.vanish_p:
            sched.tick(rng.uniform(TTL_S, 3 * TTL_S))  # a long wait: leases expire
        pipeline_runs = [a for o, a in world.dag_runs.items() if o.startswith(f"airflow:{PIPELINE}:scheduled")]
        if not any(not a.finished for a in pipeline_runs) and rng.random() < 0.5:
            runs += 1
            # a third of the runs plan as the controllers' probe: one first epoch of another size
            probe = rng.randint(1, 6) if rng.random() < 1 / 3 else None
            actors.dag_run(world, f"scheduled__{runs}", first_size=probe)
        operation = planned.get(n)
        runs += 1
        if operation == "backfill":
            end = sched.now - rng.uniform(0, 60)
            actors.dag_run(world, f"backfill__{runs}", interval=(end - rng.uniform(10, 120), end))
        elif operation == "clear":
            done = actors.published_groups(world)
            if done:
                actors.dag_run(world, rng.choice(done).split(":", 2)[2], cleared=True)
        elif (operation in ("rollback", "zombie rollback") and not _published(world)
              and n < config.chaos_steps + EXTRA_STEPS // 2):
            planned[n + 3] = operation  # an operator rolls back what was published: wait for some
        elif operation == "zombie rollback" and (last := _last_epoch(world)) is not None:
            # A rollback that takes the lease over and is stopped at its RESTORE (or right after
            # it) while the pipeline goes on around it: the zombie Config.zombie_at asks for.
            asked = (rng.randint(0, last), rng.random() < 0.7)
            zombie = actors.rollback_run(world, f"manual__{runs}", asked[0], take_over=True, recompute=asked[1])
            try:
                sched.run_until(zombie, lambda step: step == config.zombie_at)
            except Stuck:  # it waits for something (a sleep between retries): no zombie this time
                pass
            if zombie.state == "ready" and zombie.step == config.zombie_at:
                sched.pause(zombie, rng.uniform(3 * TTL_S, 6 * TTL_S))  # long enough for others to publish
                sched.zombie_at = None
                # The operator sees the rollback hang and triggers it again (the runbook), taking
                # the lease over: the pipeline then publishes again while the zombie is stopped.
                again = (sched.now + rng.uniform(1.05, 1.5) * TTL_S, asked)  # once its lease has expired
        elif operation in ("rollback", "preview"):
            last = _last_epoch(world)
            if last is not None and operation == "rollback":
                asked = (rng.randint(0, last), rng.random() < 0.7)
                roll_back(asked, take_over=rng.random() < 0.3, tries=0)
            elif last is not None:
                actors.preview_run(world, f"manual__{runs}", rng.randint(0, last))
        elif operation == "recover":
            actors.recover_run(world, f"manual__{runs}", take_over=rng.random() < 0.5,
                               withdraw=rng.random() < 0.3)
        elif operation == "skip":
            for path in _gone(world):
                actors.skip_run(world, f"manual__{runs}_{abs(hash(path)) % 1000}", path)
        if again is not None and sched.now >= again[0]:
            roll_back(again[1], take_over=True, tries=1)
            again = None
        # The operator whose rollback was refused as busy, or died, triggers it again (up to 4 times),
        # from the second time on taking the lease over: without this nearly every rollback met a
        # scheduled run holding the lease, and the RESTOREs were never exercised.
        for entry in list(retrying):
            refused, asked, tries = entry
            if refused.finished:
                retrying.remove(entry)
                if refused.result == "failed" and ("is busy" in refused.note or refused.note == "killed") and tries < 4:
                    runs += 1
                    roll_back(asked, take_over=tries >= 1, tries=tries + 1)
        if world.audit_at is not None and not world.audit_added and n >= world.audit_at * config.chaos_steps:
            world.add_audit()
        if n == lose_at:
            world.lose_store(template)
            actors.rebuild_run(world, f"rebuild_{runs}")
        # Several actor steps between two chaos events (one alone left the chaos phase shorter
        # than one group: the operator actions met no published epoch and never RESTOREd).
        for _ in range(rng.choice(STEPS_PER_EVENT)):
            if not sched.step():
                wake = sched.next_wake()
                if wake is not None and wake - sched.now < 2 * TTL_S:
                    sched.tick(max(wake - sched.now, 0.0))
                break
        n += 1


def _last_epoch(world: World) -> int | None:
    store = world.store()
    if not store.has_pipeline(PIPELINE):
        return None
    epochs = [e.epoch_id for e in store.epochs(PIPELINE) if e.state != "rolled_back"]
    return max(epochs) if epochs else None


def _published(world: World) -> bool:
    store = world.store()
    return store.has_pipeline(PIPELINE) and store.knows(PIPELINE, published=True)


def _gone(world: World) -> list[str]:
    """Registered files that are gone and not skipped yet."""
    store = world.store()
    if not store.has_pipeline(PIPELINE):
        return []
    return [e.path for e in store.manifest(PIPELINE) if e.skipped is None and not os.path.exists(e.path)]


def _poison(world: World) -> list[str]:
    """Files an epoch failed on with a poison record named in its error (only skipping helps)."""
    found = []
    for e in world.store().epochs(PIPELINE):
        if e.state == "failed" and e.error and "poison record at " in e.error:
            found.append(e.error.split("poison record at ", 1)[1].split(" line ", 1)[0])
    return found


def _quiet(world: World, outcome: Outcome) -> bool:
    """The operator's runbook, without faults, until the pipeline has drained; False (a
    ``halt`` violation) if it never gets there."""
    sched = world.sched
    sched.faults = False
    sched.drain()
    sched.tick(ZOMBIE_AFTER_S + 2 * TTL_S)  # every zombie is over, every lease expired
    store = world.store()
    # what the chaos planned; the runbook's runs, all of the spec deployed last, plan the rest
    world.chaos_epochs = ({(e.epoch_id, e.written_generation) for e in store.epochs(PIPELINE)}
                          if store.has_pipeline(PIPELINE) else set())
    runs = 0
    last = ""
    for _ in range(60):
        sched.drain()
        store = world.store()
        exists = store.has_pipeline(PIPELINE)
        intent = store.pending_rollback(PIPELINE) if exists else None
        runs += 1
        if intent is not None:
            last = intent.describe()
            if intent.rebuild:
                actors.rebuild_run(world, f"quiet_rebuild_{runs}")
            elif intent.restoring:
                actors.rollback_run(world, f"quiet__{runs}", intent.asked, recompute=True, take_over=True)
            else:
                actors.recover_run(world, f"quiet__{runs}", take_over=True, withdraw=True)
            continue
        for path in sorted(set(_gone(world)) | set(_poison(world))):
            actors.skip_run(world, f"quiet_skip_{runs}_{abs(hash(path)) % 10**6}", path)
        sched.drain()
        if exists and any(e.state in UNPUBLISHED for e in store.epochs(PIPELINE)):
            last = planning.halt_reason(store, PIPELINE, 3, 10) or "unpublished epochs"
            if "failed validation" in last:  # the runbook: deploy the fix, then recover
                world.fixed = True
            actors.recover_run(world, f"quiet__{runs}", take_over=True)
            continue
        drain = actors.dag_run(world, f"quiet_drain__{runs}", k=1000, epoch_size=1000)
        sched.drain()
        if drain.result == "skipped":
            return True
        if drain.result != "success":
            last = f"the drain run ended {drain.result!r}: {drain.note or drain.error!r}"
            if "rebuild-store" in drain.note:  # the store was lost: the error names the rebuild
                actors.rebuild_run(world, f"quiet_rebuild_{runs}")
    outcome.violations["halt"] = f"the pipeline did not drain after the runbook: {last}"
    return False


def _diff(name: str, want: Counter[Any], got: Counter[Any]) -> str | None:
    if want == got:
        return None
    missing = want - got
    extra = got - want
    return (f"{name}: {sum(missing.values())} missing (e.g. {list(missing.items())[:3]}), "
            f"{sum(extra.values())} extra (e.g. {list(extra.items())[:3]})")


def _check(world: World, outcome: Outcome) -> None:
    store = world.store()
    v = outcome.violations
    if not store.has_pipeline(PIPELINE):
        if any(world.tables.rows(t) for t in world.tables.paths()):
            v["tables"] = "the store holds no pipeline, yet the tables hold rows"
        return
    want, got = world.oracle(store), world.held()
    problems = [p for p in (_diff("counts", want["counts"], got["counts"]),
                            _diff("clean", want["clean"], got["clean"]),
                            _diff("latest", want["latest"], got["latest"]),
                            _diff("_dedup", want["_dedup"], got["_dedup"])) if p]
    if problems:
        v["tables"] = "; ".join(problems)
    valid = world.valid_lines(store) if world.audit_added else {}
    if world.audit_added and (problem := _audit(world, store, valid)):
        v["tables"] = "; ".join(p for p in (v.get("tables"), problem) if p)
    if any(n != 1 for n in got["_rejected"].values()):
        v["rejected"] = f"rejected twice: {[k for k, n in got['_rejected'].items() if n != 1][:3]}"
    elif (p := _diff("_rejected", want["_rejected"], got["_rejected"])):
        v["rejected"] = p
    epochs = store.epochs(PIPELINE)
    try:
        rules.check_contiguous((e.epoch_id, e.start, e.end) for e in epochs)
    except Exception as exc:
        v["log"] = str(exc)
    else:
        end = len(store.manifest(PIPELINE))
        if (epochs[-1].end if epochs else 0) != end or any(e.state != PUBLISHED for e in epochs):
            v["log"] = (f"epochs cover [0, {epochs[-1].end if epochs else 0}) of a manifest of {end}; states "
                        f"{sorted({e.state for e in epochs})}")
    # Records: every published epoch, every finished rollback, next to every sink.
    for sink in world.spec.sinks:
        try:
            found, rollbacks = records.read(world.tables, [sink.path])
        except records.RecordError as exc:
            v["records"] = str(exc)
            break
        have = {(r.epoch_id, r.generation) for r in found}
        if sink.name == AUDIT:  # the added sink: only the epochs it holds (written once it was there)
            held = {(r["file"], r["line"]) for r in world.tables.rows(sink.path)}
            inside = {i for i, lines in valid.items() if lines & held}
        # Named by the generation it was published in: the one it was written in, or (an epoch a
        # rollback carried over unpublished and published with the recompute) the one it lived
        # in then, which later rollbacks that kept it may have moved on from.
        missing = [(e.epoch_id, e.generation) for e in epochs
                   if not any((e.epoch_id, g) in have for g in range(e.written_generation, e.generation + 1))
                   and (sink.name != AUDIT or e.epoch_id in inside)]
        gens = {r.generation for r in rollbacks}
        # the added sink is made by the first group of a run of the new spec, whose publish then
        # notes every earlier rollback next to it; while no such group ran, there is nothing there
        made = sink.name != AUDIT or sink.path in world.tables.paths()
        lost = [r["generation"] for r in store.rollbacks(PIPELINE) if r["generation"] not in gens and made]
        if missing or lost:
            v["records"] = f"sink {sink.name}: no record of epochs {missing[:5]}; of rollbacks {lost[:5]}"
    # Asset events: every version of a sink that changed its rows, up to the last one an event
    # reported, is in some event's range; no event names a version the table does not have.
    for sink in world.spec.sinks:
        ranges = [e["versions"] for e in world.events if e["table"] == sink.path]
        if not ranges:
            continue
        commits = world.tables.all_commits(sink.path)
        reported = max(to for _, to in ranges)
        if reported > len(commits) - 1:
            v["events"] = (f"sink {sink.name}: an event reports version {reported}; the table's last is "
                           f"{len(commits) - 1}")
            break
        missed = [c.version for c in commits if c.version <= reported and (c.adds or c.removes)
                  and not any(a <= c.version <= b for a, b in ranges)]
        if missed:
            v["events"] = f"sink {sink.name}: versions {missed[:5]} changed rows and no Asset event reported them"
            break
    for actor in world.sched.actors:
        if actor.name.startswith("preview:"):
            writes = [s for s in actor.steps if ".w." in s]
            if writes:
                v["preview"] = f"{actor.name} wrote: {writes[:3]}"


def _audit(world: World, store: Any, valid: dict[int, set[tuple[str, int]]]) -> str | None:
    """The sink added during the schedule holds each published epoch's valid records once or
    not at all (the epochs published before it was added, by runs of the spec without it, are
    not in it), never part of an epoch, never a record twice; every epoch the runbook's runs
    wrote is in it (unless the store was lost: a rebuilt log may name epochs anew)."""
    held = Counter((r["file"], r["line"]) for r in world.tables.rows(world.spec.sink(AUDIT).path))
    twice = [k for k, n in held.items() if n > 1]
    if twice:
        return f"audit: {len(twice)} records more than once (e.g. {twice[:3]})"
    published = {e.epoch_id: e for e in store.epochs(PIPELINE) if e.state == PUBLISHED}
    for epoch_id, lines in sorted(valid.items()):
        inside = sum(1 for line in lines if line in held)
        if 0 < inside < len(lines):
            return f"audit: epoch {epoch_id} holds {inside} of its {len(lines)} records"
        epoch = published[epoch_id]
        if (not inside and lines and not world.config.store_loss
                and (epoch_id, epoch.written_generation) not in world.chaos_epochs):
            return (f"audit: epoch {epoch_id} (written in generation {epoch.written_generation}), written by "
                    "the runbook, is not in it")
    return None


def summary(outcomes: list[Outcome], seconds: float, seed: int) -> dict[str, Any]:
    counts = dict.fromkeys(INVARIANTS, 0)
    for o in outcomes:
        for name in o.violations:
            counts[name] = counts.get(name, 0) + 1
    return {"schedules": len(outcomes), "steps": sum(o.steps for o in outcomes), "violations": counts,
            "seed": seed, "seconds": round(seconds, 1)}


def replay(outcome: Outcome) -> str:
    """How to run one failing schedule again, and what it did."""
    tail = "\n    ".join(outcome.trace[-15:])
    return (f"seed {outcome.seed}: {json.dumps(outcome.violations)}\n  replay: make sim SCHEDULES=1 SEED={outcome.seed}"
            f" (python -m sluice.sim --schedules 1 --seed {outcome.seed} --verbose)\n  config: "
            f"{json.dumps(outcome.config)}\n  last faults:\n    {tail}")


def workdir() -> Path:
    """A folder on a RAM disk where there is one (the landing files and the store are small)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="sluice-sim-", dir=base))


def template(folder: Path) -> Path:
    """An empty store at the schema's head, made once, copied for every schedule."""
    from sluice.store import EpochStore

    path = folder / "template.db"
    store = EpochStore(f"sqlite:///{path}")
    store.close()
    return path


def run_seeds(seeds: list[int], keep: bool = False, store_url: Callable[[int], str] | None = None) -> list[Outcome]:
    """The schedules of ``seeds``, one after the other, in this process."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # the protocol's own log lines, thousands per second
    folder = workdir()
    try:
        base = template(folder)
        return [run_schedule(seed, folder, base, keep=keep, store_url=store_url) for seed in seeds]
    finally:
        logging.disable(previous)
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
