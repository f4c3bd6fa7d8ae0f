"""A class-data archive (AppCDS) for run-once drivers: the JVM maps the classes Spark and Delta
load at start-up from one file instead of reading, parsing and verifying them from the jars,
for every group again.

A run-once driver starts a JVM per group, and most of its fixed cost is that start: measured on
a 20-file YSB group (2 cores), the archive cut the group's CPU from 21.6 to 16.3 CPU-seconds
and its wall time from 16.9 to 12.4 s (``docs/how-it-works.md``, "Spark").

``make setup`` builds it once (``python -m sluice.jvm_archive``): a training run in a JVM with
the run-once options and ``-XX:ArchiveClassesAtExit`` reads JSON lines, aggregates, writes a
Delta table, merges into it and appends to it, and the JVM writes the classes it loaded when it
exits. The archive is tied to this JDK and the driver's class path; the JVM checks both and,
if either changed (a new JDK or pyspark), runs without it, silently (``-Xlog:cds=off``): the
archive can only make a start faster, never fail it. ``make setup`` rebuilds it when the
virtualenv or the jars change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sluice.paths import jars_dir

ARCHIVE_NAME = "run-once-driver.jsa"
#: Keep the JVM's own messages about the archive (a class path or JDK that changed since it
#: was built) out of task logs: it then simply starts without it.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def archive_path() -> Path:
    return jars_dir() / ARCHIVE_NAME


def archive_options() -> str:
    """The JVM options that use the archive, or "" when none was built."""
    path = archive_path()
    return f"-XX:SharedArchiveFile={path} {QUIET}" if path.is_file() else ""


PID_MARK = "sluice-training-jvm-pid="  # the training's JVM says what it dumps on stdout too
# The training run, in a child process (the archive is written when its JVM exits).
TRAINING = f"PID_MARK = {PID_MARK!r}\n" + r"""
import json, sys
from pathlib import Path
from pyspark.sql import functions as F
from sluice.spark import get_session
from sluice.sources.files import split_lines
folder = Path(sys.argv[1])
spark = get_session("sluice-jvm-archive", master="local[2]",
                    extra_conf={"spark.driver.extraJavaOptions": sys.argv[2]})
landing = folder / "landing"
landing.mkdir()
for f in range(2):
    (landing / f"part-{f}.json").write_text("\n".join(
        json.dumps({"key": f"k{i % 7}", "n": str(i), "at": str(1_700_000_000_000 + i)}) for i in range(500)))
schema = "key string, n string, at string"
lines = split_lines(spark.read.text(str(landing), wholetext=True))
rows = lines.select("_file", "_line", F.from_json("_text", schema).alias("r")).select("_file", "_line", "r.*")
rows = rows.persist()
bad = rows.where(F.col("n").isNull() | ~F.col("at").rlike("^[0-9]{1,15}$"))
at = (F.col("at").cast("long") / 1000).cast("timestamp")
agg = (rows.subtract(bad).withColumn("window", F.window(at, "10 seconds"))
       .groupBy("key", F.col("window.start").alias("window_start")).agg(F.count(F.lit(1)).alias("views")))
table = str(folder / "table")
agg.write.format("delta").option("txnAppId", "train").option("txnVersion", 1).save(table)
from delta.tables import DeltaTable
target = DeltaTable.forPath(spark, table)
(target.alias("t").merge(agg.alias("s"), "t.key = s.key AND t.window_start = s.window_start")
 .whenMatchedUpdate(set={"views": "t.views + s.views"}).whenNotMatchedInsertAll().execute())
(bad.write.format("delta").mode("append").option("txnAppId", "train").option("txnVersion", 2)
 .save(str(folder / "rejected")))
spark.read.format("delta").load(table).agg(F.sum("views")).collect()
target.history(1).collect()
rows.unpersist()
print(f"{PID_MARK}{spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()}", flush=True)
spark.stop()
"""


def build(timeout_s: float = 600.0) -> Path:
    """Build the archive (atomically: a failed or killed training leaves none) and return it."""
    from sluice.spark import RUN_ONCE_JAVA_OPTIONS, spark_jars

    spark_jars()  # the jars first: the training loads Delta from them
    target = archive_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="sluice-jvm-archive-") as folder:
        options = f"{RUN_ONCE_JAVA_OPTIONS} -XX:ArchiveClassesAtExit={partial}"
        plugins = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [plugins, os.environ.get("PYTHONPATH")]))}
        env.pop("SLUICE_SPARK_REMOTE", None)
        try:
            done = subprocess.run([sys.executable, "-c", TRAINING, folder, options], env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            partial.unlink(missing_ok=True)
            raise TimeoutError(f"the training run did not end within {timeout_s:.0f} s") from None
        said = [line for line in done.stdout.splitlines() if line.startswith(PID_MARK)]
        if done.returncode or not said:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"the training run failed ({done.returncode}): {done.stderr[-2000:]}")
        jvm = int(said[-1][len(PID_MARK):])
        deadline = time.monotonic() + timeout_s
        while _alive(jvm):  # the JVM writes the archive as it exits, after Python is done
            if time.monotonic() > deadline:
                partial.unlink(missing_ok=True)
                raise TimeoutError(f"the training JVM {jvm} did not exit within {timeout_s:.0f} s")
            time.sleep(0.2)
    if not partial.is_file() or partial.stat().st_size == 0:
        raise RuntimeError(f"the training JVM wrote no archive at {partial}")
    os.replace(partial, target)
    return target


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":  # python -m sluice.jvm_archive: used by `make setup`
    started = time.monotonic()
    try:
        path = build()
    except (RuntimeError, TimeoutError, OSError) as exc:
        # Only a faster start is lost: groups run without the archive.
        print(f"sluice: no class-data archive for run-once drivers ({exc}); groups start without it",
              file=sys.stderr)
        sys.exit(0)
    print(f"sluice: class-data archive for run-once drivers: {path} "
          f"({path.stat().st_size / 2**20:.0f} MB, {time.monotonic() - started:.0f} s)")
