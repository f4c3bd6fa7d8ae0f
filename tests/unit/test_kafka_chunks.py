"""The Kafka source's pure parts: chunks of a partition's offsets, their ranges per partition,
and the spec rules of a Kafka source (no broker, no Spark)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import yaml

from sluice.errors import SourceError, SpecError
from sluice.paths import project_root
from sluice.sources.kafka import Chunk, chunk_ranges, merge_adjacent, partition_ranges
from sluice.spec import load_spec


def test_offsets_are_cut_into_chunks_that_cover_them_once():
    assert chunk_ranges(0, 250, 100) == [(0, 100), (100, 200), (200, 250)]
    assert chunk_ranges(7, 7, 100) == []
    ranges = chunk_ranges(13, 1013, 37)
    assert ranges[0][0] == 13 and ranges[-1][1] == 1013
    assert all(a < b <= a + 37 for a, b in ranges) and all(x[1] == y[0] for x, y in pairwise(ranges))


def test_a_chunk_is_named_by_its_path_and_parsed_back():
    chunk = Chunk("ysb.events-1", 3, 200, 300)
    assert chunk.path == "kafka://ysb.events-1/3/200-300" and Chunk.parse(chunk.path) == chunk
    with pytest.raises(SourceError, match="not a Kafka chunk"):
        Chunk.parse("/landing/ysb-000001.json")


def test_partition_ranges_and_adjacent_chunks_of_one_epoch_merge():
    chunks = [Chunk("t", 0, 0, 100), Chunk("t", 1, 0, 50), Chunk("t", 0, 100, 200), Chunk("t", 1, 50, 90)]
    assert partition_ranges(chunks) == {0: (0, 200), 1: (0, 90)}
    tagged = [(chunks[0], 5), (chunks[2], 5), (chunks[1], 5), (chunks[3], 6)]
    assert merge_adjacent(tagged) == [(Chunk("t", 0, 0, 200), 5), (chunks[1], 5), (chunks[3], 6)]
    # A chunk skipped on purpose leaves a hole: its neighbours stay apart.
    assert merge_adjacent([(Chunk("t", 0, 0, 100), 1), (Chunk("t", 0, 200, 300), 1)]) == [
        (Chunk("t", 0, 0, 100), 1), (Chunk("t", 0, 200, 300), 1)]


def kafka_spec(tmp_path, **control):
    raw = yaml.safe_load((project_root() / "include" / "pipelines" / "ysb_kafka.yaml").read_text())
    raw["control"].update(control)
    path = tmp_path / "ysb_kafka.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_kafka_spec_bounds_epochs_in_records_not_bytes(tmp_path):
    spec = load_spec(kafka_spec(tmp_path))
    assert spec.source.type == "kafka" and spec.epoch_size_bound == spec.control.epoch_max_records == 20000
    with pytest.raises(SpecError, match=r"epoch_max_bytes bounds files.*epoch_max_records"):
        load_spec(kafka_spec(tmp_path, epoch_max_bytes="1MiB"))
    with pytest.raises(SpecError, match="reads the Kafka topic 'ysb', not a landing folder"):
        _ = spec.landing_dir


def test_a_kafka_spec_error_names_the_field_as_the_yaml_does(tmp_path):
    path = kafka_spec(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["source"]["chunk_records"] = 0
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"ysb_kafka.yaml: invalid pipeline spec: source.chunk_records: "):
        load_spec(path)
