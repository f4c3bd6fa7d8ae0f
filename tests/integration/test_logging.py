"""A group's log shows sluice's own lines, not the libraries' INFO chatter (Great Expectations
wrote ~200 lines when imported, py4j one per connection), and SLUICE_LOG_LEVEL=DEBUG brings
them back."""

from __future__ import annotations

import logging
import re

from tests.integration.test_exactly_once import GroupJob
from tests.pipelines import land, make_pipeline

LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<message>.*)$")


def test_a_group_under_spark_submit_logs_sluice_lines_and_no_library_info(spark):
    spec = make_pipeline("quiet_logs", base="ysb_clean", **{"control.epoch_files": 2, "control.group_epochs": 2})
    land(spec, files=4, malformed_fraction=0.05)
    out, err = GroupJob(spec.name, "--plan", "--drain").communicate(timeout=600)
    records = [m.groupdict() for m in map(LINE.match, err.splitlines()) if m]
    library_info = [r for r in records if not r["logger"].startswith("sluice") and r["level"] in ("INFO", "DEBUG")]
    assert not library_info, f"{len(library_info)} library lines, e.g. {library_info[:3]}"
    sluice = [r["message"] for r in records if r["logger"].startswith("sluice")]
    assert any("planned group 0" in m for m in sluice), sluice
    assert any("committed in one commit per table" in m for m in sluice), sluice
    assert '"state": "published"' in out.splitlines()[-1], "the job's last line is its JSON summary"


def test_verbose_brings_the_libraries_back(monkeypatch):
    from sluice.logs import LIBRARIES, quiet_libraries

    try:
        quiet_libraries(verbose=False)
        assert all(logging.getLogger(n).getEffectiveLevel() == logging.WARNING for n in LIBRARIES)
        monkeypatch.setenv("SLUICE_LOG_LEVEL", "debug")
        quiet_libraries()
        assert all(logging.getLogger(n).level == logging.NOTSET for n in LIBRARIES)
    finally:
        quiet_libraries(verbose=True)
