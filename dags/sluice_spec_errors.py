"""Shows broken pipeline specs in the Airflow UI as an import error of this file.

Every error names the spec file and the field (``ysb.yaml: invalid pipeline spec:
control.epoch_files: ...``); the valid pipelines' DAGs load from ``sluice_pipelines.py``.
"""

from __future__ import annotations

from sluice.errors import SpecError
from sluice.paths import pipelines_dir
from sluice.spec import load_spec

_errors = []
for _path in sorted(pipelines_dir().glob("*.yaml")):
    try:
        load_spec(_path)
    except SpecError as exc:
        _errors.append(str(exc))
if _errors:
    raise ImportError("broken pipeline specs: " + " | ".join(_errors))
