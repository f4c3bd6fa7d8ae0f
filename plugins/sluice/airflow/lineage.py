"""OpenLineage for sluice's tasks (docs/lineage.md): the datasets a pipeline reads and writes,
named by OpenLineage's dataset naming conventions, and what its tasks report about them.

Two layers:

* the mapping, pure and cheap (no Airflow, no OpenLineage, no Spark): ``pipeline_datasets(spec)``
  gives the source as the input and the sinks, ``_rejected`` (and ``_quarantine`` under the
  ``quarantine`` policy) as the outputs, each a ``DatasetRef(namespace, name, ...)``;
  ``delta_schema(path)`` reads a local Delta table's schema from its ``_delta_log``, a few small
  files, without Spark;
* ``operator_lineage(...)``: the ``OperatorLineage`` the operators' ``get_openlineage_facets_on_*``
  return to Airflow's OpenLineage provider, with a schema facet per dataset where it is known
  cheaply and the ``sluice`` run facet (the group, its epochs and record counts). OpenLineage
  is imported only here, so only when the provider's listener asks: with OpenLineage not
  configured (the default) the provider registers no listener and none of this runs.

Naming (https://openlineage.io/docs/spec/naming): a local path is namespace ``file``, name the
absolute path (what Airflow's ``file://`` Assets translate to, so the checkpoint's sink Assets
name the same datasets); ``s3://bucket`` / key (``s3a``, ``s3n`` too), ``gs://bucket`` / key,
``abfss://container@account.dfs.core.windows.net`` / path, ``hdfs://host:port`` / path; a Kafka
topic is namespace ``kafka://host:port`` (the first bootstrap server), name the topic.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from sluice.spec import PipelineSpec

#: The key of sluice's custom run facet in the events.
RUN_FACET = "sluice"


class DatasetRef(NamedTuple):
    """One dataset of a pipeline as OpenLineage names it, and what it is to the pipeline."""

    namespace: str
    name: str
    role: str  # source, sink, _rejected, _quarantine
    kind: str  # files, kafka, delta (the storage)
    location: str  # the spec's path, table or bootstrap servers/topic
    sink: str | None = None  # the sink's name, for a sink


class PipelineDatasets(NamedTuple):
    inputs: list[DatasetRef]
    outputs: list[DatasetRef]


_BLOB = {"s3": "s3", "s3a": "s3", "s3n": "s3", "gs": "gs", "gcs": "gs", "abfs": "abfss", "abfss": "abfss",
         "wasb": "wasbs", "wasbs": "wasbs"}


def location_dataset(location: str) -> tuple[str, str]:
    """(namespace, name) of a path or URI: a local path is ``("file", "/abs/path")``; an object
    store's is ``("s3://bucket", "key")``; another scheme keeps ``scheme://authority``."""
    parsed = urlsplit(location)
    scheme = parsed.scheme.lower()
    if not scheme or len(scheme) == 1:  # a plain path (a Windows drive letter counts as one)
        return "file", _local(location)
    if scheme == "file":
        return (f"file://{parsed.netloc}", parsed.path) if parsed.netloc else ("file", _local(parsed.path))
    if scheme in _BLOB:
        return f"{_BLOB[scheme]}://{parsed.netloc}", parsed.path.strip("/")
    if scheme == "hdfs":
        return f"hdfs://{parsed.netloc}", parsed.path.rstrip("/") or "/"
    return (f"{scheme}://{parsed.netloc}" if parsed.netloc else scheme), parsed.path.rstrip("/") or "/"


def _local(path: str) -> str:
    return os.path.normpath(os.path.abspath(path)) if path else path


def kafka_dataset(bootstrap_servers: str, topic: str) -> tuple[str, str]:
    """(namespace, name) of a Kafka topic: ``kafka://host:port`` of the first bootstrap server
    (a listener prefix such as ``PLAINTEXT://`` dropped; port 9092 when none), the topic."""
    first = bootstrap_servers.split(",")[0].strip()
    first = first.split("://", 1)[-1].strip("/")
    if not re.search(r":\d+$", first):
        first = f"{first}:9092"
    return f"kafka://{first}", topic


def source_dataset(spec: PipelineSpec) -> DatasetRef:
    """What the pipeline reads: its landing folder, its Kafka topic or its upstream Delta table."""
    source = spec.source
    kind = getattr(source, "type", "files")
    if kind == "kafka":
        namespace, name = kafka_dataset(source.bootstrap_servers, source.topic)  # type: ignore[union-attr]
        return DatasetRef(namespace, name, "source", "kafka",
                          f"{source.bootstrap_servers}/{source.topic}")  # type: ignore[union-attr]
    location = source.table if kind == "delta" else source.path  # type: ignore[union-attr]
    return DatasetRef(*location_dataset(location), "source", kind, location)


def output_datasets(spec: PipelineSpec) -> list[DatasetRef]:
    """What the pipeline writes: each sink's table (in spec order), then ``_rejected``, then
    ``_quarantine`` when failing rows are quarantined (``validation.policy: quarantine``)."""
    found = [DatasetRef(*location_dataset(s.path), "sink", "delta", s.path, s.name) for s in spec.sinks]
    found.append(DatasetRef(*location_dataset(spec.rejected_table), "_rejected", "delta", spec.rejected_table))
    if spec.validation.policy == "quarantine":
        found.append(DatasetRef(*location_dataset(spec.quarantine_table), "_quarantine", "delta",
                                spec.quarantine_table))
    return found


def pipeline_datasets(spec: PipelineSpec) -> PipelineDatasets:
    """The inputs and outputs a group of the pipeline reports."""
    return PipelineDatasets([source_dataset(spec)], output_datasets(spec))


# -- schemas, cheaply ------------------------------------------------------------------------

_COMMIT = re.compile(r"^(\d{20})\.json$")


def delta_schema(location: str, max_commits: int = 50) -> list[tuple[str, str]] | None:
    """The columns (name, Spark type) of a local Delta table, from the newest ``metaData``
    action in its ``_delta_log``: the commits since the last checkpoint, newest first, then the
    checkpoint itself. A few small file reads; ``None`` for a remote table, one not written
    yet, or one whose log this cannot read (no Spark is started for it)."""
    namespace, name = location_dataset(location)
    if namespace != "file":
        return None
    log = Path(name) / "_delta_log"
    try:
        if not log.is_dir():
            return None
        checkpoint = -1
        last = log / "_last_checkpoint"
        if last.is_file():
            checkpoint = int(json.loads(last.read_text())["version"])
        commits = sorted(((int(m.group(1)), p) for p in log.iterdir() if (m := _COMMIT.match(p.name))),
                         reverse=True)
        for version, path in commits[:max_commits]:
            if version <= checkpoint:
                break
            with path.open() as lines:
                for line in lines:
                    if '"metaData"' in line and (meta := json.loads(line).get("metaData")):
                        return _columns(meta)
        if checkpoint >= 0:
            return _checkpoint_schema(log, checkpoint)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def _checkpoint_schema(log: Path, version: int) -> list[tuple[str, str]] | None:
    for path in sorted(log.glob(f"{version:020d}.checkpoint*")):
        if path.suffix == ".json":
            for line in path.read_text().splitlines():
                if '"metaData"' in line and (meta := json.loads(line).get("metaData")):
                    return _columns(meta)
        elif path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                return None
            for meta in pq.read_table(path, columns=["metaData"]).column("metaData").to_pylist():
                if meta:
                    return _columns(meta)
    return None


def _columns(meta: dict[str, Any]) -> list[tuple[str, str]]:
    schema = json.loads(meta["schemaString"])
    return [(f["name"], _spark_type(f["type"])) for f in schema.get("fields", [])]


def _spark_type(t: Any) -> str:
    if isinstance(t, str):
        return t
    kind = t.get("type")
    if kind == "struct":
        return "struct<" + ",".join(f"{f['name']}:{_spark_type(f['type'])}" for f in t.get("fields", [])) + ">"
    if kind == "array":
        return f"array<{_spark_type(t['elementType'])}>"
    if kind == "map":
        return f"map<{_spark_type(t['keyType'])},{_spark_type(t['valueType'])}>"
    return str(kind)


def dataset_schema(ref: DatasetRef, spec: PipelineSpec) -> list[tuple[str, str]] | None:
    """A dataset's columns where they are known cheaply: a Delta table's from its log; a
    landing folder's or topic's records are the spec's ``source.schema``."""
    if ref.kind == "delta":
        return delta_schema(ref.location)
    if ref.role == "source":
        return list(spec.source.schema_.items())
    return None


# -- the run facet ---------------------------------------------------------------------------

def group_run(pipeline: str, task: str, groups: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The ``sluice`` run facet's fields from group records (``as_record``/``as_xcom`` form:
    ``group_id``, ``epochs`` with ``epoch_id``, ``generation``, ``start``, ``end``, ``state``
    and, once run, ``rows``): the groups, the epochs, the epoch and source-offset ranges and the
    summed record counts (absent before the group ran)."""
    epochs = [e for g in groups for e in g.get("epochs") or ()]
    run: dict[str, Any] = {"pipeline": pipeline, "task": task,
                           "groups": [g["group_id"] for g in groups if g.get("group_id") is not None],
                           "epochs": [{"epochId": e["epoch_id"], "generation": e.get("generation"),
                                       "start": e.get("start"), "end": e.get("end"), "state": e.get("state")}
                                      for e in epochs]}
    if epochs:
        run["epochRange"] = [min(e["epoch_id"] for e in epochs), max(e["epoch_id"] for e in epochs)]
        run["offsetRange"] = [min(e["start"] for e in epochs), max(e["end"] for e in epochs)]
    rows = [e["rows"] for e in epochs if e.get("rows")]
    if rows:
        run["records"] = {key: sum(int(r.get(key) or 0) for r in rows)
                          for key in ("input", "rejected", "quarantined", "output")}
    run.update({k: v for k, v in extra.items() if v is not None})
    return run


# -- the OpenLineage objects (imported only when the provider's listener asks) ------------------

@cache
def _run_facet_class() -> type:
    import attr
    from openlineage.client.facet_v2 import RunFacet

    @attr.define
    class SluiceRunFacet(RunFacet):
        """sluice's run facet (docs/lineage.md): the pipeline, the task and the group it ran."""

        pipeline: str
        task: str
        groups: list[int] = attr.field(factory=list)
        epochs: list[dict[str, Any]] = attr.field(factory=list)
        epochRange: list[int] | None = attr.field(default=None)  # OpenLineage spells fields in camelCase
        offsetRange: list[int] | None = attr.field(default=None)
        records: dict[str, int] | None = attr.field(default=None)
        rollback: dict[str, Any] | None = attr.field(default=None)

        @staticmethod
        def _get_schema() -> str:  # a custom facet: it conforms to the base RunFacet's schema
            return "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunFacet"

    return SluiceRunFacet


def run_facet(run: dict[str, Any]) -> Any:
    """The ``sluice`` run facet of ``group_run(...)`` fields."""
    return _run_facet_class()(**run)


def operator_lineage(spec: PipelineSpec, *, inputs: bool = True, run: dict[str, Any] | None = None,
                     schemas: bool = True) -> Any:
    """The ``OperatorLineage`` of a task on ``spec``: the source as input (``inputs``), the
    written tables as outputs, a Delta table's with a storage facet, each with a schema facet
    where it is known cheaply (``schemas``); ``run`` (``group_run``) as the ``sluice`` run facet, and the records read,
    rejected and written as input/output statistics when it counts them."""
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.facet_v2 import (
        input_statistics_input_dataset,
        output_statistics_output_dataset,
        schema_dataset,
        storage_dataset,
    )

    datasets = pipeline_datasets(spec)
    records = (run or {}).get("records") or {}

    def facets(ref: DatasetRef) -> dict[str, Any]:
        found: dict[str, Any] = {}
        if ref.kind == "delta":
            found["storage"] = storage_dataset.StorageDatasetFacet(storageLayer="delta", fileFormat="parquet")
        columns = dataset_schema(ref, spec) if schemas else None
        if columns:
            found["schema"] = schema_dataset.SchemaDatasetFacet(fields=[
                schema_dataset.SchemaDatasetFacetFields(name=n, type=t) for n, t in columns])
        return found

    ins = []
    if inputs:
        for ref in datasets.inputs:
            stats = ({"inputStatistics": input_statistics_input_dataset.InputStatisticsInputDatasetFacet(
                rowCount=records["input"])} if "input" in records else {})
            ins.append(InputDataset(namespace=ref.namespace, name=ref.name, facets=facets(ref),
                                    inputFacets=stats))
    outs = []
    single_sink = len(spec.sinks) == 1
    for ref in datasets.outputs:
        count = (records.get("output") if ref.role == "sink" and single_sink
                 else records.get("rejected") if ref.role == "_rejected"
                 else records.get("quarantined") if ref.role == "_quarantine" else None)
        stats = ({"outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
            rowCount=count)} if count is not None else {})
        outs.append(OutputDataset(namespace=ref.namespace, name=ref.name, facets=facets(ref), outputFacets=stats))
    return OperatorLineage(inputs=ins, outputs=outs, run_facets={RUN_FACET: run_facet(run)} if run else {})


def enabled() -> bool:
    """Whether Airflow's OpenLineage provider is installed and configured (a transport, a
    config file or ``OPENLINEAGE_URL``) and not disabled: only then does a task gather what its
    lineage reports beyond what it computes anyway."""
    try:
        from airflow.providers.openlineage import conf
    except ImportError:
        return False
    try:
        return not conf.is_disabled()
    except Exception:
        return False
