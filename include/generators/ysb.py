"""Yahoo Streaming Benchmark event generator, and an independent oracle of the YSB query.

    python -m include.generators.ysb --out var/landing/ysb --rate 2000 --duration 60 \
        --files-per-second 1 --seed 7 [--late-fraction 0.05 --late-max-s 30] [--realtime]

Events are JSON lines ``{user_id, page_id, ad_id, ad_type, event_type, event_time, ip_address}``
with ``event_time`` in epoch milliseconds as a string; 100 campaigns x 10 ads come from
``include/reference/ysb_ads.csv``. Files are written under a hidden name and renamed, so a
reader never sees half a file.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADS_CSV = ROOT / "include" / "reference" / "ysb_ads.csv"
AD_TYPES = ("banner", "modal", "sponsored-search", "mail", "mobile")
EVENT_TYPES = ("view", "click", "purchase")
WINDOW_MS = 10_000


def load_ads(path: Path = ADS_CSV) -> dict[str, str]:
    with open(path, newline="") as fh:
        return {row["ad_id"]: row["campaign_id"] for row in csv.DictReader(fh)}


def write_ads(path: Path = ADS_CSV, campaigns: int = 100, ads_per_campaign: int = 10, seed: int = 0) -> None:
    """The reference table (deterministic: the same ids for the same seed)."""
    rnd = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["ad_id", "campaign_id"])
        for _ in range(campaigns):
            campaign = str(uuid.UUID(int=rnd.getrandbits(128), version=4))
            for _ in range(ads_per_campaign):
                out.writerow([str(uuid.UUID(int=rnd.getrandbits(128), version=4)), campaign])


def generate(out: str | Path, *, rate: float = 1000, duration: float = 10, files_per_second: float = 1,
             seed: int = 0, start_ms: int | None = None, late_fraction: float = 0.0, late_max_s: float = 30.0,
             malformed_fraction: float = 0.0, realtime: bool = False, prefix: str = "ysb",
             progress: bool = False) -> list[Path]:
    """Write ``rate * duration`` events into ``duration * files_per_second`` files.

    Event times advance uniformly from ``start_ms``; a ``late_fraction`` of events carries an
    event time up to ``late_max_s`` seconds older (it lands in a later file than its window).
    ``malformed_fraction`` of lines are broken on purpose (bad JSON, a missing field or a
    non-numeric time) to exercise the rejected-records table.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    ads = list(load_ads())
    users = [str(uuid.UUID(int=rnd.getrandbits(128), version=4)) for _ in range(100)]
    pages = [str(uuid.UUID(int=rnd.getrandbits(128), version=4)) for _ in range(100)]
    start_ms = int(time.time() * 1000) if start_ms is None else start_ms
    n_files = max(1, round(duration * files_per_second))
    per_file = max(1, round(rate * duration / n_files))
    span_ms = 1000.0 / files_per_second
    existing = len(list(out.glob(f"{prefix}-*.json")))
    paths = []
    for f in range(n_files):
        if realtime:
            time.sleep(max(0.0, 1.0 / files_per_second))
        lines = []
        base = start_ms + f * span_ms
        for i in range(per_file):
            t = int(base + i * span_ms / per_file)
            if late_fraction and rnd.random() < late_fraction:
                t -= int(rnd.uniform(0, late_max_s * 1000))
            event = {"user_id": rnd.choice(users), "page_id": rnd.choice(pages), "ad_id": rnd.choice(ads),
                     "ad_type": rnd.choice(AD_TYPES), "event_type": rnd.choice(EVENT_TYPES),
                     "event_time": str(t), "ip_address": "1.2.3.4"}
            line = json.dumps(event)
            if malformed_fraction and rnd.random() < malformed_fraction:
                line = rnd.choice([line[: len(line) // 2],
                                   json.dumps({k: v for k, v in event.items() if k != "ad_id"}),
                                   line.replace(f'"{t}"', '"not-a-time"')])
            lines.append(line)
        path = out / f"{prefix}-{existing + f:06d}.json"
        tmp = out / f".{path.name}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        paths.append(path)
        if progress and (f + 1) % max(1, n_files // 10) == 0:
            print(f"  generated {f + 1}/{n_files} files", file=sys.stderr, flush=True)
    return paths


def parse_valid(line: str) -> dict | None:
    """The oracle's own validity rule: a JSON object with ad_id, event_type and a numeric
    event_time (the same contract as ``include/pipelines/ysb.yaml``, written independently)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    if not all(isinstance(event.get(k), str) for k in ("ad_id", "event_type", "event_time")):
        return None
    if not event["event_time"].isdigit():
        return None
    return event


#: The oracle's record size limit: the spec default of ``source.max_record_bytes``.
MAX_RECORD_BYTES = 1024 * 1024


def raw_events(paths: Iterable[str | Path]) -> Iterator[tuple[str, int, dict | None]]:
    """``(file, line, event)`` for every non-blank line of the raw files, read as bytes;
    ``event`` is None for a bad line: not UTF-8, above ``MAX_RECORD_BYTES``, or not valid by
    ``parse_valid``."""
    for path in paths:
        for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield str(path), n, None
                continue
            yield str(path), n, None if len(raw) > MAX_RECORD_BYTES else parse_valid(text)


def expected_window_counts(paths: Iterable[str | Path], ads: dict[str, str] | None = None) -> Counter:
    """Oracle: views per (campaign_id, window start in epoch ms), from the raw files."""
    ads = load_ads() if ads is None else ads
    counts: Counter = Counter()
    for _, _, event in raw_events(paths):
        if event is None or event["event_type"] != "view" or event["ad_id"] not in ads:
            continue
        t = int(event["event_time"])
        counts[(ads[event["ad_id"]], t - t % WINDOW_MS)] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate YSB ad events as JSON-lines files.")
    p.add_argument("--out", required=True, help="landing folder")
    p.add_argument("--rate", type=float, default=1000, help="events per second of event time")
    p.add_argument("--duration", type=float, default=10, help="seconds of event time")
    p.add_argument("--files-per-second", type=float, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-ms", type=int, help="event time of the first event (default: now)")
    p.add_argument("--late-fraction", type=float, default=0.0, help="share of events arriving late")
    p.add_argument("--late-max-s", type=float, default=30.0, help="how late, at most, in seconds")
    p.add_argument("--malformed-fraction", type=float, default=0.0)
    p.add_argument("--realtime", action="store_true", help="sleep between files, as a live source would")
    a = p.parse_args(argv)
    paths = generate(a.out, rate=a.rate, duration=a.duration, files_per_second=a.files_per_second, seed=a.seed,
                     start_ms=a.start_ms, late_fraction=a.late_fraction, late_max_s=a.late_max_s,
                     malformed_fraction=a.malformed_fraction, realtime=a.realtime, progress=True)
    total = sum(1 for path in paths for _ in open(path))
    print(f"wrote {len(paths)} files, {total} events, into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
