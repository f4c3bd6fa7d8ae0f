"""SparkSession construction with Delta Lake, and the one-time fetch of the jars (Delta, and
Spark's Kafka connector).

The jars are resolved once from Maven Central (through Spark's own Ivy resolver, so no
host name is configured here) into ``$SLUICE_JARS_DIR`` (default ``var/jars``). Every later
session puts those files on ``spark.jars``: no network is needed at run time.

With ``SLUICE_SPARK_REMOTE=sc://host:port`` set, ``get_session`` returns a Spark Connect client
session on that (warm, long-running) server instead of starting a JVM: the server must have the
Delta jars, ``DeltaSparkSessionExtension`` and ``DeltaCatalog`` (see ``connect_server_command``).
Only the settings the server lets a session change (SQL confs) are applied; the rest (master,
jars, scheduler, UI) are the server's own.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.paths import JOBS_DIR, jars_dir, transforms_dir

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sluice.spec import PipelineSpec
    from sluice.store import EpochStore

log = logging.getLogger("sluice.spark")

REMOTE_ENV = "SLUICE_SPARK_REMOTE"  # sc://host:port of a warm Spark Connect server
#: The Connect service as a driver plugin of ``sluice/jobs/connect_server.py`` (not Spark's
#: ``SparkConnectServer`` class, which forces a class loader per session: see that module).
CONNECT_PLUGIN = "org.apache.spark.sql.connect.SparkConnectPlugin"
#: Sessions share one class loader, hence the generated code of earlier sessions. Spark's cache
#: of compiled code is keyed by the class loader: with one per session (isolation on, as
#: ``SparkConnectServer`` forces) a client repeated 17 of 17 compiles of the same queries, with
#: isolation on but not forced 12 of 17, with isolation off none. The price: a jar one client
#: adds is seen by every session, as in a classic Spark application.
CONNECT_SERVER_CONF = {"spark.plugins": CONNECT_PLUGIN, "spark.sql.artifact.isolation.enabled": "false",
                       "spark.sql.artifact.isolation.alwaysApplyClassloader": "false"}

DELTA_VERSION = "4.4.0"  # Python package and jars must match; 4.4.1 jars are not on Maven Central
KAFKA_CONNECTOR_VERSION = "4.2.0"  # the Spark release's own Kafka connector
#: Maven coordinates of the jars every session gets, and the file names they are kept under:
#: Delta Lake, and Spark's Kafka connector with the three jars it needs beyond Spark's own
#: (a Kafka source reads a topic range as a batch through it).
JAR_PACKAGES = (
    f"io.delta:delta-spark_4.2_2.13:{DELTA_VERSION}",
    f"io.delta:delta-storage:{DELTA_VERSION}",
    f"org.apache.spark:spark-sql-kafka-0-10_2.13:{KAFKA_CONNECTOR_VERSION}",
)
JAR_NAMES = (
    f"delta-spark_4.2_2.13-{DELTA_VERSION}.jar", f"delta-storage-{DELTA_VERSION}.jar",
    f"spark-sql-kafka-0-10_2.13-{KAFKA_CONNECTOR_VERSION}.jar",
    f"spark-token-provider-kafka-0-10_2.13-{KAFKA_CONNECTOR_VERSION}.jar",
    "kafka-clients-3.9.2.jar", "commons-pool2-2.13.1.jar",
)

# Settings for a small local[*] session: no UI, few shuffle partitions (epochs are small),
# Delta's catalog and SQL extensions.
BASE_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    # A snapshot's state (what a fenced write's txn lookup needs) replayed by one task, not two:
    # sluice's tables keep few files, and each task pays its own code generation (bench/README.md).
    "spark.databricks.delta.snapshotPartitions": "1",
    # Compiled generated code, cached by its source: a group of a YSB pipeline makes ~95 distinct
    # classes and ~130 over groups of several sizes; Spark's default of 100 entries (split among
    # the cache's segments) thrashed, a warm Connect server compiling nearly all of them again.
    "spark.sql.codegen.cache.maxEntries": "1000",
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2",
}


def spark_jars() -> list[str]:
    """Paths of the jars every session gets; raises if ``make jars`` has not fetched them yet."""
    folder = jars_dir()
    paths = [folder / name for name in JAR_NAMES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"jars missing: {', '.join(missing)}. Run `make jars` (needs Maven Central once)."
        )
    return [str(p) for p in paths]


def fetch_spark_jars() -> list[str]:
    """Resolve the jars through Spark's Ivy once and copy them into the jars folder."""
    folder = jars_dir()
    if all((folder / name).is_file() for name in JAR_NAMES):
        return spark_jars()
    from pyspark.sql import SparkSession

    folder.mkdir(parents=True, exist_ok=True)
    ivy = Path(tempfile.mkdtemp(prefix="sluice-ivy-"))
    try:
        spark = (
            SparkSession.builder.master("local[1]")
            .appName("sluice-fetch-jars")
            .config("spark.jars.packages", ",".join(JAR_PACKAGES))
            .config("spark.jars.ivy", str(ivy))
            .config("spark.ui.enabled", "false")
            .getOrCreate()
        )
        spark.stop()
        for name in JAR_NAMES:
            found = glob.glob(str(ivy / "jars" / f"*{name}"))
            if not found:
                raise FileNotFoundError(f"Ivy did not resolve {name} (looked in {ivy}/jars)")
            shutil.copy(found[0], folder / name)
    finally:
        shutil.rmtree(ivy, ignore_errors=True)
    return spark_jars()


#: JVM options of a run-once driver. It lives for seconds to minutes, so the C2 compiler's work
#: (and G1's concurrent threads) never pays back: with C1 alone and the serial collector a group
#: of Delta MERGEs took 40 % fewer CPU-seconds and less wall time here, and a 25-million-row one
#: 23 % fewer CPU-seconds for 7 % more wall time. A spec's ``spark.conf`` may replace them.
#: C1 alone gets a 48 MB code cache by default (240 MB with C2): a long group (a backlog of
#: minutes, a 3 GB file) filled it, the JVM disabled its compiler and ran interpreted from then
#: on, so the cache is sized as with C2 (reserved address space; committed only as code is made).
RUN_ONCE_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -XX:+UseSerialGC"
#: The same for a group large enough that C2 pays back (``sluice.control.jit``): the JVM's
#: tiered default, the same code cache and collector (the class-data archive stays valid).
RUN_ONCE_C2_JAVA_OPTIONS = "-XX:ReservedCodeCacheSize=240m -XX:+UseSerialGC"


def run_once_java_options(compiler: str = "c1") -> str:
    """``RUN_ONCE_JAVA_OPTIONS`` (``compiler="c2"``: ``RUN_ONCE_C2_JAVA_OPTIONS``), plus the
    class-data archive ``make setup`` built for them (``sluice.jvm_archive``), when there is one."""
    from sluice.jvm_archive import archive_options

    options = RUN_ONCE_C2_JAVA_OPTIONS if compiler == "c2" else RUN_ONCE_JAVA_OPTIONS
    return f"{options} {archive_options()}".strip()


def group_compiler(spec: PipelineSpec, store: EpochStore, group_id: int | str | None = None) -> str:
    """The compiler a run-once driver of ``group_id`` (``None``: the pipeline's latest group, the
    one ``--plan`` just planned) gets: ``sluice.control.jit.compiler_for`` its records. Any doubt
    (no group, a store error) keeps C1, the cheaper side of every small group."""
    from sluice.control import jit
    from sluice.sources import source_for

    try:
        groups = store.groups(spec.name) if group_id in (None, "", "None") else [store.group(spec.name, int(group_id))]
        if not groups or not groups[-1].epochs:
            return "c1"
        records = source_for(spec, store).group_records(groups[-1])
    except Exception as exc:  # the choice is an optimisation: it never fails a group
        log.warning("pipeline %s: the group's size is unknown (%s); its driver runs C1", spec.name, exc)
        return "c1"
    compiler = jit.compiler_for(records, jit.C2_BREAK_EVEN_RECORDS)
    log.info("pipeline %s: group %s of about %s records: the driver runs %s", spec.name, groups[-1].group_id,
             records if records is not None else "an unknown number of", compiler.upper())
    return compiler


def spark_conf(extra: dict[str, str] | None = None, run_once: bool = True, compiler: str = "c1") -> dict[str, str]:
    """The Spark settings sluice uses, for a builder or for ``spark-submit --conf``.

    FAIR scheduling with the pools of ``sluice/jobs/fairscheduler.xml``: concurrent epochs of a group
    share the cores by weight (older first); sequential jobs behave as under FIFO.
    ``run_once``: a driver that ends with its group (``run_once_java_options`` for ``compiler``),
    not a server.
    """
    conf = dict(BASE_CONF)
    if run_once:
        conf["spark.driver.extraJavaOptions"] = run_once_java_options(compiler)
    conf["spark.scheduler.mode"] = "FAIR"
    conf["spark.scheduler.allocation.file"] = str(JOBS_DIR / "fairscheduler.xml")
    conf.update(extra or {})
    return conf


def python_files(transform: str | None = None) -> str:
    """A zip of the Python code executors may run (``--py-files``, ``addPyFile``): the ``sluice``
    package, the transforms folder (``paths.transforms_dir``) as ``transforms``, and the module
    of a ``package.module.function`` transform with its packages' ``__init__``. On a cluster the
    executors' machines have none of it; a transform's UDF runs there. Built once per content
    (the name carries a hash of the files' paths, sizes and times), atomically, under the data
    folder."""
    import hashlib
    import importlib.util
    import zipfile

    from sluice.paths import data_dir

    members: dict[str, Path] = {}

    def tree(folder: Path, prefix: str) -> None:
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" not in path.parts:
                members[f"{prefix}/{path.relative_to(folder).as_posix()}"] = path

    tree(Path(__file__).resolve().parent, "sluice")
    tree(transforms_dir(), "transforms")
    module_name = transform.rpartition(".")[0] if transform else ""
    if "." in module_name:  # a package.module transform outside jobs/transforms
        found = importlib.util.find_spec(module_name)
        if found is None or found.origin is None:
            raise ModuleNotFoundError(f"transform module {module_name!r} not found (looked on the Python path)")
        parts = module_name.split(".")
        origin = Path(found.origin)
        members["/".join(parts) + ".py"] = origin
        package = origin.parent
        for depth in range(len(parts) - 1, 0, -1):
            members["/".join(parts[:depth]) + "/__init__.py"] = package / "__init__.py"
            package = package.parent
    digest = hashlib.sha256()
    for name, path in sorted(members.items()):  # a namespace package has no __init__: an empty one
        st = path.stat() if path.exists() else None
        digest.update(f"{name}:{st and st.st_size}:{st and st.st_mtime_ns}\n".encode())
    folder = data_dir() / "pyfiles"
    target = folder / f"sluice-pyfiles-{digest.hexdigest()[:16]}.zip"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, path in sorted(members.items()):
                if path.exists():
                    zf.write(path, name)
                else:
                    zf.writestr(name, "")
        os.replace(partial, target)
    return str(target)


def launched_by_spark_submit() -> bool:
    """Whether this Python driver was started by ``spark-submit`` (its JVM launched this process
    and passed it the gateway's port): the master, jars and py-files are then the command
    line's, and a session built here must not replace the master (``run_group`` against
    ``spark://`` would silently run on ``local[*]``)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def connect_client_url() -> str | None:
    """The Spark Connect server a session started here is a client of: ``remote_url()``, unless
    under spark-submit (whose driver has a JVM of its own). Such a client stops its session when
    its group ends: what it cached on the server would otherwise wait for the session timeout."""
    return None if launched_by_spark_submit() else remote_url()


def remote_url() -> str | None:
    """The Spark Connect server to use (``$SLUICE_SPARK_REMOTE``), or None for a local JVM."""
    return os.environ.get(REMOTE_ENV) or None


def is_connect(spark: SparkSession) -> bool:
    """True for a Spark Connect client session: no JVM here (no ``_jvm``, ``sparkContext``),
    and no Delta Connect plugin on the server, so Delta is driven through SQL."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


@dataclass(frozen=True)
class MemoryReading:
    """What a group (or epoch) held in Spark's unified memory, in MB: its stages' peak execution
    memory (hash maps, sort buffers; the largest stage, its tasks summed) plus what it cached,
    what spilled to disk, and the unified memory of the executors (the budget both share)."""

    peak_mb: float
    spilled_mb: float
    budget_mb: float


class MemoryProbe:
    """Spark's own accounting of the memory a group's jobs used, read from the driver's status
    store: ``start`` tags this thread's jobs with a job group, ``read`` sums them up. Classic
    Spark only (local or a cluster: executors report their tasks' metrics to the driver); under
    Spark Connect the store is the server's, and nothing is measured."""

    def __init__(self, spark: SparkSession, name: str) -> None:
        self._sc = None if is_connect(spark) else getattr(spark, "sparkContext", None)
        self._name = name
        self._tag: str | None = None
        self._count = 0

    def start(self) -> None:
        if self._sc is None:
            return
        self._count += 1
        self._tag = f"sluice-{self._name}-{os.getpid()}-{self._count}"
        self._sc.setJobGroup(self._tag, f"sluice {self._name}: memory of one group")

    def read(self) -> MemoryReading | None:
        """The tagged jobs' memory, or ``None`` when nothing is measured; ends the tagging."""
        if self._sc is None or self._tag is None:
            return None
        sc, tag, self._tag = self._sc, self._tag, None
        try:
            sc.setLocalProperty("spark.jobGroup.id", None)
            tracker, store = sc.statusTracker(), sc._jsc.sc().statusStore()
            stages = {s for job in tracker.getJobIdsForGroup(tag) if (info := tracker.getJobInfo(job))
                      for s in info.stageIds}
            peak = spilled = 0
            for stage in stages:
                try:
                    data = store.stageAttempt(stage, 0, False, None, False, None)._1()
                except Exception:  # gone: the store drops skipped stages first once it holds spark.ui.retainedStages
                    continue
                peak = max(peak, data.peakExecutionMemory())
                spilled += data.memoryBytesSpilled()
            cached = sum(info.memSize() for info in sc._jsc.sc().getRDDStorageInfo())
            budget = sum(v._1() for v in _scala_map_values(sc._jsc.sc().getExecutorMemoryStatus()))
        except Exception as exc:  # measure nothing rather than fail a group
            log.warning("no memory reading for %s (the controllers keep their constant ceiling): %s", tag, exc)
            return None
        return MemoryReading(round((peak + cached) / 2**20, 1), round(spilled / 2**20, 1), round(budget / 2**20, 1))


def _scala_map_values(scala_map: Any) -> list[Any]:
    values, it = [], scala_map.valuesIterator()
    while it.hasNext():
        values.append(it.next())
    return values


def start_connect_server(log_path: Path, master: str = "local[2]", port: int | None = None,
                         timeout_s: float = 180, conf: dict[str, str] | None = None,
                         java_options: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a Spark Connect server (``connect_server_command``) in a session of its own, its
    output in ``log_path``; wait until it accepts connections. Returns the process and its
    ``sc://`` URL. Raises with the log's tail if it exits or does not listen in time. ``conf``: more
    Spark settings for the server (a benchmark's UI, for the REST API); ``java_options``: its JVM's
    (default ``connect_java_options()``)."""
    import socket

    from sluice.net import free_port

    if port is None:
        port = free_port()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(connect_server_command(master, port, conf=conf, java_options=java_options),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"sc://127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"the Spark Connect server did not start: {log_path.read_text()[-3000:]}")
        time.sleep(1)


#: JVM options of a Spark Connect server: the JVM's own tiered C1 + C2, the code cache sized as
#: for a run-once driver's C2 (see ``RUN_ONCE_JAVA_OPTIONS``). While every group brought ~120
#: classes of generated code it had not seen (Spark's server class: a class loader per session),
#: C2 never settled and C1 alone was cheaper (fixed server CPU 11.0 -> 7.0 CPU-s). Now that
#: groups share their generated code, C2 settles: on two warm servers, groups alternating
#: (``python -m bench.overhead --connect --ab``), C2's JIT fell from 6.8 to 1.3 CPU-s a group
#: over its first ~35 groups, and over the last 10 pairs its server CPU was x0.85 C1's (every
#: pair below 1), on top of C2's cheaper code per record (bench/README.md).
CONNECT_SERVER_JAVA_OPTIONS = "-XX:ReservedCodeCacheSize=240m"


def connect_java_options() -> str:
    """The Connect server's JVM options: ``SLUICE_CONNECT_JAVA_OPTIONS`` when set, else
    ``CONNECT_SERVER_JAVA_OPTIONS`` (C1 + C2). ``-XX:TieredStopAtLevel=1`` (C1 alone) spares a
    young server C2's compiling (its first ~30 small groups cost more) at ~14 CPU-s more per
    million records (``bench/results/cost.json``: 32.7 under C1, 18.6 under C1 + C2): for a
    server restarted before it has served that many."""
    return os.environ.get("SLUICE_CONNECT_JAVA_OPTIONS", CONNECT_SERVER_JAVA_OPTIONS)


def connect_server_command(master: str = "local[*]", port: int = 15002, host: str = "127.0.0.1",
                           conf: dict[str, str] | None = None, java_options: str | None = None) -> list[str]:
    """``spark-submit`` command line of a Spark Connect server with sluice's Delta settings: the
    application ``sluice/jobs/connect_server.py`` with the Connect plugin (``CONNECT_SERVER_CONF``),
    so that a group's session reuses the code earlier groups generated (the pip PySpark ships
    neither ``sbin/start-connect-server.sh`` nor a reason to prefer Spark's server class)."""
    import sys

    from pyspark.find_spark_home import _find_spark_home

    # A command whose client died is dropped after 30 s (default 5 min), well inside the lease
    # TTL: a late Delta commit can then never outlive the lease of the run that sent it.
    conf = spark_conf({"spark.connect.grpc.binding.address": host, "spark.connect.grpc.binding.port": str(port),
                       "spark.connect.execute.manager.detachedTimeout": "30s", **CONNECT_SERVER_CONF,
                       "spark.pyspark.driver.python": sys.executable, **(conf or {})}, run_once=False)
    cmd = [str(Path(_find_spark_home()) / "bin" / "spark-submit"),
           "--name", "sluice-connect", "--master", master, "--jars", ",".join(spark_jars()),
           "--driver-java-options",
           f"-Dlog4j2.configurationFile=file:{JOBS_DIR / 'log4j2.properties'} "
           f"{connect_java_options() if java_options is None else java_options}".strip()]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return [*cmd, str(JOBS_DIR / "connect_server.py")]


def _remote_session(url: str, app_name: str, extra_conf: dict[str, str] | None) -> SparkSession:
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(url).appName(app_name).getOrCreate()
    for key, value in {k: v for k, v in spark_conf(extra_conf).items() if k.startswith("spark.sql.")
                       or k.startswith("spark.databricks.")}.items():
        if spark.conf.isModifiable(key):
            spark.conf.set(key, value)
        elif spark.conf.get(key, None) != value:
            log.warning("Spark Connect: %s=%s is a server setting; the server has %s", key, value,
                        spark.conf.get(key, None))
    return spark


def get_session(app_name: str = "sluice", master: str | None = None,
                extra_conf: dict[str, str] | None = None, compiler: str = "c1") -> SparkSession:
    """Return the active SparkSession, or start one with Delta on the classpath.

    Under ``spark-submit`` the master and jars come from the command line
    (``launched_by_spark_submit``); in-process (tests, the demo, ``@task``) a ``local[*]`` session is built,
    or, with ``$SLUICE_SPARK_REMOTE`` set, a client session on that Spark Connect server.
    ``compiler``: the JIT of the driver this starts (``group_compiler``), when it starts one.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    url = connect_client_url()
    if url:
        return _remote_session(url, app_name, extra_conf)
    submitted = launched_by_spark_submit()
    builder = SparkSession.builder.appName(app_name)
    if not submitted and "spark.master" not in (extra_conf or {}):
        builder = builder.master(master or os.environ.get("SLUICE_SPARK_MASTER", "local[*]"))
    conf = spark_conf(extra_conf, compiler=compiler)
    conf.setdefault("spark.jars", ",".join(spark_jars()))
    for key, value in conf.items():
        builder = builder.config(key, value)
    log.info("starting Spark application %s", app_name)
    spark = builder.getOrCreate()
    context = spark.sparkContext
    # Executors elsewhere need the code; spark-submit (a DAG's run_group) shipped it already.
    if not context.master.startswith("local") and "sluice-pyfiles-" not in context.getConf().get(
            "spark.submit.pyFiles", ""):
        context.addPyFile(python_files())
    return spark


if __name__ == "__main__":  # python -m sluice.spark: used by `make jars`
    import sys

    if sys.argv[1:2] == ["connect-server"]:  # python -m sluice.spark connect-server [master] [port]
        args = sys.argv[2:]
        cmd = connect_server_command(args[0] if args else "local[*]", int(args[1]) if len(args) > 1 else 15002)
        os.execv(cmd[0], cmd)
    for path in fetch_spark_jars():
        print(path)
