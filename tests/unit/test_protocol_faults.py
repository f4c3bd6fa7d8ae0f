"""The holes a review and the simulation found (issue items (a) to (g)), each replayed as a
scripted interleaving of actors on the real protocol code, the real epoch store (SQLite) and the
Delta twin, with the step at which each actor is killed or paused named. Each asserts the
outcome against the oracle of the raw input (``World.oracle``), not sluice's own reading.
Milliseconds each; the random schedules are ``test_simulation.py``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sluice import boundary
from sluice.errors import FencedError
from sluice.model import LeaseOwner
from sluice.protocol import operations, rules
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import halt_reason
from sluice.protocol.run import PipelineRun
from sluice.sim import actors
from sluice.sim.schedule import template
from sluice.sim.scheduler import Actor
from sluice.sim.world import PIPELINE, TTL_S, Config, World
from sluice.store import EpochStore, records

QUIET = Config(commit="group", epoch_files=2, group_epochs=2, files=0, lines=3, malformed_p=0.3, poison=False,
               invalid=False, chaos_steps=0, kill_p=0.0, pause_p=0.0, vanish_p=0.0, store_loss=False, skew_s=0.0)


@pytest.fixture
def world(tmp_path):
    folder = tmp_path / "sim"
    folder.mkdir()
    base = template(folder)

    def make(config: Config = QUIET, seed: int = 1, table_root: str | None = None) -> World:
        root = tmp_path / f"w{seed}"
        root.mkdir()
        (root / "store.db").write_bytes(base.read_bytes())
        made = World(seed, root, f"sqlite:///{root / 'store.db'}", config, table_root)
        made.sched.faults = False
        made.sched.install()
        return made

    yield make
    boundary.HOOK = boundary.CLOCK = None


def settle(w: World) -> None:
    """Every actor to its end, then every lease expired (virtual time)."""
    w.sched.drain()
    w.sched.tick(10 * TTL_S)


def drain(w: World, name: str = "drain") -> bool:
    """A run that processes whatever is left; whether it ended well (``skipped``: nothing was)."""
    run = actors.dag_run(w, name, k=1000)
    w.sched.drain()
    assert run.result in ("success", "skipped"), run.note
    return True


def once(w: World, owner: str, **kwargs) -> Actor:
    """``sluice run-group --plan --drain`` as one process (no retries, no callbacks)."""
    def program(actor: Actor) -> str:
        PipelineRun(w.spec, w.store(), owner, w.runtime).run_once(drain=True, **kwargs)
        return "done"

    return w.sched.spawn(Actor(owner, program, owner))


def assert_oracle(w: World) -> None:
    store = w.store()
    want, got = w.oracle(store), w.held()
    assert got == want, f"tables differ from the oracle: want {want}, got {got}"
    epochs = store.epochs(PIPELINE)
    rules.check_contiguous((e.epoch_id, e.start, e.end) for e in epochs)
    assert {e.state for e in epochs} <= {"published"}


def at(*names: str):
    return lambda step: any(step.startswith(n) for n in names)


def test_a_kill_in_the_first_group_after_one_table_was_made_does_not_brick_the_pipeline(world):
    """(a) Killed after making ``_rejected`` and before making the sinks, a first group left
    ``campaign_views`` missing and every later attempt failed on it, until the pipeline halted.
    Now every table is made before the attempt is counted, and a rerun makes what is missing."""
    w = world()
    w.land(4)
    first = once(w, "cli:a:1")
    made = []
    w.sched.run_until(first, lambda step: step == "delta.w.create:commit" and len(made.append(step) or made) > 1)
    assert len(w.tables.paths()) == 1, "one table made"
    w.sched.kill(first)
    w.sched.tick(2 * TTL_S)  # its lease expires
    w.sched.run_until(once(w, "cli:a:2"))
    assert halt_reason(w.store(), PIPELINE, 3, 10) is None
    assert_oracle(w)


def test_killed_drivers_are_crashes_not_poison_attempts(world):
    """(b) Three SIGKILLs of a driver (out of memory, preempted) halted the pipeline as if a
    record were poison. Kills are counted apart, against ``control.max_crashes``."""
    w = world()
    w.land(2)
    for n in range(4):
        run = once(w, f"cli:b:{n}")
        w.sched.run_until(run, at("delta.w.write:commit"))
        w.sched.kill(run)
        w.sched.tick(2 * TTL_S)
    [epoch] = w.store().epochs(PIPELINE)
    assert epoch.failures == 0 and epoch.crashes == 3 and epoch.attempts == 4  # the 4th is still open
    assert halt_reason(w.store(), PIPELINE, 3, 10) is None, "a killed driver is no poison record"
    assert "died 3 times" in (rules.halt_reason([epoch], 3, 3) or ""), "counted against control.max_crashes"
    w.sched.run_until(once(w, "cli:b:last"))
    assert_oracle(w)


@pytest.mark.parametrize("pause_at", ["delta.w.restore:begin", "delta.w.restore:commit"])
def test_a_zombie_rollback_cannot_restore_over_a_newer_owners_published_commits(world, pause_at):
    """(c) A rollback paused between fencing the tables and its RESTORE, resumed after another
    run took the lease over and published, restored over the new owner's work (40 of 85
    rejected records left, the store saying "published"). A RESTORE is fenced now: refused
    under an older token, whenever it resumes."""
    w = world()
    w.land(4)
    w.sched.run_until(once(w, "cli:c:1"))
    zombie = actors.rollback_run(w, "manual__1", 0, recompute=True, take_over=True)
    w.sched.run_until(zombie, at(pause_at))
    w.sched.pause(zombie)
    w.sched.tick(2 * TTL_S)  # its lease expires: stopped, it renews nothing
    again = actors.rollback_run(w, "manual__2", 0, recompute=True, take_over=True)  # the runbook: trigger it again
    w.sched.run_until(again)
    assert again.result == "success", again.note
    w.land(2)
    w.sched.run_until(once(w, "cli:c:2"))
    before = w.held()
    w.sched.resume(zombie)  # SIGCONT: the zombie carries on from its step
    w.sched.run_until(zombie)
    assert zombie.result == "failed" and ("token" in zombie.note or "concurrent" in zombie.note), zombie.note
    assert w.held() == before, "the newer owner's published rows are all there"
    assert_oracle(w)


def test_a_zombie_reconcile_cannot_restore_over_a_newer_owners_published_commits(world):
    """(c) The same for the RESTORE of a rerun's reconcile."""
    w = world()
    w.land(4)
    crashed = once(w, "cli:c:1")
    w.sched.run_until(crashed, at("store.w.mark_committed"))  # every table holds the group
    w.sched.kill(crashed)
    w.sched.tick(2 * TTL_S)
    zombie = once(w, "cli:c:2")
    w.sched.run_until(zombie, at("delta.w.restore:begin"))
    w.sched.pause(zombie)
    w.sched.tick(2 * TTL_S)
    w.land(2)
    w.sched.run_until(once(w, "cli:c:3"))
    before = w.held()
    w.sched.resume(zombie)
    w.sched.run_until(zombie)
    assert zombie.error is not None and "token" in str(zombie.error)
    assert w.held() == before
    assert_oracle(w)


def test_a_zombie_paused_before_its_first_write_to_a_new_table_is_refused(world):
    """(d) Tables made by their first write (``_quarantine``, every table under ``commit:
    epoch``, a sink added later) could not be fenced by a newer owner: a zombie resumed during a
    take-over committed with its older token (488 views against 244). Every table is made, and
    fenced by a rerun, before any epoch is attempted."""
    config = Config(**{**vars(QUIET), "commit": "epoch"})
    w = world(config)
    w.land(4)
    zombie = once(w, "cli:d:1")
    w.sched.run_until(zombie, at("delta.w.write:begin"))  # its tables made, its attempt counted
    w.sched.pause(zombie)
    w.sched.tick(2 * TTL_S)
    w.sched.run_until(once(w, "cli:d:2"))
    before = w.held()
    w.sched.resume(zombie)
    w.sched.run_until(zombie)
    assert zombie.error is not None
    assert w.held() == before
    assert_oracle(w)


def test_a_new_pipelines_tables_are_born_fenced_and_need_no_fence_commit(world):
    """(issue 39) A first group fenced every table with an empty commit after making it: a
    second commit per table, and a second snapshot state to compute before the write (~0.6 s a
    table on Spark). A table is born fenced now: its creation records the token, and an older
    token's write (a zombie of a lost store) is skipped by Delta as after a fence."""
    from sluice.model import Txn
    from sluice.protocol.tables import pipeline_tables

    w = world()
    w.land(2)
    first = once(w, "cli:f:1")
    w.sched.run_until(first, at("delta.w.write:begin"))  # tables made, attempt counted, reconciled
    token = w.store().pipeline_state(PIPELINE).fence
    tables = pipeline_tables(w.spec)
    for table in tables:
        commits = list(w.tables.lineage(table.path))
        assert [(c.version, c.fence) for c in commits] == [(0, False)], f"{table.name}: {commits}"
        assert w.tables.txn_version(table.path, table.app_id(0)) == rules.txn_version(token, -1), table.name
    sink = tables[-1]
    w.tables.write(sink.path, [], sink.shape, txn=Txn(sink.app_id(0), rules.txn_version(token - 1, 5)),
                   metadata="{}")  # an older token, a later epoch: skipped, as after a fence
    assert w.tables.version(sink.path) == 0
    w.sched.run_until(first)
    assert first.error is None, first.error
    assert_oracle(w)


def test_a_store_lost_while_a_group_is_published_leaves_no_record_without_its_files(world, tmp_path):
    """The simulation (seed 810985104): the store was replaced between a publish's lease check
    and its read of the manifest, so the epoch record listed 0 files for offsets [0, 3), and
    every ``rebuild-store`` refused that record: the pipeline could never run again. The
    manifest is read with the group now, and a record that would not list its range's files is
    refused."""
    w = world()
    w.land(3)
    run = once(w, "cli:g:1")
    w.sched.run_until(run, at("store.r.publish"))
    w.sched.run_until(run, lambda step: not step.startswith("store.r.publish"))  # past the lease check
    folder = tmp_path / "lost"
    folder.mkdir()
    w.lose_store(template(folder))
    w.store()  # another process opens the store: this one's pooled connections go to the new file
    w.sched.run_until(run)
    found, _ = records.read(w.tables, [s.path for s in w.spec.sinks])
    assert found, "the group's records were written from the store it was read from"
    assert all(len(r.files) == r.end - r.start for r in found), [(r.path, len(r.files), r.start, r.end) for r in found]
    rebuild = actors.rebuild_run(w, "rebuild_1")
    w.sched.drain()
    assert rebuild.result == "rebuilt", rebuild.note
    settle(w)
    assert drain(w)
    assert_oracle(w)


def test_recover_reconciles_tables_on_any_storage(world):
    """(e) ``attempted_before`` read only local tables' logs, and ``sluice_recover`` reset the
    attempt counts: on s3a/abfss tables a recovered group was written twice (488 of 244). An
    epoch attempted once stays marked so; its tables are reconciled wherever they are."""
    w = world(table_root="s3a://bucket/warehouse/sim")
    w.land(4)
    crashed = once(w, "cli:e:1")
    w.sched.run_until(crashed, at("store.w.mark_committed"))  # every table holds the group
    w.sched.kill(crashed)
    settle(w)
    recover = actors.recover_run(w, "manual__1", take_over=True)
    w.sched.drain()
    assert recover.result == "success", recover.note
    assert_oracle(w)


def test_a_rollback_record_a_crash_left_out_is_written_by_the_next_publish(world):
    """(f) Rollback records were written after the store's rollback and never repaired: a store
    rebuilt from the tables would revive the rolled-back epochs."""
    w = world()
    w.land(4)
    assert drain(w, "scheduled__1")
    roll = actors.rollback_run(w, "manual__1", 1, recompute=False, take_over=True)
    w.sched.run_until(roll, at("delta.w.put_file"))
    w.sched.kill(roll)
    settle(w)
    sink = w.spec.sinks[0].path
    assert not records.read(w.tables, [sink])[1], "no rollback record yet"
    w.land(2)
    assert drain(w)
    assert [r.generation for r in records.read(w.tables, [sink])[1]] == [1]
    assert_oracle(w)


def test_a_backfills_recorded_intent_can_be_withdrawn(world):
    """(f) A backfill's plan step records its rollback intent; if its processing step never
    runs, the pipeline stayed halted and nothing withdrew it. ``sluice_recover`` with
    ``withdraw_rollback`` does, while no restore has started."""
    w = world()
    w.land(4)
    assert drain(w, "scheduled__1")
    store = w.store()
    arrived = max(f.mtime for f in store.manifest(PIPELINE))
    backfill = actors.dag_run(w, "backfill__1", interval=(arrived - 1, arrived + 1))
    planned = []

    def processing(step: str) -> bool:  # the processing task's first step, once the intent is recorded
        if step == "store.w.begin_rollback":
            planned.append(step)
        return bool(planned) and step == "store.w.acquire_lease"

    for _ in range(2):  # its processing task, and the retry, killed as they start
        w.sched.run_until(backfill, processing)
        w.sched.kill(backfill)
        w.sched.tick(60)
    w.sched.drain()
    assert "did not finish" in (halt_reason(store, PIPELINE, 3, 10) or "")
    assert "withdraw" in halt_reason(store, PIPELINE, 3, 10), "the message names the way out"
    settle(w)
    recover = actors.recover_run(w, "manual__1", take_over=True, withdraw=True)
    w.sched.drain()
    assert recover.result in ("nothing", "success") and halt_reason(store, PIPELINE, 3, 10) is None
    w.land(1)
    assert drain(w)
    assert_oracle(w)


def test_recover_after_a_failed_validation_gate_reruns_the_epoch_once_fixed(world):
    """An epoch that failed its expectation suite under ``fail`` halts the pipeline. Recovery
    reset the attempt counts but left the failed gate's results, so its rerun was refused as
    halted again (found by ``dag.test`` of ``sluice_recover``, then by the simulation). Now a
    recovery before the fix fails the gate again, and one after it publishes every epoch."""
    w = world(Config(**{**vars(QUIET), "invalid": True}))
    w.land(3)
    run = actors.dag_run(w, "scheduled__1", k=1000)
    w.sched.drain()
    assert run.result == "failed" and "failed validation" in run.note, run.note
    store = w.store()
    assert "failed validation" in (halt_reason(store, PIPELINE, 3, 10) or "")
    early = actors.recover_run(w, "manual__1", take_over=False)
    w.sched.drain()
    assert early.result == "failed" and "failed validation" in early.note, "the gate holds until the fix"
    w.fixed = True  # the operator deploys the check that rejects the record
    late = actors.recover_run(w, "manual__2", take_over=False)
    w.sched.drain()
    assert late.result == "success", late.note
    assert halt_reason(store, PIPELINE, 3, 10) is None
    assert drain(w)
    assert_oracle(w)


def test_a_read_does_not_wait_behind_a_writer_and_does_not_block_one(tmp_path):
    """(g) On SQLite every transaction, reads included, began IMMEDIATE: a read waited seconds
    behind a writer, and a reader paused inside its transaction stalled every writer."""
    url = f"sqlite:///{tmp_path}/s.db"
    store = EpochStore(url)
    store.register_files(PIPELINE, [("/a", 1, 1.0)])
    inside, release = threading.Event(), threading.Event()

    def paused_reader() -> None:
        with store.read(PIPELINE) as tx:
            tx.manifest()
            inside.set()
            release.wait(30)  # a reader stopped inside its transaction

    reader = threading.Thread(target=paused_reader)
    reader.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        acquire_lease(EpochStore(url), PIPELINE, "writer")  # a write, while the read is open
        assert time.monotonic() - started < 5, "the writer waited for the paused reader"
    finally:
        release.set()
        reader.join()


def test_lease_expiry_is_judged_by_the_stores_clock(tmp_path, monkeypatch):
    """(g) Expiry used each host's clock: a host whose clock ran an hour ahead took a live lease.
    Now the store's clock judges (the database's own)."""
    from sluice.store import epoch_store

    url = f"sqlite:///{tmp_path}/s.db"
    acquire_lease(EpochStore(url), PIPELINE, "holder", ttl_s=600)
    real = epoch_store.utcnow
    monkeypatch.setattr(epoch_store, "utcnow", lambda: real() + __import__("datetime").timedelta(hours=1))
    with pytest.raises(Exception, match="is busy"):
        acquire_lease(EpochStore(url), PIPELINE, "skewed-host", ttl_s=600)


def test_a_store_lost_and_replaced_refuses_to_start_over_until_rebuilt(world, tmp_path):
    """Found by the simulation: after the store was lost, a run on the new, empty store planned
    from offset 0 again and wrote every record a second time, beside a run of the lost store that
    was still going. It now refuses, naming the rebuild; the rebuild fences the tables above
    every token (the lost store's run is refused) and undoes what no record vouches for."""
    w = world()
    w.land(4)
    assert drain(w, "scheduled__1")
    w.land(2)
    zombie = actors.dag_run(w, "scheduled__2")
    w.sched.run_until(zombie, at("delta.w.write:begin"))  # holds the lost store's lease
    w.sched.pause(zombie)
    w.lose_store(tmp_path / "sim" / "template.db")
    refused = actors.dag_run(w, "scheduled__3")
    w.sched.run_until(refused)
    assert refused.result == "failed" and "rebuild-store" in refused.note
    rebuild = actors.rebuild_run(w, "rebuild_1")
    w.sched.run_until(rebuild)
    assert rebuild.result == "rebuilt", rebuild.note
    w.sched.resume(zombie)
    w.sched.drain()  # the zombie resumes: refused by Delta (the rebuild's tokens are above its)
    assert zombie.result == "failed"
    settle(w)
    assert drain(w)
    assert_oracle(w)


def test_a_rollback_on_a_lost_store_is_refused_and_the_rebuild_still_brings_everything_back(world, tmp_path):
    """Found by the simulation (seed 31001878): after the store was lost, an operator's rollback
    to epoch 0 ran on the new, empty store: it RESTOREd away every published row and wrote its
    history (generation 1) into the store and next to the sinks; the rebuild then failed on that
    history's duplicate, and every run refused the store as lost: no action unblocked it. A
    rollback on a store that knows no epoch of a pipeline whose tables hold its commits is now
    refused like a run, changing nothing, and names the rebuild; a rebuild into a store holding a
    stray rollback record replaces it with the tables' own."""
    w = world()
    w.land(4)
    assert drain(w, "scheduled__1")
    held = w.held()
    w.lose_store(tmp_path / "sim" / "template.db")
    roll = actors.rollback_run(w, "manual__1", 0, recompute=True, take_over=True)
    w.sched.run_until(roll)
    assert roll.result == "failed" and "rebuild-store" in roll.note, roll.note
    assert w.held() == held, "the refused rollback restored nothing"
    assert w.store().pending_rollback(PIPELINE) is None
    with w.store().transaction(PIPELINE, step="stray") as tx:  # what the old code left behind
        tx.add_rollback(1, {"pipeline": PIPELINE, "generation": 1, "to_epoch": 0})
    rebuild = actors.rebuild_run(w, "rebuild_1")
    w.sched.run_until(rebuild)
    assert rebuild.result == "rebuilt", rebuild.note
    settle(w)
    assert drain(w)
    assert_oracle(w)
    assert w.held() == held, "the published rows are all there, once"


def test_a_stale_token_cannot_fence_a_table_back(world):
    """A fence of an older token is refused, and says so (Delta would skip it silently)."""
    w = world()
    w.land(2)
    assert drain(w)
    store = w.store()
    old = acquire_lease(store, PIPELINE, "old")
    store.release_lease(old)
    new = acquire_lease(store, PIPELINE, str(LeaseOwner.dag_run(PIPELINE, "new")))
    from sluice.protocol.tables import pipeline_tables

    boundary.HOOK = None
    tables = pipeline_tables(w.spec)
    for t in tables:
        t.fence(w.tables, 0, new.fence)
    with pytest.raises(FencedError, match="newer owner"):
        tables[-1].fence(w.tables, 0, old.fence)
    run = PipelineRun(w.spec, store, "old", w.runtime)
    with pytest.raises(FencedError):
        run.release() or store.check_lease(old)
    assert operations.rollback_plan(store, PIPELINE, 0).generation == 0


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    boundary.HOOK = None


assert Path  # (used in type hints of fixtures above)


def test_a_refused_rebuild_names_the_store_without_its_password(tmp_path):
    """Issue 37: an error put the store URL, password included, in its message (and so in task
    logs). The rebuild refused into a store that holds the pipeline names it redacted."""
    from sluice.errors import SluiceError
    from sluice.sim.world import sim_spec

    class KnownPipelineStore:  # only what rebuild_store reads before it refuses
        url = "postgresql+psycopg://sluice:s3cret-pw@db.internal:5432/sluice"

        def pending_rollback(self, pipeline):
            return None

        def knows(self, pipeline, **_):
            return True

    spec = sim_spec(tmp_path, QUIET)
    with pytest.raises(SluiceError, match="already holds this pipeline") as refused:
        operations.rebuild_store(spec, KnownPipelineStore(), None, "owner")
    assert "s3cret-pw" not in str(refused.value) and "db.internal" in str(refused.value), refused.value


@pytest.mark.postgres
def test_a_process_paused_inside_a_store_transaction_cannot_block_a_take_over_on_postgres(postgres, monkeypatch):
    """(g) On Postgres a process stopped inside a store transaction held its row lock for good: a
    take-over waited indefinitely. A lock wait now gives up after LOCK_TIMEOUT_S with an error
    that says why, and the server ends the idle transaction after IDLE_IN_TRANSACTION_S, so the
    next try takes the lease. (Both shortened here; cost: about 5 s.)"""
    from sluice.errors import PipelineBusyError
    from sluice.store import epoch_store

    monkeypatch.setattr(epoch_store, "LOCK_TIMEOUT_S", 1)
    monkeypatch.setattr(epoch_store, "IDLE_IN_TRANSACTION_S", 3)
    url = postgres.database()
    store = EpochStore(url)
    store.release_lease(acquire_lease(store, PIPELINE, "first", ttl_s=1))  # the pipeline's row exists
    inside, release = threading.Event(), threading.Event()

    def paused_writer() -> None:
        try:
            with store.transaction(PIPELINE, step="paused") as tx:
                tx._row(lock=True)
                inside.set()
                release.wait(30)  # SIGSTOPped inside its transaction, holding the row
        except Exception:  # the server ended its transaction: what this test wants
            pass

    writer = threading.Thread(target=paused_writer)
    writer.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        with pytest.raises(PipelineBusyError, match="paused inside it"):
            acquire_lease(EpochStore(url), PIPELINE, "taker", ttl_s=60)
        assert time.monotonic() - started < 5, "the lock wait gave up"
        deadline = time.monotonic() + 15
        while True:  # the server ends the idle transaction; then the take-over goes through
            try:
                lease = acquire_lease(EpochStore(url), PIPELINE, "taker", ttl_s=60)
                break
            except PipelineBusyError:
                assert time.monotonic() < deadline, "the idle transaction was never ended"
                time.sleep(0.5)
        assert lease.owner == "taker"
    finally:
        release.set()
        writer.join()


def test_a_zombie_paused_before_it_made_a_sink_added_later_cannot_write_it(world):
    """A run of the new spec (sink ``clean`` added, first in the commit order) was stopped after
    counting its attempt and before making ``clean``. A rollback then fenced the tables there
    were, not ``clean``; its rerun made ``clean`` in generation 1. Resumed, the stopped run
    wrote ``clean`` under its generation-0 app id, which a table born in generation 1 holds no
    txn for, and Delta let the write through: its epoch twice. A group checks its lease once
    its tables are made: a rollback that takes the lease after that check finds every table the
    run will write, and fences it."""
    w = world(Config(**{**vars(QUIET), "malformed_p": 0.0}))  # no rejected rows: ``clean`` is the first write
    full = w.spec
    counts, clean, latest = full.sinks
    w.spec = full.model_copy(update={"sinks": [counts, latest]})
    w.land(2)
    w.sched.run_until(once(w, "cli:h:1"))
    w.spec = full.model_copy(update={"sinks": [clean, counts, latest]})
    w.runtime._computes.clear()  # the new spec is deployed: new processes
    w.land(2)
    zombie = once(w, "cli:h:2")
    w.sched.run_until(zombie, at("delta.w.create:begin"))  # its attempt counted; ``clean`` not made yet
    assert not w.tables.exists(clean.path)
    w.sched.pause(zombie)
    w.sched.tick(2 * TTL_S)
    rollback = actors.rollback_run(w, "manual__h", 0, recompute=True, take_over=True)
    w.sched.run_until(rollback)
    assert rollback.result == "success", rollback.note
    w.sched.run_until(once(w, "cli:h:3"))  # whatever the recompute left
    w.sched.resume(zombie)
    w.sched.run_until(zombie)
    assert zombie.error is not None, "the stopped run must not commit"
    w.spec = full
    assert_oracle(w)
