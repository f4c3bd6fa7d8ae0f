"""Glue between the pure controllers (``sluice.control``) and a pipeline: what the backlog
trigger measures (arrival rates, backlog), when it fires, and what a published group teaches
the controllers. Their state is persisted in the epoch store after every group, so it
survives restarts of the scheduler, the triggerer and the workers.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice import protocol
from sluice.control import ControlState, Decision, GroupResult, Observation, fire_reason, plan_next
from sluice.control.epoch_size import EpochSizeConfig
from sluice.control.group_size import GroupSizeConfig
from sluice.control.jit import estimate_records
from sluice.control.planner import MemorySample, deadline_plan
from sluice.sources.base import HISTORY_WINDOW, Backlog, read_history
from sluice.spec import PipelineSpec
from sluice.store import Epoch, EpochStore, Group

log = logging.getLogger("sluice.adaptive")

#: Arrival rates are measured over this many seconds of landed files (at least).
RATE_WINDOW_S = 120.0
#: Arrivals count as paused after this many usual gaps between files with nothing new.
PAUSE_GAPS = 3.0


@dataclass(frozen=True)
class StartReason:
    """Why a group started when it did (or, with ``rule`` None, why the next one waits): the
    firing rule and the figures it compared. Recorded with the group (``Group.plan["started"]``),
    shown per epoch by ``GET /sluice/pipelines/<p>/epochs`` and for the next group by ``/control``."""

    rule: str | None  # efficient group | freshness | drain | full group | scheduled | retry | None (waiting)
    objective: str  # control.objective: latency | cost
    backlog_files: int
    group_files: int  # the backlog that makes the planned group whole
    oldest_age_s: float
    predicted_wall_s: float
    freshness_sla_s: float

    @property
    def explanation(self) -> str:
        files, group = self.backlog_files, self.group_files
        due = self.oldest_age_s + self.predicted_wall_s
        if self.rule == "efficient group":
            return f"the backlog ({files} files) filled the planned group ({group} files)"
        if self.rule == "freshness":
            return (f"the oldest file was {self.oldest_age_s:.0f} s old and the group was predicted to take "
                    f"{self.predicted_wall_s:.0f} s: waiting longer would break the {self.freshness_sla_s:.0f} s "
                    f"freshness SLA (objective {self.objective})")
        if self.rule == "drain":
            return (f"arrivals stopped or paused: the whole backlog ({files} files) starts at once, in epochs of an "
                    f"efficient size, without waiting for a larger group")
        if self.rule == "full group":
            return f"the backlog ({files} files) fills the largest group the memory budget allows; waiting adds nothing"
        if self.rule == "scheduled":
            return f"a scheduled (cron) run takes whatever waits ({files} files)"
        if self.rule == "retry":
            return "a failed run left epochs unfinished; they are retried with their recorded ranges"
        if files == 0:
            return "waiting: nothing to process"
        wait = ("as long as the SLA allows" if self.objective == "cost"
                else f"until the backlog fills the planned group ({files} of {group} files)")
        return (f"waiting {wait}; the SLA forces a start in about "
                f"{max(0.0, self.freshness_sla_s - due):.0f} s (objective {self.objective})")

    def as_record(self) -> dict[str, Any]:
        return {"rule": self.rule, "objective": self.objective, "backlog_files": self.backlog_files,
                "group_files": self.group_files, "oldest_age_s": round(self.oldest_age_s, 1),
                "predicted_wall_s": round(self.predicted_wall_s, 1), "freshness_sla_s": self.freshness_sla_s,
                "explanation": self.explanation}


@dataclass(frozen=True)
class Verdict:
    """One poll's outcome: the plan for the next group, and why to start it now (or None)."""

    decision: Decision
    fire: str | None
    rate_rps: float
    file_rate: float
    started: StartReason

    def plan(self) -> dict[str, Any]:
        """What the sensor hands to the run."""
        return {"epoch_size": self.decision.epoch_size, "k": self.decision.k,
                **({"first_size": self.decision.first_size} if self.decision.first_size else {}),
                "partitions": self.decision.partitions, "reason": f"{self.fire or 'waiting'}: {self.decision.reason}",
                "predicted_wall_s": round(self.decision.predicted_wall_s, 3),
                "rate_rps": round(self.rate_rps, 3), "file_rate": round(self.file_rate, 5),
                "started": self.started.as_record()}


def load_state(spec: PipelineSpec, store: EpochStore) -> ControlState:
    raw = store.control_state(spec.name)
    if raw:
        try:
            return ControlState.from_dict(raw)
        except (KeyError, TypeError, ValueError) as exc:  # an older format: start learning again
            log.warning("pipeline %s: discarding unreadable control state (%s)", spec.name, exc)
    c = spec.control
    return ControlState.new(EpochSizeConfig(initial_files=c.epoch_files),
                            GroupSizeConfig(k0=min(c.group_epochs, c.max_group_epochs), k_max=c.max_group_epochs))


def _per_file(spec: PipelineSpec, store: EpochStore, value: Callable[[Epoch], float | None],
              last: int) -> float | None:
    """``value`` per source file over the last ``last`` epochs that have one, among the last
    ``HISTORY_WINDOW`` times as many (``None``: none)."""
    recent = store.epochs(spec.name, last=HISTORY_WINDOW * last)
    measured = [(e.end - e.start, v) for e in recent if (v := value(e)) is not None][-last:]
    files = sum(n for n, _ in measured)
    return sum(v for _, v in measured) / files if files else None


def records_per_file(spec: PipelineSpec, store: EpochStore, last: int = 20) -> float | None:
    """Input records per source file over the last epochs that read any."""
    return _per_file(spec, store, lambda e: e.rows.get("input") or None, last)


def backlog_records(spec: PipelineSpec, store: EpochStore, backlog: Backlog) -> float | None:
    """What the backlog holds in records, when the source can say: Kafka's lag, or a file or
    Delta source's bytes at the records per byte of its last published epochs. Files of a
    burst, or after a quiet spell, hold more (or fewer) records than the last epochs' average
    per file; the controllers size a drain or a catch-up by this rather than by that average."""
    if backlog.records is not None:
        return float(backlog.records)
    if backlog.files <= 0 or backlog.bytes <= 0:
        return None
    records = estimate_records([backlog.bytes], sizes_are_records=False, history=read_history(spec, store))
    return float(records) if records else None


def seconds_per_file(spec: PipelineSpec, store: EpochStore, last: int = 20) -> float | None:
    """Processing seconds per source file over the last published epochs (``None``: none yet)."""
    return _per_file(spec, store, lambda e: float(e.timings["epoch_s"])
                     if e.state == protocol.PUBLISHED and e.timings.get("epoch_s") is not None else None, last)


def arrival_rates(spec: PipelineSpec, store: EpochStore, mtimes: list[float],
                  now: float | None = None) -> tuple[float, float]:
    """``(records/s, files/s)`` landing lately: files whose mtime is within the window, the
    window being at least ``RATE_WINDOW_S`` and at least four poll intervals."""
    now = time.time() if now is None else now
    window = max(RATE_WINDOW_S, 4 * spec.control.poll_interval_s)
    recent = [m for m in mtimes if now - window <= m <= now]
    if not recent:
        return 0.0, 0.0
    # Arrivals that began within the window are measured over the time since they began.
    span = window if len(recent) < len(mtimes) else max(now - min(recent), spec.control.poll_interval_s, 1.0)
    file_rate = len(recent) / span
    per_file = records_per_file(spec, store) or 1.0
    return file_rate * per_file, file_rate


def arrivals_paused(spec: PipelineSpec, mtimes: list[float], file_rate: float, now: float | None = None) -> bool:
    """Nothing landed for ``PAUSE_GAPS`` times the usual gap between files (and at least two
    polls), although the rate window still counts recent files: a burst that ended, or a
    generator that stopped. Waiting for a larger group then only makes the backlog older."""
    if not mtimes or file_rate <= 0:
        return False
    now = time.time() if now is None else now
    return now - max(mtimes) > max(PAUSE_GAPS / file_rate, 2 * spec.control.poll_interval_s)


def decide(spec: PipelineSpec, store: EpochStore, backlog_files: int, oldest_age_s: float | None,
           mtimes: list[float], *, continuous: bool = True, backlog_records: float | None = None) -> Verdict:
    """Plan the next group and say whether to start it now. Under ``control.objective: latency``
    the backlog makes the planned group whole ("efficient group"), or waiting longer would break
    the freshness SLA ("freshness"); under ``cost`` only the SLA (or a backlog that fills the
    largest group) starts it, and it takes the whole backlog (``deadline_plan``). A scheduled
    (cron) run takes whatever is there ("scheduled"). ``backlog_records``: what the backlog holds
    in records (``backlog_records()``), which sizes its epochs when it holds more per file than the
    rate says."""
    rate_rps, file_rate = arrival_rates(spec, store, mtimes)
    state = load_state(spec, store)
    decision = plan_next(state, Observation(rate_rps, file_rate, backlog_files,
                                            freshness_sla_s=spec.control.freshness_sla_s,
                                            backlog_records=backlog_records))
    fire: str | None = None
    if not spec.control.adaptive:
        # the controllers' prior fixed cost sizes adaptive groups; fixed sizes predict from measurements only
        wall = decision.predicted_wall_s if state.group.coordination_s is not None else 0.0
        decision = Decision(spec.control.epoch_files, spec.control.group_epochs, decision.partitions,
                            "fixed sizes (control.adaptive: false)", wall)
        fire = fire_reason(decision, backlog_files, oldest_age_s or 0.0, spec.control.freshness_sla_s)
    elif spec.control.objective == "cost":
        largest = efficient_epoch_files(spec, store, state)
        decision, fire = deadline_plan(
            backlog_files, oldest_age_s or 0.0, spec.control.freshness_sla_s, max_epoch_files=largest,
            max_k=min(spec.control.max_group_epochs, state.epoch.epochs_in_memory(largest, largest)),
            partitions=decision.partitions, coordination_s=state.group.coordination_s,
            seconds_per_file=seconds_per_file(spec, store),
            lead_s=spec.control.poll_interval_s + state.epoch.config.margin_s)
    elif backlog_files > 0 and (rate_rps == 0 or arrivals_paused(spec, mtimes, file_rate)):
        decision = drain_decision(spec, store, state, backlog_files, decision)
        fire = "drain"  # waiting adds nothing to the backlog
    else:
        fire = fire_reason(decision, backlog_files, oldest_age_s or 0.0, spec.control.freshness_sla_s)
    if not continuous:
        fire = "scheduled" if backlog_files > 0 else None
    started = StartReason(fire, spec.control.objective, backlog_files, decision.group_files, oldest_age_s or 0.0,
                          decision.predicted_wall_s, spec.control.freshness_sla_s)
    return Verdict(decision, fire, rate_rps, file_rate, started)


def decide_backlog(spec: PipelineSpec, store: EpochStore, backlog: Backlog, *, continuous: bool = True) -> Verdict:
    """``decide`` on what a source's poll found (``Source.backlog()``): its files, their
    age, when they arrived and the records they hold."""
    return decide(spec, store, backlog.files, backlog.oldest_age_s, list(backlog.arrivals), continuous=continuous,
                  backlog_records=backlog_records(spec, store, backlog))


def max_epoch_files(spec: PipelineSpec, store: EpochStore, state: ControlState) -> int:
    """The largest epoch the memory budget allows, in files at the recent records per file
    (the spec's ``epoch_files`` until a file has been measured)."""
    per_file = records_per_file(spec, store)
    return max(1, int(state.epoch.max_records() / per_file)) if per_file else spec.control.epoch_files


def efficient_epoch_files(spec: PipelineSpec, store: EpochStore, state: ControlState) -> int:
    """The largest epoch in files that is neither over the memory budget nor in the steep part
    of the measured cost curve (``EpochSizeController.size_limit_records``)."""
    largest = max_epoch_files(spec, store, state)
    per_file = records_per_file(spec, store)
    limit = state.epoch.size_limit_records()
    if per_file and math.isfinite(limit):
        largest = min(largest, max(1, int(limit / per_file)))
    return largest


def drain_decision(spec: PipelineSpec, store: EpochStore, state: ControlState, backlog_files: int,
                   planned: Decision) -> Decision:
    """Nothing arrives any more (or arrivals paused) but a backlog waits: start at once and take
    it in more epochs of the controllers' efficient size (``planned``, already within the steep
    and memory bounds), as many as the backlog holds, the memory budget allows and the freshness
    SLA bounds the group's predicted wall; never one larger epoch."""
    epoch_size = max(1, min(backlog_files, planned.epoch_size))
    if state.epoch.last_rate is None and not state.epoch.curve.samples(planned.partitions):
        # Nothing measured yet: the controllers' size rests on "one record a file", which makes
        # any epoch look cheap. The spec's first size (control.epoch_files) is all that is known.
        epoch_size = max(1, min(backlog_files, spec.control.epoch_files))
    fixed = state.epoch.fixed_cost(state.group.coordination_s)
    per_epoch = max(0.0, (planned.predicted_wall_s - fixed) / planned.k) if planned.k else 0.0
    k = min(math.ceil(backlog_files / epoch_size), spec.control.max_group_epochs,
            state.epoch.epochs_in_memory(epoch_size, max_epoch_files(spec, store, state)))
    if per_epoch > 0:
        k = max(1, min(k, int((spec.control.freshness_sla_s - fixed) // per_epoch)))
    return Decision(epoch_size, k, planned.partitions,
                    f"arrivals stopped or paused: the backlog in epochs of an efficient size ({planned.reason})",
                    fixed + k * per_epoch if per_epoch > 0 else planned.predicted_wall_s)


def record_group(spec: PipelineSpec, store: EpochStore, group: Group, now: float | None = None) -> str | None:
    """Teach the controllers what a published group measured; persists their state. Groups
    that recomputed old ranges (recovery, rollback) say nothing about the current rate."""
    plan = group.plan
    epochs = [e for e in group.epochs if e.timings.get("epoch_s") is not None]
    if not epochs or group.reprocessing or "rate_rps" not in plan:
        return None
    now = time.time() if now is None else now
    started = plan.get("fired_at")
    epoch_s = [float(e.timings["epoch_s"]) for e in epochs]
    wall = max(now - started, sum(epoch_s)) if started else sum(epoch_s)
    state = load_state(spec, store)
    records = [e.rows.get("input") for e in epochs]
    result = GroupResult(group_id=group.group_id, epoch_files=tuple(e.end - e.start for e in epochs),
                         predicted_wall_s=float(plan.get("predicted_wall_s") or 0.0),
                         epoch_s=tuple(epoch_s), coordination_s=wall - sum(epoch_s),
                         partitions=int(plan.get("partitions") or state.epoch.config.initial_partitions),
                         rate_rps=float(plan["rate_rps"]), file_rate=float(plan["file_rate"]),
                         reason=str(plan.get("reason", "")),
                         epoch_records=tuple(int(n) for n in records) if None not in records else (),
                         memory=memory_samples(epochs))
    note = state.record(result)
    # Keep what else the store holds for the pipeline (the concurrency controller's state).
    store.save_control_state(spec.name, {**(store.control_state(spec.name) or {}), **state.to_dict()})
    log.info("pipeline %s: group %s wall %.1f s, coordination %.1f s (%.0f%%): %s", spec.name, group.group_id,
             wall, result.coordination_s, 100 * result.coordination_s / wall if wall else 0, note)
    return note


# -- concurrent epochs (A-scheduler) -------------------------------------------------------------


def memory_samples(epochs: list[Epoch]) -> tuple[MemorySample, ...]:
    """The memory readings a group's epochs recorded (``memory_peak_mb`` in their timings): one
    per epoch, or one for the whole group when its epochs were read and committed together."""
    samples: list[MemorySample] = []
    for commit, members in itertools.groupby(epochs, key=lambda e: tuple(e.rows.get("commit") or (e.epoch_id,))):
        members = list(members)
        timings = members[-1].timings
        if "memory_peak_mb" not in timings:
            continue
        samples.append(MemorySample(
            sum(int(e.rows.get("input") or 0) for e in members), float(timings["memory_peak_mb"]),
            float(timings.get("memory_spilled_mb", 0.0)), float(timings.get("memory_budget_mb", 0.0)),
            "group" if len(commit) > 1 else "epoch"))
    return tuple(samples)


def _concurrency_controller(spec: PipelineSpec, store: EpochStore) -> Any:
    from sluice.control.concurrency import ConcurrencyConfig, ConcurrencyController

    raw = (store.control_state(spec.name) or {}).get("concurrency")
    config = ConcurrencyConfig(max_level=spec.control.max_concurrent_epochs, latency_sla_s=spec.control.freshness_sla_s)
    if raw:
        try:
            controller = ConcurrencyController.from_dict(raw)
            controller.config = config  # the spec's current limits win over the stored ones
            return controller
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("pipeline %s: discarding unreadable concurrency state (%s)", spec.name, exc)
    return ConcurrencyController(config)


def concurrency_level(spec: PipelineSpec, store: EpochStore) -> int:
    """Epochs of the next group to compute at once: 1 when epochs depend on each other
    (a merge into state), the spec's number, or (``auto``) the hill climber's next level."""
    setting = spec.control.concurrent_epochs
    if not spec.independent_epochs:
        return 1
    if setting != "auto":
        return int(setting)
    return _concurrency_controller(spec, store).next_level()


def record_concurrency(spec: PipelineSpec, store: EpochStore, level: int, records: int, wall_s: float) -> None:
    """Teach the concurrency controller a group's throughput and wall time at ``level``."""
    if spec.control.concurrent_epochs != "auto" or not spec.independent_epochs or wall_s <= 0 or records <= 0:
        return
    controller = _concurrency_controller(spec, store)
    controller.observe(level, records / wall_s, wall_s)
    store.save_control_state(spec.name, {**(store.control_state(spec.name) or {}),
                                             "concurrency": controller.to_dict()})
    log.info("pipeline %s: %d epochs at once gave %.0f records/s; next level %d", spec.name, level,
             records / wall_s, controller.next_level())
