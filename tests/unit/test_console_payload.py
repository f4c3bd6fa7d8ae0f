"""The console's payload (``sluice.api.app``: ``/control``, ``/epochs``, ``/groups``) against a
store the test writes (SQLite, no Spark, no Airflow server): each card reads one source of
truth, and what it says agrees with the store (issue 38 item 7). The route functions are called
directly; importing the app imports Airflow's API security module (~3 s, once)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sluice import freshness
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.store import EpochStore
from tests.pipelines import make_pipeline

app = pytest.importorskip("sluice.api.app")

SINK = "campaign_views"
PASSED = {SINK: {"success": True, "evaluated": 2, "failed": [], "quarantined": 0}}
FAILED = {SINK: {"success": False, "evaluated": 2, "failed": [{"expectation": "expect_x", "column": "c",
                                                                "unexpected_count": 3}], "quarantined": 0}}
#: What a group commit records as its timings (copied to each of its epochs by the group runner).
GROUP_TIMINGS = {"read_s": 1.0, "compute_s": 3.0, f"write_{SINK}_s": 0.5, "tables_wait_s": 0.2}


class Clock:
    """The writer's store clock (naive UTC), moved by the test."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at

    def tick(self, seconds: float) -> None:
        self.at += timedelta(seconds=seconds)


@pytest.fixture
def url(tmp_path: Path, monkeypatch) -> str:
    url = f"sqlite:///{tmp_path}/console.db"
    monkeypatch.setenv("SLUICE_STORE_URL", url)  # what the routes open
    return url


def commit(store: EpochStore, lease, epochs, outputs: list[int], validations: list, *, shared: bool) -> None:
    """Record a commit as the group runner does (``GroupRunner._record_commit``): a shared
    commit's output on its last epoch (0 on the others), its timings on each epoch."""
    first, last = epochs[0].epoch_id, epochs[-1].epoch_id
    records = []
    for i, e in enumerate(epochs):
        rows = {"input": 400, "rejected": 5, "quarantined": 0, "output": outputs[i], "commit": [first, last]}
        timings = dict(GROUP_TIMINGS, epoch_s=2.0, group_s=4.7, group_epochs=len(epochs)) if shared else \
            {"read_s": 0.4, "compute_s": 1.5, f"write_{SINK}_s": 0.3, "epoch_s": 2.1}
        records.append((e, {SINK: e.epoch_id + 1}, rows, timings, validations[i]))
    store.mark_committed(lease, records)


def build(url: str, name: str, files: int = 10, **overrides) -> tuple:
    """Five epochs in four groups, planned an hour ago, 20 s apart: group 0 (epochs 0-1, one
    shared commit, both passed), group 1 (epoch 2 alone, failed its suite under ``warn``: it
    was published), group 2 (epoch 3 alone, not validated). Returns the spec, the writer and
    its clock, and the lease; ``files`` beyond the first 8 wait in the backlog."""
    spec = make_pipeline(name, **{"control.epoch_files": 2, **overrides})
    t0 = datetime.now(UTC).replace(tzinfo=None) - timedelta(hours=1)
    clock = Clock(t0)
    store = EpochStore(url, clock=clock)
    arrived = t0.replace(tzinfo=UTC).timestamp() - 10
    store.register_files(spec.name, [(f"/landing/{name}/f{i}.json", 100, arrived + i) for i in range(files)])
    lease = acquire_lease(store, spec.name, "test-run")
    for k, outputs, validations, shared in ((2, [0, 90], [PASSED, PASSED], True), (1, [75], [FAILED], False),
                                            (1, [60], [None], False)):
        group = plan_group(store, lease, epoch_size=2, k=k)
        store.start_attempt(lease, group.epochs)
        clock.tick(8)
        commit(store, lease, list(group.epochs), outputs, validations, shared=shared)
        clock.tick(12)
        store.finish_group(lease, group.group_id)
    return spec, store, clock, lease


def test_rows_out_and_timings_belong_to_the_group_commit_once(url):
    spec, store, _, _ = build(url, "console_rows")
    epochs = {e["epoch_id"]: e for e in app.epochs(spec.name)}
    groups = {g["group_id"]: g for g in app.groups(spec.name)}
    assert sorted(epochs) == [0, 1, 2, 3] and sorted(groups) == [0, 1, 2]
    # Group 0 committed epochs 0 and 1 in one commit: no per-epoch count exists, so neither
    # epoch shows one (not the store's 0 on epoch 0), and the group shows the commit's 90 once.
    for i in (0, 1):
        assert epochs[i]["rows_out"] is None and epochs[i]["commit"] == {"first": 0, "last": 1}, epochs[i]
        assert epochs[i]["own_timings"] == {}, epochs[i]
    assert epochs[0]["rows"]["output"] == 0  # the store's record, as is
    assert groups[0]["rows_out"] == 90 and groups[0]["epoch_ids"] == [0, 1]
    assert groups[0]["timings"] == dict(GROUP_TIMINGS, group_s=4.7, group_epochs=2), groups[0]
    # Epochs committed alone keep their own count and timings; their group has no shared ones.
    assert (epochs[2]["rows_out"], epochs[3]["rows_out"]) == (75, 60)
    assert epochs[2]["commit"] is None and epochs[2]["own_timings"]["compute_s"] == 1.5
    assert (groups[1]["rows_out"], groups[1]["timings"], groups[2]["rows_out"]) == (75, None, 60)
    # Every row out is counted once: the groups add up to the store's total for the pipeline.
    assert sum(g["rows_out"] for g in groups.values()) == store.summary(spec.name)["rows"]["output"] == 225
    # The group's wall is planned (t) to published (t + 20 s); its processing counts the group's
    # compute and writes once (3.0 + 0.5), not once per epoch (7.0).
    assert groups[0]["wall_s"] == pytest.approx(20.0) and groups[0]["processing_s"] == pytest.approx(3.5)
    assert groups[0]["coordination_s"] == pytest.approx(16.5)
    assert groups[1]["processing_s"] == pytest.approx(1.8)  # its one epoch's compute and write
    store.close()


def test_a_page_of_epochs_and_groups_is_the_slice_of_the_whole_with_its_own_files(url):
    """A pipeline's epochs are never pruned, so the console reads pages: ``last`` epoch ids
    (below ``before``) with their files only, and the groups from ``since`` on. Each page is the
    matching slice of the whole payload; the files are those the test registered (8 files, 2 an
    epoch, from f0)."""
    spec, store, _, _ = build(url, "console_pages")
    whole = app.epochs(spec.name)
    assert sorted(e["epoch_id"] for e in whole) == [0, 1, 2, 3]
    for last, before in itertools.product([None, 0, 1, 2, 3, 5], [None, 0, 1, 3, 4, 9]):
        below = [e for e in whole if before is None or e["epoch_id"] < before]
        ids = sorted({e["epoch_id"] for e in below})
        kept = set(ids if last is None else ids[max(0, len(ids) - last):] if last else [])
        page = app.epochs(spec.name, last=last, before=before)
        assert page == [e for e in below if e["epoch_id"] in kept], (last, before)
    registered = [f"/landing/{spec.name}/f{i}.json" for i in (6, 7)]
    for e in app.epochs(spec.name, last=1):
        assert e["epoch_id"] == 3 and [f["path"] for f in e["files"]] == registered, e
    groups = app.groups(spec.name)
    for since in (0, 1, 2, 3):
        assert app.groups(spec.name, since=since) == [g for g in groups if g["group_id"] >= since]
    store.close()


def test_validation_outcomes_count_each_epoch_once(url):
    spec, store, _, lease = build(url, "console_validation", **{"validation.policy": "warn"})
    group = plan_group(store, lease, epoch_size=2, k=1)  # epoch 4: fails its suite, not committed
    store.start_attempt(lease, group.epochs)
    store.mark_failed(lease, list(group.epochs), "validation failed", validation=FAILED, rows={"input": 400})
    shown = app.epochs(spec.name)
    # What the test wrote, epoch by epoch (not derived from the payload).
    expected = {0: "passed", 1: "passed", 2: "failed", 3: None, 4: "failed"}
    assert {e["epoch_id"]: e["validation_outcome"] for e in shown} == expected
    live = [e for e in shown if e["live"]]
    counts = {o: sum(1 for e in live if e["validation_outcome"] == o) for o in ("passed", "failed", None)}
    assert counts == {"passed": 2, "failed": 2, None: 1} and len(live) == 5
    store.close()


def test_halted_is_one_record_for_both_cards(url):
    spec, store, _, lease = build(url, "console_halted")
    control = app.control(spec.name)
    assert control["halted"] is None and control["next"]["mode"] in ("start", "wait"), control["next"]
    assert "halted" not in control["next"]["reason"]
    # An epoch fails its suite under the ``fail`` policy: the pipeline is halted.
    group = plan_group(store, lease, epoch_size=2, k=1)
    store.start_attempt(lease, group.epochs)
    store.mark_failed(lease, list(group.epochs), "validation failed", validation=FAILED, rows={"input": 400})
    control = app.control(spec.name)
    assert control["halted"] and "epoch 4 failed validation" in control["halted"], control["halted"]
    nxt = control["next"]
    assert nxt["mode"] == "halted" and nxt["fire"] is None and nxt["started"]["rule"] is None, nxt
    assert nxt["reason"].startswith("halted: epoch 4 failed validation"), nxt["reason"]
    store.close()


def test_no_reason_reads_python_none(url):
    # Nothing waits and the sizes are fixed (control.adaptive: false): the sensor would not fire.
    spec, store, _, _ = build(url, "console_idle", files=8)
    nxt = app.control(spec.name)["next"]
    assert (nxt["mode"], nxt["fire"]) == ("wait", None), nxt
    assert nxt["reason"] == "waiting: fixed sizes (control.adaptive: false)", nxt["reason"]
    assert "None" not in nxt["started"]["explanation"], nxt
    store.close()
    # Two files have waited an hour (SLA 5 s): the sensor would start a group, and says why.
    spec, store, _, _ = build(url, "console_late")
    nxt = app.control(spec.name)["next"]
    assert (nxt["mode"], nxt["fire"]) == ("start", "freshness"), nxt
    assert nxt["reason"] == "freshness: fixed sizes (control.adaptive: false)", nxt["reason"]
    store.close()


def test_freshness_is_stale_iff_the_last_publish_is_older_than_the_sla(url):
    spec, store, clock, lease = build(url, "console_stale")  # SLA 5 s; last publish an hour ago
    last = max(e.published_at for e in store.epochs(spec.name)).replace(tzinfo=UTC).timestamp()
    control = app.control(spec.name)
    f = control["freshness"]
    age = control["now"] - last
    assert f["last_publish_age_s"] == pytest.approx(age, abs=0.06) and age > 3000
    assert f["stale"] is (age > f["sla_s"]) is True and f["sla_s"] == 5
    assert f["last_publish_at"] == datetime.fromtimestamp(last, UTC).isoformat().replace("+00:00", "Z")
    # A group published now (the writer's clock moved to the present): fresh.
    clock.at = datetime.now(UTC).replace(tzinfo=None)
    group = plan_group(store, lease, epoch_size=2, k=1)
    store.start_attempt(lease, group.epochs)
    commit(store, lease, list(group.epochs), [10], [PASSED], shared=False)
    store.finish_group(lease, group.group_id)
    f = app.control(spec.name)["freshness"]
    assert f["last_publish_age_s"] < f["sla_s"] and f["stale"] is False, f
    store.close()


def test_staleness_at_the_sla_boundary():
    t0 = datetime(2026, 1, 1)
    now = t0.replace(tzinfo=UTC).timestamp()
    from sluice.store import Epoch

    published = [Epoch("p", 0, 0, 0, 0, 1, "published", published_at=t0 - timedelta(seconds=30)),
                 Epoch("p", 1, 0, 0, 1, 2, "published", published_at=t0 - timedelta(seconds=10)),
                 Epoch("p", 2, 0, 1, 2, 3, "planned")]
    assert freshness.staleness(10, published, None, now).stale is False  # exactly the SLA old
    stale = freshness.staleness(9.9, published, 4.0, now)
    assert stale.stale and stale.age_s == 10 and "last publish 10 s ago, more than the 9.9 s SLA" in \
        stale.explanation()
    never = freshness.staleness(10, published[2:], None, now)
    assert never.age_s is None and not never.stale and "nothing published yet" in never.explanation()
    assert freshness.staleness(10, published[2:], 11.0, now).stale  # data waited longer than the SLA
