"""sluice's exactly-once protocol, in one house and in DESIGN order, as Spark's
``MicroBatchExecution`` reads ``populateStartOffsets`` -> ``constructNextBatch`` -> ``runBatch``:

* ``rules``: the pure rules (state machine, ranges, txn packing, lineage, halts);
* ``leases``: who may hold a pipeline, the lease kept alive while a run works;
* ``planning``: reconcile and plan (write-ahead) a group, a backfill's share;
* ``tables``: a pipeline's tables as the protocol writes them (txn, fence, replay, creation);
* ``group``: the group job: process and commit one group (reconcile the tables first);
* ``run``: ``PipelineRun``, the steps of one run (plan, process, validate, publish);
* ``operations``: rollback, redo, backfill, rebuild, skip a file, withdraw an intent.

The rules are re-exported here (``protocol.PUBLISHED``, ``protocol.plan_ranges``); the steps are
imported from their modules (lazily here, so the store and the sources can use the rules).
"""

from __future__ import annotations

from typing import Any

from sluice.protocol.rules import *  # noqa: F403
from sluice.protocol.rules import (  # noqa: F401  (the names tests and modules use)
    TRANSITIONS,
    TXN_EPOCH_BITS,
    Range,
    check_contiguous,
    check_transition,
    current_lineage,
    epochs_to_reprocess,
    fenced_out,
    first_commit_holding,
    foreign_commits,
    halt_reason,
    plan_ranges,
    sink_app_id,
    txn_epoch,
    txn_token,
    txn_version,
)

_LAZY = {
    "PipelineRun": "sluice.protocol.run", "GroupPlan": "sluice.protocol.run", "SensedPlan": "sluice.protocol.run",
    "Runtime": "sluice.protocol.runtime", "run_once": "sluice.protocol.run", "cli_owner": "sluice.protocol.run",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sluice.protocol' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
