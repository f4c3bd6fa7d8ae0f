"""SparkSession construction with Delta Lake, and the one-time fetch of the Delta jars.

The Delta jars are resolved once from Maven Central (through Spark's own Ivy resolver, so no
host name is configured here) into ``$SLUICE_JARS_DIR`` (default ``var/jars``). Every later
session puts those files on ``spark.jars``: no network is needed at run time.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.paths import jars_dir

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_VERSION = "4.4.0"  # Python package and jars must match; 4.4.1 jars are not on Maven Central
DELTA_PACKAGES = (
    f"io.delta:delta-spark_4.2_2.13:{DELTA_VERSION}",
    f"io.delta:delta-storage:{DELTA_VERSION}",
)
DELTA_JAR_NAMES = (f"delta-spark_4.2_2.13-{DELTA_VERSION}.jar", f"delta-storage-{DELTA_VERSION}.jar")

# Settings for a small local[*] session: no UI, few shuffle partitions (epochs are small),
# Delta's catalog and SQL extensions.
BASE_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2",
}


def delta_jars() -> list[str]:
    """Paths of the Delta jars; raises if ``make jars`` has not fetched them yet."""
    folder = jars_dir()
    paths = [folder / name for name in DELTA_JAR_NAMES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Delta jars missing: {', '.join(missing)}. Run `make jars` (needs Maven Central once)."
        )
    return [str(p) for p in paths]


def fetch_delta_jars() -> list[str]:
    """Resolve the Delta jars through Spark's Ivy once and copy them into the jars folder."""
    folder = jars_dir()
    if all((folder / name).is_file() for name in DELTA_JAR_NAMES):
        return delta_jars()
    from pyspark.sql import SparkSession

    folder.mkdir(parents=True, exist_ok=True)
    ivy = Path(tempfile.mkdtemp(prefix="sluice-ivy-"))
    try:
        spark = (
            SparkSession.builder.master("local[1]")
            .appName("sluice-fetch-jars")
            .config("spark.jars.packages", ",".join(DELTA_PACKAGES))
            .config("spark.jars.ivy", str(ivy))
            .config("spark.ui.enabled", "false")
            .getOrCreate()
        )
        spark.stop()
        for name in DELTA_JAR_NAMES:
            found = glob.glob(str(ivy / "jars" / f"*{name}"))
            if not found:
                raise FileNotFoundError(f"Ivy did not resolve {name} (looked in {ivy}/jars)")
            shutil.copy(found[0], folder / name)
    finally:
        shutil.rmtree(ivy, ignore_errors=True)
    return delta_jars()


def spark_conf(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The Spark settings sluice uses, for a builder or for ``spark-submit --conf``."""
    conf = dict(BASE_CONF)
    conf.update(extra or {})
    return conf


def get_session(app_name: str = "sluice", master: str | None = None,
                extra_conf: dict[str, str] | None = None) -> SparkSession:
    """Return the active SparkSession, or start one with Delta on the classpath.

    Under ``spark-submit`` the master and jars come from the command line and the session
    already exists; in-process (tests, the demo, ``@task``) a ``local[*]`` session is built.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    if not os.environ.get("SPARK_SUBMIT_PROCESS") and "spark.master" not in (extra_conf or {}):
        builder = builder.master(master or os.environ.get("SLUICE_SPARK_MASTER", "local[*]"))
    conf = spark_conf(extra_conf)
    conf.setdefault("spark.jars", ",".join(delta_jars()))
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


if __name__ == "__main__":  # python -m sluice.spark: used by `make jars`
    for path in fetch_delta_jars():
        print(path)
