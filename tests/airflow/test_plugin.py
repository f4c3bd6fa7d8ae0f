"""Airflow's plugin loader finds the sluice plugin and does not shadow real packages.

It imports every ``.py`` under the plugins folder as a top-level module named after the file,
unless ``.airflowignore`` excludes it: without ``plugins/.airflowignore``,
``sluice/sinks/delta.py`` would replace delta-spark's ``delta`` package in every Airflow
process (a failure ``dag.test()`` shows only once a task has run)."""

from __future__ import annotations

import subprocess
import sys

from sluice.paths import project_root

PROBE = """
import sys
from airflow._shared.plugins_manager.plugins_manager import _load_plugins_from_plugin_directory
plugins, errors = _load_plugins_from_plugin_directory(sys.argv[1])
assert not errors, errors
assert [p.name for p in plugins] == ["sluice"], [p.name for p in plugins]
assert plugins[0].fastapi_apps[0]["url_prefix"] == "/sluice"
import delta.tables
shadowed = sorted(n for n, m in sys.modules.items() if "/plugins/sluice/" in (getattr(m, "__file__", "") or "")
                  and not n.startswith("sluice"))
assert not shadowed, shadowed
print("ok")
"""


def test_plugin_loads_alone_and_shadows_nothing():
    plugins = str(project_root() / "plugins")
    out = subprocess.run([sys.executable, "-c", PROBE, plugins], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": plugins})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
