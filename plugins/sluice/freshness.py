"""How fresh a pipeline's output is: the age of its oldest data not yet published (in an
unpublished epoch, or still in the backlog), against ``control.freshness_sla_s``. The control
API shows it; ``FreshnessTrigger`` turns a breach, and the recovery, into Airflow alerts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice import protocol

if TYPE_CHECKING:
    from sluice.sources import Backlog
    from sluice.spec import PipelineSpec
    from sluice.store import EpochLog

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


def unpublished_arrivals(spec: PipelineSpec, log: EpochLog) -> list[float]:
    """When the data of the current generation's unpublished epochs arrived (entries skipped on
    purpose excluded)."""
    waiting = [e for e in log.epochs(spec.name) if e.state in protocol.UNPUBLISHED]
    if not waiting:
        return []
    entries = log.manifest(spec.name, min(e.start for e in waiting), max(e.end for e in waiting))
    spans = [(e.start, e.end) for e in waiting]
    return [f.mtime for f in entries if f.skipped is None and any(a <= f.position < b for a, b in spans)]


def measure(spec: PipelineSpec, log: EpochLog, backlog: Backlog, now: float | None = None) -> Freshness:
    now = time.time() if now is None else now
    oldest = unpublished_arrivals(spec, log)
    if backlog.oldest_age_s is not None:
        oldest.append(now - backlog.oldest_age_s)
    age = max(0.0, now - min(oldest)) if oldest else None
    return Freshness(spec.name, age, spec.control.freshness_sla_s)


def transition(was_breached: bool | None, breached: bool) -> str | None:
    """The alert a new observation raises: ``breached`` on entering a breach (also on the first
    observation), ``recovered`` on leaving one, else nothing."""
    if breached and not was_breached:
        return BREACHED
    if was_breached and not breached:
        return RECOVERED
    return None
