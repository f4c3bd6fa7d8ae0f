"""JIT by size (``sluice.control.jit``, ``Source.group_records``, ``sluice.spark.group_compiler``):
a run-once driver gets C2 only for a group at or above the measured break-even, counted from the
manifest and the pipeline's published epochs. No Spark; cost: under 1 s."""

from __future__ import annotations

import random

import pytest

from sluice.control import jit
from sluice.control.jit import compiler_for, estimate_records
from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.spark import group_compiler, run_once_java_options
from sluice.spec import load_spec
from sluice.store import EpochStore

NAME = "jit_test"


def test_the_compiler_is_c2_only_at_or_above_the_break_even():
    assert compiler_for(None) == "c1"
    assert compiler_for(999, 1000) == "c1"
    assert compiler_for(1000, 1000) == "c2"
    assert compiler_for(10**9, None) == "c1", "no break-even measured: C2 never pays back"
    assert "-XX:TieredStopAtLevel=1" in run_once_java_options("c1")
    assert "TieredStopAtLevel" not in run_once_java_options("c2")


def test_records_are_estimated_from_chunk_sizes_or_the_published_bytes_per_record():
    rng = random.Random(5)
    sizes = [rng.randrange(1, 10_000) for _ in range(7)]
    assert estimate_records(sizes, sizes_are_records=True) == sum(sizes)
    assert estimate_records(sizes, sizes_are_records=False) is None, "bytes with no history: unknown"
    history = [(rng.randrange(1_000, 90_000), rng.randrange(10, 900)) for _ in range(5)]
    per_record = sum(b for b, _ in history) / sum(r for _, r in history)
    assert estimate_records(sizes, sizes_are_records=False, history=history) == round(sum(sizes) / per_record)
    assert estimate_records(sizes, sizes_are_records=False, history=[(0, 5), (100, 0)]) is None


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "specs" / f"{NAME}.yaml"
    path.parent.mkdir()
    landing = tmp_path / "landing"
    landing.mkdir()
    path.write_text(f"""\
source:
  path: {landing}
  format: json
  schema: {{id: string, n: long}}
transform: demo.clean
sinks:
  - name: out
    mode: append
    path: {tmp_path}/tables/out
""")
    return load_spec(path)


def test_a_group_gets_c2_once_its_files_hold_more_records_than_the_break_even(spec, tmp_path, monkeypatch):
    """Two published one-file epochs of 100 bytes per record, then a planned group of three
    files: its estimate is their bytes / 100, and the driver's compiler flips at that count."""
    store = EpochStore(f"sqlite:///{tmp_path}/s.db")
    try:
        sizes = [5_000, 7_000, 20_000, 30_000, 40_000]
        store.register_files(NAME, [(f"/in/{i}.json", size, 1000.0 + i) for i, size in enumerate(sizes)])
        lease = acquire_lease(store, NAME, "run")
        first = plan_group(store, lease, epoch_size=1, k=2)
        assert group_compiler(spec, store) == "c1", "nothing published: the size is unknown"
        store.start_attempt(lease, first.epochs)
        store.mark_committed(lease, [(e, {}, {"input": size // 100}, {}, None)
                                     for e, size in zip(first.epochs, sizes, strict=False)])
        store.finish_group(lease, first.group_id)
        second = plan_group(store, lease, epoch_size=3, k=1)
        expected = sum(sizes[2:]) // 100  # computed here from the bytes: 900 records
        monkeypatch.setattr(jit, "C2_BREAK_EVEN_RECORDS", expected + 1)
        assert group_compiler(spec, store) == "c1"
        monkeypatch.setattr(jit, "C2_BREAK_EVEN_RECORDS", expected)
        assert group_compiler(spec, store) == "c2"
        assert group_compiler(spec, store, first.group_id) == "c1", "the named group, not the latest"
        assert group_compiler(spec, store, second.group_id) == "c2"
        assert group_compiler(spec, store, 99) == "c1", "an unknown group keeps C1 and fails nothing"
    finally:
        store.close()


def test_the_submit_task_gives_a_large_planned_group_c2s_options(spec, tmp_path, monkeypatch):
    """``RunGroupSubmitOperator`` swaps the DAG's C1 options for C2's when the planned group (the
    plan's XCom) is at or above the break-even, and leaves a spec's own options alone."""
    from sluice.airflow.submit import RunGroupSubmitOperator
    from sluice.spark import RUN_ONCE_C2_JAVA_OPTIONS, RUN_ONCE_JAVA_OPTIONS

    url = f"sqlite:///{tmp_path}/s.db"
    monkeypatch.setenv("SLUICE_STORE_URL", url)
    monkeypatch.setattr("sluice.airflow.submit.get_spec", lambda name: spec)
    store = EpochStore(url)
    try:
        store.register_files(NAME, [(f"/in/{i}.json", 4_000, 1000.0 + i) for i in range(3)])
        lease = acquire_lease(store, NAME, "run")
        first = plan_group(store, lease, epoch_size=1, k=1)
        store.start_attempt(lease, first.epochs)
        store.mark_committed(lease, [(first.epochs[0], {}, {"input": 40}, {}, None)])
        store.finish_group(lease, first.group_id)
        second = plan_group(store, lease, epoch_size=2, k=1)  # 8,000 bytes at 100 per record: 80
    finally:
        store.close()

    class TI:
        def xcom_pull(self, task_ids):
            return {"group_id": second.group_id}

    def options(java: str, break_even: int) -> str:
        monkeypatch.setattr(jit, "C2_BREAK_EVEN_RECORDS", break_even)
        op = RunGroupSubmitOperator(task_id="run_group", pipeline=NAME, application="x.py",
                                    conf={"spark.driver.extraJavaOptions": f"{java} -Dx=1", "spark.other": "y"})
        op._choose_compiler(spec, {"ti": TI()})
        assert op.conf["spark.other"] == "y"
        return op.conf["spark.driver.extraJavaOptions"]

    assert options(RUN_ONCE_JAVA_OPTIONS, 81) == f"{RUN_ONCE_JAVA_OPTIONS} -Dx=1"
    assert options(RUN_ONCE_JAVA_OPTIONS, 80) == f"{RUN_ONCE_C2_JAVA_OPTIONS} -Dx=1"
    assert options("-Xss4m", 80) == "-Xss4m -Dx=1", "a spec's own JVM options are its own"
