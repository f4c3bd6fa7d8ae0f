"""Where sluice keeps things on disk: one place, overridable by environment variables.

Two layouts, told apart by the root's contents:

* **a checkout** (this repository: ``make demo``): specs in ``include/pipelines/``, transforms in
  ``jobs/transforms/``, data under ``var/``;
* **a folder of pipeline specs** (``pip install sluice``, then ``sluice init`` in Airflow's DAGs
  folder): the root is that folder, with the specs (``*.yaml``) and ``transforms/`` in it; data
  goes under ``$AIRFLOW_HOME/sluice``.

The root is ``$SLUICE_HOME``, else the checkout this package sits in, else Airflow's DAGs folder.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
#: What spark-submit needs next to its application: ``run_group.py``, the FAIR pools, log4j2
#: settings. Its own folder: spark-submit puts it first on ``sys.path`` (see run_group.py).
JOBS_DIR = PACKAGE_DIR / "jobs"
RUN_GROUP_APP = JOBS_DIR / "run_group.py"
#: The repository root when this package is ``plugins/sluice`` of a checkout.
PROJECT_ROOT = PACKAGE_DIR.parents[1]


def _is_checkout(root: Path) -> bool:
    return (root / "include" / "pipelines").is_dir()


def _path(value: str | Path) -> Path:
    """As Airflow reads its paths: ``~`` and ``$VARS`` expanded."""
    return Path(os.path.expanduser(os.path.expandvars(str(value))))


def airflow_home() -> Path:
    return _path(os.environ.get("AIRFLOW_HOME", "~/airflow"))


def dags_folder() -> Path:
    """Airflow's DAGs folder: ``$AIRFLOW__CORE__DAGS_FOLDER``, else Airflow's configuration."""
    if "AIRFLOW__CORE__DAGS_FOLDER" in os.environ:
        return _path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    try:
        from airflow.configuration import conf
    except ImportError:  # a Spark executor without Airflow: the default
        return airflow_home() / "dags"
    return _path(conf.get("core", "dags_folder"))


def project_root() -> Path:
    """Root of the sluice project: ``$SLUICE_HOME``, the checkout, or Airflow's DAGs folder."""
    if "SLUICE_HOME" in os.environ:
        return Path(os.environ["SLUICE_HOME"])
    return PROJECT_ROOT if _is_checkout(PROJECT_ROOT) else dags_folder()


def data_dir() -> Path:
    """Folder for landing data, Delta tables and the default store (``var/`` of a checkout)."""
    if "SLUICE_DATA_DIR" in os.environ:
        return Path(os.environ["SLUICE_DATA_DIR"])
    root = project_root()
    return root / "var" if _is_checkout(root) else airflow_home() / "sluice"


def jars_dir() -> Path:
    """The Delta and Kafka jars (``sluice jars`` fetches them; a checkout's stay in ``var/jars``
    whatever ``$SLUICE_DATA_DIR`` says, so test sessions share them)."""
    if "SLUICE_JARS_DIR" in os.environ:
        return Path(os.environ["SLUICE_JARS_DIR"])
    root = project_root()
    return root / "var" / "jars" if _is_checkout(root) else data_dir() / "jars"


def pipelines_dir() -> Path:
    if "SLUICE_PIPELINES_DIR" in os.environ:
        return Path(os.environ["SLUICE_PIPELINES_DIR"])
    root = project_root()
    return root / "include" / "pipelines" if _is_checkout(root) else root


def transforms_dir() -> Path:
    """The package ``transforms``: ``module.function`` in a spec names a module in it."""
    root = project_root()
    return root / "jobs" / "transforms" if _is_checkout(root) else root / "transforms"
