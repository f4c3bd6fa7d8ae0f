"""The one entry point the backlog sensor calls: ``plan_next(state, observation) -> Decision``.

``ControlState`` bundles the DyBBS epoch-size controller and the AIMD group-size controller; it
round-trips through ``to_dict``/``from_dict`` as plain JSON, so the epoch store can persist it per
pipeline and the controllers survive scheduler and triggerer restarts. ``plan_next`` is
idempotent for a given observation (a finished group is folded in once, by ``group_id``), so the
trigger may call it on every poll.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.control.epoch_size import EpochSizeConfig, EpochSizeController
from sluice.control.group_size import GroupSizeConfig, GroupSizeController

#: Decision reasons whose groups must not move the learning state (their size was not a probe).
NON_ADAPTIVE = ("catch-up", "overload", "freshness", "idle", "drain", "arrivals stopped", "deadline", "fixed sizes",
                "retry", "fallback")


def adaptive_reason(reason: str) -> bool:
    """Whether a group's size was the controllers' own probe or stable point. A sensed group's
    reason is ``"<firing rule>: <decision reason>"``; neither part may be a non-adaptive one."""
    return not any(part.strip().startswith(NON_ADAPTIVE) for part in reason.split(": "))


@dataclass(frozen=True)
class MemorySample:
    """One read's peak in Spark's memory: an epoch's, or a whole group's under one commit per group."""

    records: int
    peak_mb: float
    spilled_mb: float
    budget_mb: float
    unit: str  # "epoch" or "group"


@dataclass(frozen=True)
class GroupResult:
    """What a finished group measured: files and seconds per epoch, and its coordination time
    (Airflow scheduling + sensor delay + Spark start-up and warm-up = wall time - sum of epochs)."""

    group_id: int
    epoch_files: tuple[int, ...]
    epoch_s: tuple[float, ...]
    coordination_s: float
    partitions: int
    rate_rps: float
    file_rate: float
    reason: str = ""
    epoch_records: tuple[int, ...] = ()  # input records per epoch; () = unknown, estimated from the rate
    memory: tuple[MemorySample, ...] = ()  # what its reads held in Spark's memory (classic Spark only)
    predicted_wall_s: float = 0.0  # what its plan predicted (0: unknown); a bad miss triggers a fallback

    @property
    def wall_s(self) -> float:
        return self.coordination_s + sum(self.epoch_s)


@dataclass(frozen=True)
class Observation:
    """The sensor's view: arrival rate (records/s, files/s), backlog in files, the last group;
    the freshness SLA bounds a group's predicted wall, and what the backlog holds (records, when
    the source can say) sizes its epochs when it holds more per file than the rate says."""

    rate_rps: float
    file_rate: float
    backlog_files: int
    last_group: GroupResult | None = None
    freshness_sla_s: float | None = None
    backlog_records: float | None = None


@dataclass(frozen=True)
class Decision:
    """Plan for the next group: ``k`` epochs of ``epoch_size`` files with ``partitions``."""

    epoch_size: int
    k: int
    partitions: int
    reason: str
    predicted_wall_s: float = 0.0
    first_size: int = 0  # the first epoch's files when it differs (a probe of one epoch); 0: epoch_size

    @property
    def group_files(self) -> int:
        """The backlog (files) that makes this group whole: the sensor's efficient-group threshold."""
        return sum(self.epoch_files())

    def epoch_files(self) -> tuple[int, ...]:
        """The planned epochs' files, in order (a backlog smaller than the group ends it sooner)."""
        return (self.first_size or self.epoch_size,) + (self.epoch_size,) * (self.k - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "group_files": self.group_files}


@dataclass
class ControlState:
    epoch: EpochSizeController = field(default_factory=EpochSizeController)
    group: GroupSizeController = field(default_factory=GroupSizeController)
    last_group_id: int | None = None
    last_note: str = ""

    @classmethod
    def new(cls, epoch: EpochSizeConfig | None = None, group: GroupSizeConfig | None = None) -> ControlState:
        return cls(EpochSizeController(epoch), GroupSizeController(group or GroupSizeConfig()))

    def record(self, result: GroupResult) -> str:
        """Fold in one finished group (once per ``group_id``); returns a note for the log."""
        if result.group_id == self.last_group_id:
            return self.last_note
        if len(result.epoch_files) != len(result.epoch_s) or not result.epoch_files:
            raise ValueError(f"group {result.group_id}: need one time per epoch")
        adaptive = adaptive_reason(result.reason)
        # A drain's k is the backlog's, not a setting: only the controllers' own groups move AIMD
        # (a long catch-up would otherwise walk k down, step by step, to 1).
        self.group.observe(result.coordination_s, result.wall_s, len(result.epoch_files), adjust=adaptive)
        note = self.epoch.record(
            rate_rps=result.rate_rps, file_rate=result.file_rate, partitions=result.partitions,
            epoch_files=list(result.epoch_files), epoch_s=list(result.epoch_s),
            epoch_records=list(result.epoch_records) or None,
            coordination_s=result.coordination_s, coordination_ewma_s=self.group.coordination_s or 0.0,
            k_cap=self.group.k, adaptive=adaptive, predicted_wall_s=result.predicted_wall_s,
            k_max=self.group.config.k_max)
        for sample in result.memory:
            self.epoch.record_memory(sample.records, sample.peak_mb, sample.spilled_mb, sample.budget_mb, sample.unit)
        self.last_group_id = result.group_id
        self.last_note = f"k={self.group.k} ({self.group.last_action}); {note}"
        return self.last_note

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "epoch": self.epoch.to_dict(), "group": self.group.to_dict(),
                "last_group_id": self.last_group_id, "last_note": self.last_note}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControlState:
        if data.get("version") != 1:
            raise ValueError(f"unknown control state version {data.get('version')!r}")
        return cls(EpochSizeController.from_dict(data["epoch"]), GroupSizeController.from_dict(data["group"]),
                   data["last_group_id"], data.get("last_note", ""))


def plan_next(state: ControlState, observation: Observation) -> Decision:
    """Fold in the last group (if new) and plan the next one."""
    if observation.last_group is not None:
        state.record(observation.last_group)
    plan = state.epoch.propose(observation.rate_rps, observation.file_rate, state.group.coordination_s,
                               state.group.k, observation.backlog_files, k_max=state.group.config.k_max,
                               max_wall_s=observation.freshness_sla_s, backlog_records=observation.backlog_records)
    return Decision(plan.epoch_size, plan.k, plan.partitions, plan.reason, plan.predicted_wall_s, plan.first_size)


def fire_reason(decision: Decision, backlog_files: int, oldest_age_s: float, freshness_sla_s: float) -> str | None:
    """Why the sensor should start the group now, or ``None`` to keep waiting: the backlog makes
    the planned group whole, or waiting longer would break the freshness SLA."""
    if backlog_files <= 0:
        return None
    if backlog_files >= decision.group_files:
        return "efficient group"
    if oldest_age_s + decision.predicted_wall_s >= freshness_sla_s:
        return "freshness"
    return None


def deadline_plan(backlog_files: int, oldest_age_s: float, freshness_sla_s: float, *, max_epoch_files: int,
                  max_k: int, partitions: int, coordination_s: float | None,
                  seconds_per_file: float | None, lead_s: float = 0.0) -> tuple[Decision, str | None]:
    """The plan and firing rule of ``control.objective: cost``: wait as long as the freshness SLA
    allows, then take the whole backlog in one group (epochs as large as the memory budget and
    the steep part of the measured cost curve allow, ``max_epoch_files``), so nothing runs
    between groups and each group's fixed costs (Spark start, Airflow tasks, per-epoch commits)
    are paid as rarely as the SLA permits.

    Fires ("freshness") once ``oldest_age_s + predicted wall + lead_s`` reaches the SLA, the
    wall being the measured coordination plus the measured seconds per file times the group's
    files (``lead_s``: the poll interval and a margin, the time the decision may come late); or
    ("full group") once the backlog fills ``max_k`` epochs of ``max_epoch_files``, which waiting
    cannot make larger. Before anything was measured the wall is taken as half the SLA.
    """
    epoch_size = max(1, min(backlog_files, max_epoch_files))
    k = min(math.ceil(max(backlog_files, 1) / epoch_size), max_k)
    files = min(backlog_files, epoch_size * k)
    if coordination_s is None or seconds_per_file is None:
        wall, basis = freshness_sla_s / 2, "nothing measured yet: half the SLA"
    else:
        wall, basis = coordination_s + seconds_per_file * files, "measured"
    reason = f"deadline: the whole backlog in one group (wall {wall:.1f} s, {basis})"
    decision = Decision(epoch_size, k, partitions, reason, wall)
    if backlog_files <= 0:
        return decision, None
    if backlog_files >= max_epoch_files * max_k:
        return decision, "full group"
    if oldest_age_s + wall + lead_s >= freshness_sla_s:
        return decision, "freshness"
    return decision, None
