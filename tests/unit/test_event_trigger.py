"""When the event trigger of a ``@backlog`` pipeline creates a DAG run (pure rule)."""

from __future__ import annotations

from sluice.airflow.triggers import should_fire


def test_fires_on_ready_data_when_no_run_is_active():
    assert should_fire(True, 0, next_offset=0, fired=None, now=100.0, settle_s=120)
    assert not should_fire(False, 0, next_offset=0, fired=None, now=100.0, settle_s=120)
    assert not should_fire(True, 1, next_offset=0, fired=None, now=100.0, settle_s=120), "a run is queued or running"


def test_fires_once_per_backlog_until_it_settles():
    fired = (4, 100.0)
    # The run it created may not be visible yet, and the backlog looks the same until it plans.
    assert not should_fire(True, 0, next_offset=4, fired=fired, now=110.0, settle_s=120)
    assert should_fire(True, 0, next_offset=8, fired=fired, now=110.0, settle_s=120), "new data was planned since"
    # That run died before planning: the same backlog gets a new run once the wait has passed.
    assert should_fire(True, 0, next_offset=4, fired=fired, now=221.0, settle_s=120)
    # Airflow could not be asked (None): memory alone decides.
    assert should_fire(True, None, next_offset=8, fired=fired, now=110.0, settle_s=120)
