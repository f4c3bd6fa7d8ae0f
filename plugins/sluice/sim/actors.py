"""The simulation's actors: what Airflow and operators do to a pipeline, as the DAGs do it, task
by task (``sluice.airflow.dag_factory``), on the real protocol code. A task killed at a step
boundary is retried once where its DAG retries (a new process of the same DAG run); a DAG run
that fails for good releases its lease in its failure callback (most of the time: Airflow runs
callbacks of killed tasks late, or not at all)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.errors import OperatorActionRequired, PipelineBusyError, SluiceError
from sluice.model import PUBLISHED, LeaseOwner
from sluice.protocol import operations
from sluice.protocol.leases import acquire_lease
from sluice.protocol.run import GroupPlan, PipelineRun
from sluice.sim.scheduler import Actor, Killed
from sluice.sim.world import PIPELINE, TTL_S, World

BUSY_WAIT_S = 15.0
RETRY_DELAY_S = 10.0


class TaskFailed(Exception):
    """A task failed for good (its retries used up, or an error no retry fixes)."""


def task(world: World, actor: Actor, fn: Callable[[], Any], retries: int) -> Any:
    """Run one Airflow task: a kill ends its process (a new one retries it); an operator-action
    error fails it at once; another error is retried."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Killed:
            actor.killed = False  # the retry is a new process
            actor.keepers.clear()
            if attempt == retries:
                raise TaskFailed("killed") from None
        except OperatorActionRequired as exc:
            raise TaskFailed(str(exc)) from exc
        except Exception as exc:
            if attempt == retries:
                raise TaskFailed(str(exc)) from exc
        world.sched.sleep(RETRY_DELAY_S)
    raise AssertionError("unreachable")


def _failed(world: World, owner: str) -> None:
    """``release_lease_on_failure``: Airflow's failure callback of the DAG run."""
    if world.rng.random() < 0.8:
        PipelineRun(world.spec, world.store(), owner).release()


def _plan_with_wait(run: PipelineRun, world: World, **kwargs: Any) -> GroupPlan | None:
    """``PlanGroupOperator``: wait for a busy pipeline up to the lease's lifetime."""
    waited = 0.0
    while True:
        try:
            return run.plan(**kwargs)
        except PipelineBusyError as exc:
            if waited >= TTL_S:
                raise OperatorActionRequired(f"{exc} (waited {waited:.0f} s)") from None
            world.sched.sleep(BUSY_WAIT_S)
            waited += BUSY_WAIT_S


def _group_steps(world: World, actor: Actor, owner: str, planned: GroupPlan | None, retries: int,
                 change: str) -> str:
    """run_group -> validate -> checkpoint, then the Asset events of the checkpoint."""
    def run() -> PipelineRun:
        return PipelineRun(world.spec, world.store(), owner, world.runtime)

    group_id = planned.group_id if planned is not None else None
    task(world, actor, lambda: run().process(group_id), retries)
    task(world, actor, lambda: run().validate(), retries)
    report = task(world, actor, lambda: run().publish(), retries)
    # The checkpoint succeeded: Airflow emits its Asset events; the next task acknowledges them.
    world.emit(owner, report["change"], report["published"])
    task(world, actor, lambda: run().acknowledge(report["published"]), retries)
    return "success"


def dag_run(world: World, run_id: str, *, interval: tuple[float, float] | None = None,
            cleared: bool = False, k: int | None = None, epoch_size: int | None = None,
            first_size: int | None = None) -> Actor:
    """A run of the pipeline's DAG (scheduled, a backfill's, or a past run cleared in the UI);
    ``first_size``: the controllers' probe, a first epoch of another size than the rest."""
    owner = str(LeaseOwner.dag_run(PIPELINE, run_id))

    def program(actor: Actor) -> str:
        try:
            run = PipelineRun(world.spec, world.store(), owner, world.runtime)
            planned = task(world, actor, lambda: _plan_with_wait(
                PipelineRun(world.spec, world.store(), owner, world.runtime), world,
                take_over_prefix=LeaseOwner.runs_of(PIPELINE), resume_own=True, alive=world.alive,
                interval=interval, k=k, epoch_size=epoch_size, first_size=first_size), retries=1)
            del run
            if planned is None:
                return "skipped"
            change = "recompute" if planned.rollback or cleared else "publish"
            return _group_steps(world, actor, owner, planned, 1, change)
        except TaskFailed as exc:
            _failed(world, owner)
            actor.note = str(exc)
            return "failed"

    actor = Actor(f"run:{run_id}", program, owner)
    world.dag_runs[owner] = actor
    return world.sched.spawn(actor)


def rollback_run(world: World, run_id: str, to_epoch: int, *, recompute: bool, take_over: bool) -> Actor:
    """A run of ``sluice_rollback`` (no retries)."""
    owner = str(LeaseOwner.dag_run("sluice_rollback", run_id))

    def program(actor: Actor) -> str:
        def roll() -> dict[str, Any]:
            store = world.store()
            lease = acquire_lease(store, PIPELINE, owner, ttl_s=TTL_S,
                                  take_over_prefix=LeaseOwner.runs_of(PIPELINE) if take_over else None)
            try:
                report = operations.rollback(world.spec, store, world.runtime, lease, to_epoch=to_epoch,
                                             reason="simulated operator", recompute=recompute)
            except BaseException:
                store.release_lease(lease)
                raise
            if not recompute:
                store.release_lease(lease)
            return report

        try:
            report = task(world, actor, roll, retries=0)
            world.emit(owner, "rollback", report["changes"])
            task(world, actor, lambda: PipelineRun(world.spec, world.store(), owner).acknowledge(report["changes"]),
                 retries=0)  # the recompute gate, after the rollback succeeded
            if not recompute or report.get("group_id") is None:
                return "rolled back"
            return _group_steps(world, actor, owner, None, 0, "recompute")
        except TaskFailed as exc:
            _failed(world, owner)
            actor.note = str(exc)
            return "failed"

    actor = Actor(f"rollback:{run_id}", program, owner)
    world.dag_runs[owner] = actor
    return world.sched.spawn(actor)


def recover_run(world: World, run_id: str, *, take_over: bool, withdraw: bool = False) -> Actor:
    """A run of ``sluice_recover`` (no retries)."""
    owner = str(LeaseOwner.dag_run("sluice_recover", run_id))

    def program(actor: Actor) -> str:
        try:
            planned = task(world, actor, lambda: _plan_with_wait(
                PipelineRun(world.spec, world.store(), owner, world.runtime), world,
                take_over_prefix=LeaseOwner.runs_of(PIPELINE if take_over else "sluice_recover"),
                recover=True, resume_own=True, alive=None if take_over else world.alive,
                withdraw_rollback=withdraw), retries=0)
            if planned is None:
                return "nothing"
            return _group_steps(world, actor, owner, planned, 0, "recovery")
        except TaskFailed as exc:
            _failed(world, owner)
            actor.note = str(exc)
            return "failed"

    actor = Actor(f"recover:{run_id}", program, owner)
    world.dag_runs[owner] = actor
    return world.sched.spawn(actor)


def skip_run(world: World, run_id: str, path: str) -> Actor:
    """A run of ``sluice_skip_file`` for a file that is gone."""
    owner = str(LeaseOwner.dag_run("sluice_skip_file", run_id))

    def program(actor: Actor) -> str:
        try:
            task(world, actor, lambda: operations.skip_file(world.spec, world.store(), path, by=owner,
                                                            reason="gone from the landing folder"), retries=0)
        except TaskFailed:
            return "failed"
        return "skipped"

    return world.sched.spawn(Actor(f"skip:{run_id}", program, owner))


def preview_run(world: World, run_id: str, to_epoch: int) -> Actor:
    """``sluice_rollback_preview``'s plan and preconditions: reads only."""
    def program(actor: Actor) -> str:
        store = world.store()
        try:
            plan, _ = operations.group_rollback_plan(store, PIPELINE, to_epoch)
            operations.check_preconditions(world.spec, store, world.runtime, plan)
        except SluiceError:
            return "refused"
        return "previewed"

    return world.sched.spawn(Actor(f"preview:{run_id}", program, can_pause=True))


def rebuild_run(world: World, run_id: str) -> Actor:
    """``sluice rebuild-store`` after the store was lost (run again until it finishes)."""
    owner = f"cli:sim:{run_id}"

    def program(actor: Actor) -> str:
        try:
            task(world, actor, lambda: operations.rebuild_store(world.spec, world.store(), world.runtime, owner),
                 retries=2)
        except TaskFailed as exc:
            actor.note = str(exc)
            return "failed"
        return "rebuilt"

    actor = Actor(f"rebuild:{run_id}", program, owner)
    world.dag_runs[owner] = actor
    return world.sched.spawn(actor)


def published_groups(world: World) -> list[str]:
    """Owners of DAG runs of the pipeline that published a group (what a clear may re-run)."""
    store = world.store()
    if not store.has_pipeline(PIPELINE):
        return []
    return sorted({g.owner for g in store.groups(PIPELINE)
                   if g.state == PUBLISHED and g.owner.startswith(LeaseOwner.runs_of(PIPELINE))})
