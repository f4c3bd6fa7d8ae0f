"""docs/pipeline-spec.md is generated from plugins/sluice/spec.py and must not drift from it."""

from __future__ import annotations

import difflib

from include.spec_reference import OUTPUT, render
from sluice.spec import (
    AlertsSpec,
    ControlSpec,
    KafkaSourceSpec,
    PipelineSpec,
    SinkSpec,
    SourceSpec,
    SparkSpec,
    ValidationSpec,
)


def test_committed_pipeline_spec_reference_is_current():
    committed = OUTPUT.read_text() if OUTPUT.exists() else ""
    generated = render()
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True),
                                             "docs/pipeline-spec.md", "generated"))[:60])
    assert committed == generated, (
        f"docs/pipeline-spec.md differs from the spec models (plugins/sluice/spec.py): run `make docs`\n{diff}")


def test_every_field_of_every_model_is_documented():
    text = render()
    for model in (PipelineSpec, SourceSpec, KafkaSourceSpec, SinkSpec, ValidationSpec, AlertsSpec, ControlSpec,
                  SparkSpec):
        for name, info in model.model_fields.items():
            assert f"| `{info.alias or name}` |" in text, f"{model.__name__}.{name} is missing from the reference"
