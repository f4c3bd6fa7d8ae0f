"""GX loads in the background of a group's process (``validation.warm_in_background``): once per
process, only for a pipeline with a suite, and without touching Spark (GX's Spark engine, made
where no session is up, starts a local one: a JVM in a Connect client's process). Cost: ~5-8 s
(a fresh process: GX's import and ephemeral context)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sluice.paths import project_root

PROBE = """
import json, os, sys
from sluice import validation
from sluice.spec import load_spec

root = sys.argv[1]
plain = load_spec(f"{root}/include/pipelines/ysb_campaign_hourly.yaml")
gated = load_spec(f"{root}/include/pipelines/ysb.yaml")
out = {"plain": validation.warm_in_background(plain) is None,
       "gx_before": "great_expectations" in sys.modules}
thread = validation.warm_in_background(gated)
out["thread"] = thread is not None
out["again"] = validation.warm_in_background(gated) is None
thread.join(timeout=120)
out["built"] = validation._context.cache_info().currsize
import pyspark
out["spark"] = pyspark.SparkContext._active_spark_context is not None  # GX's engine would start one
out["suite"] = type(validation.load_suite(os.path.join(root, gated.sinks[0].expectations))).__name__
print(json.dumps(out))
"""


def test_gx_is_warmed_once_per_process_and_only_for_a_pipeline_with_a_suite():
    root = project_root()
    assert not any(s.expectations for s in _spec(root, "ysb_campaign_hourly").sinks)  # the plain pipeline has no suite
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "plugins"), str(root),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE, str(root)], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"plain": True, "gx_before": False, "thread": True, "again": True, "built": 1, "spark": False,
                    "suite": "ExpectationSuite"}


def _spec(root, name):
    from sluice.spec import load_spec

    return load_spec(root / "include" / "pipelines" / f"{name}.yaml")
