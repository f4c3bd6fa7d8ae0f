"""Fault injection for crash tests: ``SLUICE_FAULT=<point>[@<epoch>]``, ``SLUICE_FAULT_MODE``.

Points: ``after_plan`` (the group is in the log, nothing read), ``mid_write`` (the first
table's transaction of the group, or epoch, is in Delta, the others are not),
``after_delta_commit`` (every table holds it, the epoch log does not yet), ``mid_reconcile``
(a rerun restored one table an earlier attempt wrote, not yet the others), ``before_publish``
(the epoch records are written, the store has not published the group), ``mid_rollback``
(one table restored, not yet the others), ``mid_rebuild`` (a store rebuild loaded the
records, its orphan rollback has not started). Mode ``kill`` sends SIGKILL to this process, as
a lost machine would; ``stop`` sends SIGSTOP (a paused VM, a GC pause: it carries on after
SIGCONT); ``raise`` throws ``InjectedFault``. Unset, this module does nothing.
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = ("after_plan", "mid_write", "after_delta_commit", "mid_reconcile", "before_publish", "mid_rollback",
          "mid_rebuild")


#: Held by the lease renewal around its store write, and by a ``stop`` fault while stopped:
#: the injected pause then never freezes the process inside a store transaction (a zombie
#: holding the store's write lock would block every other writer, a different failure).
STORE_WRITE = threading.Lock()


class InjectedFault(RuntimeError):
    pass


def maybe_fail(point: str, epoch_id: int | None = None) -> None:
    wanted = os.environ.get("SLUICE_FAULT")
    if not wanted:
        return
    name, _, at = wanted.partition("@")
    if name != point or (at and epoch_id is not None and int(at) != epoch_id):
        return
    mode = os.environ.get("SLUICE_FAULT_MODE", "raise")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stop":  # a zombie: frozen until SIGCONT, then it carries on from here
        with STORE_WRITE:
            os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise InjectedFault(f"injected fault at {point} (epoch {epoch_id})")
