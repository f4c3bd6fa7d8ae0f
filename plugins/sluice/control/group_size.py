"""Group size k by AIMD on coordination overhead (Drizzle, SOSP'17 §3.4).

A group is k epochs run by one run-once Spark application started by one DAG run, so it pays
the coordination (Airflow scheduling, sensor delay, Spark start-up and warm-up) once. Drizzle's
rule: smooth ``overhead = coordination / group wall time`` with an EWMA; above the upper bound
multiply k, below the lower bound take a step off k, inside the band keep it. When k changes, the
average is rescaled to the new k (coordination is per group, execution per epoch), so the EWMA
smooths spikes without lagging behind k's own changes.

Sluice runs groups from the backlog that is already there, so k is a *cap*: a group never has
more epochs than the backlog holds, and k only grows when the last group was full (a group cut
short by the backlog says nothing about a larger k, and growing k then would only inflate it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GroupSizeConfig:
    """Drizzle leaves the factor, the step and the EWMA weight open; Fig. 11 fits x2 steps."""

    lower: float = 0.05
    upper: float = 0.10
    k0: int = 2
    k_min: int = 1
    k_max: int = 64
    increase: float = 2.0
    decrease: int = 1
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if not 0 <= self.lower < self.upper < 1:
            raise ValueError(f"need 0 <= lower < upper < 1 (got {self.lower}, {self.upper})")
        if not 1 <= self.k_min <= self.k0 <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k0 <= k_max (got {self.k_min}, {self.k0}, {self.k_max})")
        if self.increase <= 1 or self.decrease < 1 or not 0 < self.alpha <= 1:
            raise ValueError("need increase > 1, decrease >= 1 and 0 < alpha <= 1")


@dataclass
class GroupSizeController:
    """AIMD state: k, the smoothed overhead and the smoothed coordination time (seconds)."""

    config: GroupSizeConfig = field(default_factory=GroupSizeConfig)
    k: int = 0
    overhead: float | None = None
    coordination_s: float | None = None
    last_action: str = "init"

    def __post_init__(self) -> None:
        if self.k == 0:
            self.k = self.config.k0

    def observe(self, coordination_s: float, wall_s: float, epochs_run: int, adjust: bool = True) -> int:
        """Fold in one finished group and apply the AIMD rule; returns the new k. ``adjust=False``
        (a catch-up or drain group, whose k the backlog set) only updates the coordination time."""
        if wall_s <= 0 or coordination_s < 0 or epochs_run < 1:
            raise ValueError(f"bad group measurement: coordination={coordination_s}, wall={wall_s}, "
                             f"epochs={epochs_run}")
        a = self.config.alpha
        if not adjust:
            self.coordination_s = (coordination_s if self.coordination_s is None
                                   else a * coordination_s + (1 - a) * self.coordination_s)
            self.last_action = "hold: not the controllers' own group"
            return self.k
        sample = min(1.0, coordination_s / wall_s)
        self.overhead = sample if self.overhead is None else a * sample + (1 - a) * self.overhead
        self.coordination_s = (coordination_s if self.coordination_s is None
                               else a * coordination_s + (1 - a) * self.coordination_s)
        cfg, old = self.config, self.k
        if self.overhead > cfg.upper:
            if epochs_run >= self.k:
                self.k = min(cfg.k_max, max(self.k + 1, math.ceil(self.k * cfg.increase)))
                self.last_action = "increase"
            else:
                self.last_action = "hold: group limited by backlog"
        elif self.overhead < cfg.lower:
            self.k = max(cfg.k_min, self.k - cfg.decrease)
            self.last_action = "decrease"
        else:
            self.last_action = "hold: in band"
        if self.k != old:
            # The average was measured at the old k: carry it over to the new one (execution time
            # scales with k, coordination does not), or the lag would overshoot k by several steps.
            o, r = self.overhead, self.k / old
            self.overhead = o / (o + (1 - o) * r)
        return self.k

    def limit(self, backlog_epochs: int) -> int:
        """k for the next group: never more epochs than the backlog holds (at least one)."""
        return max(1, min(self.k, backlog_epochs))

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "k": self.k, "overhead": self.overhead,
                "coordination_s": self.coordination_s, "last_action": self.last_action}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupSizeController:
        return cls(config=GroupSizeConfig(**data["config"]), k=int(data["k"]), overhead=data["overhead"],
                   coordination_s=data["coordination_s"], last_action=data.get("last_action", "restored"))
