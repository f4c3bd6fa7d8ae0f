"""Step boundaries: every call into the Delta facade's twin and every epoch-store transaction
announces itself here, so the deterministic simulation (``sluice.sim``) can interleave actors,
kill them, pause them and move their clocks exactly there. Code written later is covered
without anyone naming a point. Outside the simulation the hook is ``None``: one global lookup.
"""

from __future__ import annotations

from collections.abc import Callable

#: Called with the step's name ("store.plan_group", "delta.write:begin", ...) by the thread
#: that is about to take the step; it may block (the scheduler's turn) or raise (a kill).
HOOK: Callable[[str], None] | None = None


def step(name: str) -> None:
    hook = HOOK
    if hook is not None:
        hook(name)
