"""How fresh a pipeline's output is: the age of its oldest data not yet published (in an
unpublished epoch, or still in the backlog), against ``control.freshness_sla_s``. The control
API shows it; ``FreshnessTrigger`` turns a breach, and the recovery, into Airflow alerts. The
console's card shows ``staleness``: the age of the last publish against the same SLA."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sluice import protocol

if TYPE_CHECKING:
    from sluice.sources import Backlog
    from sluice.spec import PipelineSpec
    from sluice.store import Epoch, EpochStore

BREACHED, RECOVERED = "breached", "recovered"


@dataclass(frozen=True)
class Freshness:
    pipeline: str
    age_s: float | None  # None: nothing waits to be published
    sla_s: float

    @property
    def breached(self) -> bool:
        return self.age_s is not None and self.age_s > self.sla_s

    def as_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "age_s": None if self.age_s is None else round(self.age_s, 1),
                "sla_s": self.sla_s, "breached": self.breached}


def unpublished_arrivals(spec: PipelineSpec, store: EpochStore) -> list[float]:
    """When the data of the current generation's unpublished epochs arrived (entries skipped on
    purpose excluded)."""
    waiting = store.epochs(spec.name, states=protocol.UNPUBLISHED)
    if not waiting:
        return []
    entries = store.manifest(spec.name, min(e.start for e in waiting), max(e.end for e in waiting))
    spans = [(e.start, e.end) for e in waiting]
    return [f.mtime for f in entries if f.skipped is None and any(a <= f.position < b for a, b in spans)]


def measure(spec: PipelineSpec, store: EpochStore, backlog: Backlog, now: float | None = None) -> Freshness:
    now = time.time() if now is None else now
    oldest = unpublished_arrivals(spec, store)
    if backlog.oldest_age_s is not None:
        oldest.append(now - backlog.oldest_age_s)
    age = max(0.0, now - min(oldest)) if oldest else None
    return Freshness(spec.name, age, spec.control.freshness_sla_s)


@dataclass(frozen=True)
class Staleness:
    """How long the output has gone unchanged: the age of the last publish against the SLA
    (what the console's freshness card shows). Stale when the last publish is older than the
    SLA; before any publish, when data has waited longer than the SLA (``waiting_s``: the age of
    the oldest data not yet published, ``Freshness.age_s``; None when nothing waits)."""

    sla_s: float
    last_publish: float | None  # epoch seconds of the newest publish of the current generation
    age_s: float | None  # now - last_publish
    waiting_s: float | None

    @property
    def stale(self) -> bool:
        if self.age_s is not None:
            return self.age_s > self.sla_s
        return self.waiting_s is not None and self.waiting_s > self.sla_s

    def explanation(self) -> str:
        waiting = ("nothing waits to be published" if self.waiting_s is None
                   else f"the oldest data not yet published is {self.waiting_s:.0f} s old")
        if self.age_s is None:
            return f"nothing published yet; {waiting}"
        verdict = "more" if self.stale else "not more"
        return (f"last publish {self.age_s:.0f} s ago, {verdict} than the {self.sla_s:g} s SLA; {waiting}")

    def as_dict(self) -> dict[str, Any]:
        return {"last_publish_at": None if self.last_publish is None else
                datetime.fromtimestamp(self.last_publish, UTC).isoformat().replace("+00:00", "Z"),
                "last_publish_age_s": None if self.age_s is None else round(self.age_s, 1),
                "waiting_s": None if self.waiting_s is None else round(self.waiting_s, 1),
                "stale": self.stale, "explanation": self.explanation()}


def last_publish(epochs: list[Epoch]) -> float | None:
    """When the newest of ``epochs`` was published (epoch seconds; the store's times are naive UTC)."""
    times = [e.published_at for e in epochs if e.published_at is not None]
    return max(times).replace(tzinfo=UTC).timestamp() if times else None


def staleness(sla_s: float, epochs: list[Epoch], waiting_s: float | None, now: float | None = None) -> Staleness:
    """``epochs``: the current generation's; ``waiting_s``: ``measure(...).age_s``."""
    now = time.time() if now is None else now
    last = last_publish(epochs)
    return Staleness(sla_s, last, None if last is None else max(0.0, now - last), waiting_s)


#: How many of the last groups the floor takes the median wall of: recent enough to follow a
#: change (a bigger rate, a Connect server), enough to ride out one slow group.
FLOOR_GROUPS = 10


@dataclass(frozen=True)
class SlaFloor:
    """The freshness a pipeline can hold, from its groups' measured wall (``docs/operating.md``,
    "What freshness a pipeline can hold"): a record that lands just after a group started waits
    for that group, then for its own, and for a poll before it: ``2 x wall + poll``. Under the
    cost objective the same bound holds: a group's span of arrivals must cover its own wall."""

    sla_s: float
    poll_s: float
    group_wall_s: float | None  # median over the last groups, planned to published; None before any
    groups: int

    @property
    def floor_s(self) -> float | None:
        return None if self.group_wall_s is None else 2 * self.group_wall_s + self.poll_s

    @property
    def feasible(self) -> bool | None:
        return None if self.floor_s is None else self.floor_s <= self.sla_s

    def explanation(self) -> str:
        if self.floor_s is None:
            return "no group published yet: nothing measured"
        said = (f"groups take {self.group_wall_s:.0f} s (median of the last {self.groups}, planned to published), "
                f"so about {self.floor_s:.0f} s of freshness (2 x the wall + the {self.poll_s:g} s poll)")
        if self.feasible:
            return f"{said} is within the {self.sla_s:g} s SLA"
        return (f"{said} is more than the {self.sla_s:g} s SLA: no epoch size holds it. Raise "
                f"control.freshness_sla_s to {2.5 * self.group_wall_s + self.poll_s:.0f} s or more, or cut the "
                "group's fixed cost (a warm Spark Connect server)")

    def as_dict(self) -> dict[str, Any]:
        return {"sla_s": self.sla_s, "group_wall_s": None if self.group_wall_s is None else round(self.group_wall_s, 1),
                "groups": self.groups, "floor_s": None if self.floor_s is None else round(self.floor_s, 1),
                "feasible": self.feasible, "explanation": self.explanation()}


def group_walls(epochs: list[Epoch]) -> list[float]:
    """Each published group's wall, in group order: its first epoch planned to its last published."""
    spans: dict[int, tuple[datetime, datetime]] = {}
    for e in epochs:
        if e.planned_at is None or e.published_at is None:
            continue
        first, last = spans.get(e.group_id, (e.planned_at, e.published_at))
        spans[e.group_id] = (min(first, e.planned_at), max(last, e.published_at))
    return [(last - first).total_seconds() for _, (first, last) in sorted(spans.items())]


def sla_floor(sla_s: float, poll_s: float, epochs: list[Epoch], groups: int = FLOOR_GROUPS) -> SlaFloor:
    recent = group_walls(epochs)[-groups:]
    return SlaFloor(sla_s, poll_s, statistics.median(recent) if recent else None, len(recent))


def transition(was_breached: bool | None, breached: bool) -> str | None:
    """The alert a new observation raises: ``breached`` on entering a breach (also on the first
    observation), ``recovered`` on leaving one, else nothing."""
    if breached and not was_breached:
        return BREACHED
    if was_breached and not breached:
        return RECOVERED
    return None
