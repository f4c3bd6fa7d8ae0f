"""``ysb_downstream``: an example of a DAG downstream of a sluice table.

Scheduled on the ``ysb`` pipeline's table (its Asset, ``sluice/ysb/campaign_views``), it runs
after every change of that table and says what changed: a published group (``publish``), a
rollback that removed rows (``rollback``: which epochs, back to which Delta version, why), a
recompute or a recovery. Copy it to react to a sluice table in your own DAGs: a report that must
be redone after a rollback, a cache to invalidate. It starts paused, like every new DAG.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG, task

from sluice.airflow.operators import sink_asset
from sluice.errors import SpecError
from sluice.spec import get_spec

try:
    _spec = get_spec("ysb")
except SpecError:  # no ysb pipeline here: no example either
    _spec = None

if _spec is not None:
    with DAG(dag_id="ysb_downstream", schedule=[sink_asset(_spec.name, _spec.sinks[0])],
             start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False, tags=["sluice", "example"],
             doc_md=__doc__) as dag_ysb_downstream:

        @task
        def what_changed(triggering_asset_events: Any = None) -> list[dict[str, Any]]:
            changes = []
            for asset, events in (triggering_asset_events or {}).items():
                for event in events:
                    extra = dict(event.extra or {})
                    changes.append(extra)
                    if extra.get("change") == "rollback":
                        print(f"{asset.name}: rolled back to epoch {extra.get('to_epoch')} "
                              f"(epochs {extra.get('rolled_back_epochs')} removed, table restored to version "
                              f"{extra.get('restored_to_version')}): {extra.get('reason')}")
                    else:
                        print(f"{asset.name}: {extra.get('change', 'publish')} of epochs {extra.get('epochs')} "
                              f"(Delta version {extra.get('version')})")
            return changes

        what_changed()
