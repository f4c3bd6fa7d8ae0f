"""A large file written slowly into the landing folder while discovery polls run: registered
once, read once, and the table equal to the oracle (issue 37's goal for ``source.settle_s``).

    python -m bench.slow_write [--quick] [--mb 1000] [--seconds 60] [--poll 0.5]

An uploader writes one YSB events file of ``--mb`` MB (``--quick``: 100 MB) in place, under its
final name, in 4 MB appends spread over ``--seconds``: the shape of an ``scp`` or an SFTP upload,
not a rename into place. Meanwhile a poller calls the file source's ``discover`` (what each
``plan_group`` does; a new source object each time, as each task has) every ``--poll`` seconds,
and goes on after the upload until the file is registered. Then one group (k = 1, one file per
epoch) runs in-process on local Spark (the file is read line by line above 8 MiB).

Checked, each against the raw file, not sluice's reading of it: the manifest holds the file
exactly once, at its final size; the epoch's input count equals the file's lines (read once:
a second read would double it); its rejected count and ``_rejected`` equal the malformed lines;
the table equals the views per campaign and window computed line by line from the file.
Writes ``bench/results/slow_write.json`` and ``slow_write.png``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import configure, results_dir, session, write_result, write_spec, ysb_spec_yaml
from bench.large_file import MB, check, generate, oracle

CHUNK = 4 * MB


def upload(source: Path, target: Path, seconds: float, log: list[tuple[float, int]], t0: float) -> None:
    """Append ``source`` to ``target`` in ``CHUNK`` writes evenly over ``seconds``."""
    size = source.stat().st_size
    chunks = max(1, -(-size // CHUNK))
    pause = seconds / chunks
    written = 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        for i in range(chunks):
            data = src.read(CHUNK)
            dst.write(data)
            dst.flush()
            written += len(data)
            log.append((round(time.monotonic() - t0, 2), written))
            time.sleep(max(0.0, (i + 1) * pause - (time.monotonic() - t0)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 MB over 20 s")
    parser.add_argument("--mb", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--poll", type=float, default=0.5)
    parser.add_argument("--settle", type=float, default=5.0, help="source.settle_s (the spec's default)")
    args = parser.parse_args(argv)
    size_mb = args.mb or (100 if args.quick else 1000)
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    work = configure("slow_write")

    from sluice.protocol.run import run_once
    from sluice.sources import source_for
    from sluice.store import EpochStore

    source = work / "source" / "ysb-big.json"
    generated = generate(source, size_mb * MB)
    landing = work / "landing"
    landing.mkdir()
    raw = ysb_spec_yaml("slow_write", landing, work / "tables" / "campaign_views", epoch_files=1, k=1)
    # The shipped ysb pipeline says 0 (its generator renames files into place); an uploader
    # writing in place needs the default.
    raw["source"]["settle_s"] = args.settle
    spec = write_spec(work / "pipelines", raw)
    store = EpochStore(os.environ["SLUICE_STORE_URL"])
    target = landing / "ysb-000000.json"
    print(f"slow_write: {generated / MB:,.0f} MB written over {seconds:.0f} s, polls every {args.poll} s, "
          f"source.settle_s = {spec.source.settle_s}", flush=True)

    written: list[tuple[float, int]] = []
    polls: list[dict[str, Any]] = []
    t0 = time.monotonic()
    uploader = threading.Thread(target=upload, args=(source, target, seconds, written, t0))
    uploader.start()
    registered_at = None
    while uploader.is_alive() or registered_at is None:
        end = source_for(spec, store).discover()
        now = round(time.monotonic() - t0, 2)
        entries = [e for e in store.manifest(spec.name) if e.path == str(target)]
        polls.append({"t": now, "manifest_end": end, "entries": len(entries),
                      "on_disk": target.stat().st_size if target.exists() else 0, "writing": uploader.is_alive()})
        if entries and registered_at is None:
            registered_at = now
        if now > seconds + 10 * spec.source.settle_s + 60:
            raise RuntimeError(f"the file was not registered {now:.0f} s after its upload began")
        time.sleep(args.poll)
    uploader.join()
    upload_s = written[-1][0]
    entries = [e for e in store.manifest(spec.name) if e.path == str(target)]
    final = target.stat().st_size
    print(f"  upload took {upload_s:.1f} s; {len(polls)} polls; registered at {registered_at} s, "
          f"{len(entries)} manifest entr{'y' if len(entries) == 1 else 'ies'} of {entries[0].size:,} bytes "
          f"(on disk {final:,})", flush=True)

    expected = oracle(target)
    spark = session("sluice-bench-slow-write")
    t1 = time.perf_counter()
    done = run_once(spec, store, spark, epoch_size=1, k=1, drain=True)
    group_wall = time.perf_counter() - t1
    epochs = store.epochs(spec.name)
    run = {"tables": {"sink": spec.sinks[0].path, "rejected": spec.rejected_table},
           "epochs": [{"rows": e.rows} for e in epochs]}
    checked = check(spark, run, expected)
    result = {
        "mb": round(final / MB, 1), "upload_s": upload_s, "poll_interval_s": args.poll,
        "settle_s": spec.source.settle_s, "polls": len(polls),
        "polls_while_writing": sum(p["writing"] for p in polls),
        "registered_at_s": registered_at, "registered_after_upload_s": round(registered_at - upload_s, 2),
        "manifest_entries": len(entries), "registered_bytes": entries[0].size, "bytes_on_disk": final,
        "registered_once": len(entries) == 1 and entries[0].size == final,
        "groups": len(done), "epochs": len(epochs), "group_wall_s": round(group_wall, 1),
        "read_once": checked["input_records"] == expected["records"],
        **checked,
        "config": {"chunk_mb": CHUNK / MB, "spark": "local[2]", "quick": args.quick},
        "series": {"written": written, "polls": [[p["t"], p["entries"]] for p in polls]},
    }
    ok = result["registered_once"] and result["read_once"] and checked["table_equals_oracle"] and \
        checked["counts_equal_oracle"]
    result["ok"] = ok
    write_result("slow_write", result)
    plot(result, results_dir() / "slow_write.png")
    print({k: result[k] for k in ("registered_once", "read_once", "table_equals_oracle", "counts_equal_oracle",
                                  "input_records", "oracle_records", "registered_after_upload_s", "group_wall_s")})
    spark.stop()
    return 0 if ok else 1


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    written = result["series"]["written"]
    ax.plot([t for t, _ in written], [b / MB for _, b in written], label="bytes on disk (MB)")
    ax.axvline(result["registered_at_s"], color="black", linestyle="--",
               label=f"registered ({result['manifest_entries']} entry, {result['registered_bytes'] / MB:,.0f} MB)")
    polls = result["series"]["polls"]
    ax.scatter([t for t, _ in polls], [0] * len(polls), marker="|", color="grey", label="discovery polls")
    ax.set_xlabel("seconds since the upload began")
    ax.set_ylabel("MB")
    ax.set_title(f"A {result['mb']:,.0f} MB file uploaded in place over {result['upload_s']:.0f} s "
                 f"(settle_s {result['settle_s']:g})")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
