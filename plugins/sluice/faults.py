"""Fault injection for crash tests: ``SLUICE_FAULT=<point>[@<epoch>]``, ``SLUICE_FAULT_MODE``.

Points: ``after_plan`` (the group is in the log, nothing read), ``mid_write`` (the epoch's
first sink transaction is in Delta, the others are not), ``after_delta_commit`` (every sink
holds the epoch, the epoch log does not yet). Mode ``kill`` sends SIGKILL to this process, as
a lost machine would; ``raise`` throws ``InjectedFault``. Unset, this module does nothing.
"""

from __future__ import annotations

import os
import signal

POINTS = ("after_plan", "mid_write", "after_delta_commit")


class InjectedFault(RuntimeError):
    pass


def maybe_fail(point: str, epoch_id: int | None = None) -> None:
    wanted = os.environ.get("SLUICE_FAULT")
    if not wanted:
        return
    name, _, at = wanted.partition("@")
    if name != point or (at and epoch_id is not None and int(at) != epoch_id):
        return
    if os.environ.get("SLUICE_FAULT_MODE", "raise") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault at {point} (epoch {epoch_id})")
