"""Bad input loses nothing: a file that vanishes before its epoch runs stops the run with an
error naming the pipeline and the file, writes nothing, and the epoch reruns with the same
range once the file is back."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator

import pytest

from sluice import protocol
from sluice.errors import SourceError
from sluice.protocol.planning import halt_reason
from sluice.protocol.run import PipelineRun, run_once
from sluice.protocol.runtime import Runtime
from sluice.store import EpochStore
from tests.pipelines import assert_matches_oracle, invalid_lines, land, make_pipeline, rejected_lines


def test_vanished_file_fails_clearly_then_reruns_same_range(spark, tmp_path):
    log = EpochStore()
    spec = make_pipeline("vanished_file", **{"control.epoch_files": 2, "control.group_epochs": 2})
    files = land(spec, files=4, malformed_fraction=0.05)
    planned = PipelineRun(spec, log, "test-owner").plan()
    victim = files[2]  # in epoch 1
    stat = victim.stat()
    shutil.move(victim, tmp_path / victim.name)
    with pytest.raises(SourceError) as info:
        PipelineRun(spec, log, "test-owner", Runtime.spark(spark)).process(planned.group_id)
    message = str(info.value)
    assert "'vanished_file'" in message and str(victim) in message and "no longer in the landing folder" in message
    epochs = log.epochs(spec.name)
    # One commit per group: the group (epochs 0 and 1) fails as a whole, naming the file.
    assert epochs[0].state == protocol.FAILED and epochs[1].state == protocol.FAILED
    assert str(victim) in epochs[1].error
    PipelineRun(spec, log, "test-owner").release()
    shutil.move(tmp_path / victim.name, victim)
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    run_once(spec, log, spark, drain=True)
    after = log.epochs(spec.name)
    assert [(e.start, e.end) for e in after] == [(e.start, e.end) for e in epochs], "ranges never change"
    assert_matches_oracle(spark, spec, log)


def test_csv_source_reports_bad_rows_with_file_and_line(spark):
    """The same contract for CSV: a row that does not parse goes to _rejected with its line."""
    spec = make_pipeline("csv_source", base="ysb_clean",
                         **{"source.format": "csv", "source.pattern": "*.csv"})
    header = "user_id,page_id,ad_id,ad_type,event_type,event_time,ip_address"
    good = "u1,p1,a1,banner,view,1767225600000,1.2.3.4"
    (spec.landing_dir / "a.csv").write_text(f"{header}\n{good}\nu2,p2,,banner,view,1767225600001,1.2.3.4\n"
                                            f"{good}\nu3,p3,a3,banner,view,yesterday,1.2.3.4\n")
    log = EpochStore()
    run_once(spec, log, spark, drain=True)
    rows = spark.read.format("delta").load(spec.sinks[0].path).collect()
    assert len(rows) == 2 and all(r["ad_id"] == "a1" for r in rows)
    rejected = {(r["line"], r["reason"].split(":")[0]) for r in spark.read.format("delta").load(spec.rejected_table)
                .collect()}
    assert rejected == {(3, "missing required field 'ad_id'"), (5, "failed check 'event_time_is_epoch_ms'")}


def test_bad_files_go_to_rejected_line_by_line_and_nothing_halts(spark):
    """Zero-byte, a Latin-1 line, JSON arrays, one 50 MB line (a file read line by line) and a
    2 MiB line (a file read whole) among good files: every bad line is in _rejected with its
    file, line and defect, the rest equals the oracle, and the pipeline is not halted."""
    spec = make_pipeline("bad_files", **{"control.epoch_files": 3, "control.group_epochs": 4})
    good = land(spec, files=3, malformed_fraction=0.02)
    lines = good[0].read_text().splitlines()
    folder = spec.landing_dir
    (folder / "bad-empty.json").write_bytes(b"")
    (folder / "bad-latin1.json").write_bytes("\n".join(lines[:3]).encode() + b'\n{"ad_id": "caf\xe9"}\n'
                                             + "\n".join(lines[3:6]).encode() + b"\n")
    (folder / "bad-arrays.json").write_text("\n".join(f"[{line}]" for line in lines[:4]) + "\n" + lines[4] + "\n")
    huge = '{"ad_id": "' + "x" * (50 * 1024 * 1024) + '"}'
    (folder / "bad-huge.json").write_text(lines[0] + "\n" + huge + "\n" + lines[1] + "\n")
    (folder / "bad-big-line.json").write_text(lines[2] + "\n\n" + '{"ad_id": "' + "y" * (2 * 1024 * 1024) + '"}\n'
                                              + lines[3] + "\n")
    log = EpochStore()
    run_once(spec, log, spark, drain=True)
    assert_matches_oracle(spark, spec, log)
    assert halt_reason(log, spec.name, spec.control.max_attempts, 10) is None
    rows = spark.read.format("delta").load(spec.rejected_table).collect()
    by_file = {}
    for r in rows:
        by_file.setdefault(os.path.basename(r["file"]), []).append((r["line"], r["reason"], len(r["record"])))
    assert by_file["bad-huge.json"] == [(2, f"malformed record: record of {len(huge)} bytes exceeds "
                                            "source.max_record_bytes = 1048576", 1024)]
    assert [(line, len_) for line, _, len_ in by_file["bad-big-line.json"]] == [(3, 1024)]
    assert [line for line, reason, _ in by_file["bad-latin1.json"] if "not UTF-8" in reason] == [4]
    assert sorted(line for line, reason, _ in by_file["bad-arrays.json"] if "JSON array" in reason) == [1, 2, 3, 4]
    assert "bad-empty.json" not in by_file
    # Each rejected record carries the epoch of its file (a group reads several epochs in one
    # scan, whole files and one read line by line): the manifest's order is modification time,
    # then path, and the group's epochs take 3 files each.
    landed_files = sorted((f for f in folder.iterdir() if f.is_file()), key=lambda f: (f.stat().st_mtime, str(f)))
    epoch_of = {f.name: i // 3 for i, f in enumerate(landed_files)}
    assert len({e.group_id for e in log.epochs(spec.name)}) == 1 and len(log.epochs(spec.name)) == 3
    assert {(os.path.basename(r["file"]), r["epoch"]) for r in rows} == {
        (name, epoch_of[name]) for name in by_file}


def test_files_read_line_by_line_in_several_blocks_report_each_bad_line_exactly(spark, monkeypatch):
    """Files read line by line (above the whole-file limit) and split into several blocks (the
    splits of one file go to different tasks): every rejected record's file and line equal the
    raw files' (numbered without a shuffle: block by block, from each block's first row), its
    epoch is its file's, and the table equals the oracle."""
    from sluice.sources import files as file_source

    spec = make_pipeline("line_blocks", **{"control.epoch_files": 2, "control.group_epochs": 3})
    paths = land(spec, files=6, rate_per_file=1500, malformed_fraction=0.02)
    monkeypatch.setattr(file_source, "WHOLE_FILE_MAX_BYTES", 1024)  # every file read line by line
    before = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "65536")  # ~5 blocks per file
    try:
        assert min(p.stat().st_size for p in paths) > 3 * 65536, "each file spans several blocks"
        log = EpochStore()
        run_once(spec, log, spark, drain=True)
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", before)
    assert_matches_oracle(spark, spec, log)
    rejected = rejected_lines(spark, spec)
    expected = {(str(p), n) for p, n in invalid_lines(paths)}
    assert len(expected) > 20 and len(rejected) == len(set(rejected)) and set(rejected) == expected
    order = sorted(paths, key=lambda f: (f.stat().st_mtime, str(f)))
    epochs = {(r["file"], r["epoch"]) for r in spark.read.format("delta").load(spec.rejected_table).collect()}
    assert epochs == {(str(p), order.index(p) // 2) for p in {p for p in paths if str(p) in {f for f, _ in rejected}}}


def test_epochs_bounded_in_bytes_hold_files_up_to_the_bound_and_equal_the_oracle(spark):
    """`control.epoch_max_bytes`: small and large files mixed; every epoch stays within the
    bound (a file larger than it is an epoch alone), and the table equals the oracle."""
    spec = make_pipeline("bytes_bound", **{"control.epoch_files": 4, "control.group_epochs": 8,
                                           "control.epoch_max_bytes": "40KiB", "spark.mode": "in_process"})
    land(spec, files=3, rate_per_file=60, seed=31)
    land(spec, files=2, rate_per_file=400, seed=32)  # each above 40 KiB
    land(spec, files=3, rate_per_file=60, seed=33)
    log = EpochStore()
    try:
        run_once(spec, log, spark, drain=True)
        sizes = {e.path: e.size for e in log.manifest(spec.name)}
        epochs = log.epochs(spec.name)
        held = [[e.size for e in log.manifest(spec.name, ep.start, ep.end)] for ep in epochs]
        assert sum(map(len, held)) == len(sizes) == 8
        assert all(len(h) == 1 or sum(h) <= 40 * 1024 for h in held), held
        assert any(len(h) == 1 and h[0] > 40 * 1024 for h in held), "the large files are epochs alone"
        assert len(epochs) > 2, "4 files per epoch alone would have made 2 epochs"
        assert_matches_oracle(spark, spec, log)
    finally:
        log.close()


def test_a_file_landed_again_under_its_name_with_new_content_is_processed(spark, tmp_path):
    """A daily export overwrites yesterday's file under the same name: the new content is new
    data (never skipped as "seen"), the old rows stay, and the table equals the oracle over both
    contents; the new content's bad lines are rejected under its kept copy."""
    from include.generators.ysb import expected_window_counts
    from tests.pipelines import landed, table_counts

    spec = make_pipeline("relanded", **{"control.epoch_files": 2, "control.group_epochs": 2,
                                        "spark.mode": "in_process"})
    land(spec, files=3, seed=41, malformed_fraction=0.05)
    log = EpochStore()
    try:
        run_once(spec, log, spark, drain=True)
        first = expected_window_counts(landed(spec))
        assert table_counts(spark, spec) == first
        victim = landed(spec)[1]
        fresh = land(make_pipeline("relanded_src"), files=1, seed=42, malformed_fraction=0.1)[0]
        shutil.copyfile(fresh, tmp_path / "new.json")
        os.replace(tmp_path / "new.json", victim)  # atomically, as a writer should
        os.utime(victim, (victim.stat().st_mtime + 60, victim.stat().st_mtime + 60))
        run_once(spec, log, spark, drain=True)
        assert table_counts(spark, spec) == first + expected_window_counts([victim])
        kept = [e.path for e in log.manifest(spec.name) if "/_sluice/relanded/" in e.path]
        assert len(kept) == 1 and log.manifest(spec.name)[-1].path == kept[0]
        assert invalid_lines([victim]) and {n for p, n in rejected_lines(spark, spec) if p == kept[0]} == {
            n for _, n in invalid_lines([victim])}
    finally:
        log.close()


def read_both_ways(spark, source, end: int, monkeypatch) -> Iterator[tuple[str, list]]:
    """The records of offsets ``[0, end)`` read whole, then line by line (every file above the
    whole-file limit)."""
    from sluice.sources import files as file_source

    for how, whole_max in (("whole", file_source.WHOLE_FILE_MAX_BYTES), ("line by line", 0)):
        with monkeypatch.context() as m:
            m.setattr(file_source, "WHOLE_FILE_MAX_BYTES", whole_max)
            yield how, source.read(spark, 0, end).collect()


def test_a_byte_order_mark_is_not_read_and_a_file_changed_under_a_lazy_read_fails(spark, monkeypatch):
    """A UTF-8 byte-order mark (Excel's "CSV UTF-8", Notepad) does not make a file's first record
    malformed, whether the file is read whole or line by line; and a file appended to after
    ``check_retained`` but before Spark reads it fails the read, naming it. Cost: three reads of
    two tiny files through the session's Spark (about 4 s after its start, on 2 cores); no table is
    written."""
    from pyspark.errors import PySparkException

    from sluice.sources import FileSource

    spec = make_pipeline("bom_input", **{"source.settle_s": 0})
    paths = land(spec, files=2, rate_per_file=3)
    first = {}
    for path in paths:
        first[str(path)] = json.loads(path.read_text().splitlines()[0])["ad_id"]
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    log = EpochStore()
    try:
        source = FileSource(spec, log)
        assert source.discover() == 2
        for how, rows in read_both_ways(spark, source, 2, monkeypatch):
            assert {r["_file"]: (r["ad_id"], r["_corrupt_record"], r["_defect"]) for r in rows
                    if r["_line"] == 1} == {p: (ad, None, None) for p, ad in first.items()}, how
        lazy = source.read(spark, 0, 2)  # checked now, read at collect()
        with open(paths[0], "ab") as fh:
            fh.write(b'{"ad_id": "late"}\n')
        with pytest.raises(PySparkException, match=re.escape(f"file {paths[0]} was read with")):
            lazy.collect()
    finally:
        log.close()


def test_crlf_and_lf_files_read_whole_and_line_by_line_give_the_raw_lines(spark, monkeypatch):
    """Files with Windows line ends (CRLF), Unix ones without a last line end, and one ending in
    a lone CR give, read whole and line by line alike, each raw line once under its number: a
    line's end is never part of its record (nor of a malformed record's text in ``_rejected``).
    The oracle is Python's ``splitlines`` of the raw bytes. Cost: two reads of three tiny files
    through the session's Spark (about 2 s on 2 cores); no table is written."""
    from sluice.sources import FileSource

    spec = make_pipeline("line_ends", **{"source.settle_s": 0})
    paths = land(spec, files=3, rate_per_file=4)
    for i, path in enumerate(paths):
        lines = path.read_text().splitlines()
        lines[1] = '{"ad_id": "cut'  # malformed, so its text is what _rejected keeps
        ends = ("\r\n".join(lines) + "\r\n", "\n".join(lines), "\r\n".join(lines) + "\r")[i]
        path.write_bytes(ends.encode())
    expected = {}
    for path in paths:
        for n, line in enumerate(path.read_bytes().decode().splitlines(), start=1):
            if line.strip():
                try:
                    expected[(str(path), n)] = (json.loads(line)["ad_id"], None)
                except ValueError:
                    expected[(str(path), n)] = (None, line)
    log = EpochStore()
    try:
        source = FileSource(spec, log)
        assert source.discover() == 3
        for how, rows in read_both_ways(spark, source, 3, monkeypatch):
            got = {(r["_file"], r["_line"]): (r["ad_id"], r["_corrupt_record"]) for r in rows}
            assert len(rows) == len(got) and got == expected, how
    finally:
        log.close()
