"""OpenLineage (docs/lineage.md): the datasets sluice's group task reports through Airflow's
OpenLineage provider.

* The mapping spec -> datasets (``sluice.airflow.lineage``) for a file, a Kafka and a Delta
  source with several sinks, the Delta-log schema reader and the run facet: pure, milliseconds.
* The operators' hooks (run_group in both Spark modes, rollback), called directly: milliseconds.
* With OpenLineage not configured (the suite's default) the provider registers no listener, so
  none of it runs: milliseconds; configured (the transport variable of the test below), its
  plugin listens: a fresh interpreter importing it, ~3 s.
* One pipeline DAG under ``dag.test()`` with the provider's listener on its **file transport**:
  the START and COMPLETE events of ``run_group`` name exactly the landing folder, the sink and
  the ``_rejected`` table, with names this test computes from the spec's paths. One in-process
  Spark group of one epoch (2 small files) on the session's SparkSession: 11 s on a quiet
  2-core machine, 38-62 s with the cores shared (load average 7-11), nearly all of it the
  group's Spark work and Delta commits (each of the 12 events is emitted in ~0.1 s), plus
  5-12 s for the SparkSession when this is the worker's first Spark test.
"""

from __future__ import annotations

import json
from pathlib import Path

from sluice.airflow import lineage
from sluice.spec import PipelineSpec
from tests.pipelines import land, make_pipeline

SCHEMA = {"ad_id": "string", "event_time": "string"}


def spec_of(source: dict, sinks: list[dict], **more) -> PipelineSpec:
    return PipelineSpec.model_validate({"name": "lin", "source": {"schema": SCHEMA, **source},
                                        "transform": "ysb.campaign_views", "sinks": sinks, **more})


def ids(refs) -> list[tuple[str, str]]:
    return [(r.namespace, r.name) for r in refs]


def test_file_source_and_two_local_sinks():
    spec = spec_of({"path": "/data/landing/lin/"},
                   [{"name": "views", "mode": "append", "path": "/data/tables/lin/views"},
                    {"name": "totals", "mode": "aggregate", "path": "/data/tables/lin/totals", "keys": ["k"],
                     "sums": ["n"]}])
    found = lineage.pipeline_datasets(spec)
    assert ids(found.inputs) == [("file", "/data/landing/lin")]
    # _rejected beside the first sink, in the folder named after the pipeline
    assert ids(found.outputs) == [("file", "/data/tables/lin/views"), ("file", "/data/tables/lin/totals"),
                                  ("file", "/data/tables/lin/_rejected")]
    assert [(r.role, r.sink) for r in found.outputs] == [("sink", "views"), ("sink", "totals"), ("_rejected", None)]


def test_kafka_source_and_object_store_sinks():
    spec = spec_of({"type": "kafka", "bootstrap_servers": "PLAINTEXT://b1.example:9093,b2.example:9093",
                    "topic": "ad-events"},
                   [{"name": "a", "mode": "append", "path": "s3a://lake/sluice/lin/a"},
                    {"name": "b", "mode": "append", "path": "abfss://tables@acct.dfs.core.windows.net/lin/b"}],
                   rejected_path="gs://quarantine-bucket/lin/_rejected")
    found = lineage.pipeline_datasets(spec)
    assert ids(found.inputs) == [("kafka://b1.example:9093", "ad-events")]
    assert ids(found.outputs) == [("s3://lake", "sluice/lin/a"),
                                  ("abfss://tables@acct.dfs.core.windows.net", "lin/b"),
                                  ("gs://quarantine-bucket", "lin/_rejected")]
    assert lineage.kafka_dataset("localhost", "t") == ("kafka://localhost:9092", "t")


def test_delta_source_with_quarantine_and_hdfs():
    spec = spec_of({"type": "delta", "table": "/data/tables/upstream/events"},
                   [{"name": "hourly", "mode": "aggregate", "path": "hdfs://nn:8020/warehouse/lin/hourly",
                     "keys": ["k"], "sums": ["n"]},
                    {"name": "raw", "mode": "append", "path": "/data/tables/lin/raw"}],
                   validation={"policy": "quarantine"})
    found = lineage.pipeline_datasets(spec)
    assert ids(found.inputs) == [("file", "/data/tables/upstream/events")]
    assert found.inputs[0].kind == "delta"
    # side tables beside the first sink; its folder is named after the pipeline
    assert ids(found.outputs) == [("hdfs://nn:8020", "/warehouse/lin/hourly"), ("file", "/data/tables/lin/raw"),
                                  ("hdfs://nn:8020", "/warehouse/lin/_rejected"),
                                  ("hdfs://nn:8020", "/warehouse/lin/_quarantine")]


def test_sink_datasets_are_the_checkpoint_assets_as_the_provider_translates_them():
    """The checkpoint's outlets (``sink_asset``) and run_group's outputs name the same datasets."""
    from airflow.providers.common.compat.openlineage.utils.utils import translate_airflow_asset

    from sluice.airflow.operators import sink_asset

    spec = spec_of({"path": "/data/landing/lin"},
                   [{"name": "a", "mode": "append", "path": "/data/tables/lin/a"},
                    {"name": "b", "mode": "append", "path": "/data/other/b"}])
    translated = [translate_airflow_asset(sink_asset(spec.name, s), None) for s in spec.sinks]
    assert [(d.namespace, d.name) for d in translated] == ids(lineage.output_datasets(spec)[:2])


def _commit(log: Path, version: int, *actions: dict) -> None:
    (log / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))


def _meta(*fields: tuple[str, object]) -> dict:
    schema = {"type": "struct", "fields": [{"name": n, "type": t, "nullable": True, "metadata": {}}
                                           for n, t in fields]}
    return {"metaData": {"id": "x", "format": {"provider": "parquet"}, "schemaString": json.dumps(schema)}}


def test_delta_schema_from_the_log_newest_metadata_first(tmp_path):
    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)
    _commit(log, 0, {"commitInfo": {}}, {"protocol": {}},
            _meta(("a", "string"), ("s", {"type": "struct", "fields": [{"name": "x", "type": "integer"}]}),
                  ("arr", {"type": "array", "elementType": "string"})))
    _commit(log, 1, {"add": {"path": "p.parquet"}})
    assert lineage.delta_schema(str(tmp_path / "t")) == [("a", "string"), ("s", "struct<x:integer>"),
                                                          ("arr", "array<string>")]
    _commit(log, 2, {"commitInfo": {}}, _meta(("a", "string"), ("b", "long")))  # schema evolution
    _commit(log, 3, {"add": {"path": "q.parquet"}})
    assert lineage.delta_schema(str(tmp_path / "t")) == [("a", "string"), ("b", "long")]
    assert lineage.delta_schema(str(tmp_path / "missing")) is None
    assert lineage.delta_schema("s3a://bucket/t") is None, "a remote table is not read"


def test_delta_schema_from_a_parquet_checkpoint(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)
    meta = _meta(("campaign_id", "string"), ("views", "long"))["metaData"]
    pq.write_table(pa.table({"metaData": [None, {"schemaString": meta["schemaString"]}]}),
                   log / f"{10:020d}.checkpoint.parquet")
    (log / "_last_checkpoint").write_text(json.dumps({"version": 10, "size": 2}))
    _commit(log, 11, {"add": {"path": "p.parquet"}})  # the commits before the checkpoint are gone
    assert lineage.delta_schema(str(tmp_path / "t")) == [("campaign_id", "string"), ("views", "long")]


def test_operator_lineage_carries_schemas_counts_and_the_sluice_run_facet(tmp_path):
    from openlineage.client.serde import Serde

    sink = tmp_path / "lin" / "views"
    (sink / "_delta_log").mkdir(parents=True)
    _commit(sink / "_delta_log", 0, _meta(("ad_id", "string"), ("n", "long")))
    spec = spec_of({"path": str(tmp_path / "landing")}, [{"name": "views", "mode": "append", "path": str(sink)}])
    groups = [{"group_id": 4, "epochs": [
        {"epoch_id": 7, "generation": 0, "start": 10, "end": 12, "state": "committed",
         "rows": {"input": 100, "rejected": 3, "quarantined": 0, "output": 0}},
        {"epoch_id": 8, "generation": 0, "start": 12, "end": 14, "state": "committed",
         "rows": {"input": 50, "rejected": 1, "quarantined": 0, "output": 140, "commit": [7, 8]}}]}]
    run = lineage.group_run(spec.name, "run_group", groups)
    assert run["epochRange"] == [7, 8] and run["offsetRange"] == [10, 14]
    assert run["records"] == {"input": 150, "rejected": 4, "quarantined": 0, "output": 140}
    ol = lineage.operator_lineage(spec, run=run)
    got = {"inputs": [Serde.to_dict(d) for d in ol.inputs], "outputs": [Serde.to_dict(d) for d in ol.outputs],
           "run_facets": {k: Serde.to_dict(v) for k, v in ol.run_facets.items()}}
    (source,), (views, rejected) = got["inputs"], got["outputs"]
    assert source["name"] == str(tmp_path / "landing") and source["inputFacets"]["inputStatistics"]["rowCount"] == 150
    assert [f["name"] for f in source["facets"]["schema"]["fields"]] == ["ad_id", "event_time"]
    assert [(f["name"], f["type"]) for f in views["facets"]["schema"]["fields"]] == [("ad_id", "string"),
                                                                                     ("n", "long")]
    assert views["facets"]["storage"]["storageLayer"] == "delta"
    assert views["outputFacets"]["outputStatistics"]["rowCount"] == 140
    assert rejected["outputFacets"]["outputStatistics"]["rowCount"] == 4 and "schema" not in rejected["facets"]
    facet = got["run_facets"]["sluice"]
    assert facet["groups"] == [4] and [e["epochId"] for e in facet["epochs"]] == [7, 8]
    assert facet["_schemaURL"].endswith("#/$defs/RunFacet")


def test_operators_hooks_name_the_pipelines_tables():
    """The group task's hooks (start, failure) and the rollback's: a rollback RESTOREs the
    tables and reads no source. No Airflow run, no Spark."""
    from sluice.airflow.operators import RollbackOperator, RunGroupOperator

    spec = make_pipeline("lineage_hooks")
    tables = {("file", str(Path(s.path))) for s in spec.sinks} | {("file", str(Path(spec.rejected_table)))}
    run_group = RunGroupOperator(task_id="run_group", pipeline=spec.name)
    for ol in (run_group.get_openlineage_facets_on_start(), run_group.get_openlineage_facets_on_failure(None)):
        assert [(d.namespace, d.name) for d in ol.inputs] == [("file", str(spec.landing_dir))]
        assert {(d.namespace, d.name) for d in ol.outputs} == tables
        assert ol.run_facets == {}, "no group before act() recorded one"
    rollback = RollbackOperator(task_id="rollback", pipeline=spec.name).get_openlineage_facets_on_complete(None)
    assert rollback.inputs == [] and {(d.namespace, d.name) for d in rollback.outputs} == tables


class _TI:
    def __init__(self, value):
        self.value, self.pulls = value, []

    def xcom_pull(self, task_ids):
        self.pulls.append(task_ids)
        return self.value


def test_submit_operator_gathers_its_run_facet_only_when_configured(monkeypatch):
    """spark.mode submit: spark-submit stubbed out. Unconfigured, ``execute`` does what it did
    (no XCom pull, no store read); configured, the run facet names the planned group."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    import sluice.spark
    from sluice.airflow.submit import RunGroupSubmitOperator
    from sluice.protocol.run import PipelineRun
    from sluice.store import EpochStore

    spec = make_pipeline("lineage_submit")
    land(spec, files=2)
    store = EpochStore()
    planned = PipelineRun(spec, store, "test:lineage").plan()
    store.close()
    submitted = []
    monkeypatch.setattr(SparkSubmitOperator, "execute", lambda self, context: submitted.append(self.py_files))
    monkeypatch.setattr(sluice.spark, "python_files", lambda transform=None: "code.zip")
    op = RunGroupSubmitOperator(task_id="run_group", pipeline=spec.name, application="run_group.py")
    ti = _TI(planned.as_xcom())
    op.execute({"ti": ti})
    assert submitted == ["code.zip"] and ti.pulls == [] and op._lineage_run is None
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT", '{"type": "console"}')
    op.execute({"ti": ti})
    assert len(submitted) == 2 and ti.pulls == ["plan_group"]
    facet = op.get_openlineage_facets_on_complete(None).run_facets["sluice"]
    assert facet.groups == [planned.group_id]
    assert [e["epochId"] for e in facet.epochs] == [e.epoch_id for e in planned.epochs]
    assert facet.offsetRange == [0, 2]


def test_not_configured_means_no_listener_and_nothing_runs():
    """The suite configures no transport: the provider is disabled and registers no listener,
    so no ``get_openlineage_facets_*`` is ever called."""
    from airflow.providers.openlineage import conf
    from airflow.providers.openlineage.plugins.openlineage import OpenLineageProviderPlugin
    from airflow.sdk.listener import get_listener_manager

    assert conf.is_disabled() and not lineage.enabled()
    assert OpenLineageProviderPlugin.listeners == []
    assert not [p for p in get_listener_manager().pm.get_plugins() if type(p).__name__ == "OpenLineageListener"]


def test_the_transport_setting_turns_the_providers_listener_on(tmp_path):
    """The setting the test below uses is what makes the provider's plugin listen, in a process
    that reads it at start (the provider decides when its plugin is imported)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, AIRFLOW__OPENLINEAGE__TRANSPORT=json.dumps(
        {"type": "file", "log_file_path": str(tmp_path / "ol.jsonl"), "append": True}))
    code = ("from airflow.providers.openlineage.plugins.openlineage import OpenLineageProviderPlugin as P; "
            "print([type(x).__name__ for x in P.listeners])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1:] == ["['OpenLineageListener']"], out.stdout[-2000:] + out.stderr[-2000:]


def _events(path: Path, job: str) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("job", {}).get("name") == job:
            found.setdefault(event["eventType"], []).append(event)
    return found


def _named(datasets: list[dict]) -> set[tuple[str, str]]:
    return {(d["namespace"], d["name"]) for d in datasets}


def test_dag_test_reports_the_group_tasks_datasets_to_the_file_transport(spark, tmp_path, monkeypatch):
    # Imported while OpenLineage is unconfigured, the provider's plugin registers no listener of
    # its own; this test adds one to the Task SDK's listeners for its one DAG run.
    import airflow.providers.openlineage.plugins.openlineage  # noqa: F401
    from airflow.providers.openlineage.plugins.listener import OpenLineageListener
    from airflow.sdk.listener import get_listener_manager

    from sluice.airflow.dag_factory import build_dag
    from sluice.store import EpochStore

    events = tmp_path / "openlineage.jsonl"
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT",
                       json.dumps({"type": "file", "log_file_path": str(events), "append": True}))
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__NAMESPACE", "sluice-tests")
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD", "True")  # no fork of a process with a JVM
    assert lineage.enabled()
    # Manual runs (schedule null): the sensor takes whatever backlog there is at once.
    spec = make_pipeline("lineage_dag", schedule=None, **{"spark.mode": "in_process", "control.epoch_files": 2,
                                                          "control.group_epochs": 1})
    land(spec, files=2, malformed_fraction=0.05)  # one group of one epoch
    # What the events must name, from the spec's paths (not from sluice.airflow.lineage).
    landing = str(Path(spec.source.path).resolve())
    sinks = {("file", str(Path(s.path).resolve())) for s in spec.sinks}
    rejected = ("file", str(Path(spec.rejected_table).resolve()))

    listener, listeners = OpenLineageListener(), get_listener_manager()
    listeners.add_listener(listener)
    try:
        dr = build_dag(spec).test(run_conf={"drain": False})
    finally:
        listeners.pm.unregister(listener)
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert dr.state == "success", states

    run_group = _events(events, f"{spec.name}.run_group")
    assert sorted(run_group) == ["COMPLETE", "START"] and all(len(v) == 1 for v in run_group.values()), run_group
    for kind in ("START", "COMPLETE"):
        event = run_group[kind][0]
        assert event["job"]["namespace"] == "sluice-tests"
        assert _named(event["inputs"]) == {("file", landing)}, kind
        assert _named(event["outputs"]) == sinks | {rejected}, kind
        assert len(event["outputs"]) == len(sinks) + 1, "each table once"
    for _, name in sinks | {rejected}:  # the names are the tables the group wrote
        assert (Path(name) / "_delta_log").is_dir(), name

    complete = run_group["COMPLETE"][0]
    store = EpochStore()
    epochs = store.epochs(spec.name)
    store.close()
    facet = complete["run"]["facets"]["sluice"]
    assert facet["pipeline"] == spec.name and facet["groups"] == [0]
    assert [e["epochId"] for e in facet["epochs"]] == [e.epoch_id for e in epochs] == [0]
    assert facet["epochRange"] == [0, 0] and facet["offsetRange"] == [0, 2]
    n_rejected = sum(e.rows["rejected"] for e in epochs)
    assert n_rejected > 0 and facet["records"]["rejected"] == n_rejected
    assert facet["records"]["input"] == sum(e.rows["input"] for e in epochs)
    outputs = {(d["namespace"], d["name"]): d for d in complete["outputs"]}
    assert outputs[rejected]["outputFacets"]["outputStatistics"]["rowCount"] == n_rejected
    (sink,) = spec.sinks
    columns = spark.read.format("delta").load(sink.path).columns
    assert [f["name"] for f in outputs[("file", str(Path(sink.path).resolve()))]["facets"]["schema"]["fields"]] \
        == columns

    # checkpoint reports its sink Assets (outlets): the same datasets as run_group's sinks
    checkpoint = _events(events, f"{spec.name}.checkpoint")
    assert _named(checkpoint["COMPLETE"][0]["outputs"]) == sinks
