"""``run_group.py`` with its steps timed: what ``bench.overhead --connect`` runs as a group's client.

    python bench/connect_trace.py <trace.json> <run_group.py arguments...>

Wraps the protocol's and the Spark glue's steps (session, plan, lease, tables made ready,
reconcile, read, validation, each table's write, the store's commit record, publish) and writes
each call as ``[name, thread, start, end, cpu]`` (``time.monotonic()``, which is the machine's
clock, so the bench lines the calls up with its samples of the Connect server's CPU; ``cpu``:
this process's CPU-seconds during the call, every thread's). Nothing here changes what runs.
"""

from __future__ import annotations

import functools
import json
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]

CALLS: list[list[Any]] = []
T_START = time.monotonic()

#: (module, attribute path, step name) of the calls traced
STEPS = [
    ("sluice.spark", "get_session", "session"),
    ("sluice.spark", "group_compiler", "compiler_choice"),
    ("sluice.protocol.run", "PipelineRun.plan", "plan"),
    ("sluice.protocol.run", "PipelineRun._lease", "lease"),
    ("sluice.protocol.run", "PipelineRun.validate", "validate_gate"),
    ("sluice.protocol.run", "PipelineRun.publish", "publish"),
    ("sluice.protocol.run", "PipelineRun.write_epoch_records", "epoch_records"),
    ("sluice.protocol.group", "GroupJob._start_attempt", "start_attempt"),
    ("sluice.protocol.group", "ready_tables", "ready_tables"),
    ("sluice.protocol.group", "GroupJob.reconcile_tables", "reconcile"),
    ("sluice.protocol.group", "GroupJob.commit_group", "commit_group"),
    ("sluice.protocol.group", "GroupJob._record_commit", "record_commit"),
    ("sluice.protocol.group", "GroupJob.maybe_optimize", "maybe_optimize"),
    ("sluice.compute", "SparkCompute.prefetch", "prefetch_start"),
    ("sluice.compute", "SparkCompute._read", "read"),
    ("sluice.compute", "SparkCompute.prepare_group", "prepare_group"),
    ("sluice.compute", "SparkCompute._validate", "gx_validate"),
    ("sluice.compute", "SparkCompute._warm", "warm_start"),
    ("sluice.compute", "SparkCompute.read_memory", "read_memory"),
    ("sluice.protocol.tables", "PipelineTable.write", "table_write"),
    ("sluice.delta.spark", "SparkTables.holds_no_files", "delta_holds_no_files"),
    ("sluice.delta.spark", "SparkTables.txn_version", "delta_txn_version"),
    ("sluice.delta.spark", "SparkTables.create", "delta_create"),
    ("sluice.delta.spark", "SparkTables._merge", "delta_merge"),
    ("sluice.delta.spark", "SparkTables.exists", "delta_exists"),
    ("sluice.delta.spark", "SparkTables.commit_rows", "delta_commit_rows"),
    ("sluice.validation", "validate", "gx_suite"),
]


def _wrap(fn: Any, name: str) -> Any:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.monotonic(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            label = name
            if name == "table_write" and args:
                label = f"table_write:{getattr(args[0], 'name', '?')}"
            CALLS.append([label, threading.current_thread().name, t0, time.monotonic(), time.process_time() - c0])
    return traced


def install() -> None:
    import importlib

    for module_name, attr, name in STEPS:
        module = importlib.import_module(module_name)
        owner, _, leaf = attr.rpartition(".")
        target = getattr(module, owner) if owner else module
        original = getattr(target, leaf)
        traced = _wrap(original, name)
        setattr(target, leaf, traced)
        if not owner:  # a function imported by name elsewhere: rebind those too
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("sluice") and getattr(mod, leaf, None) is original:
                    setattr(mod, leaf, traced)


def main() -> int:
    out = Path(sys.argv[1])
    t_import = time.monotonic()
    install()
    imported = time.monotonic()
    sys.argv = [str(ROOT / "plugins" / "sluice" / "jobs" / "run_group.py"), *sys.argv[2:]]
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        CALLS.append(["import_and_patch", "MainThread", t_import, imported, 0.0])
        out.write_text(json.dumps({"start": T_START, "end": time.monotonic(), "cpu": time.process_time(),
                                   "calls": CALLS}))
    return code


if __name__ == "__main__":
    sys.exit(main())
