"""Concurrent epochs (A-scheduler, Cheng et al.): which epochs may run at once, FAIR pool
weights favouring older epochs, and the online tuning of the concurrency level.

Pure Python: no Spark, no Airflow. The runner computes up to ``level`` independent epochs at
once and commits them in epoch order; this module only decides ``level``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

#: Sink modes whose epochs do not read what earlier epochs wrote (A-scheduler §II-A).
STATELESS_MODES = frozenset({"append"})


def epoch_dependency(sink_modes: Iterable[str]) -> Literal["independent", "dependent"]:
    """A-scheduler §II-A / §III-A: jobs of consecutive batches are *independent* when no
    output depends on earlier batches. A pipeline whose sinks all append qualifies; a merge
    into state (``aggregate``, upserts) makes epoch e+1 depend on e, so it stays sequential."""
    return "independent" if all(m in STATELESS_MODES for m in sink_modes) else "dependent"


def pool_weights(epoch_ids: Sequence[int], max_weight: int = 8) -> dict[int, int]:
    """FAIR pool weight per epoch, higher for older epochs (A-scheduler §III-B: the allocator
    favours the oldest batch so that batches finish, and commit, in order): the oldest gets
    ``max_weight``, each younger one a step less, never below 1."""
    ordered = sorted(epoch_ids)
    return {e: max(1, max_weight - i) for i, e in enumerate(ordered)}


@dataclass(frozen=True)
class ConcurrencyConfig:
    max_level: int = 4
    latency_sla_s: float = 300.0  # a group slower than this counts as a broken SLA
    method: Literal["hill_climb", "sarsa"] = "hill_climb"
    explore_every: int = 10  # hill climbing: re-probe a neighbour every N groups at the optimum
    alpha: float = 0.5  # Sarsa(0) learning rate (A-scheduler §IV)
    gamma: float = 0.5  # Sarsa(0) discount
    epsilon: float = 0.1  # Sarsa(0) exploration probability
    seed: int = 0


@dataclass
class ConcurrencyController:
    """Tunes the number of epochs computed at once from each group's throughput and wall time.

    ``hill_climb`` (default): start at 1, step up while throughput improves and the group
    stays within the SLA; step back to the best level when throughput drops or the SLA breaks;
    at the optimum, re-probe a neighbour every ``explore_every`` groups (the rate may change).
    ``sarsa``: A-scheduler's Sarsa(0) over states = levels, actions = {-1, 0, +1}, reward =
    throughput normalised by the best seen, minus 1 when the SLA breaks.
    """

    config: ConcurrencyConfig = field(default_factory=ConcurrencyConfig)
    level: int = 1
    best: dict[str, float] = field(default_factory=dict)  # level -> EWMA throughput
    direction: int = 1
    groups_at_best: int = 0
    q: dict[str, float] = field(default_factory=dict)  # "level:action" -> value (Sarsa)
    last_action: int = 0
    rng_state: int = 0

    def next_level(self) -> int:
        return max(1, min(self.config.max_level, self.level))

    def observe(self, level: int, throughput_rps: float, latency_s: float) -> int:
        """Fold in one group run at ``level``; returns the level for the next group."""
        key = str(level)
        old = self.best.get(key)
        self.best[key] = throughput_rps if old is None else 0.5 * old + 0.5 * throughput_rps
        broke_sla = latency_s > self.config.latency_sla_s
        if self.config.method == "sarsa":
            self.level = self._sarsa(level, throughput_rps, broke_sla)
        else:
            self.level = self._hill_climb(level, broke_sla)
        return self.next_level()

    def _hill_climb(self, level: int, broke_sla: bool) -> int:
        top = max(self.best, key=lambda k: self.best[k])
        best_level = int(top)
        if broke_sla and level > 1:
            self.direction = -1
            return level - 1
        if level == best_level:
            self.groups_at_best += 1
            up = level + 1
            if str(up) not in self.best and up <= self.config.max_level and self.direction > 0:
                return up  # still climbing
            if self.groups_at_best >= self.config.explore_every:
                self.groups_at_best = 0
                neighbour = level + self.direction
                if not 1 <= neighbour <= self.config.max_level:
                    self.direction = -self.direction
                    neighbour = level + self.direction
                return max(1, min(self.config.max_level, neighbour))
            return level
        # The probe did worse than the best known level: go back there.
        self.direction = -1 if level > best_level else 1
        self.groups_at_best = 0
        return best_level

    def _sarsa(self, level: int, throughput_rps: float, broke_sla: bool) -> int:
        rng = random.Random(self.config.seed * 1_000_003 + self.rng_state)
        self.rng_state += 1
        top = max(self.best.values()) or 1.0
        reward = throughput_rps / top - (1.0 if broke_sla else 0.0)
        prev = level - self.last_action
        action = self._choose(level, rng)
        q_prev = self.q.get(f"{prev}:{self.last_action}", 0.0)
        q_next = self.q.get(f"{level}:{action}", 0.0)
        self.q[f"{prev}:{self.last_action}"] = q_prev + self.config.alpha * (
            reward + self.config.gamma * q_next - q_prev)
        self.last_action = action
        return max(1, min(self.config.max_level, level + action))

    def _choose(self, level: int, rng: random.Random) -> int:
        actions = [a for a in (-1, 0, 1) if 1 <= level + a <= self.config.max_level]
        if rng.random() < self.config.epsilon:
            return rng.choice(actions)
        return max(actions, key=lambda a: (self.q.get(f"{level}:{a}", 0.0), -abs(a)))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["version"] = 1
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConcurrencyController:
        if data.get("version") != 1:
            raise ValueError(f"unknown concurrency state version {data.get('version')!r}")
        fields = {k: v for k, v in data.items() if k not in ("version", "config")}
        return cls(config=ConcurrencyConfig(**data["config"]), **fields)
