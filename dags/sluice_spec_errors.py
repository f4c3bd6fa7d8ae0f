"""Shows broken pipeline specs in the Airflow UI as an import error of this file.

Every error names the spec file and the field (``ysb.yaml: invalid pipeline spec:
control.epoch_files: ...``), or the pipelines that write the same Delta table; the valid
pipelines' DAGs load from ``sluice_pipelines.py``.
"""

from __future__ import annotations

from sluice.spec import raise_spec_errors

raise_spec_errors()
