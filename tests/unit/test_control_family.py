"""The controllers over a seeded family of traces (issue 36), not only the named ones.

Hypothesis draws seeds of ``bench.simulator.family_member`` (shapes x cost models x rates near
and above capacity; two hours each here, four in ``make bench-control``); for each, FixBI (the
best static setting in hindsight on the very trace and seed, found by the bench's exhaustive
search) and the oracle are computed independently of sluice. Every drawn seed is printed (run
with ``-s``) and noted in a failing example.

* Wherever some static setting keeps the backlog bounded, sluice's backlog stays bounded: below
  the same bound that qualifies a static setting (``UNBOUNDED_FILES``), and within a few times
  FixBI's largest backlog.
* Mean latency <= 1.25x FixBI on every trace: the issue's goal, not met yet (on two-hour traces
  median 1.15x, p90 2.1x, max 4.0x over seeds 0-47; the worst are memory cliffs, silences and
  bursty joins, where the transient of learning the curve dominates). Encoded as an xfail: a few
  draws may all pass (XPASS), the family as a whole does not (``SLUICE_FAMILY_FULL=1``).

Cost: 4 seeds per property, about 1.5 s each (12 s of CPU in all).
``SLUICE_FAMILY_EXAMPLES=N`` draws more; ``SLUICE_FAMILY_FULL=1`` also runs the bench's family
(its first 64 four-hour traces, several minutes; marker ``variant``) against the goals.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from bench.control import UNBOUNDED_FILES, fixbi, run_family, summarise_family
from bench.simulator import Oracle, Simulator, Sluice, family_member
from sluice.control import GroupSizeConfig

EXAMPLES = int(os.environ.get("SLUICE_FAMILY_EXAMPLES", "4"))
HOURS = 2.0
# no shrinking: a failing seed is reported as drawn (shrinking would simulate many more traces)
family_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                           phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 10_000)


@functools.lru_cache(maxsize=64)
def runs(seed: int) -> dict:
    """Sluice, the oracle and FixBI on family trace ``seed`` (two hours)."""
    m = family_member(seed, HOURS * 3600)
    sim = Simulator(m.workload, m.trace, seed=seed)
    out = {"name": m.name, "sluice": sim.run(Sluice(group=GroupSizeConfig(k0=3))),
           "oracle": sim.run(Oracle(m.workload))}
    try:
        out["fixbi"], out["config"] = fixbi(m.workload, m.trace, seed)
    except AssertionError:  # no static setting keeps the backlog bounded: nothing to hold sluice to
        out["fixbi"] = None
    print(f"family seed {seed} ({m.name}): sluice {out['sluice'].mean_latency_s:.1f} s, "
          f"max backlog {out['sluice'].max_backlog_files}; FixBI "
          + (f"{out['fixbi'].mean_latency_s:.1f} s, max backlog {out['fixbi'].max_backlog_files}"
             if out["fixbi"] else "unbounded"))
    return out


@pytest.mark.parametrize("prop", [
    "bounded",
    pytest.param("latency", marks=pytest.mark.xfail(
        strict=False, reason="issue 36's latency goal (<= 1.25x FixBI on every trace) is not met yet")),
])
@family_settings
@given(seed=seeds)
def test_family_property(prop, seed):
    """``bounded``: wherever a static setting keeps the backlog bounded, so does sluice.
    ``latency``: sluice's mean latency is within 1.25x FixBI's. Both draw the same seeds (one
    test function, derandomized), so each trace is simulated once."""
    r = runs(seed)
    note(f"seed {seed}: {r['name']}")
    sluice, fix = r["sluice"], r["fixbi"]
    if fix is None:
        return
    if prop == "bounded":
        assert sluice.max_backlog_files <= UNBOUNDED_FILES, (seed, sluice.max_backlog_files)
        assert sluice.max_backlog_files <= 8 * fix.max_backlog_files + 300, (
            seed, sluice.max_backlog_files, fix.max_backlog_files)
        # every file was processed exactly once, and the latency is finite
        assert sluice.processed_files[-1][1] == int(HOURS * 3600) and np.isfinite(sluice.mean_latency_s)
    else:
        ratio = sluice.mean_latency_s / fix.mean_latency_s
        assert ratio <= 1.25, (seed, r["name"], ratio, r["config"])


@pytest.mark.variant
@pytest.mark.skipif(not os.environ.get("SLUICE_FAMILY_FULL"), reason="several minutes: SLUICE_FAMILY_FULL=1")
def test_the_bench_family_meets_the_goals():
    """``make bench-control``'s family (its first 64 four-hour traces, the bench's own code) against the
    issue's goals: median <= 1.05x FixBI, p90 <= 1.15x, max <= 1.25x, median <= 1.10x the oracle,
    no runaway."""
    fam = summarise_family([run_family(seed) for seed in range(64)])
    print(fam)
    assert fam["runaway"] == 0
    assert fam["fixbi"]["median"] <= 1.05 and fam["fixbi"]["p90"] <= 1.15 and fam["fixbi"]["max"] <= 1.25
    assert fam["oracle"]["median"] <= 1.10
