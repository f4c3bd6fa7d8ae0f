"""Unit tests of SQL transforms without Spark: ``transform: {sql: ...}`` parses beside the
``module.function`` form, what can be checked at load time is (each error naming the file and
``transform.sql``), and Spark's errors are turned into ones naming the spec and the column at the
query's own line. cost: ~1 s in all, imports included."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.errors import SpecError, TransformError
from sluice.spec import PipelineSpec, SqlTransformSpec, load_spec
from sluice.sql_transform import SqlTransform, check_query, tokens

SPEC = """\
source:
  path: /data/landing/demo
  schema:
    ad_id: string
    amount: long
transform: {transform}
reference:
  ads: /data/ads.csv
sinks:
  - name: out
    mode: append
    path: /data/tables/demo/out
"""


def write(folder: Path, name: str, transform: str, text: str = SPEC) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text.replace("{transform}", transform))
    return path


def spec_error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_a_function_and_a_query_both_load(tmp_path):
    function = load_spec(write(tmp_path, "fn", "demo.clean"))
    assert function.transform == "demo.clean" and function.transform_function == "demo.clean"
    query = load_spec(write(tmp_path, "q", '\n  sql: |\n    SELECT ad_id, amount FROM records -- all\n'))
    assert isinstance(query.transform, SqlTransformSpec) and query.transform_function is None
    assert query.transform.sql == "SELECT ad_id, amount FROM records -- all\n"
    # a mapping in flow style, with a trailing ; and a join of a reference
    flow = load_spec(write(tmp_path, "flow", '{sql: "SELECT * FROM records JOIN ads USING (ad_id);"}'))
    assert isinstance(flow.transform, SqlTransformSpec)


@pytest.mark.parametrize(("transform", "expected"), [
    ('{sql: ""}', "transform.sql: Value error, is empty"),
    ('{sql: "  -- only a comment"}', "transform.sql: Value error, is empty"),
    ('{sql: "SELECT 1; SELECT * FROM records"}', "transform.sql: Value error, holds more than one statement (a `;` "
                                                 "at line 1 pos 8)"),
    ('{sql: "INSERT INTO t SELECT * FROM records"}', "transform.sql: Value error, must be a query"),
    ('{sql: "SELECT * FROM ads"}', "transform.sql: Value error, does not read `records`"),
    ("{sql: \"SELECT 'records' FROM ads /* records */\"}", "does not read `records`"),
    ('{sql: "SELECT * FROM records", mode: x}', "transform.mode: Extra inputs are not permitted"),
    ('{query: "SELECT * FROM records"}', "transform.sql: Field required"),
    ("Demo.Clean", "transform: String should match pattern"),
    ("[demo.clean]", "transform: Input should be a valid string"),
])
def test_load_time_errors_name_the_file_and_the_field(tmp_path, transform, expected):
    assert expected in spec_error(write(tmp_path, "bad", transform))


def test_a_query_has_one_sink_and_records_is_not_a_reference_name(tmp_path):
    two_sinks = SPEC + "  - name: more\n    mode: append\n    path: /data/tables/demo/more\n"
    message = spec_error(write(tmp_path, "two", '{sql: "SELECT * FROM records"}', two_sinks))
    assert "transform.sql: a SQL transform's result goes to one sink, but the pipeline has 2" in message
    clash = SPEC.replace("  ads: /data/ads.csv", "  Records: /data/r.csv")
    message = spec_error(write(tmp_path, "clash", '{sql: "SELECT * FROM records"}', clash))
    assert "reference.Records: the name `records` is the view of the epoch's records" in message
    # a Python transform may still take a reference called records
    assert load_spec(write(tmp_path, "py", "demo.clean", clash)).reference


@pytest.mark.parametrize("sql", [
    "SELECT ';' AS semi FROM records",                      # a ; inside a string
    "SELECT a FROM records -- ; a comment\n",              # ... a line comment
    "SELECT a /* ; /* nested ; */ still */ FROM records",   # ... a nested block comment
    "SELECT `a;b` FROM `records`",                          # ... a quoted identifier; records quoted
    "SELECT 'it\\'s' FROM records;  -- trailing ; is fine",
    "WITH v AS (SELECT * FROM records) SELECT * FROM v",
    "(SELECT * FROM records)",
    "FROM records SELECT ad_id",
    "select * from RECORDS",
])
def test_one_statement_reading_records(sql):
    assert "records" in check_query(sql).lower()


def test_tokens_skip_comments_and_keep_literals_whole():
    found = [(t.kind, t.text) for t in tokens("SELECT 'a;b', `c``d` -- x;\nFROM /* y */ records;")]
    assert found == [("word", "SELECT"), ("string", "'a;b'"), ("other", ","), ("ident", "`c``d`"),
                     ("word", "FROM"), ("word", "records"), ("semicolon", ";")]


class FakeAnalysisError(Exception):
    """What PySpark's AnalysisException offers (classic and Spark Connect alike)."""

    def __init__(self, message: str, condition: str, params: dict[str, str]) -> None:
        super().__init__(message)
        self.condition, self.params = condition, params

    def getCondition(self) -> str:
        return self.condition

    def getMessageParameters(self) -> dict[str, str]:
        return self.params


def test_spark_errors_name_the_spec_the_column_and_the_query_line():
    sql = "SELECT campaign_id,\n       nope\nFROM records JOIN ads USING (ad_id)\n"
    transform = SqlTransform("views", "/specs/views.yaml", sql)
    # The query runs as line 2 on of sluice's statement: Spark's line 3 is the query's line 2.
    exc = FakeAnalysisError("[UNRESOLVED_COLUMN.WITH_SUGGESTION] A column ... with name `nope` cannot be resolved. "
                            "SQLSTATE: 42703; line 3 pos 7;\n'Project [*]\n+- ...",
                            "UNRESOLVED_COLUMN.WITH_SUGGESTION", {"objectName": "`nope`", "proposal": "`ad_id`"})
    error = transform.error(exc, check_query(sql))
    assert isinstance(error, TransformError)
    text = str(error)
    assert text.startswith("pipeline 'views' (/specs/views.yaml): transform.sql: column `nope` cannot be resolved, "
                           "at line 2 pos 7 ('nope'): [UNRESOLVED_COLUMN.WITH_SUGGESTION]"), text
    assert "line 3" not in text and "Project" not in text  # neither sluice's wrapper nor Spark's plan
    parse = FakeAnalysisError("[PARSE_SYNTAX_ERROR] Syntax error at or near 'FORM'. SQLSTATE: 42601 (line 4, pos 0)",
                              "PARSE_SYNTAX_ERROR", {"error": "'FORM'"})
    assert "transform.sql: at line 3 pos 0 ('FROM records JOIN ads USING (ad_id)'): [PARSE_SYNTAX_ERROR]" in str(
        transform.error(parse, check_query(sql)))
    table = FakeAnalysisError("[TABLE_OR_VIEW_NOT_FOUND] The table or view `adz` cannot be found. SQLSTATE: 42P01; "
                              "line 4 pos 23;", "TABLE_OR_VIEW_NOT_FOUND", {"relationName": "`adz`"})
    assert "table or view `adz` cannot be resolved, at line 3 pos 23" in str(transform.error(table, sql))


def test_the_spec_model_is_strict():
    with pytest.raises(ValueError):
        SqlTransformSpec.model_validate({"sql": "SELECT * FROM records", "extra": 1})
    assert PipelineSpec.model_fields["transform"].description
