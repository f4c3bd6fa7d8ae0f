"""Where sluice keeps things on disk: one place, overridable by environment variables."""

from __future__ import annotations

import os
from pathlib import Path

#: The repository root (``plugins/sluice/paths.py`` -> three levels up).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def project_root() -> Path:
    """Root of the sluice project (``$SLUICE_HOME`` or the checkout this file belongs to)."""
    return Path(os.environ.get("SLUICE_HOME", PROJECT_ROOT))


def data_dir() -> Path:
    """Git-ignored folder for landing data, Delta tables and the default store (``var/``)."""
    return Path(os.environ.get("SLUICE_DATA_DIR", project_root() / "var"))


def jars_dir() -> Path:
    return Path(os.environ.get("SLUICE_JARS_DIR", project_root() / "var" / "jars"))


def pipelines_dir() -> Path:
    return Path(os.environ.get("SLUICE_PIPELINES_DIR", project_root() / "include" / "pipelines"))
