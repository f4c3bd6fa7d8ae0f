"""The glue between the controllers and a pipeline (no Spark): arrival rates from landed files,
the firing rules, and controller state that a published group updates and that survives a
restart (a new EpochStore on the same store)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sluice import adaptive
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.store import EpochStore
from tests.pipelines import make_pipeline


@pytest.fixture
def log(tmp_path: Path):
    store = EpochStore(f"sqlite:///{tmp_path}/s.db")
    yield store
    store.close()


def test_arrival_rates_count_recent_files_and_scale_by_records_per_file(log):
    spec = make_pipeline("adaptive_rates")
    now = 10_000.0
    mtimes = [now - 5 * i for i in range(30)]  # a file every 5 s over 150 s; 24 in the last 120 s
    rate, file_rate = adaptive.arrival_rates(spec, log, mtimes, now=now)
    assert file_rate == pytest.approx(25 / 120)  # ages 0, 5, ..., 120 s
    assert rate == pytest.approx(file_rate)  # no history yet: one record per file
    assert adaptive.arrival_rates(spec, log, [now - 500], now=now) == (0.0, 0.0)


def test_fixed_sizes_unless_adaptive(log):
    fixed = make_pipeline("adaptive_fixed", **{"control.epoch_files": 3, "control.group_epochs": 5})
    verdict = adaptive.decide(fixed, log, backlog_files=15, oldest_age_s=0.0, mtimes=[1.0] * 15)
    assert (verdict.decision.epoch_size, verdict.decision.k) == (3, 5)
    assert verdict.fire == "efficient group"
    assert adaptive.decide(fixed, log, 14, 0.0, [1.0] * 14).fire is None
    assert adaptive.decide(fixed, log, 14, 60.0, [1.0] * 14).fire == "freshness"


def test_a_published_group_updates_the_persisted_state(log, tmp_path):
    spec = make_pipeline("adaptive_learns", **{"control.adaptive": True, "control.epoch_files": 2})
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, 100.0 + i) for i in range(4)])
    lease = acquire_lease(log, spec.name, "run")
    fired_at = 1_000.0
    group = plan_group(log, lease, epoch_size=2, k=2, plan={
        "reason": "efficient group: slow start", "partitions": 2, "fired_at": fired_at,
        "rate_rps": 2000.0, "file_rate": 1.0})
    for e in group.epochs:
        log.mark_committed(lease, [(e, {}, {"input": 4000}, {"epoch_s": 5.0}, None)])
    group = log.finish_group(lease, group.group_id)
    assert log.control_state(spec.name) is None
    note = adaptive.record_group(spec, log, group, now=fired_at + 30.0)  # 20 s of coordination
    assert note and "k=" in note
    saved = log.control_state(spec.name)
    assert saved["last_group_id"] == group.group_id
    assert saved["group"]["coordination_s"] == pytest.approx(20.0)

    restarted = EpochStore(log.url)  # a new process: the same state from the store
    state = adaptive.load_state(spec, restarted)
    assert state.to_dict() == saved
    assert adaptive.records_per_file(spec, restarted) == pytest.approx(2000.0)
    restarted.close()


def test_arrivals_that_began_lately_are_measured_since_they_began(log):
    spec = make_pipeline("adaptive_start")
    now = 10_000.0
    _, file_rate = adaptive.arrival_rates(spec, log, [now - i for i in range(40)], now=now)
    assert file_rate == pytest.approx(40 / 39)  # one file a second, not 40 per 120 s


def test_a_backlog_with_no_arrivals_drains_in_one_group(log):
    spec = make_pipeline("adaptive_drain", **{"control.adaptive": True})
    verdict = adaptive.decide(spec, log, backlog_files=36, oldest_age_s=500.0, mtimes=[1.0] * 36)
    assert verdict.decision.reason.startswith("arrivals stopped")
    assert verdict.decision.epoch_size * verdict.decision.k >= 36
    assert verdict.fire == "drain" and "whole backlog (36 files)" in verdict.started.explanation
    # a backlog that is not a multiple of the epoch size drains too (no freshness wait)
    odd = adaptive.decide(spec, log, backlog_files=37, oldest_age_s=0.0, mtimes=[1.0] * 37)
    assert odd.decision.epoch_size * odd.decision.k >= 37 and odd.fire == "drain"


def test_a_first_drain_with_nothing_measured_takes_epochs_of_the_specs_size(log):
    """Before any group was measured the controllers assume one record a file, which makes any
    epoch look cheap: a first drain took a 16-file backlog as one epoch (the README walk's
    rollback to epoch 1 then had nothing to roll back). It takes control.epoch_files-sized
    epochs, more of them."""
    spec = make_pipeline("adaptive_first_drain", **{"control.adaptive": True, "control.epoch_files": 4})
    verdict = adaptive.decide(spec, log, backlog_files=16, oldest_age_s=600.0, mtimes=[1.0] * 16)
    assert verdict.fire == "drain"
    assert (verdict.decision.epoch_size, verdict.decision.k) == (4, 4), verdict.decision


def test_objective_cost_waits_for_the_deadline_then_takes_the_whole_backlog(log):
    spec = make_pipeline("adaptive_cost", **{"control.adaptive": True, "control.objective": "cost",
                                             "control.freshness_sla_s": 60, "control.poll_interval_s": 1})
    # One published group teaches the planner: 2 epochs of 5 files at 2 s each, 8 s of coordination.
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, 100.0 + i) for i in range(10)])
    lease = acquire_lease(log, spec.name, "run")
    group = plan_group(log, lease, epoch_size=5, k=2, plan={
        "reason": "freshness: deadline", "partitions": 2, "fired_at": 1_000.0, "rate_rps": 100.0, "file_rate": 1.0})
    for e in group.epochs:
        log.mark_committed(lease, [(e, {}, {"input": 500}, {"epoch_s": 2.0}, None)])
    group = log.finish_group(lease, group.group_id)
    adaptive.record_group(spec, log, group, now=1_012.0)
    assert adaptive.seconds_per_file(spec, log) == pytest.approx(0.4)

    # 30 files waiting, one a second: the wall is 8 + 0.4 * 30 = 20 s, the lead 1 s poll + 2 s margin.
    mtimes = [time.time() - i for i in range(30)]
    assert adaptive.decide(spec, log, 30, oldest_age_s=36.0, mtimes=mtimes).fire is None
    verdict = adaptive.decide(spec, log, 30, oldest_age_s=37.5, mtimes=mtimes)
    assert verdict.fire == "freshness"
    assert verdict.decision.epoch_size * verdict.decision.k >= 30
    assert verdict.decision.predicted_wall_s == pytest.approx(20.0)
    # the same backlog under the latency objective starts as soon as the stable group is there
    latency = make_pipeline("adaptive_latency", **{"control.adaptive": True, "control.epoch_files": 4,
                                                   "control.group_epochs": 1, "control.freshness_sla_s": 60})
    assert adaptive.decide(latency, log, 30, oldest_age_s=1.0, mtimes=mtimes).fire == "efficient group"


def test_objective_cost_needs_adaptive_control():
    from sluice.spec import SpecError

    with pytest.raises(SpecError, match=r"objective: cost .* adaptive: true"):
        make_pipeline("adaptive_cost_fixed", **{"control.objective": "cost"})


def test_why_a_group_started_is_recorded_with_it(log):
    from sluice.protocol.run import SensedPlan

    spec = make_pipeline("adaptive_why", **{"control.epoch_files": 3, "control.group_epochs": 5,
                                            "control.freshness_sla_s": 60})
    waiting = adaptive.decide(spec, log, 14, 10.0, [1.0] * 14).started
    assert waiting.rule is None and "14 of 15 files" in waiting.explanation
    late = adaptive.decide(spec, log, 14, 60.0, [1.0] * 14).started
    assert late.rule == "freshness" and late.oldest_age_s == 60.0 and "60 s freshness SLA" in late.explanation
    verdict = adaptive.decide(spec, log, 15, 10.0, [1.0] * 15)
    assert verdict.started.rule == "efficient group" and (verdict.started.backlog_files,
                                                          verdict.started.group_files) == (15, 15)
    # the sensor's plan reaches the group's record through the plan step's XCom
    sensed = SensedPlan.fired(json.loads(json.dumps(verdict.plan())), None, {})
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, 100.0 + i) for i in range(15)])
    group = plan_group(log, acquire_lease(log, spec.name, "run"), epoch_size=3, k=5,
                           plan={**sensed.measured(), "reason": sensed.reason})
    started = log.group_plans(spec.name)[group.group_id]["started"]
    assert started == verdict.started.as_record()
    assert started["explanation"] == "the backlog (15 files) filled the planned group (15 files)"


def test_a_probe_epoch_travels_from_the_verdict_to_the_epochs_ranges(log):
    """The controllers' one probe epoch (``Decision.first_size``) reaches the store through the
    sensor's XCom: the group's first epoch holds the probe, the others the measured size, the
    plan records it; a run's own ``epoch_size`` or ``k`` holds for every epoch (no probe)."""
    from sluice.control import Decision
    from sluice.protocol.run import SensedPlan

    spec = make_pipeline("adaptive_probe", **{"control.freshness_sla_s": 600})
    decision = Decision(4, 3, 2, "catch-up; one probe epoch of 10 files, then 2 of 4", 60.0, first_size=10)
    assert decision.group_files == 18 and decision.epoch_files() == (10, 4, 4)
    started = adaptive.StartReason("efficient group", "latency", 30, decision.group_files, 5.0, 60.0, 600.0)
    verdict = adaptive.Verdict(decision, "efficient group", 100.0, 1.0, started)
    sensed = SensedPlan.fired(json.loads(json.dumps(verdict.plan())), None, {})
    assert sensed.first_size == 10
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, 100.0 + i) for i in range(30)])
    group = plan_group(log, acquire_lease(log, spec.name, "run"), epoch_size=sensed.epoch_size, k=sensed.k,
                       plan={**sensed.measured(), "reason": sensed.reason}, first_size=sensed.first_size)
    ranges = [(e.start, e.end) for e in log.epochs(spec.name) if e.group_id == group.group_id]
    assert [end - start for start, end in ranges] == [10, 4, 4], ranges  # 18 of the 30 files, in order
    assert log.group_plans(spec.name)[group.group_id]["first_size"] == 10
    assert SensedPlan.fired(verdict.plan(), None, {"k": 5}).first_size is None


def test_a_burst_that_ended_drains_without_waiting_for_the_sla(log):
    spec = make_pipeline("adaptive_burst", **{"control.adaptive": True, "control.freshness_sla_s": 120,
                                              "control.poll_interval_s": 5})
    now = time.time()
    arriving = [now - 1 - i for i in range(16)]  # a file a second, the last one a second ago
    verdict = adaptive.decide(spec, log, 16, oldest_age_s=16.0, mtimes=arriving)
    # nothing measured: 20 s of fixed cost makes 22 files the first stable group; 16 are not enough
    assert verdict.decision.group_files == 22 and verdict.fire is None
    assert not adaptive.arrivals_paused(spec, arriving, verdict.file_rate, now=now)
    ended = [m - 15 for m in arriving]  # the same burst, over for 16 s (3 gaps, 2 polls: 10 s)
    verdict = adaptive.decide(spec, log, 16, oldest_age_s=31.0, mtimes=ended)
    assert verdict.file_rate > 0 and verdict.decision.reason.startswith("arrivals stopped")
    assert verdict.fire == "drain" and verdict.decision.group_files >= 16


def test_only_the_controllers_own_sizes_teach_slow_start():
    from sluice.control.planner import adaptive_reason

    assert adaptive_reason("efficient group: slow start (1/5 sizes)") and adaptive_reason("scheduled: stable")
    for reason in ("efficient group: catch-up", "freshness: slow start (2/5 sizes)",
                   "drain: arrivals stopped or paused: the whole backlog in one group",
                   "freshness: deadline: the whole backlog in one group", "retry the unfinished epochs [3]"):
        assert not adaptive_reason(reason), reason


def test_the_cost_model_learns_from_the_records_read_not_the_guessed_rate(log):
    """Before any epoch ran, the rate is a guess (one record per file); the first group's cost
    samples must use the records its epochs read, or the next group's size is off by 1000x."""
    spec = make_pipeline("adaptive_records", **{"control.adaptive": True})
    log.register_files(spec.name, [(f"/l/f{i}.json", 10, 100.0 + i) for i in range(4)])
    lease = acquire_lease(log, spec.name, "run")
    group = plan_group(log, lease, epoch_size=2, k=2, plan={
        "reason": "efficient group: slow start", "partitions": 2, "fired_at": 1_000.0,
        "rate_rps": 1.0, "file_rate": 1.0})  # the guess: one record per file
    for e in group.epochs:
        log.mark_committed(lease, [(e, {}, {"input": 3000}, {"epoch_s": 4.0}, None)])
    adaptive.record_group(spec, log, log.finish_group(lease, group.group_id), now=1_030.0)
    state = adaptive.load_state(spec, log)
    assert state.epoch.epoch_cost() == (0.0, pytest.approx(4.0 / 3000))  # through the origin: one size seen
    # at 1,500 records a file, 1 file/s: 1 - 2.0 s of work per file < 0, nothing is stable -> the budget;
    # at 500 records a file: spare 1/3 s per file, F (26 s measured) + 2 s -> 84 files
    assert state.epoch.start_size(1500.0, 1.0, 26.0, cap=200) == 200
    assert state.epoch.start_size(500.0, 1.0, 26.0, cap=200) == 84


def test_fixed_sizes_predict_no_wall_before_a_group_was_measured(log):
    """The controllers' 20 s prior sizes adaptive groups; under fixed sizes it must not make a
    short SLA fire at once (the group's wall is only predicted from what was measured)."""
    fixed = make_pipeline("adaptive_fixed_wall", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                                    "control.freshness_sla_s": 5})
    verdict = adaptive.decide(fixed, log, 1, 0.0, [time.time()])
    assert verdict.decision.predicted_wall_s == 0.0 and verdict.fire is None


def test_a_drain_of_superlinear_work_takes_more_epochs_of_an_efficient_size(log):
    """Arrivals stopped with 500 files waiting, on a pipeline whose measured cost curve is a
    join's (cost per record lowest near 6,700 records, 1.5x that beyond about 17,500): the drain
    starts at once, in many epochs within the steep bound, not one 500-file epoch (the issue's
    runaway began with the whole backlog as one epoch)."""
    spec = make_pipeline("adaptive_drain_join", **{"control.adaptive": True, "control.freshness_sla_s": 300})
    state = adaptive.load_state(spec, log)
    for n in (2_000, 4_000, 8_000, 12_000, 16_000):  # 1,000 records a file
        state.epoch.curve.add(n, 2.1 + 4.7e-8 * n * n, 2)
    state.epoch.last_rate = (1000.0, 1.0)
    log.save_control_state(spec.name, state.to_dict())
    verdict = adaptive.decide(spec, log, backlog_files=500, oldest_age_s=400.0, mtimes=[1.0] * 500)
    d = verdict.decision
    assert verdict.fire == "drain" and d.reason.startswith("arrivals stopped")
    assert d.epoch_size * 1000 <= state.epoch.size_limit_records() < 20_000
    assert d.k > 1 and d.predicted_wall_s <= 300.0


def test_the_controllers_see_the_sla_and_the_backlog_records(log):
    """The freshness SLA bounds a group's predicted wall; a backlog whose files hold more than
    the rate says (Kafka's lag) sizes its epochs."""
    spec = make_pipeline("adaptive_sla", **{"control.adaptive": True, "control.freshness_sla_s": 40})
    state = adaptive.load_state(spec, log)
    for n in (10_000, 20_000, 40_000, 60_000):
        state.epoch.curve.add(n, 2 + 5e-4 * n, 2)
    log.save_control_state(spec.name, state.to_dict())
    now = time.time()
    mtimes = [now - i for i in range(100)]
    verdict = adaptive.decide(spec, log, 100, oldest_age_s=100.0, mtimes=mtimes, backlog_records=100 * 3000)
    assert verdict.decision.predicted_wall_s <= 40.0
    assert verdict.decision.epoch_size * 3000 <= state.epoch.size_limit_records()


def _land_lines(folder: Path, name: str, rng, records: int) -> int:
    """A JSON-lines file of ``records`` records of random length; returns its line count as
    written (the oracle: counted here, not by any sluice reader)."""
    lines = [json.dumps({"ad_id": f"a{i}", "pad": "x" * int(rng.integers(20, 120))}) for i in range(records)]
    (folder / name).write_text("".join(line + "\n" for line in lines))
    return len(lines)


def test_a_file_backlog_is_counted_in_records_by_its_bytes(log):
    """After a quiet spell of sparse files, a burst's dense files wait: the controllers see what
    they hold (their bytes at the records per byte read so far), not the last epochs' average
    per file, which is 20x too small here. Seeded; 0.1 s."""
    import numpy as np

    from sluice.sources import source_for

    seed = int(time.time()) % 10_000
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    spec = make_pipeline("adaptive_bytes", **{"control.adaptive": True})
    spec.landing_dir.mkdir(parents=True, exist_ok=True)
    source = source_for(spec, log)
    sparse = [_land_lines(spec.landing_dir, f"a{i:03d}.json", rng, int(rng.integers(5, 15))) for i in range(8)]
    source.discover()
    lease = acquire_lease(log, spec.name, "run")
    group = plan_group(log, lease, epoch_size=4, k=2, plan={"reason": "test", "partitions": 2})
    log.mark_committed(lease, [(e, {}, {"input": sum(sparse[e.start:e.end])}, {"epoch_s": 1.0}, None)
                               for e in group.epochs])
    log.finish_group(lease, group.group_id)
    log.release_lease(lease)
    dense = [_land_lines(spec.landing_dir, f"b{i:03d}.json", rng, int(rng.integers(150, 250))) for i in range(6)]

    backlog = source.backlog()
    assert backlog.files == 6 and backlog.records is None
    estimate = adaptive.backlog_records(spec, log, backlog)
    assert estimate == pytest.approx(sum(dense), rel=0.1), (estimate, sum(dense))
    assert adaptive.records_per_file(spec, log) * 6 < sum(dense) / 5  # what the average would have said
    # a source that counts its records (Kafka's lag) is taken at its word
    assert adaptive.backlog_records(spec, log, replace(backlog, records=1234)) == 1234.0
    # and the decision sizes the drain by them: nothing arrived lately, so no rate is measured
    verdict = adaptive.decide_backlog(spec, log, replace(backlog, arrivals=()))
    assert "sized by the backlog's records" in verdict.decision.reason, verdict.decision
