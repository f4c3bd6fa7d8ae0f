"""Step boundaries: every call into the Delta facade's twin and every epoch-store transaction
announces itself here, so the deterministic simulation (``sluice.sim``) can interleave actors,
kill them, pause them and move their clocks exactly there. Code written later is covered
without anyone naming a point. Outside the simulation the hook is ``None``: one global lookup.

The host's clock is read here too (``host_time``): the simulation gives each actor a skewed one,
so that nothing the protocol decides may depend on a host's clock (lease expiry is judged by the
store's clock; a host's time only dates records).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Called with the step's name ("store.plan_group", "delta.write:begin", ...) by the thread
#: that is about to take the step; it may block (the scheduler's turn) or raise (a kill).
HOOK: Callable[[str], None] | None = None


def step(name: str) -> None:
    hook = HOOK
    if hook is not None:
        hook(name)


#: The host's clock (seconds since the epoch), when the simulation sets one; ``None``: the real one.
CLOCK: Callable[[], float] | None = None


def host_time() -> float:
    clock = CLOCK
    return time.time() if clock is None else clock()
