"""Skip a file that is gone or unreadable, on purpose and recorded (who, when, why).

    python jobs/skip_file.py --pipeline ysb --file <path> --reason "truncated upload"
    make skip-file PIPELINE=ysb FILE=<path> REASON="truncated upload"

The epoch holding the file reads around it from now on (reruns and rollback recomputes too);
failed epochs holding it get fresh attempts, so a pipeline halted on it runs again. The same
as triggering the ``sluice_skip_file`` DAG in the Airflow UI. No Spark is started.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "plugins") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins"))

from sluice import execution  # noqa: E402
from sluice.errors import SluiceError  # noqa: E402
from sluice.spec import get_spec  # noqa: E402
from sluice.store import EpochLog  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skip_file", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--file", required=True, help="the file's path (absolute, or relative to the landing folder)")
    parser.add_argument("--reason", required=True, help="why; recorded with who and when")
    parser.add_argument("--by", default=f"cli:{getpass.getuser()}", help="who skips it (default: cli:<user>)")
    parser.add_argument("--store-url", help="epoch store URL (default: $SLUICE_STORE_URL, else the usual lookup)")
    args = parser.parse_args(argv)
    spec = get_spec(args.pipeline)
    epoch_log = EpochLog(args.store_url or os.environ.get("SLUICE_STORE_URL"))
    try:
        report = execution.skip_file(spec, epoch_log, args.file, by=args.by, reason=args.reason)
    finally:
        epoch_log.close()
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SluiceError as exc:
        print(f"skip_file: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
