"""``sluice``: the command line (``pip install sluice``; in a checkout ``python -m sluice``).

    sluice init [FOLDER]                         the DAG files that turn FOLDER's specs into DAGs
    sluice jars                                  fetch the Delta and Kafka jars once (Maven Central)
    sluice run-group --pipeline P --plan         plan, run and publish one group (no Airflow)
    sluice rollback --pipeline P --to-epoch N --reason WHY   trigger sluice_rollback in Airflow
    sluice preview-rollback --pipeline P --to-epoch N      recompute into shadow tables and diff (changes nothing)
    sluice recover --pipeline P                  trigger sluice_recover in Airflow
    sluice skip-file --pipeline P --file F --reason WHY      skip a gone or unreadable file
    sluice rebuild-store --pipeline P            rebuild a lost epoch store from the tables' records
    sluice connect-server [--port 15002]         a Spark Connect server with sluice's settings

rollback, recover, skip-file and preview-rollback act on this host (it holds Airflow's
configuration) or, with --api-url URL, through that api-server as SLUICE_API_USER (password
SLUICE_API_PASSWORD, or SLUICE_API_TOKEN), who needs edit access to the pipeline's DAG.

Errors sluice raises (a busy pipeline, a bad spec, a lost file) end with one line naming the
command and exit status 2.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import SluiceError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sluice.store import EpochStore

VERBOSE_HELP = "log libraries' INFO lines too (Great Expectations, py4j; also SLUICE_LOG_LEVEL=DEBUG)"

#: What ``sluice init`` writes: the pipelines' and operations' DAGs in one file, the broken
#: specs' errors in another (an import error takes only its own file's DAGs away).
DAG_FILES = {
    "sluice_dags.py": '''"""sluice's DAGs: one per pipeline spec (*.yaml) in this folder, and the operations
DAGs (sluice_rollback, sluice_recover, sluice_skip_file, sluice_alerts). Written by `sluice init`."""

from sluice.airflow.dag_factory import all_dags

globals().update(all_dags())
''',
    "sluice_spec_errors.py": '''"""Shows broken pipeline specs in the Airflow UI as an import error of this DAG
file (each error names the spec file and the field). Written by `sluice init`."""

from sluice.spec import raise_spec_errors

raise_spec_errors()
''',
}


def _store(args: argparse.Namespace) -> EpochStore:
    from sluice.store import EpochStore

    return EpochStore(args.store_url or os.environ.get("SLUICE_STORE_URL"))


def run_group(args: argparse.Namespace) -> Any:
    """One run-once Spark application: the group ``--owner`` planned, or (``--plan``) plan it
    under a lease of its own first, then publish. The same code under spark-submit and in-process."""
    from sluice.logs import configure_job
    from sluice.protocol.run import PipelineRun, cli_owner
    from sluice.protocol.runtime import Runtime
    from sluice.spark import connect_client_url, get_session, group_compiler
    from sluice.spec import get_spec

    if (args.group is None) == (not args.plan):
        raise SluiceError("give exactly one of --group or --plan")
    configure_job(args.verbose)
    spec = get_spec(args.pipeline)
    store = _store(args)

    def spark() -> SparkSession:
        # The JVM starts after planning, so its compiler fits the group it runs (sluice.control.jit).
        return get_session(f"sluice-{spec.name}", extra_conf=spec.spark.conf,
                           compiler=group_compiler(spec, store, None if args.plan else args.group))

    # Spark starts once a group is planned: a busy or idle pipeline is reported before a JVM starts.
    # A Connect client releases its session when the group ends, as the Airflow task does (what it
    # cached or materialised on the server goes with it); a spark-submit driver ends with its process.
    runtime = Runtime.spark(spark, stop=connect_client_url() is not None)
    run = PipelineRun(spec, store, args.owner or cli_owner(), runtime)
    try:
        if args.plan:
            return run.run_once(epoch_size=args.epoch_size, k=args.k, drain=args.drain, extra=args.plan_extra,
                                first_size=args.first_size)
        group_id = None if args.group in ("None", "") else int(args.group)
        return run.process(group_id)
    finally:
        runtime.close()


def skip_file(args: argparse.Namespace) -> Any:
    """Skip a file that is gone or unreadable, on purpose and recorded (who, when, why). The epoch
    holding it reads around it from now on; failed epochs holding it get fresh attempts. No Spark."""
    from sluice.protocol.operations import skip_file as skip
    from sluice.spec import get_spec

    if args.api_url:  # sluice_skip_file on a remote Airflow, as a user who may edit the pipeline's DAG
        return _api_action(args, "skip-file", {"file": args.file, "reason": args.reason})
    spec = get_spec(args.pipeline)
    store = _store(args)
    try:
        return skip(spec, store, args.file, by=args.by or f"cli:{_user()}", reason=args.reason)
    finally:
        store.close()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a UID without a passwd entry (containers)
        return f"uid{os.getuid()}"


def rebuild_store(args: argparse.Namespace) -> Any:
    """Rebuild a lost epoch store from the JSON epoch records next to a pipeline's tables; what
    the tables hold beyond the last published epoch is rolled back, so the next run recomputes it.
    Refuses a store that already holds the pipeline."""
    from sluice.logs import configure_job
    from sluice.protocol.operations import rebuild_store as rebuild
    from sluice.protocol.run import cli_owner
    from sluice.protocol.runtime import Runtime
    from sluice.spark import get_session
    from sluice.spec import get_spec

    configure_job(args.verbose)
    spec = get_spec(args.pipeline)
    runtime = Runtime.spark(lambda: get_session(f"sluice-rebuild-{spec.name}", extra_conf=spec.spark.conf), stop=True)
    try:
        return rebuild(spec, _store(args), runtime, cli_owner())
    finally:
        runtime.close()


def _airflow_user() -> str | None:
    """The user ``airflow dags trigger`` records as the run's triggering user (the OS user)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def _trigger(dag_id: str, conf: dict[str, Any]) -> Any:
    """Trigger an operations DAG through Airflow's own command line: the run, its lease and its
    checks are Airflow's and sluice's as from the UI. This host holds Airflow's configuration,
    so it is trusted like the scheduler: the conf is stamped (``sluice.airflow.actions``) with
    the OS user, whom ``airflow dags trigger`` records as the triggering user; the operations
    DAGs refuse a run without a stamp."""
    from sluice.airflow.actions import STAMP_KEY, stamp

    airflow = shutil.which("airflow") or str(Path(sys.executable).with_name("airflow"))
    stamped = stamp(dag_id, conf, _airflow_user(), via="cli")
    proc = subprocess.run([airflow, "dags", "trigger", dag_id, "--conf", json.dumps(stamped), "--output", "json"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SluiceError(f"airflow dags trigger {dag_id} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    shown = {k: v for k, v in conf.items() if k != STAMP_KEY}
    return {"triggered": dag_id, "conf": shown, "airflow": proc.stdout.strip()}


def _api_action(args: argparse.Namespace, action: str, body: dict[str, Any]) -> Any:
    """The action through a remote api-server: ``POST /sluice/pipelines/<p>/actions/<action>``
    as a user (``SLUICE_API_TOKEN``, or ``SLUICE_API_USER`` and ``SLUICE_API_PASSWORD`` for
    ``POST /auth/token``), who needs edit access to the pipeline's DAG."""
    import httpx

    url = args.api_url.rstrip("/")
    with httpx.Client(base_url=url, timeout=60.0) as client:
        token = os.environ.get("SLUICE_API_TOKEN")
        if not token:
            user, password = os.environ.get("SLUICE_API_USER"), os.environ.get("SLUICE_API_PASSWORD")
            if not user or not password:
                raise SluiceError("--api-url needs SLUICE_API_TOKEN, or SLUICE_API_USER and SLUICE_API_PASSWORD")
            r = client.post("/auth/token", json={"username": user, "password": password})
            if r.status_code not in (200, 201):
                raise SluiceError(f"logging in to {url} as {user!r} failed: HTTP {r.status_code} {r.text[:500]}")
            token = r.json()["access_token"]
        r = client.post(f"/sluice/pipelines/{args.pipeline}/actions/{action}", json=body,
                        headers={"Authorization": f"Bearer {token}"})
    if r.status_code != 200:
        raise SluiceError(f"{action} of {args.pipeline} refused by {url}: HTTP {r.status_code} {r.text[:1000]}")
    return r.json()


def rollback(args: argparse.Namespace) -> Any:
    body = {"to_epoch": args.to_epoch, "reason": args.reason, "recompute": not args.no_recompute,
            "take_over": args.take_over}
    if args.api_url:
        return _api_action(args, "rollback", body)
    return _trigger("sluice_rollback", {"pipeline": args.pipeline, **body})


def preview_rollback(args: argparse.Namespace) -> Any:
    """What a rollback to an epoch with recompute would leave in each table: the epochs are
    recomputed with the current code into shadow tables and compared with the published ones.
    Nothing is changed; the report is kept for the console too (sluice_rollback_preview runs
    the same in Airflow)."""
    from sluice.logs import configure_job
    from sluice.preview import shadow_preview
    from sluice.spark import get_session
    from sluice.spec import get_spec

    if args.api_url:  # sluice_rollback_preview on a remote Airflow
        return _api_action(args, "rollback-preview", {"to_epoch": args.to_epoch})
    configure_job(args.verbose)
    spec = get_spec(args.pipeline)
    spark = get_session(f"sluice-preview-{spec.name}", extra_conf=spec.spark.conf)
    try:
        return shadow_preview(spec, _store(args), spark, args.to_epoch).as_dict()
    finally:
        spark.stop()


def recover(args: argparse.Namespace) -> Any:
    body = {"withdraw_rollback": args.withdraw_rollback, "take_over": args.take_over}
    if args.api_url:
        return _api_action(args, "recover", body)
    return _trigger("sluice_recover", {"pipeline": args.pipeline, **body})


def jars(args: argparse.Namespace) -> Any:
    from sluice.spark import fetch_spark_jars

    return {"jars": fetch_spark_jars()}


def connect_server(args: argparse.Namespace) -> Any:
    from sluice.spark import connect_server_command

    command = connect_server_command(args.master, args.port, args.host)
    os.execv(command[0], command)


def init(args: argparse.Namespace) -> Any:
    """Write the DAG files into a folder of pipeline specs (Airflow's DAGs folder by default);
    an existing file with other content is left alone and reported."""
    from sluice.paths import dags_folder

    folder = Path(args.folder) if args.folder else dags_folder()
    folder.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for name, text in DAG_FILES.items():
        path = folder / name
        if path.exists() and path.read_text() != text and not args.force:
            kept.append(str(path))
            continue
        path.write_text(text)
        written.append(str(path))
    return {"folder": str(folder), "written": written, "kept (differs; --force replaces)": kept}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    def command(name: str, func: Callable[[argparse.Namespace], Any], help_text: str,
                pipeline: bool = True, store: bool = False, api: bool = False) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=func.__doc__ or help_text)
        sub.set_defaults(func=func)
        if pipeline:
            sub.add_argument("--pipeline", required=True)
        if store:
            sub.add_argument("--store-url", help="epoch store URL (default: $SLUICE_STORE_URL, else the usual lookup)")
        if api:
            sub.add_argument("--api-url", default=os.environ.get("SLUICE_API_URL"),
                             help="act through this Airflow api-server (POST /sluice/pipelines/<p>/actions/...) "
                                  "as SLUICE_API_USER/SLUICE_API_PASSWORD (or SLUICE_API_TOKEN), who needs edit "
                                  "access to the pipeline's DAG; default $SLUICE_API_URL, else locally")
        return sub

    sub = command("run-group", run_group, "run one group of epochs in one Spark application", store=True)
    sub.add_argument("--group", help="run the group this owner planned (its id, or None when the plan step only "
                                     "recorded a rollback)")
    sub.add_argument("--owner", help="lease owner (default: this process)")
    sub.add_argument("--plan", action="store_true", help="plan the next group first, then publish it")
    sub.add_argument("--drain", action="store_true", help="with --plan: repeat until the backlog is empty")
    sub.add_argument("--epoch-size", type=int)
    sub.add_argument("-k", type=int)
    sub.add_argument("--first-size", type=int, help="with --plan: the first epoch's files (the controllers' probe "
                                                     "of one larger epoch; the others hold --epoch-size)")
    sub.add_argument("--plan-extra", type=json.loads, default=None,
                     help="with --plan: JSON recorded in the group's plan (the controllers' decision)")
    sub.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)

    sub = command("skip-file", skip_file, "skip a gone or unreadable file, recorded", store=True, api=True)
    sub.add_argument("--file", required=True, help="the file's path (absolute, or relative to the landing folder)")
    sub.add_argument("--reason", required=True, help="why; recorded with who and when")
    sub.add_argument("--by", help="who skips it (default: cli:<user>)")

    sub = command("rebuild-store", rebuild_store, "rebuild a lost epoch store from the tables' records", store=True)
    sub.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)

    take_over = "take the lease from the pipeline's own DAG runs; only when none runs"
    sub = command("rollback", rollback, "trigger sluice_rollback in Airflow", api=True)
    sub.add_argument("--to-epoch", type=int, required=True, help="the first epoch rolled back (it and every later one)")
    sub.add_argument("--reason", required=True)
    sub.add_argument("--no-recompute", action="store_true", help="remove the epochs' rows; do not recompute them")
    sub.add_argument("--take-over", action="store_true", help=take_over)

    sub = command("preview-rollback", preview_rollback, "recompute a rollback's epochs into shadow tables and diff "
                  "them with the published ones (changes nothing)", store=True, api=True)
    sub.add_argument("--to-epoch", type=int, required=True, help="the first epoch rolled back (it and every later one)")
    sub.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)

    sub = command("recover", recover, "trigger sluice_recover in Airflow (rerun failed or unfinished epochs)", api=True)
    sub.add_argument("--withdraw-rollback", action="store_true",
                     help="first withdraw a recorded rollback whose restores never started, instead of finishing it")
    sub.add_argument("--take-over", action="store_true", help=take_over)
    command("jars", jars, "fetch the Delta and Kafka jars into the jars folder (once; Maven Central)", pipeline=False)

    sub = command("connect-server", connect_server, "a Spark Connect server with sluice's settings", pipeline=False)
    sub.add_argument("--master", default="local[*]")
    sub.add_argument("--host", default="127.0.0.1")
    sub.add_argument("--port", type=int, default=15002)

    sub = command("init", init, "write the DAG files into a folder of pipeline specs", pipeline=False)
    sub.add_argument("folder", nargs="?", help="default: Airflow's DAGs folder")
    sub.add_argument("--force", action="store_true", help="replace DAG files that differ")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its result is printed as the last line, in JSON."""
    args = _parser().parse_args(argv)
    try:
        result = args.func(args)
    except SluiceError as exc:  # a clear one-line error (busy pipeline, bad spec, lost file)
        print(f"sluice {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=str))
    return 0
