"""A deterministic scheduler of actors for the simulation: each actor (a DAG run, an operator's
action) is a greenlet running the real protocol code; only one runs at a time, and it runs until
its next step boundary (``sluice.boundary``: a Delta facade call, a store transaction), where it
switches back to the scheduler. The scheduler, from a seeded ``random.Random``, picks who goes
next and what happens there: the step is taken, or the actor is killed (SIGKILL: it vanishes, no
cleanup runs), or paused (SIGSTOP: a zombie, resumed later, after its lease expired). Virtual
time advances between steps; a lease kept alive by a paused actor is not renewed.

Same seed, same interleaving, same faults: a failing schedule replays exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from greenlet import getcurrent, greenlet

from sluice import boundary


class Killed(BaseException):
    """The actor's process vanished (SIGKILL) at a step boundary: nothing after it runs, not
    even its ``finally`` blocks' store or Delta calls (each of them is a boundary too)."""


class Stuck(RuntimeError):
    """The actors did not end, or a scripted actor was not where the script expected it."""


class _Greenlet(greenlet):
    actor: Actor | None = None


def current() -> Actor | None:
    """The actor whose code is running (``None``: the scheduler's own calls, or another thread's)."""
    return getattr(getcurrent(), "actor", None)


@dataclass(eq=False)
class Actor:
    """One process-like thing the scheduler interleaves. ``program(actor)`` runs in its own
    greenlet; ``owner`` is its lease owner (a DAG run)."""

    name: str
    program: Callable[[Actor], Any]
    owner: str = ""
    can_pause: bool = True
    state: str = "new"  # new, ready, running, paused, sleeping, done
    wake_at: float = 0.0
    step: str = ""
    killed: bool = False
    error: BaseException | None = None
    result: Any = None
    note: str = ""  # why it failed, in its own words
    steps: list[str] = field(default_factory=list)
    keepers: list[list[Any]] = field(default_factory=list)  # [lease, ttl_s, last renewed]
    paused_at: float | None = None
    skew: float = 0.0  # its host's clock runs this many seconds off the store's
    glet: _Greenlet | None = None

    @property
    def finished(self) -> bool:
        return self.state == "done"


class Scheduler:
    """Runs actors one step at a time. ``now`` is the virtual time (seconds)."""

    def __init__(self, rng: random.Random, start: float = 1_780_000_000.0) -> None:
        self.rng = rng
        self.now = start
        self.actors: list[Actor] = []
        self._hub = getcurrent()
        self.steps = 0
        self.trace: list[str] = []
        self.renew: Callable[[Any, float], None] | None = None  # (lease, ttl) -> renew, from the world
        self.kill_p = 0.0
        self.pause_p = 0.0
        self.pause_s: tuple[float, float] = (0.0, 0.0)
        self.faults = True
        self.log_steps = False  # every step in the trace (a replay's detail)
        self.skew_s = 0.0  # each actor's host clock is off by up to this much (either way)
        # Pauses land this many times more often at a Delta write (its begin or commit): a zombie
        # stopped inside a write is the case the fence exists for, and a uniform pause rarely
        # lands between a fence and the RESTORE after it (300 uniform schedules missed a RESTORE
        # that ignored the fence; see docs/testing.md).
        self.zombie_at: str | None = None  # the first actor to wait at this step is stopped there (once)
        self.hot_steps: dict[str, float] = {"delta.w.restore": 10.0, "delta.w.": 5.0}  # first match

    # -- in the actor's greenlet -----------------------------------------------------------------

    def hook(self, name: str) -> None:
        actor = current()
        if actor is None:  # the scheduler's own calls (renewals, checks)
            return
        if actor.killed:
            raise Killed(name)
        actor.step = name
        actor.steps.append(name)
        actor.state = "ready"
        self._hub.switch()
        if actor.killed:
            raise Killed(name)

    def sleep(self, seconds: float) -> None:
        """An actor waits (virtual time): a step boundary it leaves only once ``seconds`` passed."""
        actor = current()
        if actor is None:
            return
        actor.wake_at = self.now + seconds
        actor.state = "sleeping"
        self._hub.switch()
        if actor.killed:
            raise Killed("sleep")

    def _main(self, actor: Actor) -> None:
        try:
            if actor.killed:
                raise Killed("start")
            actor.result = actor.program(actor)
        except Killed:
            actor.killed = True
        except BaseException as exc:  # the actor failed: what it raised is its outcome
            actor.error = exc
        finally:
            actor.state = "done"
            actor.keepers.clear()

    # -- in the scheduler (the greenlet that made it) ---------------------------------------------

    def spawn(self, actor: Actor) -> Actor:
        actor.glet = _Greenlet(self._main, parent=self._hub)
        actor.glet.actor = actor
        if self.skew_s:
            actor.skew = self.rng.uniform(-self.skew_s, self.skew_s)
        self.actors.append(actor)
        return actor

    def _resume(self, actor: Actor) -> None:
        """Let the actor run to its next step boundary (or its end)."""
        if self.log_steps:
            self.trace.append(f"{self.now:.0f} {actor.name}: {actor.step or 'start'}")
        actor.state = "running"
        actor.glet.switch(actor)
        self.steps += 1

    def kill(self, actor: Actor) -> None:
        """SIGKILL: the actor unwinds without taking another step."""
        actor.killed = True
        actor.keepers.clear()
        if actor.state in ("ready", "sleeping", "paused", "new"):
            self.trace.append(f"{self.now:.0f} kill {actor.name} at {actor.step or 'start'}")
            self._resume(actor)

    def runnable(self) -> list[Actor]:
        return [a for a in self.actors if a.state in ("new", "ready")]

    def tick(self, dt: float) -> None:
        """Advance virtual time: wake sleepers and paused actors that are due; keep the leases
        of actors that are not paused alive (their renewal threads)."""
        self.now += dt
        for actor in self.actors:
            if actor.state == "sleeping" and actor.wake_at <= self.now:
                actor.state = "ready"
            elif actor.state == "paused" and actor.wake_at <= self.now:
                self.trace.append(f"{self.now:.0f} resume {actor.name} at {actor.step}")
                actor.state = "ready"
                actor.paused_at = None
        if self.renew is None:
            return
        for actor in self.actors:
            if actor.state in ("paused", "done") or actor.killed:
                continue
            for keeper in list(actor.keepers):
                lease, ttl, last = keeper
                if self.now - last >= ttl / 3:
                    keeper[2] = self.now
                    try:
                        self.renew(lease, ttl)
                    except Exception:  # taken over: this renewal thread stops
                        actor.keepers.remove(keeper)

    def step(self) -> bool:
        """Let one ready actor take one step (or kill or pause it there). False when none is ready."""
        ready = self.runnable()
        if not ready:
            return False
        actor = self.rng.choice(ready)
        if self.faults and actor.state == "ready" and actor.step == self.zombie_at and actor.can_pause:
            self.zombie_at = None  # a zombie: stopped well past its lease's expiry, then it carries on
            actor.state = "paused"
            actor.paused_at = self.now
            actor.wake_at = self.now + self.rng.uniform(*self.pause_s)
            self.trace.append(f"{self.now:.0f} zombie {actor.name} at {actor.step} until {actor.wake_at:.0f}")
            return True
        if self.faults and actor.state == "ready":
            roll = self.rng.random()
            if roll < self.kill_p:
                self.kill(actor)
                return True
            pause_p = self.pause_p * next((f for p, f in self.hot_steps.items() if actor.step.startswith(p)), 1.0)
            if roll < self.kill_p + min(pause_p, 0.5) and actor.can_pause:
                actor.state = "paused"
                actor.paused_at = self.now
                actor.wake_at = self.now + self.rng.uniform(*self.pause_s)
                self.trace.append(f"{self.now:.0f} pause {actor.name} at {actor.step} until {actor.wake_at:.0f}")
                return True
        self._resume(actor)
        return True

    def pause(self, actor: Actor, seconds: float = float("inf")) -> None:
        """SIGSTOP an actor waiting at a step (scripted): it is not scheduled until ``resume``
        or ``seconds`` of virtual time pass; its lease is not renewed meanwhile."""
        actor.state = "paused"
        actor.paused_at = self.now
        actor.wake_at = self.now + seconds
        self.trace.append(f"{self.now:.0f} pause {actor.name} at {actor.step}")

    def resume(self, actor: Actor) -> None:
        """SIGCONT: the actor is ready again at the step it was stopped at."""
        actor.state = "ready"
        actor.paused_at = None
        self.trace.append(f"{self.now:.0f} resume {actor.name} at {actor.step}")

    def run_until(self, actor: Actor, stop: Callable[[str], bool] | None = None, max_steps: int = 10_000) -> Actor:
        """A scripted interleaving: let only ``actor`` take steps until it waits at one for which
        ``stop(step)`` is true (it has not taken it), or it ends."""
        for _ in range(max_steps):
            if actor.state == "done":
                return actor
            if actor.state not in ("new", "ready"):
                raise Stuck(f"actor {actor.name} is {actor.state}, not ready")
            if actor.state == "ready" and stop is not None and stop(actor.step):
                return actor
            self._resume(actor)
        raise Stuck(f"actor {actor.name} took {max_steps} steps without stopping")

    def next_wake(self) -> float | None:
        waiting = [a.wake_at for a in self.actors if a.state in ("sleeping", "paused")]
        return min(waiting) if waiting else None

    def drain(self, max_steps: int = 100_000) -> None:
        """Run every actor to its end, without faults (paused ones resume when due)."""
        faults, self.faults = self.faults, False
        try:
            for _ in range(max_steps):
                if self.step():
                    continue
                wake = self.next_wake()
                if wake is None:
                    return
                self.tick(max(wake - self.now, 0.0))
            raise Stuck(f"the actors did not finish within {max_steps} steps")
        finally:
            self.faults = faults

    def host_time(self) -> float:
        """The clock of the host the running actor is on (the scheduler's own: virtual time)."""
        actor = current()
        return self.now + (actor.skew if actor is not None else 0.0)

    def install(self) -> None:
        boundary.HOOK = self.hook
        boundary.CLOCK = self.host_time

    def uninstall(self) -> None:
        boundary.HOOK = None
        boundary.CLOCK = None

    def abandon(self) -> None:
        """End every actor still going (a failed schedule): each is killed at its boundary."""
        for actor in self.actors:
            if actor.state != "done":
                actor.killed = True
                actor.glet.switch(actor)
