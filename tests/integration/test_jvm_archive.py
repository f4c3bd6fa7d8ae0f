"""The run-once drivers' class-data archive (``sluice.jvm_archive``), as ``make setup`` built it."""

from __future__ import annotations

from pathlib import Path


def test_run_once_driver_maps_the_archive(spark):
    """A run-once driver (the test session's JVM has the run-once options) maps the archive
    ``make setup`` built: the kernel lists the file among the JVM's mappings, so its classes
    came from it. A JDK or class path that no longer matches would leave it unmapped."""
    from sluice.jvm_archive import archive_path
    from sluice.spark import RUN_ONCE_JAVA_OPTIONS

    path = archive_path().resolve()
    assert path.is_file(), f"make setup builds {path}"
    options = spark.sparkContext.getConf().get("spark.driver.extraJavaOptions")
    assert RUN_ONCE_JAVA_OPTIONS in options and f"-XX:SharedArchiveFile={path}" in options, options
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    mapped = {line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
              if len(line.split(maxsplit=5)) == 6}
    assert str(path) in mapped, f"the driver JVM {pid} did not map {path}"
