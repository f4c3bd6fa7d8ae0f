"""Who may hold a pipeline: at most one run has a group in flight. A lease carries a fencing
token, bumped on every acquisition; every store write and Delta commit of the run carries it, so
a run whose lease was taken over can no longer change anything. Expiry is judged by the store's
clock; a long step keeps its lease alive (``LeaseKeeper``) so that only a run that is paused or
gone loses it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sluice import faults
from sluice.errors import FencedError, PipelineBusyError
from sluice.model import Lease, LeaseOwner
from sluice.store import EpochStore
from sluice.store.epoch_store import DEFAULT_LEASE_TTL_S, token_base

log = logging.getLogger("sluice.protocol.leases")


def dead_local_process(owner: str | None) -> bool:
    """A command-line owner ``cli:<host>:<pid>`` on this host whose process has exited."""
    parsed = LeaseOwner.parse(owner)
    here = LeaseOwner.this_process()
    if parsed is None or parsed.kind != here.kind or parsed.scope != here.scope or not parsed.name.isdigit():
        return False
    try:
        os.kill(int(parsed.name), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def acquire_lease(store: EpochStore, pipeline: str, owner: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S,
                  take_over_prefix: str | None = None, alive: Callable[[str], bool] | None = None,
                  dead: Callable[[str | None], bool] = dead_local_process, held: bool = False) -> Lease:
    """Take the pipeline's lease, or fail fast with ``PipelineBusyError``.

    The same owner re-acquires its own lease (a retried task). A lease held by another owner is
    taken only once it has expired (by the store's clock), when its holder is proven dead
    (``dead``: by default a command-line run on this host whose process is gone), or when its
    owner starts with ``take_over_prefix`` (another run of the same DAG) and ``alive(owner)``
    says that run has ended. Without ``alive`` the prefix alone decides, which is right only
    where one run of the DAG can be active at a time: Airflow applies ``max_active_runs`` to
    backfill runs separately, so a backfill run and a scheduled run of one DAG can overlap.
    Every acquisition bumps the fencing token. ``held``: only if ``owner`` holds it already (a
    later task of the run that planned; ``FencedError`` otherwise)."""
    with store.transaction(pipeline, step="acquire_lease") as tx:
        state = tx.state(lock=True)
        if held and state.lease_owner != owner:
            raise FencedError(f"pipeline {pipeline!r}: {owner!r} does not hold the lease (holder: "
                              f"{state.lease_owner!r})")
        now = tx.now()
        held = state.lease_owner is not None and state.lease_owner != owner
        live = state.lease_expires_at is not None and state.lease_expires_at > now
        stale_same_dag = (take_over_prefix is not None and (state.lease_owner or "").startswith(take_over_prefix)
                          and not (alive is not None and state.lease_owner and alive(state.lease_owner)))
        if held and live and not stale_same_dag and not dead(state.lease_owner):
            raise PipelineBusyError(
                f"pipeline {pipeline!r} is busy: its lease is held by {state.lease_owner!r} "
                f"since {state.lease_acquired_at:%Y-%m-%d %H:%M:%S} UTC until "
                f"{state.lease_expires_at:%H:%M:%S} UTC; at most one group per pipeline may be "
                "in flight. Wait for that run, or release the lease once it is known dead.")
        token = max(state.fence + 1, token_base(now))  # tokens rise with the store's clock
        changes: dict[str, Any] = {"lease_owner": owner, "lease_expires_at": now + timedelta(seconds=ttl_s),
                                   "fence": token}
        if state.lease_owner != owner:
            changes["lease_acquired_at"] = now
        tx.update_state(**changes)
        return Lease(pipeline, owner, token)


class LeaseKeeper:
    """Renews a lease every third of its TTL from a thread while a long step works (a group, a
    rollback, a rebuild), so a long step does not let it expire. A renewal that finds the lease
    taken over stops; the run's next store write, or Delta (the token in every commit and
    restore), then refuses it."""

    def __init__(self, store: EpochStore, lease: Lease, ttl_s: float) -> None:
        self.store, self.lease, self.ttl_s = store, lease, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"sluice-lease-{lease.pipeline}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()  # (the lease was just taken: its first renewal is due a third of the TTL later)
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with faults.STORE_WRITE:
                    self.store.renew_lease(self.lease, self.ttl_s)
            except FencedError as exc:
                log.warning("%s", exc)
                return
            except Exception:  # the store is briefly unreachable: try again next time
                log.exception("pipeline %s: could not renew the lease", self.lease.pipeline)
