"""Pipeline specs: ``include/pipelines/<name>.yaml`` parsed and validated.

A spec error names the file and the field (``ysb.yaml: control.epoch_files: ...``), so an
operator can fix it without reading sluice's code.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from sluice.errors import SpecError
from sluice.paths import data_dir, pipelines_dir, project_root

NAME = r"^[a-z][a-z0-9_]{0,62}$"
UPSERT_DELETED = "_deleted"  # an upsert sink's tombstone flag column (see SinkSpec.delete_when)
UPSERT_HISTORY = ("valid_from", "valid_to", "current")  # what history: scd2 adds (SinkSpec.history)
SPARK_TYPES = {"string", "long", "int", "integer", "double", "float", "boolean", "timestamp", "date", "binary"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _RecordsSpec(_Strict):
    """What every source's records must look like: the schema they parse into and the checks
    that send a record to ``_rejected``."""

    schema_: dict[str, str] = Field(alias="schema", description="field -> Spark SQL type")
    required: list[str] = Field(default_factory=list, description="fields that must not be null")
    checks: dict[str, str] = Field(default_factory=dict,
                                   description="rule name -> SQL boolean expression a valid record satisfies")
    max_record_bytes: int = Field(1024 * 1024, ge=1, description="a longer record (line) goes to _rejected with "
                                                                 "its size; only its first KiB is kept")
    unknown_fields: Literal["reject", "rescue", "ignore"] = Field(
        "reject", description="JSON fields not in the schema: reject (the record goes to _rejected, naming "
                              "them), rescue (kept as a JSON object in a _rescued_data column the transform "
                              "gets, as Auto Loader does), or ignore (dropped, on purpose). A value of the wrong "
                              "type makes the record malformed (rejected) whatever this says")

    @property
    def drift(self) -> str:
        """How unknown fields are handled: ``unknown_fields`` for JSON; CSV and Parquet are read
        by position or by name, so extra columns are not seen (``ignore``)."""
        return self.unknown_fields if getattr(self, "format", "json") == "json" else "ignore"

    @field_validator("schema_")
    @classmethod
    def _types(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("must name at least one field")
        for name, typ in value.items():
            if typ.lower() not in SPARK_TYPES:
                raise ValueError(f"field {name!r} has unknown type {typ!r} (one of {sorted(SPARK_TYPES)})")
        return value

    @model_validator(mode="after")
    def _required_known(self) -> _RecordsSpec:
        unknown = [f for f in self.required if f not in self.schema_]
        if unknown:
            raise ValueError(f"required fields {unknown} are not in the schema")
        return self


class SourceSpec(_RecordsSpec):
    """A landing folder of files."""

    type: Literal["files"] = Field("files", description="files: a landing folder (may be left out)")
    path: str = Field(description="landing folder")
    format: Literal["json", "csv", "parquet"] = Field("json", description="JSON lines, CSV or Parquet files")
    pattern: str = Field("*", description="glob of file names to pick up in the folder")
    csv_header: bool = Field(True, description="csv: the first line of each file names the columns")
    settle_s: float = Field(
        5.0, ge=0, description="a file is registered only once nothing has changed it for this many seconds (its "
                               "modification time, or its size and modification time across polls): one still "
                               "being written is read once, whole; 0: at once (files always renamed into place)")


#: Settings only Spark's Java Kafka client knows (librdkafka refuses them): not in
#: ``source.options`` or ``source.discovery_options``. Exact names, then prefixes.
KAFKA_JAVA_ONLY = frozenset({
    "sasl.jaas.config", "sasl.client.callback.handler.class", "sasl.login.class", "ssl.keystore.type",
    "ssl.keystore.key", "ssl.keystore.certificate.chain", "ssl.protocol", "ssl.enabled.protocols",
    "ssl.keymanager.algorithm", "ssl.trustmanager.algorithm", "ssl.provider", "ssl.engine.factory.class",
    "ssl.secure.random.implementation", "security.providers", "key.deserializer", "value.deserializer",
    "interceptor.classes"})
KAFKA_JAVA_ONLY_PREFIXES = ("ssl.truststore.", "sasl.login.", "sasl.oauthbearer.jwks.")
#: Settings only librdkafka (sluice's discovery client) knows: not in ``source.spark_options``;
#: in ``source.options`` they go to librdkafka alone.
KAFKA_LIBRDKAFKA_ONLY = frozenset({
    "ssl.ca.location", "ssl.ca.pem", "ssl.ca.certificate.stores", "ssl.certificate.location",
    "ssl.certificate.pem", "ssl.key.location", "ssl.key.pem", "ssl.crl.location", "ssl.engine.location",
    "ssl.engine.id", "ssl.sigalgs.list", "ssl.curves.list", "sasl.mechanisms", "sasl.username", "sasl.password",
    "enable.ssl.certificate.verification", "debug", "log_level", "socket.timeout.ms", "api.version.request",
    "broker.version.fallback", "sasl.kerberos.kinit.cmd", "sasl.kerberos.keytab", "sasl.kerberos.principal",
    "sasl.oauthbearer.config", "enable.sasl.oauthbearer.unsecure.jwt"})
#: Settings that hold a secret themselves (whatever their value): from ``source.connection``.
KAFKA_SECRET_KEYS = frozenset({"ssl.key.pem", "ssl.keystore.key", "ssl.keystore.certificate.chain"})
_SECRET_WORD = re.compile(r"(?i)password|secret")


def kafka_java_only(key: str) -> bool:
    return key in KAFKA_JAVA_ONLY or key.startswith(KAFKA_JAVA_ONLY_PREFIXES)


def kafka_option_problem(key: str, value: str, field: str) -> str | None:
    """What is wrong with Kafka client setting ``key`` in ``source.<field>`` (``options``: both
    clients, ``discovery_options``: librdkafka, ``spark_options``: Spark's Java client), or
    ``None``. Never quotes the value: it may be a secret."""
    if _SECRET_WORD.search(key) or key in KAFKA_SECRET_KEYS or (
            key in ("sasl.jaas.config", "sasl.oauthbearer.config") and _SECRET_WORD.search(value)):
        return (f"{key!r} holds a secret (a password, key or token); a spec is no place for it (it is read by "
                "every task, shown in the UI and kept in git): put it in the Airflow connection named by "
                "source.connection (login, password and extra)")
    if key.startswith("kafka."):
        return f"{key!r}: name the client setting without the kafka. prefix (sluice adds it for Spark)"
    if field == "spark_options" and key in KAFKA_LIBRDKAFKA_ONLY:
        return (f"{key!r} is a librdkafka setting Spark's Java client does not know: put it in "
                "source.discovery_options (or use the Java client's own setting)")
    if field != "spark_options" and kafka_java_only(key):
        return (f"{key!r} is a setting of Spark's Java Kafka client only (librdkafka, sluice's discovery "
                "client, refuses it): put it in source.spark_options")
    return None


class KafkaSourceSpec(_RecordsSpec):
    """A Kafka topic of JSON records (one per message value). Two clients talk to the brokers:
    sluice's own (librdkafka, through confluent-kafka: discovery, backlog, retention checks) and
    Spark's Java client (reading the records). `options` go to both, `discovery_options` to the
    first, `spark_options` to the second; credentials come from the Airflow connection named by
    `connection`, never from the spec."""

    type: Literal["kafka"] = Field(description="kafka: a Kafka topic")
    bootstrap_servers: str = Field(description="host:port[,host:port...] of the brokers")
    topic: str = Field(pattern=r"^[A-Za-z0-9._-]{1,249}$", description="the topic to read, every partition")
    format: Literal["json"] = Field("json", description="message values are JSON records (no key, headers or Avro)")
    chunk_records: int = Field(
        10_000, ge=1, le=10_000_000,
        description="new records of a partition are registered in chunks of at most this many; an epoch is a "
                    "whole number of chunks (control.epoch_files of them, at most control.epoch_max_records)")
    fail_on_data_loss: bool = Field(
        True, description="records deleted by retention before sluice registered them stop the pipeline with an "
                          "error naming the partition and offsets; false: log it and go on from the earliest "
                          "offset still held")
    connection: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,250}$",
        description="an Airflow connection (its id) holding the brokers' credentials: login and password are the "
                    "SASL username and password; extra may set security_protocol (default SASL_SSL or "
                    "SASL_PLAINTEXT with a login, SSL or PLAINTEXT without, by whether a CA or truststore is "
                    "set), sasl_mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512; default PLAIN), ssl_ca_location "
                    "(a PEM CA file, for both clients), ssl_truststore_location, ssl_truststore_type and "
                    "ssl_truststore_password (Spark's client), ssl_check_hostname (default true). sluice turns "
                    "them into both clients' settings (over options on a clash). Each task and the Spark job "
                    "resolve it at run time (outside Airflow: the AIRFLOW_CONN_<ID> environment variable); the "
                    "secrets are masked in task logs and never written to errors, XCom or the epoch store")
    options: dict[str, str] = Field(
        default_factory=dict,
        description="Kafka client settings for both clients (security.protocol, sasl.mechanism, ...): as is for "
                    "sluice's discovery client (librdkafka), prefixed with kafka. for Spark's; a setting only "
                    "librdkafka knows (ssl.ca.location, debug, ...) goes to it alone, one only the Java client "
                    "knows (sasl.jaas.config, ssl.truststore.*) is an error (use spark_options). No secrets "
                    "(passwords, keys, a jaas config with a password): see connection")
    discovery_options: dict[str, str] = Field(
        default_factory=dict,
        description="librdkafka settings for sluice's discovery client alone (over options), e.g. "
                    "ssl.ca.location, ssl.endpoint.identification.algorithm; a Java client setting is an error. "
                    "No secrets")
    spark_options: dict[str, str] = Field(
        default_factory=dict,
        description="Java client settings for Spark's reads alone (over options), without the kafka. prefix, "
                    "e.g. ssl.truststore.location, ssl.truststore.type; a librdkafka-only setting is an error. "
                    "No secrets")

    @field_validator("options", "discovery_options", "spark_options")
    @classmethod
    def _client_settings(cls, value: dict[str, str], info: Any) -> dict[str, str]:
        problems = [p for k, v in value.items() if (p := kafka_option_problem(k, str(v), info.field_name))]
        if problems:
            raise ValueError("; ".join(problems))
        return value

    def librdkafka_options(self) -> dict[str, str]:
        """The spec's settings for sluice's discovery client (librdkafka)."""
        return {**self.options, **self.discovery_options}

    def java_options(self) -> dict[str, str]:
        """The spec's settings for Spark's Java client, without the ``kafka.`` prefix."""
        return {**{k: v for k, v in self.options.items() if k not in KAFKA_LIBRDKAFKA_ONLY}, **self.spark_options}


class DeltaSourceSpec(_RecordsSpec):
    """Another Delta table (an upstream pipeline's sink): the rows each of its versions added."""

    type: Literal["delta"] = Field(description="delta: the versions of another Delta table")
    table: str = Field(description="the upstream Delta table's folder")
    change_feed: bool = Field(
        False, description="false: read the files each version added (an append-only upstream, such as an "
                           "append sink); true: read the table's change data feed (delta.enableChangeDataFeed), "
                           "inserts and update post-images, for an upstream that MERGEs or updates")
    unknown_fields: Literal["reject", "rescue", "ignore"] = Field(
        "ignore", description="upstream columns not in the schema: ignore (the default: the schema picks the "
                              "columns this pipeline reads), rescue or reject, as for files")

    @property
    def format(self) -> str:
        """The rows reach the parse as JSON objects (``DeltaTableSource._read``)."""
        return "json"


def _source_kind(value: Any) -> str:
    """A source's ``type`` (``files`` when left out, as specs before Kafka did)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "files"


class SqlTransformSpec(_Strict):
    """`transform: {sql: ...}`: a Spark SQL query as the transform. The epoch's valid records
    (under `commit: group`, the group's) are the view `records` (the `source.schema` fields, and
    `_rescued_data` under `unknown_fields: rescue`), each `reference` a view of its name; the
    query's result is what the pipeline's one sink gets, through the same validation, quarantine
    and exactly-once commit as a Python transform's output. An unknown column or a syntax error
    fails the group before anything is written, naming the spec file, `transform.sql`, the
    column and its line; it counts as a failed attempt (`control.max_attempts`)."""

    sql: str = Field(description="one query (SELECT, WITH ... SELECT, FROM, VALUES) that reads `records`, e.g. "
                                 "SELECT ... FROM records JOIN ads USING (ad_id) GROUP BY ...; checked when the spec "
                                 "loads (one statement, a query, reads records), columns and syntax by Spark at run "
                                 "time")

    @field_validator("sql")
    @classmethod
    def _one_query(cls, value: str) -> str:
        from sluice.sql_transform import check_query

        check_query(value)
        return value


def _transform_kind(value: Any) -> str:
    """``sql`` for a mapping (``{sql: ...}``), ``function`` for a ``module.function`` string."""
    return "sql" if isinstance(value, dict | SqlTransformSpec) else "function"


TRANSFORM_FUNCTION = r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$"


class SinkSpec(_Strict):
    """A Delta table the transform's output is written to."""

    name: str = Field(pattern=NAME, description="the sink's name (its Asset is sluice/<pipeline>/<name>)")
    mode: Literal["append", "aggregate", "upsert"] = Field(
        description="append: rows are appended; aggregate: merge-add of sums per key into the table; upsert: "
                    "MERGE by `keys`, the row with the highest `sequence_by` wins (deletes kept as tombstones)")
    path: str = Field(description="the Delta table's folder")
    keys: list[str] = Field(default_factory=list, description="aggregate, upsert: merge keys")
    sums: list[str] = Field(default_factory=list, description="aggregate: columns added on merge")
    sequence_by: str | None = Field(
        None, description="upsert: the column that orders the changes of a key (a CDC log sequence number, an "
                          "update time): the row with the highest value wins, whatever order rows arrive in; a "
                          "null is older than any value")
    delete_when: str | None = Field(
        None, description="upsert: SQL condition on a row that makes it a delete (e.g. \"op = 'd'\"); a delete "
                          "stays in the table as a tombstone row (`_deleted` true) so that an older change "
                          "arriving later cannot bring the key back: readers filter `NOT _deleted`")
    history: Literal["none", "scd2"] = Field(
        "none", description="upsert: none keeps the latest row per key; scd2 keeps every version, one row per "
                            "key and sequence, with valid_from (its sequence), valid_to (the next version's, null "
                            "for the last) and current (the last version, unless a delete); a late change is put "
                            "in its place in the history")
    expectations: str | None = Field(None, description="Great Expectations suite (JSON) checked on each "
                                                       "epoch's output before it is written")
    partition_by: list[str] = Field(default_factory=list, description="append: the Delta table's partition "
                                                                       "columns, one writer per key")

    @model_validator(mode="after")
    def _aggregate_fields(self) -> SinkSpec:
        if self.mode == "aggregate" and (not self.keys or not self.sums):
            raise ValueError("an aggregate sink needs `keys` and `sums`")
        if self.mode == "append" and (self.keys or self.sums):
            raise ValueError("an append sink takes neither `keys` nor `sums`")
        if self.mode == "aggregate" and self.partition_by:
            raise ValueError("`partition_by` is for append sinks (an aggregate sink is keyed by `keys`)")
        return self._upsert_fields()

    def _upsert_fields(self) -> SinkSpec:
        """An upsert sink's fields, each error naming the sink and the field (``load_spec`` adds
        the file and ``sinks.<n>``)."""
        what = f"sink {self.name!r}"
        upsert_only = [f for f in ("sequence_by", "delete_when") if getattr(self, f) is not None]
        if self.mode != "upsert":
            if upsert_only or self.history != "none":
                raise ValueError(f"{what}: {', '.join(upsert_only or ['history'])} is for upsert sinks "
                                 f"(mode: {self.mode})")
            return self
        if not self.keys:
            raise ValueError(f"{what}: an upsert sink needs `keys` (the columns a row is merged by)")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"{what}: keys {self.keys} name a column twice")
        if not self.sequence_by:
            raise ValueError(f"{what}: an upsert sink needs `sequence_by` (the column whose highest value wins: "
                             "changes may arrive out of order)")
        if self.sequence_by in self.keys:
            raise ValueError(f"{what}: sequence_by {self.sequence_by!r} is one of the keys; it must order the "
                             "changes of one key")
        if self.sums:
            raise ValueError(f"{what}: `sums` is for aggregate sinks (an upsert replaces the row)")
        if self.partition_by:
            raise ValueError(f"{what}: `partition_by` is for append sinks (an upsert sink is keyed by `keys`)")
        if self.delete_when is not None and not self.delete_when.strip():
            raise ValueError(f"{what}: delete_when is empty (leave it out for a sink without deletes)")
        own = [UPSERT_DELETED, *(UPSERT_HISTORY if self.history == "scd2" else ())]
        taken = [c for c in (*self.keys, self.sequence_by) if c in own]
        if taken:
            raise ValueError(f"{what}: {taken} are the upsert sink's own columns ({', '.join(own)}); rename them "
                             "in the transform")
        return self


class ControlSpec(_Strict):
    """How big epochs and groups are, and when a group starts."""

    adaptive: bool = Field(False, description="size epochs (DyBBS) and groups (Drizzle AIMD) from measurements; "
                                              "false: the fixed sizes below")
    epoch_files: int = Field(4, ge=1, le=100_000,
                             description="epoch size, in source files (if adaptive, a floor for the first size, "
                                         "which the controllers compute from the measured fixed cost)")
    epoch_max_records: int | None = Field(
        None, ge=1, description="Kafka: bound an epoch in records (as maxOffsetsPerTrigger does); it ends before "
                                "the chunk that would take it past the bound; null: chunks only")
    epoch_max_bytes: int | None = Field(
        None, ge=1, description="bound an epoch in bytes as well as files (a number of bytes, or with a unit: "
                                "512MiB, 2GB): it ends before the file that would take it past the bound, and a "
                                "larger file is an epoch alone; null: files only")
    group_epochs: int = Field(3, ge=1, le=1000, description="k: epochs per group (one Spark application)")
    max_group_epochs: int = Field(64, ge=1, le=1000, description="adaptive: the largest k")
    freshness_sla_s: float = Field(300, gt=0, description="the sensor starts a group before its oldest data "
                                                          "would miss this")
    objective: Literal["latency", "cost"] = Field(
        "latency", description="adaptive: latency starts a group as soon as the backlog fills the controllers' "
                               "stable group (the freshest data; Spark busy much of the time); cost waits as long "
                               "as freshness_sla_s allows, then takes the whole backlog in one group, so nothing "
                               "runs between groups")
    sensor_mode: Literal["deferrable", "reschedule"] = Field(
        "deferrable", description="reschedule: for deployments without a triggerer")
    poll_interval_s: float = Field(5, gt=0, description="how often the backlog sensor (or trigger) looks at the source")
    sensor_timeout_s: float = Field(6 * 3600, gt=0, description="@continuous: how long a run waits for data "
                                                                "before it is skipped (the next run waits again)")
    lease_ttl_s: float = Field(600, gt=0, description="the pipeline's lease expires this long after its last "
                                                      "renewal (renewed every third of it while a group runs)")
    max_attempts: int = Field(3, ge=1, description="an epoch failing this often (an error recorded each time: a "
                                                   "poison record, a bug) halts the pipeline")
    max_crashes: int = Field(10, ge=1, description="an epoch whose Spark driver dies this often without a word "
                                                   "(killed, out of memory, its machine lost) halts the pipeline; "
                                                   "counted apart from max_attempts")
    optimize_every_groups: int = Field(0, ge=0, description="OPTIMIZE (compact) the sinks every N groups; 0: never")
    concurrent_epochs: int | Literal["auto"] = Field(
        "auto", description="epochs of a group computed at once (A-scheduler), for pipelines whose sinks all "
                            "append; auto: tuned online by hill climbing; 1: one after the other")
    max_concurrent_epochs: int = Field(4, ge=1, le=32, description="auto: the highest concurrency tried")

    @field_validator("epoch_max_bytes", mode="before")
    @classmethod
    def _bytes_with_unit(cls, value: Any) -> Any:
        return parse_bytes(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _cost_needs_measurements(self) -> ControlSpec:
        if self.objective == "cost" and not self.adaptive:
            raise ValueError("objective: cost plans each group from measured times; it needs adaptive: true")
        return self


class AlertsSpec(_Strict):
    """What Airflow raises about a pipeline, besides failed tasks."""

    freshness: bool = Field(
        False, description="alert when the pipeline's oldest unpublished data is older than "
                           "control.freshness_sla_s: the sluice_alerts DAG runs and its task fails naming the "
                           "pipeline, its data's age and the SLA (on_failure_callback, e-mail, the UI); a run "
                           "that logs the recovery follows. Opt-in: each alerting pipeline adds a poll loop to "
                           "the triggerer")
    notifier: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$",
        description="module.callable called with each alert (a dict: pipeline, change, age_s, sla_s) by the "
                    "alert task, for a channel of your own (Slack, a pager)")


class ValidationSpec(_Strict):
    """What happens to an epoch whose output fails its sink's expectation suite."""

    policy: Literal["fail", "quarantine", "warn"] = Field(
        "fail", description="fail: write nothing of the epoch and halt the pipeline; quarantine: write the "
                            "failing rows to the quarantine table instead; warn: record only")


class SparkSpec(_Strict):
    """Where a group's Spark application runs."""

    mode: Literal["submit", "in_process"] = Field(
        "submit", description="submit: spark-submit through SparkSubmitOperator; in_process: a SparkSession in "
                              "the Airflow worker's task")
    conn_id: str = Field("spark_default", description="submit: the Airflow connection spark-submit uses "
                                                      "(local[*], spark://host:port, ...)")
    conf: dict[str, str] = Field(default_factory=dict, description="Spark settings for the group's application, "
                                                                   "over sluice's defaults")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$", re.IGNORECASE)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEDUP_TIME_TYPES = ("timestamp", "long", "int", "integer")


def parse_duration(value: Any) -> float:
    """``"24h"`` -> 86400.0; ``"90s"``, ``"30m"``, ``"7d"``; a bare number is seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration (seconds, or a number with s, m, h or d: 90s, 30m, 24h, 7d)")
    return float(match.group(1)) * _SECONDS[(match.group(2) or "s").lower()]


class DedupSpec(_Strict):
    """Drop a valid record whose key was kept before (across epochs, groups and runs), within
    a horizon measured on the records' own time. The first occurrence in source order (epoch,
    then file, then line) is kept; the seen keys are a Delta table of the pipeline (`_dedup`
    beside `_rejected`), written in the group's commit and rolled back with the epochs. Needs
    `commit: group`."""

    keys: list[str] = Field(min_length=1, description="the schema fields that make a record's key; each must "
                                                      "be in source.required")
    within: float | None = Field(
        None, description="the horizon (seconds, or 90s, 30m, 24h, 7d): a record is dropped when its key was kept "
                          "with a `time` at most this far from its own, before or after; a key seen again "
                          "further away is kept and its time becomes the key's seen time; null: a key is kept "
                          "once, ever")
    time: str | None = Field(
        None, description="the schema field (timestamp, or long/int Unix seconds) the horizon is measured on: "
                          "the record's own time, never the time it was processed, so a recompute after a "
                          "rollback drops the same records; required with `within`, and in source.required")

    @field_validator("within", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return None if value is None else parse_duration(value)

    @model_validator(mode="after")
    def _time_with_horizon(self) -> DedupSpec:
        if self.within is not None and self.within <= 0:
            raise ValueError(f"within: must be above zero (got {self.within:g} s)")
        if self.within is not None and not self.time:
            raise ValueError("within: a horizon needs `time`, the record field it is measured on (the record's "
                             "own time, so that a recompute gives the same answer)")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"keys: {self.keys} name a field twice")
        return self


class PipelineSpec(_Strict):
    """One pipeline, one DAG: a source, a transform and Delta sinks."""

    name: str = Field(pattern=NAME, description="the pipeline's and its DAG's name; must match the file name "
                                                "(and defaults to it)")
    description: str = Field("", description="the DAG's description")
    schedule: str | None = Field(
        "@continuous", description="@continuous: a DAG run always waits for data (its sensor deferred to the "
                                   "triggerer); @backlog: event-driven, a run is created only when the backlog "
                                   "trigger fires (an Asset watcher), so none waits; a cron expression or preset: "
                                   "scheduled runs that take whatever is there; null: manual runs only")
    start_date: str = Field("2026-01-01", description="the DAG's start date (UTC)")
    source: Annotated[Annotated[SourceSpec, Tag("files")] | Annotated[KafkaSourceSpec, Tag("kafka")]
                      | Annotated[DeltaSourceSpec, Tag("delta")], Discriminator(_source_kind)] = Field(
        description="where the records come from, by `type`")
    transform: Annotated[Annotated[str, Tag("function"), StringConstraints(pattern=TRANSFORM_FUNCTION)]
                         | Annotated[SqlTransformSpec, Tag("sql")], Discriminator(_transform_kind)] = Field(
        description="module.function in the transforms folder (jobs/transforms/ of a checkout, transforms/ "
                    "beside the specs of an installed sluice), or package.module.function (lower-case dotted "
                    "names); or a mapping {sql: ...}: a Spark SQL query over the views `records` and the "
                    "references (one sink)")
    reference: dict[str, str] = Field(default_factory=dict, description="name -> CSV file")
    sinks: list[SinkSpec] = Field(min_length=1, description="the Delta tables written, one or more")
    partitioning: Literal["hash", "prompt"] = Field(
        "hash", description="how a keyed write (aggregate keys, append partition_by) spreads an epoch's "
                            "rows over tasks: Spark's hash, or Prompt's skew-balancing plan")
    rejected_path: str | None = Field(None, description="the _rejected table's folder; null: _rejected beside the "
                                                        "first sink (_rejected_<name> where that folder is not "
                                                        "named after the pipeline)")
    quarantine_path: str | None = Field(None, description="the _quarantine table's folder; null: beside the "
                                                          "first sink, as rejected_path")
    commit: Literal["group", "epoch"] = Field(
        "group", description="group: one Delta commit per table per group (the group's epochs read, "
                             "transformed and written together); epoch: one Delta version per epoch (a commit "
                             "per table per epoch, ~1-2 s each; epochs may then run concurrently)")
    validation: ValidationSpec = ValidationSpec()
    alerts: AlertsSpec = AlertsSpec()
    control: ControlSpec = ControlSpec()
    spark: SparkSpec = SparkSpec()
    dedup: DedupSpec | None = Field(None, description="drop records whose key was seen before within a horizon "
                                                      "(see the section); null: no deduplication")
    tags: list[str] = Field(default_factory=list, description="DAG tags, besides sluice")
    path: str = Field("", description="the YAML file this spec came from (set by the loader)")

    @model_validator(mode="after")
    def _unique_sinks(self) -> PipelineSpec:
        names = [s.name for s in self.sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"sink names must be unique (got {names})")
        if "_rejected" in names:
            raise ValueError("sink name `_rejected` is reserved for the rejected-records table")
        if self.partitioning == "prompt" and not any(s.keys or s.partition_by for s in self.sinks):
            raise ValueError("partitioning: prompt balances a keyed write, but no sink has `keys` (aggregate) "
                             "or `partition_by` (append)")
        level = self.control.concurrent_epochs
        stateful = [s.name for s in self.sinks if s.mode != "append"]
        if isinstance(level, int) and level > 1 and stateful:
            raise ValueError(f"control.concurrent_epochs: {level} needs independent epochs, but sink(s) "
                             f"{stateful} merge into state (epoch e+1 depends on e); use 1 or auto")
        if isinstance(self.source, KafkaSourceSpec) and self.control.epoch_max_bytes is not None:
            raise ValueError("control.epoch_max_bytes bounds files; a Kafka source's epochs are bounded in records "
                             "(control.epoch_max_records)")
        if not isinstance(self.source, KafkaSourceSpec) and self.control.epoch_max_records is not None:
            raise ValueError("control.epoch_max_records is for a Kafka source; bound files with "
                             "control.epoch_max_bytes")
        if isinstance(level, int) and level < 1:
            raise ValueError(f"control.concurrent_epochs must be >= 1 or 'auto' (got {level})")
        return self

    @model_validator(mode="after")
    def _sql_transform(self) -> PipelineSpec:
        if not isinstance(self.transform, SqlTransformSpec):
            return self
        if len(self.sinks) != 1:  # a query has one result; a Python transform may return one per sink
            raise ValueError(f"transform.sql: a SQL transform's result goes to one sink, but the pipeline has "
                             f"{len(self.sinks)} ({[s.name for s in self.sinks]}); use a Python transform")
        clash = [name for name in self.reference if name.lower() == "records"]
        if clash:
            raise ValueError(f"reference.{clash[0]}: the name `records` is the view of the epoch's records under a "
                             "SQL transform; rename the reference")
        return self

    @model_validator(mode="after")
    def _dedup_fields(self) -> PipelineSpec:
        dedup = self.dedup
        if dedup is None:
            return self
        schema, required = self.source.schema_, set(self.source.required)
        unknown = [k for k in dedup.keys if k not in schema]
        if unknown:
            raise ValueError(f"dedup.keys: {unknown} are not fields of source.schema ({sorted(schema)})")
        if dedup.time is not None:
            if dedup.time not in schema:
                raise ValueError(f"dedup.time: {dedup.time!r} is not a field of source.schema ({sorted(schema)})")
            if schema[dedup.time].lower() not in DEDUP_TIME_TYPES:
                raise ValueError(f"dedup.time: field {dedup.time!r} is {schema[dedup.time]}; the horizon is measured "
                                 "on a timestamp or a long/int of Unix seconds")
        loose = [f for f in (*dedup.keys, *([dedup.time] if dedup.time else [])) if f not in required]
        if loose:
            raise ValueError(f"dedup: fields {loose} must be in source.required (a record without its key or time "
                             "goes to _rejected rather than being deduplicated by a null)")
        if self.commit != "group":
            raise ValueError("dedup: needs commit: group (each group reads the seen keys as of the previous "
                             "group's commit; commit: epoch, concurrent epochs in particular, is not supported)")
        return self

    @property
    def transform_function(self) -> str | None:
        """The ``module.function`` of a Python transform; ``None`` for a SQL transform."""
        return self.transform if isinstance(self.transform, str) else None

    @property
    def independent_epochs(self) -> bool:
        """Whether epochs may be computed concurrently: every sink appends (A-scheduler's
        independent jobs); a merge into state makes epoch e+1 depend on e."""
        from sluice.control.concurrency import epoch_dependency

        return epoch_dependency(s.mode for s in self.sinks) == "independent"

    @property
    def data_driven(self) -> bool:
        """Whether the backlog and the freshness SLA decide when a group starts (``@continuous``,
        ``@backlog``), rather than a clock or an operator."""
        return self.schedule in ("@continuous", "@backlog")

    @property
    def landing_dir(self) -> Path:
        if isinstance(self.source, KafkaSourceSpec):
            raise SpecError(f"pipeline {self.name!r} reads the Kafka topic {self.source.topic!r}, not a landing folder")
        if isinstance(self.source, DeltaSourceSpec):
            raise SpecError(f"pipeline {self.name!r} reads the Delta table {self.source.table}, not a landing folder")
        return Path(self.source.path)

    @property
    def epoch_size_bound(self) -> int | None:
        """The bound on an epoch's summed manifest sizes: bytes of files, records of Kafka chunks."""
        if isinstance(self.source, KafkaSourceSpec):
            return self.control.epoch_max_records
        return self.control.epoch_max_bytes

    @property
    def rejected_table(self) -> str:
        return self.rejected_path or self._own_table("_rejected")

    @property
    def quarantine_table(self) -> str:
        return self.quarantine_path or self._own_table("_quarantine")

    @property
    def dedup_table(self) -> str | None:
        """The seen keys of ``dedup`` (``None`` without it): ``_dedup`` beside ``_rejected``'s default."""
        return self._own_table("_dedup") if self.dedup is not None else None

    def _own_table(self, name: str) -> str:
        """A side table of this pipeline alone, beside its first sink: a rollback RESTOREs it,
        which would undo another pipeline's rows too. In the documented layout the sinks' folder
        is named after the pipeline and the table keeps its plain name; elsewhere (sinks of
        several pipelines in one folder) the pipeline's name is added to it."""
        folder = self.sinks[0].path.rstrip("/").rsplit("/", 1)[0]  # as text: s3a://bucket/... keeps its //
        return f"{folder}/{name if folder.rsplit('/', 1)[-1] == self.name else f'{name}_{self.name}'}"

    def table_writers(self) -> dict[str, list[str]]:
        """Every Delta table the pipeline writes, with the epoch-log keys of its writers."""
        found: dict[str, list[str]] = {}
        for sink in self.sinks:
            found.setdefault(sink.path, []).append(sink.name)
            found.setdefault(self.quarantine_table, []).append(f"_quarantine_{sink.name}")  # before one commit
        found.setdefault(self.quarantine_table, []).append("_quarantine")
        found.setdefault(self.rejected_table, []).append("_rejected")
        if self.dedup_table is not None:
            found.setdefault(self.dedup_table, []).append("_dedup")
        return found

    def sink(self, name: str) -> SinkSpec:
        for s in self.sinks:
            if s.name == name:
                return s
        raise KeyError(f"pipeline {self.name!r} has no sink {name!r}")


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912; ``"2GB"`` -> 2000000000; a bare number is bytes."""
    match = _BYTES.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (a number of bytes, or with a unit: 512MiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])


_VAR = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::-([^}]*))?\}")


def _expand(value: Any) -> Any:
    """Expand ``${VAR}`` / ``${VAR:-default}``; ``SLUICE_DATA_DIR`` and ``SLUICE_HOME`` always
    resolve (to ``var/`` and the project root) so specs need no environment to load."""
    if isinstance(value, str):
        defaults = {"SLUICE_DATA_DIR": str(data_dir()), "SLUICE_HOME": str(project_root())}

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            found = os.environ.get(name) or default or defaults.get(name)
            if found is None:
                raise SpecError(f"environment variable {name} is not set and has no default")
            return found

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def _relative_to_project(path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else project_root() / p)


def _field(loc: tuple[Any, ...]) -> str:
    """A validation error's field as the YAML names it (``source.schema``, not pydantic's
    ``source.files.schema`` with the source's type tag in it; ``transform.sql``, not
    ``transform.sql.sql``)."""
    parts = [str(p) for i, p in enumerate(loc)
             if not (i and loc[i - 1] == "source" and p in ("files", "kafka", "delta"))
             and not (i == 1 and loc[0] == "transform" and p in ("function", "sql"))]
    return ".".join(parts)


def load_spec(path: str | Path) -> PipelineSpec:
    """Parse and validate one spec file; raise ``SpecError`` naming the file and the field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: pipeline spec not found") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a pipeline spec must be a mapping, got {type(raw).__name__}")
    try:
        raw = _expand(raw)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    raw.setdefault("name", path.stem)
    raw["path"] = str(path)
    try:
        spec = PipelineSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{_field(err['loc']) or '<top>'}: {err['msg']}" for err in exc.errors())
        raise SpecError(f"{path}: invalid pipeline spec: {problems}") from None
    if spec.name != path.stem:
        raise SpecError(f"{path}: name: {spec.name!r} must match the file name {path.stem!r}")
    fixed_source: Any = spec.source
    if isinstance(spec.source, SourceSpec):
        fixed_source = spec.source.model_copy(update={"path": _relative_to_project(spec.source.path)})
    elif isinstance(spec.source, DeltaSourceSpec):
        fixed_source = spec.source.model_copy(update={"table": _relative_to_project(spec.source.table)})
    fixed_sinks = [s.model_copy(update={"path": _relative_to_project(s.path),
                                        "expectations": s.expectations and _relative_to_project(s.expectations)})
                   for s in spec.sinks]
    fixed_refs = {k: _relative_to_project(v) for k, v in spec.reference.items()}
    fixed_rejected = _relative_to_project(spec.rejected_path) if spec.rejected_path else None
    fixed_quarantine = _relative_to_project(spec.quarantine_path) if spec.quarantine_path else None
    if isinstance(fixed_source, DeltaSourceSpec) and any(
            os.path.normpath(fixed_source.table) == os.path.normpath(s.path) for s in fixed_sinks):
        raise SpecError(f"{path}: source.table: {fixed_source.table} is also a sink of this pipeline; a pipeline "
                        "cannot read its own output")
    for sink in fixed_sinks:
        if sink.expectations and not Path(sink.expectations).is_file():
            raise SpecError(f"{path}: sinks.{sink.name}.expectations: suite {sink.expectations} does not exist")
    return spec.model_copy(update={"source": fixed_source, "sinks": fixed_sinks, "reference": fixed_refs,
                                   "rejected_path": fixed_rejected, "quarantine_path": fixed_quarantine})


def shared_tables(specs: Iterable[PipelineSpec]) -> dict[str, list[str]]:
    """Delta tables written by more than one pipeline (path: pipelines). Each pipeline must own
    its tables: a rollback RESTOREs them, which would undo the other pipelines' rows too."""
    writers: dict[str, list[str]] = {}
    for spec in specs:
        for path in spec.table_writers():
            writers.setdefault(os.path.normpath(path), []).append(spec.name)
    return {path: names for path, names in writers.items() if len(names) > 1}


def load_pipeline_specs(folder: str | Path | None = None) -> tuple[dict[str, PipelineSpec], list[str]]:
    """The folder's valid pipeline specs, and the errors of the others (each names the file and
    the field): a broken spec never takes the other pipelines' DAGs away. Pipelines that write
    the same table are errors too, all of them (none may roll the others' rows back)."""
    folder = Path(folder) if folder else pipelines_dir()
    specs: dict[str, PipelineSpec] = {}
    errors: list[str] = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            specs[path.stem] = load_spec(path)
        except SpecError as exc:
            errors.append(str(exc))
    for table, names in sorted(shared_tables(specs.values()).items()):
        errors.append(f"pipelines {', '.join(names)} all write the Delta table {table}: each pipeline needs its "
                      f"own tables (a rollback of one would remove the others' rows); change a sink `path`, "
                      f"`rejected_path` or `quarantine_path` in {', '.join(specs[n].path for n in names)}")
        for name in names:
            specs.pop(name, None)
    return specs, errors


def raise_spec_errors(folder: str | Path | None = None) -> None:
    """Raise the folder's spec errors as one ``ImportError``: what a DAG file does so that the
    Airflow UI shows them as its import error."""
    _, errors = load_pipeline_specs(folder)
    if errors:
        raise ImportError("broken pipeline specs: " + " | ".join(errors))


def get_spec(name: str) -> PipelineSpec:
    path = pipelines_dir() / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in pipelines_dir().glob("*.yaml"))
        raise SpecError(f"no pipeline {name!r}: {path} does not exist (known: {known})")
    return load_spec(path)
