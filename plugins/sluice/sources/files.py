"""``FileSource``: a landing folder of JSON-lines, CSV or Parquet files as an offset source.

Offsets are positions in a manifest of discovered files, persisted in the epoch store and
ordered by modification time, then path. A position never changes once given, so an epoch's
range ``[start, end)`` always names the same files. Files must be immutable once they land:
writers should write to a hidden name (``.name`` or ``_name``) and rename, which Spark and sluice
both ignore until then. A file written in place is registered only once it has settled
(``settled``): unchanged for ``source.settle_s`` seconds.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from sluice.boundary import host_time
from sluice.errors import SourceError
from sluice.sources.base import Backlog, Source, lookup
from sluice.spec import PipelineSpec
from sluice.store import EpochStore, ManifestEntry

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import Column, DataFrame, SparkSession

    from sluice.model import EpochRange


log = logging.getLogger(__name__)

#: Where a file landed again under a name already seen, with new content, is kept (in the
#: landing folder, which listing ignores: ``_`` names), one immutable copy per version. Written
#: only through real folders: a symbolic link on the way is refused (``_private_folder``).
RELANDED_PARTS = ("_sluice", "relanded")
RELANDED_DIR = os.path.join(*RELANDED_PARTS)
_RELANDED = re.compile(r"^(?P<stem>.*)\.relanded-(?P<mtime_ns>\d+)-(?P<size>\d+)(?P<suffix>\.[^.]*)?$")

#: What an operator can do about a file that is gone, unreadable or changed.
SKIP_HINT = ("Put the file back as it was, or skip it on purpose (recorded, through sluice_skip_file): the "
             "console's skip-file action, `sluice skip-file` or `make skip-file PIPELINE=<name> FILE=<path> "
             "REASON=<why>`")


@dataclass(frozen=True)
class Sighting:
    """A landed file as a poll saw it: its size and modification time, and since when (the
    host's clock) it has looked like that."""

    size: int
    mtime: float
    since: float


def settled(size: int, mtime: float, now: float, settle_s: float, seen: Sighting | None) -> bool:
    """Whether a landed file has stopped changing: nothing changed it for ``settle_s`` seconds,
    as its modification time says (one poll is enough, in any process), or as the polls of one
    source object saw it (``seen``: the earlier sighting; this covers a modification time ahead
    of this host's clock). A change since the earlier sighting means it is being written,
    whatever its modification time says. ``settle_s`` 0: every file is settled."""
    if settle_s <= 0:
        return True
    if seen is not None and (seen.size, seen.mtime) != (size, mtime):
        return False
    return now - mtime >= settle_s or (seen is not None and now - seen.since >= settle_s)


class LinkRefused(OSError):
    """A path component sluice would write through is a symbolic link."""


def _private_folder(root: str, parts: tuple[str, ...]) -> int:
    """An open descriptor of ``root/parts...``, each part made if missing and opened without
    following a symbolic link (raises ``LinkRefused`` naming the link): files created through
    it stay inside ``root`` whatever links an uploader puts in the landing folder."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    path = root
    try:
        for part in parts:
            path = os.path.join(path, part)
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                        os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise LinkRefused(errno.ELOOP, "a symbolic link", path) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


class FileSource(Source):
    def __init__(self, spec: PipelineSpec, store: EpochStore) -> None:
        super().__init__(spec, store)
        self.folder = spec.landing_dir
        self.refused: list[str] = []  # of the last listing: symbolic links leading out of the folder
        #: New files not settled yet, as this object's polls saw them (``settled``). Only a
        #: long-lived object (a poller) has earlier sightings: between processes (the trigger
        #: polls, a run discovers) the modification time alone decides.
        self._sightings: dict[str, Sighting] = {}

    # -- discovery ---------------------------------------------------------------------------

    def list_folder(self) -> list[tuple[str, int, float]]:
        """``(path, size, mtime)`` of landed files, ordered by mtime then path.

        A symbolic link is followed only within the landing folder: one that leads out of it
        (``/etc/passwd``, another team's folder) is refused, logged and listed in
        ``refused`` (and in the backlog the API shows) until an operator removes it or copies
        the file in; the other files go on."""
        if not self.folder.is_dir():
            raise SourceError(
                f"pipeline {self.spec.name!r}: landing folder {self.folder} does not exist "
                f"(source.path in {self.spec.path})"
            )
        root = os.path.realpath(self.folder)
        found, refused = [], []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name.startswith((".", "_")) or not entry.is_file():
                    continue
                if not fnmatch.fnmatch(entry.name, self.spec.source.pattern):
                    continue
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if os.path.commonpath([root, target]) != root:
                        refused.append(f"{os.path.abspath(entry.path)} is a symbolic link to {target}, outside "
                                       f"the landing folder {root}: not read (remove it, or copy the file in)")
                        continue
                st = entry.stat()
                found.append((os.path.abspath(entry.path), st.st_size, st.st_mtime))
        found.sort(key=lambda f: (f[2], f[0]))
        refused.sort()
        if refused != self.refused:  # once per change, not at every poll
            for reason in refused:
                log.warning("pipeline %s: %s", self.spec.name, reason)
        self.refused = refused
        return found

    def discover(self) -> int:
        """Append newly landed files to the manifest; returns the manifest's end offset.

        A file is known by its path, size and modification time. One landed again under a name
        already seen, with new content (a daily export overwriting yesterday's), is new data:
        it is copied, as it is now, to ``_sluice/relanded/`` in the landing folder and that copy
        is registered, so its epoch can be read again however often the name is reused. (The
        epoch of the previous content cannot be recomputed: that content is gone.)

        A file still being written (``settled``) is left for a later call: registered before it
        settled, it would fail its epoch as changed, and each later size would be new data."""
        files = []
        unseen, seen_paths = self._unseen(self.list_folder())
        unseen, settling = self._settle(unseen)
        if settling:
            log.info("pipeline %s: %d file(s) changed less than source.settle_s = %s s ago, registered once "
                     "they settle: %s", self.spec.name, len(settling), self.spec.source.settle_s,
                     ", ".join(p for p, _, _ in settling[:5]) + (" ..." if len(settling) > 5 else ""))
        for path, size, mtime in unseen:
            if path in seen_paths:
                path, size, mtime = self._keep_copy(path)
                log.warning("pipeline %s: %s landed again with new content; kept as %s (new data)",
                            self.spec.name, self._original(path), path)
            files.append((path, size, mtime))
        return self.store.register_files(self.spec.name, files)

    def _unseen(self, listing: list[tuple[str, int, float]]) -> tuple[list[tuple[str, int, float]], set[str]]:
        """Landed files not in the manifest as they are now (a new path, or new content under a
        path seen before: a different size or modification time), and the paths seen before."""
        seen = {(self._original(p), size, mtime) for p, size, mtime in self.store.known_files(self.spec.name)}
        return [f for f in listing if f not in seen], {p for p, _, _ in seen}

    def _settle(self, new: list[tuple[str, int, float]]) -> tuple[list[tuple[str, int, float]],
                                                                   list[tuple[str, int, float]]]:
        """``new`` files split into those that settled and those still settling (see ``settled``;
        "now" is ``boundary.host_time()``, the simulation's virtual clock there)."""
        now, settle_s = host_time(), self.spec.source.settle_s
        ready, settling, sightings = [], [], {}
        for path, size, mtime in new:
            seen = self._sightings.get(path)
            if settled(size, mtime, now, settle_s, seen):
                ready.append((path, size, mtime))
                continue
            settling.append((path, size, mtime))
            unchanged = seen is not None and (seen.size, seen.mtime) == (size, mtime)
            sightings[path] = seen if unchanged else Sighting(size, mtime, now)
            if mtime - now > settle_s and not unchanged:  # said once per change of the file
                log.warning("pipeline %s: %s was modified %.0f s ahead of this host's clock (clocks out of "
                            "sync?); it is registered once unchanged for %s s", self.spec.name, path,
                            mtime - now, settle_s)
        self._sightings = sightings
        return ready, settling

    @property
    def _relanded_dir(self) -> str:
        return os.path.join(os.path.abspath(self.folder), RELANDED_DIR)

    def _original(self, path: str) -> str:
        """The landed path a manifest entry stands for (a kept copy's original name)."""
        folder, name = os.path.split(path)
        match = _RELANDED.match(name)
        if match is None or folder != self._relanded_dir:
            return path
        return os.path.join(os.path.abspath(self.folder), match["stem"] + (match["suffix"] or ""))

    def _keep_copy(self, path: str) -> tuple[str, int, float]:
        """Copy the file as it is now (one open: a rename that replaces it meanwhile cannot mix
        two versions) under a name that holds its modification time and size. Nothing is
        written through a symbolic link: an uploader's ``_sluice -> ../dags`` would otherwise
        put the copy, its content, wherever the link leads."""
        folder = self._relanded_dir
        try:
            with open(path, "rb") as src:
                st = os.fstat(src.fileno())
                stem, suffix = os.path.splitext(os.path.basename(path))
                name = f"{stem}.relanded-{st.st_mtime_ns}-{st.st_size}{suffix}"
                tmp = f".{name}.tmp"
                dir_fd = _private_folder(os.path.abspath(self.folder), RELANDED_PARTS)
                try:
                    try:  # a temporary file left by a crash, or a link put there: removed, never followed
                        os.unlink(tmp, dir_fd=dir_fd)
                    except FileNotFoundError:
                        pass
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                    with os.fdopen(os.open(tmp, flags, 0o666, dir_fd=dir_fd), "wb") as dst:
                        shutil.copyfileobj(src, dst)
                        dst.flush()
                        os.utime(dst.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
                    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # a link there is replaced
                    kept = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                finally:
                    os.close(dir_fd)
        except LinkRefused as exc:
            raise SourceError(f"pipeline {self.spec.name!r}: {path} landed again with new content, and its copy "
                              f"was not kept: {exc.filename} is a symbolic link. sluice never writes through a "
                              f"link in the landing folder (it could lead anywhere, such as the DAGs folder); "
                              f"remove it ({RELANDED_DIR} must be plain folders, or absent)") from None
        except OSError as exc:
            raise SourceError(f"pipeline {self.spec.name!r}: {path} landed again with new content, and its copy "
                              f"could not be kept in {folder}: {exc.strerror or exc}") from None
        return os.path.join(folder, name), kept.st_size, kept.st_mtime

    def backlog(self, listing: list[tuple[str, int, float]] | None = None) -> Backlog:
        """Unplanned data: manifest entries past the next offset plus files not yet registered
        (``listing``: a ``list_folder()`` result the caller already has).

        Read-only (it registers nothing), so the backlog trigger can poll it cheaply. A file still
        being written is not counted until it settles (``discover`` would not register it).
        """
        next_offset = self.store.next_offset(self.spec.name)
        pending = self.store.manifest(self.spec.name, start=next_offset)
        listing = self.list_folder() if listing is None else listing
        new, _ = self._settle(self._unseen(listing)[0])
        sizes = [e.size for e in pending] + [f[1] for f in new]
        mtimes = [e.mtime for e in pending] + [f[2] for f in new]
        oldest = host_time() - min(mtimes) if mtimes else None
        return Backlog(files=len(sizes), bytes=sum(sizes), oldest_age_s=oldest, next_offset=next_offset,
                       refused=tuple(self.refused), arrivals=tuple(f[2] for f in listing))

    def describe(self, entries: list[ManifestEntry]) -> dict[str, Any]:
        return {"files": [e.path for e in entries if e.skipped is None],
                "skipped": [e.path for e in entries if e.skipped is not None]}

    # -- ranges ------------------------------------------------------------------------------

    def check_retained(self, start: int, end: int) -> list[ManifestEntry]:
        """The files of the range to read: raise ``SourceError`` naming the file unless each is
        still there, readable and unchanged since it was discovered (a rerun must read the same
        records). Files an operator skipped (``sluice_skip_file``) are left out."""
        entries = [e for e in self.entries(start, end) if e.skipped is None]
        for entry in entries:
            with self._open(entry) as fh:
                fh.read(1)
        return entries

    def read_bytes(self, entry: ManifestEntry) -> bytes:
        """The content of a retained file, for a reader in plain Python: exactly the registered
        bytes, or ``SourceError`` naming the file (it changed since ``check_retained``)."""
        with self._open(entry) as fh:
            data = fh.read(entry.size + 1)  # one byte more: one appended meanwhile shows
            if len(data) != entry.size:
                raise self._changed(entry, os.fstat(fh.fileno()).st_size)
        return data

    def _open(self, entry: ManifestEntry) -> BinaryIO:
        """``entry``'s file, opened for reading, after checking (on the open file: no rename
        can slip between check and read) that it still has its registered size and
        modification time."""
        try:
            fh = open(entry.path, "rb")
        except FileNotFoundError:
            raise SourceError(f"pipeline {self.spec.name!r}: file {entry.path} (offset "
                              f"{entry.position}) is no longer in the landing folder. {SKIP_HINT}") from None
        except OSError as exc:
            raise SourceError(f"pipeline {self.spec.name!r}: cannot read file {entry.path} "
                              f"(offset {entry.position}): {exc.strerror or exc}. {SKIP_HINT}") from None
        st = os.fstat(fh.fileno())
        if st.st_size != entry.size or st.st_mtime != entry.mtime:
            fh.close()
            raise self._changed(entry, st.st_size)
        return fh

    def _changed(self, entry: ManifestEntry, size: int) -> SourceError:
        return SourceError(f"pipeline {self.spec.name!r}: file {entry.path} (offset {entry.position}) "
                           f"changed after it was discovered (size {entry.size} -> {size} "
                           "bytes, or its modification time); landed files must be immutable. Landed again "
                           "with new content on purpose? The new content is read as new data (kept under "
                           f"{RELANDED_DIR}); this range's old content is gone. {SKIP_HINT}")

    def read(self, spark: SparkSession, start: int, end: int) -> DataFrame:
        """Read exactly the files of ``[start, end)`` (less any an operator skipped).

        Columns: the spec's schema, ``_file``, ``_line`` (1-based line, or row index for
        Parquet), ``_corrupt_record`` (the raw text of a record that did not parse) and
        ``_defect`` (why a line is bad before any parsing: too large, not UTF-8, an array).
        """
        return self._read(spark, self.check_retained(start, end))

    def read_epochs(self, spark: SparkSession, epochs: list[EpochRange]) -> DataFrame:
        """Read a group's contiguous epochs in one scan: ``read`` of their whole range, with the
        ``_epoch`` each record's file belongs to (by its manifest position; looked up once per
        file where files are read whole, before they are split into records)."""
        entries = self.check_retained(epochs[0].start, epochs[-1].end)
        # A lookup even for one epoch: an int literal is written into the generated Java source,
        # so each new epoch id made the read's whole stage a new class to compile, and to
        # JIT-compile again, every group on a long-lived Connect server; a map is a reference.
        owner = {e.path: next(epoch.epoch_id for epoch in epochs if epoch.start <= e.position < epoch.end)
                 for e in entries}
        return self._read(spark, entries, lambda file: lookup(file, owner))

    def _read(self, spark: SparkSession, entries: list[ManifestEntry],
              epoch_of: Callable[[Column], Column] | None = None) -> DataFrame:
        """``read`` of retained manifest entries; with ``epoch_of``, an ``_epoch`` column too."""
        from pyspark.sql import functions as F

        schema = ", ".join(f"`{k}` {v}" for k, v in self.spec.source.schema_.items())
        if not entries:  # every file of the range was skipped on purpose
            return self.empty_records(spark, epoch_of is not None)
        if self.spec.source.format != "parquet":
            return self.parse_lines(self._lines(spark, entries, epoch_of))
        df = spark.read.schema(schema).parquet(*[e.path for e in entries]).select(
            *[F.col(f"`{c}`") for c in self.spec.source.schema_],
            file_name(F.col("_metadata.file_path")).alias("_file"),
            (F.col("_metadata.row_index") + 1).alias("_line"),
            F.lit(None).cast("string").alias("_corrupt_record"),
            F.lit(None).cast("string").alias("_defect"),
        )
        return df.withColumn("_epoch", epoch_of(F.col("_file"))) if epoch_of else df

    def _lines(self, spark: SparkSession, entries: list[ManifestEntry],
               epoch_of: Callable[[Column], Column] | None = None) -> DataFrame:
        """Numbered lines (``_file``, ``_line``, ``_text``, and ``_epoch = epoch_of(_file)``) of
        JSON or CSV files: small files whole (one row per file, split here: cheap for many
        small files); large ones line by line, so one file never has to fit in a single string.

        Spark reads lazily, after ``check_retained``: a small file's bytes are checked against
        its registered size as they are read (one comparison per file). A large file read line
        by line is not (its line ends are gone by then); settling (``settled``) is its guard."""
        from functools import reduce

        small = [e for e in entries if e.size <= WHOLE_FILE_MAX_BYTES]
        large = [e.path for e in entries if e.size > WHOLE_FILE_MAX_BYTES]
        parts = ([split_lines(spark.read.text([e.path for e in small], wholetext=True), epoch_of,
                              sizes={e.path: e.size for e in small}, pipeline=self.spec.name)] if small else []) + (
            [number_lines(spark, large, epoch_of)] if large else [])
        return reduce(lambda a, b: a.unionByName(b), parts)

    def parse(self, files: DataFrame) -> DataFrame:
        """Parse JSON-lines or CSV files read whole (``text`` with ``wholetext``: one row per
        file). Works on a batch or a streaming read alike."""
        return self.parse_lines(split_lines(files))



#: Files up to this size are read whole and split into lines; larger ones line by line.
WHOLE_FILE_MAX_BYTES = 8 * 1024 * 1024
#: The UTF-8 byte-order mark, as Spark's text columns hold it (U+FEFF).
BOM = "\ufeff"


def file_name(uri: Column) -> Column:
    """The file system path of Spark's ``_metadata.file_path`` (a ``file:`` URI, %-encoded), as
    the manifest holds it. A literal '+' stays a '+' (url_decode would make it a space)."""
    from pyspark.sql import functions as F

    return F.url_decode(F.regexp_replace(F.regexp_replace(uri, "^file:", ""), "\\+", "%2B"))


def split_lines(files: DataFrame, epoch_of: Callable[[Column], Column] | None = None,
                sizes: dict[str, int] | None = None, pipeline: str = "") -> DataFrame:
    """``_file`` (its path), ``_line`` (1-based), ``_text`` (and ``_epoch = epoch_of(_file)``)
    from files read whole (one row per file): what depends on the file only is computed once
    per file, before the split. ``sizes`` (path -> registered bytes): a file read with other
    bytes fails the read, naming it. A leading byte-order mark is not part of line 1 (Hadoop's
    line reader, behind ``number_lines``, skips it by itself).

    Split at ``\\n``, then one ``\\r`` cut from a line's end: a one-character separator takes
    Java's ``String.split`` fast path, where ``\\r?\\n`` ran the regex engine over every file
    (~3 of the read's ~14 µs a record, on 2 cores). A last line ending in a lone ``\\r`` loses it
    too, as Hadoop's line reader (large files) ends a line there."""
    from pyspark.sql import functions as F

    files = files.select(file_name(F.col("_metadata.file_path")).alias("_file"), "value")
    if sizes is not None:  # the raw bytes, before the split decodes them
        read = F.octet_length("value")
        registered = lookup(F.col("_file"), {p: F.lit(n).cast("long") for p, n in sizes.items()})
        files = files.withColumn("value", F.when(read == registered, F.col("value")).otherwise(F.raise_error(
            F.concat(F.lit(f"pipeline {pipeline!r}: file "), F.col("_file"), F.lit(" was read with "),
                     read.cast("string"), F.lit(" bytes, registered with "), registered.cast("string"),
                     F.lit("; it changed after it was discovered (landed files must be immutable)")))))
    if epoch_of:
        files = files.withColumn("_epoch", epoch_of(F.col("_file")))
    epoch = ["_epoch"] if epoch_of else []
    text = F.col("_text")
    return files.select(
        "_file", *epoch, F.posexplode(F.split(strip_bom(F.col("value")), "\n")).alias("_pos", "_text"),
    ).select("_file", (F.col("_pos") + 1).alias("_line"),
             F.when(text.endswith("\r"), F.expr("substring(_text, 1, length(_text) - 1)")).otherwise(text)
             .alias("_text"), *epoch)


def strip_bom(text: Column) -> Column:
    """``text`` without a leading UTF-8 byte-order mark (Excel's "CSV UTF-8", Notepad and some
    exporters write one), which would otherwise make a file's first record malformed."""
    from pyspark.sql import functions as F

    return F.when(text.startswith(BOM), F.substring(text, 2, 2**31 - 1)).otherwise(text)


def number_lines(spark: SparkSession, paths: list[str],
                 epoch_of: Callable[[Column], Column] | None = None) -> DataFrame:
    """``_file`` (its path), ``_line`` (1-based), ``_text`` (and ``_epoch = epoch_of(_file)``)
    of files read line by line, without a shuffle: a block of a file (a split; a file up to
    ``spark.sql.files.maxPartitionBytes`` is one) is read by one task in order, so its lines
    have consecutive ``monotonically_increasing_id``s. A first pass counts each block's lines
    and finds its first id (one small row per block, collected); the second reads the lines
    again and numbers each from its id, its block's first id and the lines of the file's
    earlier blocks. Both scans plan the same splits, so they assign the same ids (the files
    were checked unchanged before). What depends on the file only (its path, its epoch) is one
    lookup per line in a map of the files, not computed per line."""
    from itertools import chain

    from pyspark.sql import functions as F

    def scan() -> DataFrame:
        return spark.read.text(paths).select(
            F.col("_metadata.file_path").alias("_uri"), F.col("_metadata.file_block_start").alias("_block"),
            F.monotonically_increasing_id().alias("_row"), F.col("value").alias("_text"))

    blocks = sorted(scan().groupBy("_uri", "_block")
                    .agg(F.min("_row").alias("first"), F.count(F.lit(1)).alias("lines"))
                    .select("*", file_name(F.col("_uri")).alias("path")).collect(),
                    key=lambda b: (b["_uri"], b["_block"]))
    if not blocks:  # only empty files: no lines
        lines = scan().select(F.col("_uri").alias("_file"), F.col("_row").alias("_line"), "_text")
        return lines.withColumn("_epoch", F.lit(None).cast("int")) if epoch_of else lines
    shift: dict[str, dict[int, int]] = {}  # per file and block: its lines' numbers minus their ids
    path: dict[str, str] = {}
    before: dict[str, int] = {}
    for b in blocks:
        uri = b["_uri"]
        shift.setdefault(uri, {})[b["_block"]] = before.get(uri, 0) + 1 - b["first"]
        before[uri] = before.get(uri, 0) + b["lines"]
        path[uri] = b["path"]

    def file_info(uri: str) -> Column:
        fields = [F.lit(path[uri]).alias("file"), F.create_map(*chain.from_iterable(
            (F.lit(k).cast("long"), F.lit(v).cast("long")) for k, v in shift[uri].items())).alias("shift")]
        if epoch_of:  # a constant per file: Spark folds it
            fields.append(epoch_of(F.lit(path[uri])).alias("epoch"))
        return F.struct(*fields)

    info = lookup(F.col("_uri"), {uri: file_info(uri) for uri in shift})
    return scan().select(info.getField("file").alias("_file"),
                         (F.col("_row") + F.element_at(info.getField("shift"), F.col("_block"))).alias("_line"),
                         "_text", *([info.getField("epoch").alias("_epoch")] if epoch_of else []))
