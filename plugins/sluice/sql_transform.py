"""SQL transforms: ``transform: {sql: "SELECT ... FROM records JOIN ads USING (ad_id) ..."}``.

The query's result is the transform's output, exactly as a Python transform's DataFrame is: it
goes to the (one) sink through the same validation, quarantine and exactly-once commit.

* **At spec-load time** (no Spark): ``check_query`` -- not empty, one statement, a query rather
  than a command, and it reads ``records``. The spec's loader names the file and ``transform.sql``.
* **At run time** (``SqlTransform``): the epoch's (or group's) valid records are the view
  ``records``, each ``reference`` a view of its name. They are CTEs over DataFrames passed to
  ``spark.sql(query, **frames)``, which registers them under fresh unique names: classic Spark
  drops those temporary views once the query is analysed, Spark Connect sends the frames inside
  the plan. Concurrent epochs (``control.concurrent_epochs``) share the SparkSession, so nothing
  is ever registered under a fixed name (``records`` of one epoch would be another's).
* **Errors**: Spark's ``AnalysisException`` (an unknown column or table, a syntax error) becomes a
  ``TransformError`` naming the pipeline, the spec file, ``transform.sql``, what Spark names
  (the column) and its line and position in the spec's query. It is raised before anything is
  written and is recorded as a failed attempt, as a transform's bug is (``control.max_attempts``).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.errors import TransformError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

RECORDS = "records"  # the view of the epoch's valid records
QUERY_KEYWORDS = ("select", "with", "from", "values", "table")  # a statement that is a query


@dataclass(frozen=True)
class Token:
    kind: str  # word, ident (a `quoted` identifier), string, semicolon, other
    text: str
    offset: int


def tokens(sql: str) -> list[Token]:
    """Spark SQL's tokens, as far as finding statements and table names needs: comments
    (``--``, nested ``/* */``) are dropped, string literals and quoted identifiers kept whole."""
    found: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace():
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c in "'\"`":
            j = i + 1
            while j < n:
                if c != "`" and sql[j] == "\\":  # Spark's string literals escape with a backslash
                    j += 2
                    continue
                if sql[j] == c:
                    if c == "`" and sql.startswith("``", j):  # `` is a backquote inside an identifier
                        j += 2
                        continue
                    break
                j += 1
            found.append(Token("ident" if c == "`" else "string", sql[i:j + 1], i))
            i = j + 1
        elif c.isalpha() or c == "_":
            m = re.compile(r"[A-Za-z0-9_]+").match(sql, i)
            assert m is not None
            found.append(Token("word", m.group(), i))
            i = m.end()
        else:
            found.append(Token("semicolon" if c == ";" else "other", c, i))
            i += 1
    return found


def _name(token: Token) -> str | None:
    """The identifier a token names (case-insensitive, as Spark resolves names), if any."""
    if token.kind == "word":
        return token.text.lower()
    if token.kind == "ident":
        return token.text[1:-1].replace("``", "`").lower()
    return None


def line_col(sql: str, offset: int) -> tuple[int, int]:
    """1-based line and 0-based position of an offset (Spark's ``line N pos M``)."""
    before = sql[:offset]
    return before.count("\n") + 1, offset - (before.rfind("\n") + 1)


def check_query(sql: str) -> str:
    """The query without a trailing ``;``; ``ValueError`` saying what is wrong with it.
    What can be checked without Spark: columns, functions and syntax are Spark's, at run time."""
    found = tokens(sql)
    if not found:
        raise ValueError("is empty: give one query that reads `records`, e.g. SELECT ... FROM records")
    if found[-1].kind == "semicolon":  # one trailing ; is the end of the statement, not a second one
        sql = sql[:found[-1].offset] + " " + sql[found[-1].offset + 1:]
        found = found[:-1]
    for token in found:
        if token.kind == "semicolon":
            line, pos = line_col(sql, token.offset)
            raise ValueError(f"holds more than one statement (a `;` at line {line} pos {pos}): give one query")
    first = next((t for t in found if t.text != "("), found[0])
    if _name(first) not in QUERY_KEYWORDS or first.kind != "word":
        raise ValueError(f"must be a query (starting with {', '.join(k.upper() for k in QUERY_KEYWORDS)}), not "
                         f"{first.text[:40]!r}...: its result is the transform's output, which sluice writes")
    if not any(_name(t) == RECORDS for t in found):
        raise ValueError("does not read `records` (the view of the epoch's records): select FROM records")
    return sql.rstrip()


@dataclass(frozen=True)
class SqlTransform:
    """The callable a SQL transform is at run time: ``(records, refs) -> DataFrame``, the shape
    of a Python transform (``sluice.compute.load_transform``)."""

    pipeline: str
    spec_path: str
    sql: str

    def __call__(self, records: DataFrame, refs: dict[str, DataFrame]) -> DataFrame:
        from pyspark.errors import AnalysisException

        query = check_query(self.sql)
        frames = {RECORDS: records, **refs}
        # Line 1 binds the names to the frames (spark.sql puts a fresh unique view name in each
        # {placeholder}); the spec's query starts at line 2, column 0, so Spark's "line N pos M"
        # is the query's line N-1, position M. Braces of the query are escaped for the formatter
        # (format() turns {{ back into {, so the text Spark parses is the spec's).
        bind = ", ".join(f"{_quote(name)} AS (SELECT * FROM {{_v{i}}})" for i, name in enumerate(frames))
        body = query.replace("{", "{{").replace("}", "}}")
        text = f"WITH {bind} SELECT * FROM (\n{body}\n)"
        spark = records.sparkSession
        _hush_pyspark_log()
        _HUSH.active = True
        try:
            return spark.sql(text, **{f"_v{i}": frame for i, frame in enumerate(frames.values())})
        except AnalysisException as exc:  # ParseException is one too
            raise self.error(exc, query) from None
        finally:
            _HUSH.active = False

    def error(self, exc: Exception, query: str) -> TransformError:
        """``exc`` as the spec's author needs it: the pipeline, the file, ``transform.sql``, what
        Spark names and where, in the spec's own query."""
        condition = _condition(exc)
        params = _parameters(exc)
        head = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = ""
        position = _POSITION.search(str(exc))
        if position:
            line, pos = int(position.group(1)) - 1, int(position.group(2))  # the query is on line 2 on
            head = _POSITION.sub("", head).rstrip(" ;.") + "."
            lines = query.splitlines()
            if 1 <= line <= len(lines):
                where = f"at line {line} pos {pos} ({lines[line - 1].strip()[:200]!r})"
        named = params.get("objectName") or params.get("relationName") or params.get("routineName")
        what = ""
        if named:
            kind = ("table or view" if "relationName" in params or "TABLE" in (condition or "")
                    else "function" if "routineName" in params or "ROUTINE" in (condition or "") else "column")
            what = f"{kind} {named} cannot be resolved"
        said = ", ".join(part for part in (what, where) if part)
        return TransformError(f"pipeline {self.pipeline!r} ({self.spec_path}): transform.sql: "
                              f"{said + ': ' if said else ''}{head} Fix the query in the spec (its views: `records`, "
                              "the source.schema fields, and each reference by its name)")


class _Hush(logging.Filter, threading.local):
    """Drops PySpark's own ERROR record of an analysis error (its message and the whole JVM
    stack) raised while this thread runs a SQL transform's query: the TransformError raised
    instead says what it means. Other threads (concurrent epochs) log as usual."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.active


_HUSH = _Hush()


def _hush_pyspark_log() -> None:
    # PySpark's own logger class: a plain Logger made here first would break PySpark's calls.
    from pyspark.logger import PySparkLogger

    logger = PySparkLogger.getLogger("SQLQueryContextLogger")
    if _HUSH not in logger.filters:
        logger.addFilter(_HUSH)


_POSITION = re.compile(r"\(?\s*line (\d+),? pos(?:ition)? (\d+)\s*\)?;?")


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _condition(exc: Exception) -> str | None:
    for getter in ("getCondition", "getErrorClass"):
        try:
            found = getattr(exc, getter)()
        except Exception:
            continue
        if found:
            return str(found)
    return None


def _parameters(exc: Exception) -> dict[str, str]:
    try:
        return dict(exc.getMessageParameters() or {})  # type: ignore[attr-defined]
    except Exception:
        return {}

