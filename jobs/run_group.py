"""Run-once Spark application of sluice: processes one group of epochs in one SparkSession.

    spark-submit jobs/run_group.py --pipeline ysb --group 3 --owner airflow:ysb:<run_id>
    python jobs/run_group.py --pipeline ysb --plan [--drain]     # plan + run + publish

With ``--group`` it runs a group that ``plan_group`` already wrote to the epoch log, under the
lease of ``--owner``; with ``--plan`` it takes the lease itself. The same code runs under
spark-submit (any master) and in-process. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
# The checkout's sluice first: spark-submit puts only this folder on sys.path, and the code it
# ships to executors (--py-files, a zip with sluice in it) ahead of PYTHONPATH.
if str(ROOT / "plugins") in sys.path:
    sys.path.remove(str(ROOT / "plugins"))
sys.path.insert(0, str(ROOT / "plugins"))

from sluice import execution  # noqa: E402
from sluice.errors import SluiceError  # noqa: E402
from sluice.logs import configure_job  # noqa: E402
from sluice.spark import get_session  # noqa: E402
from sluice.spec import get_spec  # noqa: E402
from sluice.store import EpochLog  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_group", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--group", help="run the group this owner planned (its id, or None when the plan "
                                        "step only recorded a rollback)")
    parser.add_argument("--owner", help="lease owner (default: this process)")
    parser.add_argument("--plan", action="store_true", help="plan the next group first, then publish it")
    parser.add_argument("--drain", action="store_true", help="with --plan: repeat until the backlog is empty")
    parser.add_argument("--epoch-size", type=int)
    parser.add_argument("-k", type=int)
    parser.add_argument("--plan-extra", type=json.loads, default=None,
                        help="with --plan: JSON recorded in the group's plan (the controllers' decision)")
    parser.add_argument("--store-url", help="epoch store URL (default $SLUICE_STORE_URL)")
    parser.add_argument("--verbose", action="store_true", help="log libraries' INFO lines too (Great Expectations, "
                                                                "py4j; also SLUICE_LOG_LEVEL=DEBUG)")
    args = parser.parse_args(argv)
    if (args.group is None) == (not args.plan):
        parser.error("give exactly one of --group or --plan")
    group_id = None if args.group in (None, "None", "") else int(args.group)
    configure_job(args.verbose)
    spec = get_spec(args.pipeline)
    epoch_log = EpochLog(args.store_url or os.environ.get("SLUICE_STORE_URL"))
    def spark() -> SparkSession:
        return get_session(f"sluice-{spec.name}", extra_conf=spec.spark.conf)

    if args.plan:  # plan first: a busy or idle pipeline is reported before a JVM starts
        result: object = execution.run_once(spec, epoch_log, spark, owner=args.owner, epoch_size=args.epoch_size,
                                            k=args.k, drain=args.drain, extra=args.plan_extra)
    else:
        result = execution.run(spec, epoch_log, args.owner or execution.cli_owner(), group_id, spark())
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SluiceError as exc:  # a clear one-line error (busy pipeline, bad spec, lost file)
        print(f"run_group: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
