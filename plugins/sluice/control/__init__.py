"""Adaptive control, pure Python (no Spark, no Airflow): epoch size and partitions by DyBBS on a
cost curve learned from every epoch, group size by Drizzle's AIMD, and ``plan_next`` combining
them for the backlog sensor, under safety bounds that hold on any input (``epoch_size``)."""

from sluice.control.cost_curve import CostCurve
from sluice.control.epoch_size import (
    EpochPlan,
    EpochSizeConfig,
    EpochSizeController,
    isotonic_fit,
    predict,
    rate_bin,
    smallest_stable_group,
)
from sluice.control.group_size import GroupSizeConfig, GroupSizeController
from sluice.control.planner import (
    ControlState,
    Decision,
    GroupResult,
    Observation,
    deadline_plan,
    fire_reason,
    plan_next,
)

__all__ = [
    "ControlState",
    "CostCurve",
    "Decision",
    "EpochPlan",
    "EpochSizeConfig",
    "EpochSizeController",
    "GroupResult",
    "GroupSizeConfig",
    "GroupSizeController",
    "Observation",
    "deadline_plan",
    "fire_reason",
    "isotonic_fit",
    "plan_next",
    "predict",
    "rate_bin",
    "smallest_stable_group",
]
