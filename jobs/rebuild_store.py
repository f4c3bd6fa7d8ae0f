"""Rebuild a lost epoch store from the JSON epoch records next to a pipeline's tables.

    python jobs/rebuild_store.py --pipeline ysb [--store-url URL]      # make store-rebuild PIPELINE=ysb

The records (``<table>/_sluice/epochs/``, ``_sluice/rollbacks/``) give every published epoch
with its range, files, Delta versions and generation. Anything the tables hold beyond the last
published epoch (a group that committed but never published) is rolled back, so the next run
recomputes it: nothing is lost, nothing counted twice. Refuses to touch a store that already
holds the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "plugins") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins"))

from sluice import execution  # noqa: E402
from sluice.errors import SluiceError  # noqa: E402
from sluice.logs import configure_job  # noqa: E402
from sluice.spark import get_session  # noqa: E402
from sluice.spec import get_spec  # noqa: E402
from sluice.store import EpochLog  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rebuild_store", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--store-url", help="epoch store URL (default: $SLUICE_STORE_URL, else the usual lookup)")
    parser.add_argument("--verbose", action="store_true", help="log libraries' INFO lines too (Great Expectations, "
                                                                "py4j; also SLUICE_LOG_LEVEL=DEBUG)")
    args = parser.parse_args(argv)
    configure_job(args.verbose)
    spec = get_spec(args.pipeline)
    epoch_log = EpochLog(args.store_url or os.environ.get("SLUICE_STORE_URL"))
    spark = get_session(f"sluice-rebuild-{spec.name}", extra_conf=spec.spark.conf)
    try:
        report = execution.rebuild_store(spec, epoch_log, spark, execution.cli_owner())
    finally:
        spark.stop()
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SluiceError as exc:
        print(f"rebuild_store: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
