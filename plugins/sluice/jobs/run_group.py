"""spark-submit's application for one group of epochs: ``sluice run-group`` (``sluice.cli``).

    spark-submit .../sluice/jobs/run_group.py --pipeline ysb --group 3 --owner airflow:ysb:<run_id>

spark-submit runs a file, not a module, and puts this file's folder first on ``sys.path``; the
``sluice`` this file belongs to goes before any other copy (``PYTHONPATH``, the ``--py-files``
zip shipped to executors), so a checkout never runs with an installed release's code.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sluice.cli import main

if __name__ == "__main__":
    sys.exit(main(["run-group", *sys.argv[1:]]))
