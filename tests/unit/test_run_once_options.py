"""Which JVM options a run-once driver gets, with and without the class-data archive."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def jars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLUICE_JARS_DIR", str(tmp_path))
    return tmp_path


def test_without_an_archive_the_run_once_options_alone(jars: Path) -> None:
    from sluice.spark import RUN_ONCE_JAVA_OPTIONS, spark_conf

    assert spark_conf()["spark.driver.extraJavaOptions"] == RUN_ONCE_JAVA_OPTIONS
    assert "spark.driver.extraJavaOptions" not in spark_conf(run_once=False)


def test_an_archive_is_shared_quietly_and_a_spec_may_replace_the_options(jars: Path) -> None:
    from sluice.jvm_archive import ARCHIVE_NAME
    from sluice.spark import RUN_ONCE_JAVA_OPTIONS, spark_conf

    (jars / ARCHIVE_NAME).write_bytes(b"not checked here: the JVM validates it and runs without a bad one")
    options = spark_conf()["spark.driver.extraJavaOptions"]
    assert options.startswith(RUN_ONCE_JAVA_OPTIONS)
    assert f"-XX:SharedArchiveFile={jars / ARCHIVE_NAME}" in options and "-Xlog:cds=off" in options
    assert spark_conf({"spark.driver.extraJavaOptions": "-Xmx1g"})["spark.driver.extraJavaOptions"] == "-Xmx1g"
