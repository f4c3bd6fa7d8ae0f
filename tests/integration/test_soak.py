"""Random SIGKILLs of a real run-once Spark driver (``run_group.py --plan --drain``), at moments
nobody named, through several groups (the first one included), with data landing between kills;
then a drain. The tables equal the oracle of the raw files and the pipeline is never halted (a
killed driver is a crash, not a poison attempt). Seeded; the seed is printed
(``SLUICE_SOAK_SEED`` replays it). Cost: about 2-3 minutes (a JVM per attempt)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

from sluice.protocol.planning import halt_reason
from sluice.protocol.run import run_once
from sluice.store import EpochStore
from tests.integration.test_exactly_once import GroupJob
from tests.pipelines import assert_matches_oracle, land, make_pipeline

KILLS = 8


def test_random_kills_through_several_groups_then_a_drain_equal_the_oracle(spark):
    seed = int(os.environ.get("SLUICE_SOAK_SEED") or time.time_ns() % 1_000_000_000)
    print(f"\nsoak seed {seed} (replay: SLUICE_SOAK_SEED={seed})")
    rng = random.Random(seed)
    spec = make_pipeline("soak", **{"control.epoch_files": 2, "control.group_epochs": 2})
    store = EpochStore()
    land(spec, files=4, seed=1, malformed_fraction=0.03)
    kills, first_group_killed, landed, moments = 0, False, 1, []
    while kills < KILLS:
        job = GroupJob(spec.name, "--plan", "--drain")
        first = not store.knows(spec.name, published=True)
        if first:  # the first group: wait until it is planned, then kill it before it publishes
            deadline = time.monotonic() + 120
            while not store.epochs(spec.name) and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            delay = rng.uniform(0.0, 3.0)
        else:
            delay = rng.uniform(1.0, 30.0)  # from the JVM's start to the middle of a group
        try:
            job.proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.kill(job.pid, signal.SIGKILL)
            job.proc.wait(timeout=30)
            kills += 1
            moments.append(round(delay, 1))
            first_group_killed |= first and not store.knows(spec.name, published=True)
        else:
            _, err = job.communicate(timeout=10)
            assert job.returncode == 0, err[-3000:]
        assert halt_reason(store, spec.name, spec.control.max_attempts, spec.control.max_crashes) is None, \
            f"halted after kill {kills} (seed {seed})"
        if rng.random() < 0.6:  # data lands meanwhile
            landed += 1
            land(spec, files=rng.randint(1, 3), seed=landed, malformed_fraction=0.03)
    print(f"killed at {moments} s")
    assert first_group_killed, "a kill landed in the first group"
    run_once(spec, store, spark, drain=True)
    assert_matches_oracle(spark, spec, store)
    assert {e.state for e in store.epochs(spec.name)} == {"published"}
