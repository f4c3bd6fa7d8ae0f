"""Steps 3 and 4 of a group: process it and commit it, one Delta transaction per table, then
record the commit in the store. ``sluice.protocol.run`` tells the whole story and calls this;
``sluice.compute`` reads and transforms; the tables are written through the Delta facade.

An attempt, in order:

1. **Tables ready**: every table of the pipeline exists before anything is written to any (the
   sinks created from the transform's output schema, ``_rejected`` and ``_quarantine`` from
   theirs), so a newer owner can always fence every one of them. A table is born fenced: its
   creation commit records this run's token (an empty append with the txn).
2. **Attempt counted** in the store (a fenced write): a run that lost its lease stops here. An
   attempt left open by a dead driver counts as a crash, not as a failure. (``commit: group``
   counts it before step 1, and the data plane reads the source during steps 1 and 3, which
   read none; ``commit: epoch`` makes the tables ready first, then counts each epoch's.)
3. **Reconcile** (if the epochs were attempted before, or nothing was published yet): record
   this run's token in every table step 1 did not create (no earlier attempt, a zombie
   included, can commit from then on), then RESTORE
   (fenced) each table that holds any of the epochs to the version before the first commit
   holding them, so the rerun writes every table afresh.
4. **Process** (``Compute``) and **commit**: ``_rejected`` and ``_quarantine`` first, then the
   sinks, each table at most once per group, a table with nothing to write skipped; then the
   store records the epochs committed, in one transaction.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, NoReturn

from sluice import faults, validation
from sluice.compute import QUARANTINE, REJECTED, Compute, Prepared
from sluice.errors import FencedError, PipelineHaltedError, SharedTableError, SluiceError, TransformError
from sluice.model import COMMITTED, FAILED, PUBLISHED, Epoch, EpochRange, Group, Lease
from sluice.protocol import rules
from sluice.protocol.tables import PipelineTable, SinkCommit, pipeline_tables
from sluice.spec import PipelineSpec
from sluice.store import EpochStore

if TYPE_CHECKING:
    from collections.abc import Collection

    from sluice.protocol.runtime import Runtime

log = logging.getLogger("sluice.protocol.group")


def restore_conflict(runtime: Runtime, path: str, pipeline: str, version: int) -> str | None:
    """Why ``pipeline`` must not RESTORE the table at ``path`` to ``version``: other pipelines
    committed to it since (their rows would be undone too); ``None`` when none did."""
    foreign = rules.foreign_commits(runtime.tables.lineage(path), pipeline, version)
    if not foreign:
        return None
    writers = "; ".join(f"pipeline {name!r} (versions {', '.join(map(str, versions))})"
                        for name, versions in sorted(foreign.items()))
    return (f"table {path} also holds rows of {writers} written after version {version}: a RESTORE by "
            f"pipeline {pipeline!r} would remove them too. Give each pipeline its own tables (`rejected_path`, "
            f"`quarantine_path`, the sinks' `path`; the defaults are per pipeline)")


def ready_tables(spec: PipelineSpec, store: EpochStore, runtime: Runtime, lease: Lease, generation: int) -> list[str]:
    """Create every table of the pipeline that does not exist yet (empty, with its schema): a
    table is never created by its first write, where a newer owner could not have fenced it.
    Each is born fenced (its creation records the lease token). Returns the paths this call
    created, so fenced already."""
    tables = runtime.tables
    missing = [t for t in pipeline_tables(spec) if not tables.exists(t.path)]
    if not missing:
        return []
    empty = runtime.compute(spec, store).empty()
    created = []
    for table in missing:
        if table.create(tables, empty[table.name], generation=generation, token=lease.fence):
            created.append(table.path)
            log.info("pipeline %s: created table %s (%s)", spec.name, table.path, table.name)
    return created


def fence_tables(spec: PipelineSpec, runtime: Runtime, generation: int, token: int,
                 fenced: Collection[str] = ()) -> None:
    """Record the lease token in every table of the pipeline (``PipelineTable.fence``) but those
    in ``fenced`` (paths this lease created under ``generation``: born fenced). A fence commit
    costs the table's snapshot state twice (before and after it)."""
    for table in pipeline_tables(spec):
        if table.path not in fenced:
            table.fence(runtime.tables, generation, token)


class GroupJob:
    """Processes the epochs of one planned group, in order, under a lease."""

    def __init__(self, spec: PipelineSpec, store: EpochStore, runtime: Runtime) -> None:
        self.spec = spec
        self.store = store
        self.runtime = runtime
        self.tables = {t.name: t for t in pipeline_tables(spec)}
        self.sinks = [self.tables[s.name] for s in spec.sinks]

    @property
    def compute(self) -> Compute:
        return self.runtime.compute(self.spec, self.store)

    def run(self, lease: Lease, group: Group, concurrency: int = 1) -> Group:
        """Process the group's unwritten epochs in order (steps 3 and 4).

        ``commit: group`` (the default): the epochs are read in one scan, transformed and
        written together, one Delta commit per table. ``commit: epoch``: one after the other,
        each with its own commits; with ``concurrency`` > 1 (independent epochs only: append
        sinks, A-scheduler) up to that many are computed at once and committed one by one in
        epoch order.

        Under the ``fail`` policy an epoch that fails validation is recorded as failed and the
        group stops there: nothing of it or of later epochs is written, and the ``validate``
        step halts the pipeline.
        """
        faults.maybe_fail("after_plan")
        partitions = group.plan.get("partitions")
        if partitions and self.spec.control.adaptive:  # the controllers' partition count (DyBBS hill climb)
            self.compute.set_partitions(int(partitions))
        todo = [e for e in group.epochs if e.state not in (COMMITTED, PUBLISHED)]
        with self.runtime.keeper(self.store, lease, self.spec.control.lease_ttl_s):
            if todo and self.spec.commit == "group":
                self._run_group_commit(lease, todo)
            elif todo:
                self._run_epoch_commits(lease, todo, concurrency)
        self.maybe_optimize(group)
        return self.store.group(self.spec.name, group.group_id)

    def _run_epoch_commits(self, lease: Lease, todo: list[Epoch], concurrency: int) -> None:
        """``commit: epoch``: the tables made ready once, then each epoch counted, reconciled,
        processed and committed in order (or computed concurrently, committed in order)."""
        try:
            created = ready_tables(self.spec, self.store, self.runtime, lease, todo[0].generation)
        except TransformError as exc:  # fails on empty input (a SQL error): a failed attempt
            self._attempt(lease, todo[:1], reconcile=False)  # no table was written: none existed yet
            self._fail(lease, todo[:1], exc)
        if concurrency > 1 and len(todo) > 1:
            self._run_concurrently(lease, todo, concurrency, fenced=created)
            return
        for epoch in todo:
            self._attempt(lease, [epoch], fenced=created)
            try:
                committed = self.commit_epoch(lease, self.compute.prepare_epoch(epoch))
            except Exception as exc:
                self._fail(lease, [epoch], exc)
            if not committed:
                break

    def _run_group_commit(self, lease: Lease, todo: list[Epoch]) -> None:
        """``commit: group``: the attempt is counted first (step 2); the data plane then starts
        reading the source (``Compute.prefetch``) while the tables are made ready (step 1) and
        reconciled (step 3), which read no source; the group is written only after both
        (step 4). A new pipeline's first group makes its tables during its read."""
        must_reconcile = self._start_attempt(lease, todo)
        self.compute.prefetch(todo)
        try:
            try:
                created = ready_tables(self.spec, self.store, self.runtime, lease, todo[0].generation)
            except TransformError as exc:  # fails on empty input (a SQL error): a failed attempt
                self._fail(lease, todo, exc)  # no table was written: none existed yet
            if must_reconcile:
                self.reconcile_tables(lease, todo, created)  # ends with a lease check
            else:
                # Every table is made now: a rollback taking the lease after this check fences
                # each one. Before it, a table could be born after the rollback (a sink added to
                # the spec), holding no txn of this generation's app id: Delta would take this
                # run's write there however stale its token.
                self.store.check_lease(lease)
            try:
                self.commit_group(lease, self.compute.prepare_group(todo))
            except Exception as exc:
                self._fail(lease, todo, exc)
        finally:
            self.compute.drop_prefetch()

    # -- an attempt, and what an earlier one left in the tables --------------------------------

    def _start_attempt(self, lease: Lease, epochs: list[Epoch]) -> bool:
        """Count an attempt of ``epochs`` (refused once the pipeline is halted on them); whether
        the tables must be reconciled before they are written: if any was attempted before, and
        before the pipeline's first publish always (a run of a store that was lost may have
        written these epochs)."""
        reason = rules.halt_reason(epochs, self.spec.control.max_attempts, self.spec.control.max_crashes)
        if reason:
            raise PipelineHaltedError(f"pipeline {self.spec.name!r} is halted: {reason}")
        published_before = self.store.start_attempt(lease, epochs)
        return any(e.attempts > 0 or e.state == FAILED for e in epochs) or not published_before

    def _attempt(self, lease: Lease, epochs: list[Epoch], reconcile: bool = True, fenced: Collection[str] = ()) -> None:
        """``_start_attempt``, then reconcile the tables if it must (unless ``reconcile`` is
        false; ``fenced``: tables this lease created, see ``reconcile_tables``)."""
        if self._start_attempt(lease, epochs) and reconcile:
            self.reconcile_tables(lease, epochs, fenced)

    def reconcile_tables(self, lease: Lease, epochs: list[Epoch], fenced: Collection[str] = ()) -> dict[str, int]:
        """Before an epoch that was attempted already is written again: record this run's lease
        token in every table (from then on no earlier attempt, a zombie included, can commit),
        then RESTORE each table that holds any of these epochs to the version before the first
        commit holding them. The rerun then writes every table afresh: nothing an earlier
        attempt wrote survives beside the rerun's output (a fix that now rejects a record
        cannot leave it in neither table). Returns the restored versions by table path."""
        generation, first = epochs[0].generation, epochs[0].epoch_id
        tables = self.runtime.tables
        # (A table this lease just created was born fenced, and holds nothing to restore.)
        fence_tables(self.spec, self.runtime, generation, lease.fence, fenced)
        restored: dict[str, int] = {}
        for table in self.tables.values():
            holding = rules.first_commit_holding(tables.lineage(table.path), table.app_id(generation), generation,
                                                 first)
            if holding is None:
                continue
            conflict = restore_conflict(self.runtime, table.path, self.spec.name, holding - 1)
            if conflict:
                raise SharedTableError(f"pipeline {self.spec.name!r}: epochs from {first} cannot be written again: "
                                       f"{conflict}")
            table.restore(tables, holding - 1, generation=generation, token=lease.fence)
            restored[table.path] = holding - 1
            log.warning("pipeline %s: %s held epochs >= %s of an earlier attempt (version %s); restored to "
                        "version %s before writing them again", self.spec.name, table.path, first, holding,
                        holding - 1)
            faults.maybe_fail("mid_reconcile", first)
        self.store.check_lease(lease)
        return restored

    # -- commit ----------------------------------------------------------------------------------

    def _writes(self, prepared: Prepared, epochs: list[Epoch]) -> list[tuple[PipelineTable, Any, int | None]]:
        """What each table gets, in commit order: ``_rejected``, ``_quarantine``, the sinks, then
        ``_dedup`` (the seen keys, under ``dedup``). A group without a valid record writes no
        sink; otherwise the sinks' rows are counted by Delta's commit metrics (or the compute),
        not by a job of their own."""
        n_rejected = sum(prepared.n_rejected.get(e.epoch_id, 0) for e in epochs)
        quarantined = sum(r.quarantined for e in epochs for r in prepared.results.get(e.epoch_id, {}).values())
        valid = sum(prepared.n_input.get(e.epoch_id, 0) - prepared.n_rejected.get(e.epoch_id, 0) for e in epochs)
        writes: list[tuple[PipelineTable, Any, int | None]] = [
            (self.tables[REJECTED], prepared.rejected, n_rejected),
            (self.tables[QUARANTINE], prepared.quarantined, quarantined)]
        writes += [(sink, prepared.outputs.get(sink.name) if valid else None, prepared.counts.get(sink.name))
                   for sink in self.sinks]
        if "_dedup" in self.tables:  # the seen keys, MERGEd in the same group commit (sluice.dedup)
            writes.append((self.tables["_dedup"], prepared.dedup_state if valid else None, None))
        return writes

    def _write_all(self, lease: Lease, prepared: Prepared, epochs: list[Epoch]) -> list[SinkCommit]:
        timings = prepared.timings
        commits: list[SinkCommit] = []
        ranges = [e.range for e in epochs]
        for table, frame, rows in self._writes(prepared, epochs):
            if frame is None or rows == 0:
                continue  # nothing to write: no commit
            if commits:
                faults.maybe_fail("mid_write", epochs[-1].epoch_id)
            t_sink = time.monotonic()
            commits.append(table.write(self.runtime.tables, frame, epochs=ranges, generation=epochs[0].generation,
                                       token=lease.fence, skip_empty=True, rows=rows))
            timings[f"write_{table.name}_s"] = round(time.monotonic() - t_sink, 3)
        return commits

    def commit_group(self, lease: Lease, prepared: Prepared) -> None:
        """Write the group's epochs (those before one that failed validation under ``fail``):
        at most one Delta transaction per table; then record them committed in one store
        transaction (step 4). A crash in between is repaired by ``reconcile_tables``."""
        epochs, timings = prepared.committing, prepared.timings
        commits: list[SinkCommit] = []
        try:
            t_wait = time.monotonic()
            prepared.wait()
            timings["tables_wait_s"] = round(time.monotonic() - t_wait, 3)
            if epochs:
                timings["compute_s"] = round(time.monotonic() - prepared.t0, 3)
                commits = self._write_all(lease, prepared, epochs)
            self.compute.read_memory(timings)  # before the release: the group's cache counts
        finally:
            prepared.release()
        if epochs:
            faults.maybe_fail("after_delta_commit", epochs[-1].epoch_id)
            self._record_commit(lease, prepared, commits)
        if prepared.failed is not None:
            self._record_validation_failure(lease, prepared)

    def commit_epoch(self, lease: Lease, prepared: Prepared) -> bool:
        """Write a prepared epoch's tables and record the commit; ``False`` when it failed
        validation under ``fail`` (nothing written)."""
        if prepared.failed is not None:
            prepared.release()
            self._record_validation_failure(lease, prepared)
            return False
        epoch = prepared.committing[0]
        for name, r in prepared.results.get(epoch.epoch_id, {}).items():
            if not r.success:
                log.warning("pipeline %s epoch %s: sink %s failed validation (%s): %s", self.spec.name,
                            epoch.epoch_id, name, self.spec.validation.policy, r.describe())
        try:
            commits = self._write_all(lease, prepared, [epoch])
            self.compute.read_memory(prepared.timings)  # before the release: the epoch's cache counts
        finally:
            prepared.release()
        faults.maybe_fail("after_delta_commit", epoch.epoch_id)
        self._record_commit(lease, prepared, commits)
        return True

    def _record_validation_failure(self, lease: Lease, prepared: Prepared) -> None:
        failed = prepared.failed
        assert failed is not None
        results = {name: r.as_dict() for name, r in prepared.results[failed.epoch_id].items()}
        self.store.mark_failed(lease, [failed], "validation failed: " + validation.describe(results),
                               validation=results, rows={"input": prepared.n_input.get(failed.epoch_id, 0)})
        for name, r in results.items():
            if not r["success"]:
                log.warning("pipeline %s epoch %s: sink %s failed validation (fail)", self.spec.name,
                            failed.epoch_id, name)

    def _record_commit(self, lease: Lease, prepared: Prepared, commits: list[SinkCommit]) -> None:
        """The store records the epochs committed together, with their versions, counts and
        timings. Output rows are counted per commit: the last epoch of a commit holds them; the
        group's wall time is shared by files (the controllers see seconds per file, DyBBS)."""
        epochs = prepared.committing
        elapsed = time.monotonic() - prepared.t0
        files = sum(e.end - e.start for e in epochs)
        sink_names = {s.name for s in self.sinks}
        versions = {c.sink: c.version for c in commits}
        output = sum(c.rows for c in commits if c.sink in sink_names)
        keys = {c.sink: c.keys for c in commits if c.keys}
        records = []
        for i, epoch in enumerate(epochs):
            results = prepared.results.get(epoch.epoch_id, {})
            last = i == len(epochs) - 1
            rows: dict[str, Any] = {
                "input": prepared.n_input.get(epoch.epoch_id, 0),
                "rejected": prepared.n_rejected.get(epoch.epoch_id, 0),
                "quarantined": sum(r.quarantined for r in results.values()),
                "output": output if last else 0}
            if self.spec.dedup is not None:
                rows["deduplicated"] = prepared.n_deduplicated.get(epoch.epoch_id, 0)
            if len(epochs) > 1 or self.spec.commit == "group":
                rows["commit"] = [epochs[0].epoch_id, epochs[-1].epoch_id]
            if keys and last:  # Prompt's key statistics (sluice.sinks.layout), of the whole commit
                rows["keys"] = keys
            timings = dict(prepared.timings)
            if len(epochs) > 1 or self.spec.commit == "group":
                timings.update(epoch_s=round(elapsed * (epoch.end - epoch.start) / max(files, 1), 3),
                               group_s=round(elapsed, 3), group_epochs=len(epochs))
            else:
                timings["epoch_s"] = round(elapsed, 3)
            records.append((epoch, versions, rows, timings, {n: r.as_dict() for n, r in results.items()} or None))
        self.store.mark_committed(lease, records)
        log.info("pipeline %s epochs %s..%s committed in one commit per table: %s", self.spec.name,
                 epochs[0].epoch_id, epochs[-1].epoch_id,
                 json.dumps({"commits": [c.describe() for c in commits], "timings": prepared.timings}))

    def _run_concurrently(self, lease: Lease, epochs: list[Epoch], level: int, fenced: Collection[str] = ()) -> None:
        """Compute up to ``level`` epochs at once (worker threads, one FAIR pool each), commit
        in order from this thread: the store is written here only."""
        from concurrent.futures import Future, ThreadPoolExecutor

        from sluice.control.concurrency import pool_weights

        weights = pool_weights([e.epoch_id for e in epochs])
        queue: list[tuple[Epoch, Future[Prepared]]] = []
        upcoming = iter(epochs)
        with ThreadPoolExecutor(max_workers=level, thread_name_prefix="sluice-epoch") as pool:

            def submit() -> None:
                epoch = next(upcoming, None)
                if epoch is not None:
                    self._attempt(lease, [epoch], fenced=fenced)
                    queue.append((epoch, pool.submit(self._prepare_in_pool, epoch, weights[epoch.epoch_id], level)))

            for _ in range(level):
                submit()
            last_commit = time.monotonic()
            try:
                while queue:
                    epoch, future = queue.pop(0)
                    try:
                        prepared = future.result()
                        # epoch_s is the wall time this epoch added to the group: its compute
                        # overlapped the previous epochs', and the controllers (DyBBS) must see
                        # the group's real pace, not the sum of overlapping spans.
                        prepared.t0 = max(prepared.t0, last_commit)
                        committed = self.commit_epoch(lease, prepared)
                        last_commit = time.monotonic()
                    except Exception as exc:
                        self._fail(lease, [epoch], exc)
                    if not committed:
                        break
                    submit()
            finally:  # a failure or a stop: let the epochs in flight finish, drop their caches
                for _, pending in queue:
                    try:
                        pending.result().release()
                    except Exception:
                        pass

    def _prepare_in_pool(self, epoch: Epoch, weight: int, level: int) -> Prepared:
        prepared = self.compute.prepare_epoch(epoch, materialize=True, weight=weight)
        prepared.timings["concurrency"] = level
        return prepared

    def _fail(self, lease: Lease, epochs: list[Epoch], exc: Exception) -> NoReturn:
        """Record the epochs' failure with its real cause and their files, pointing at the
        poison record when one record alone makes the transform fail, and raise. A fenced run
        records nothing (it may not), and a driver that died is a crash, not a failure: its
        attempt stays open and the next one counts it."""
        if isinstance(exc, FencedError):
            raise exc
        first, last = epochs[0], epochs[-1]
        what = f"epoch {first.epoch_id}" if len(epochs) == 1 else f"epochs {first.epoch_id}..{last.epoch_id}"
        what += f" (offsets [{first.start}, {last.end}))"
        message = _short_error(exc)
        if self.compute.died(exc):
            # No probe: the session is gone. Say what killed it, not the socket error it left.
            message = (f"the Spark driver died while processing files {self._file_names(first.start, last.end)} "
                       f"({message}); most often it ran out of memory: raise spark.driver.memory, or lower "
                       "source.max_record_bytes or control.epoch_files")
            raise SluiceError(f"pipeline {self.spec.name!r} {what} failed: {message}") from exc
        if not isinstance(exc, SluiceError | faults.InjectedFault):
            poison = self.compute.locate_poison(EpochRange(first.epoch_id, first.start, last.end))
            if poison:
                entries = self.store.manifest(self.spec.name, first.start, last.end)
                holder = next((e.epoch_id for e in epochs
                               if any(f.path == poison[0] and e.start <= f.position < e.end for f in entries)), None)
                message += f" -- poison record at {poison[0]} line {poison[1]} (epoch {holder}): {poison[2][:500]}"
            else:
                message += f" -- files {self._file_names(first.start, last.end)}"
        self.store.mark_failed(lease, epochs, message)
        if isinstance(exc, SluiceError | faults.InjectedFault):
            raise exc
        raise SluiceError(f"pipeline {self.spec.name!r} {what} failed: {message}") from exc

    def _file_names(self, start: int, end: int, limit: int = 5) -> str:
        paths = [e.path for e in self.store.manifest(self.spec.name, start, end)]
        more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
        return ", ".join(paths[:limit]) + more

    def maybe_optimize(self, group: Group) -> None:
        """Compact the sinks every ``control.optimize_every_groups`` groups (many small epochs
        leave many small files). OPTIMIZE commits carry no txn id and change no rows."""
        every = self.spec.control.optimize_every_groups
        if not every or (group.group_id + 1) % every:
            return
        tables = self.runtime.tables
        for sink in self.sinks:
            if tables.exists(sink.path):
                t0 = time.monotonic()
                metrics = tables.optimize(sink.path)
                log.info("pipeline %s: OPTIMIZE %s after group %s in %.1f s: %s", self.spec.name, sink.path,
                         group.group_id, time.monotonic() - t0, metrics["metrics"] if metrics else None)


def _short_error(exc: BaseException) -> str:
    """The first line of an exception (Spark's carry a JVM stack trace), capped."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:1000] if text else ''}"
