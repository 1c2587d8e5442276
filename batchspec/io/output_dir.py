"""The output directory: committed shards and their manifests, atomic commit, temporary files
(beside the output, or a local spool), the run summaries.

Every bookkeeping path is built here, on :class:`OutputDir`, under ``<output.path>/_batchspec/``:

- ``manifest/<shard>.json``: one small object per committed shard (its row count, the input's
  fingerprint, the run that committed it, each file's size and identity). One object per shard,
  never a shared file, so that workers never read-modify-write the same object.
- ``locks/<shard>.json``: the lease of the process working on a shard
  (:mod:`batchspec.leases.shard_leases`).
- ``runs/<run_id>.json``: the summary of each run.
- ``auto/<key>.json``: a ``speculative: auto`` choice (:mod:`batchspec.tune.auto`).
- ``tmp/``: files being written (local output only; for object stores they are spooled on
  local disk and committed with a single put)."""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import tempfile

from fsspec.core import url_to_fs

from batchspec.errors import InputDataError, quoted
from batchspec.io.contained import name_max, plain_relative, short_name, too_long
from batchspec.io.host import pid_alive, this_host
from batchspec.io.output_formats import OUTPUT_FORMATS, OutputFormat, all_suffixes
from batchspec.io.records import BOOKKEEPING_DIR, Shard, TableState
from batchspec.io.retry import retry
from batchspec.io.states import ShardState
from batchspec.io.urls import bound_requests, full_url, is_local_fs, store_version
from batchspec.redact import sanitize_url

log = logging.getLogger(__name__)

_TMP_NAME = re.compile(
    r"^(?P<shard>.+)~(?P<host>[^~]+)~(?P<pid>\d+)~[0-9a-f]+"
    r"(?P<suffix>" + "|".join(re.escape(s) for s in all_suffixes()) + r")\.tmp$"
)


_SPOOL_PREFIX = "batchspec-spool-"


_spool: str | None = None


def spool_dir() -> str:
    """This process's private directory (0700, from ``mkdtemp``) for files on their way to an
    object store. Spools of dead processes are removed the next time a process makes one."""
    global _spool
    if _spool is None or not os.path.isdir(_spool):
        _remove_dead_spools()
        _spool = tempfile.mkdtemp(prefix=f"{_SPOOL_PREFIX}{os.getpid()}-")
    return _spool


def _remove_dead_spools() -> None:
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_SPOOL_PREFIX):
            continue
        pid = name[len(_SPOOL_PREFIX) :].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # only our own real directories, left by a process that is gone
        if (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid()
            and pid.isdigit()
            and not pid_alive(int(pid))
        ):
            shutil.rmtree(path, ignore_errors=True)


def tmp_file_name(shard_name: str, suffix: str = ".parquet") -> str:
    """A temporary file name that says which process owns it; ``suffix`` is the final file's
    (``.parquet``, ``.output.jsonl``, ``.errors.jsonl``). The shard is named by the start of
    its name and a hash (:func:`short_name`, flat: shard names may hold /), so that a shard whose
    own output name fits the file system never gets a temporary name that does not."""
    flat = short_name(shard_name.replace("%", "%25").replace("/", "%2F"))
    return f"{flat}~{this_host()}~{os.getpid()}~{os.urandom(6).hex()}{suffix}.tmp"


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(src: str, dst: str) -> None:
    """Rename ``src`` over ``dst`` after its bytes are on disk, then persist the rename."""
    with open(src, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(src, dst)
    fsync_dir(os.path.dirname(dst) or ".")


def remove_orphan_tmp_files(directory: str) -> int:
    """Delete temporary files left by dead processes of this host (a SIGKILL, an OOM kill)."""
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        m = _TMP_NAME.match(name)
        if m and m["host"] == this_host() and not pid_alive(int(m["pid"])):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def same_input(recorded: dict | None, current: dict) -> bool:
    """Whether a manifest's ``input_fingerprint`` is the shard's input now. ``deletes`` (an
    Iceberg data file's delete files, in manifests of earlier batchspec versions) is no part of
    a data file's identity: rows deleted after a shard was answered stay answered."""
    if recorded is None:
        return False
    return {k: v for k, v in recorded.items() if k != "deletes"} == current


def _manifest_shaped(record: dict) -> bool:
    """Whether a manifest's fields that are read as objects are objects (or absent)."""
    return all(
        value is None or isinstance(value, dict)
        for key, value in record.items()
        if key in ("input_fingerprint", "spec_fingerprint", "metadata") or key.endswith("_info")
    )


class OutputDir:
    """The output directory and its bookkeeping, on any fsspec filesystem. ``output_format``
    (``output.format``) names the files a shard's results are in (:attr:`format`)."""

    def __init__(
        self,
        url: str,
        storage_options: dict,
        output_format: str = "parquet",
        table: str | None = None,
        catalog: dict | None = None,
    ):
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.format: OutputFormat = OUTPUT_FORMATS[output_format]
        self.fs, self.path = url_to_fs(self.url, **storage_options)
        bound_requests(self.fs)
        self.path = self.path.rstrip("/")
        self.display_url = full_url(self.fs, self.path)
        #: An Iceberg output: the table (``NAMESPACE.TABLE``) and its catalog's properties.
        self.table, self.catalog = table, dict(catalog or {})
        self._table_state = None
        self._name_max: int | None = None

    @classmethod
    def of(cls, output) -> OutputDir:
        """The output directory (or table) of an ``OutputSpec``."""
        return cls(output.path, output.storage_options, output.format, output.table, output.catalog)

    # ------------------------------------------------------------------ a table output

    def refresh_table(self) -> None:
        """Read a table output's state again (the plan does, once)."""
        self._table_state = None

    @property
    def table_state(self) -> TableState:
        """What a table output holds, read once."""
        if self._table_state is None:
            self._table_state = self.format.table_state(self)
        return self._table_state

    def check_table_schema(self, fields: list, result_fields: list | None = None) -> None:
        """Exit 2 naming the column where an existing table's schema and this job's columns
        (``fields``: the kept input columns; ``result_fields``: its task's) differ."""
        from batchspec.columns import output_schema

        self.format.check_schema(self, output_schema(fields, result_fields))

    @property
    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def join(self, *parts: str) -> str:
        """A path below the output, from relative ``parts`` (a shard's name among them). The
        one gate of write containment: every path batchspec writes (outputs, manifests,
        leases, temporary files) is built here, and a name that is not plain and relative
        (``..``, absolute, another store, a NUL) is refused, exit 3, whatever made it; so, on
        local disk, is a path that a symbolic link already below the output leads elsewhere
        (``out/sub -> /elsewhere``): the place is checked, not only the name."""
        relative = "/".join(parts)
        why = plain_relative(relative)
        if why is None and self.is_local:
            why = self._leaves(relative)
        if why is not None:
            raise InputDataError(
                self.display_url, f"refused to use {quoted(relative)} below the output: {why}"
            )
        return posixpath.join(self.path, relative)

    def _leaves(self, relative: str) -> str | None:
        """Why the local path ``relative`` names is not below the output once symbolic links
        are followed (each folder on the way, and the file itself), or None. The output's own
        path may be a link: it is followed too."""
        root = os.path.realpath(self.path)
        real = os.path.realpath(posixpath.join(self.path, relative))
        if real == root or real.startswith(root.rstrip("/") + "/"):
            return None
        return f"a symbolic link below the output leads it outside the output, to {quoted(real)}"

    def check_folders(self) -> None:
        """Exit 3 (:meth:`join`) where a folder batchspec or the table's library writes in is a
        symbolic link leading out of the output (``_batchspec`` and its folders; a table's
        data and log folders): found when a run plans, before anything is written."""
        folders = [BOOKKEEPING_DIR] + [
            f"{BOOKKEEPING_DIR}/{name}" for name in ("manifest", "locks", "runs", "tmp", "auto")
        ]
        folders += list(self.format.folders)
        for folder in folders:
            self.join(folder)

    def unnamable(self, shard: Shard) -> str | None:
        """Why a shard's files cannot be named on this output (local disk: one of its names'
        segments is over the file system's limit, its output or data file, its manifest or its
        lease), or None where they can. Temporary files and a Lance dataset's data files have
        names of bounded length; these are the names that follow the shard's own."""
        if not self.is_local:
            return None
        if self._name_max is None:
            self._name_max = name_max(self.path)
        limit = self._name_max
        names = [
            *self.format.file_names(shard.name),
            f"{BOOKKEEPING_DIR}/manifest/{shard.name}.json",
            f"{BOOKKEEPING_DIR}/locks/{shard.name}.json",
        ]
        for name in names:
            segment = too_long(name, limit)
            if segment is not None:
                return (
                    f"its output would need the file name {quoted(segment)} "
                    f"({len(segment.encode())} bytes), longer than the {limit} bytes a file name "
                    f"may have on {self.display_url}'s file system: give the input file a shorter "
                    "name (the output mirrors the input's names)"
                )
        return None

    def output_path(self, shard: Shard) -> str:
        """The shard's output file (its results file, where the format has more than one)."""
        return self.join(shard.name + self.format.suffix)

    def part_paths(self, shard: Shard) -> dict[str, str]:
        """Every file of the shard, by part (:attr:`OutputFormat.parts`), the results first."""
        return {part: self.join(shard.name + suffix) for part, suffix in self.format.parts.items()}

    def file_url(self, shard_name: str, part: str = "output") -> str:
        """The URL of one of a shard's files, for messages (no credentials, no query)."""
        return sanitize_url(f"{self.display_url.rstrip('/')}/{shard_name}{self.format.parts[part]}")

    def publish(self, local_file: str, final: str) -> None:
        """Make a finished local file visible as ``final`` in one step: an atomic rename on
        local disk (``local_file`` is then beside it, in :meth:`tmp_dir`), a single put on an
        object store (s3fs uploads a large file in parts that become visible together)."""
        if self.is_local:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            replace_durably(local_file, final)
        else:
            retry(lambda: self.fs.put_file(local_file, final), f"writing {final}")
            os.unlink(local_file)
            self.fs.invalidate_cache(final)

    # ------------------------------------------------------------------ bookkeeping paths

    def manifest_path(self, shard_name: str) -> str:
        """The committed record of a shard."""
        return self.join(BOOKKEEPING_DIR, "manifest", shard_name + ".json")

    def locks_dir(self) -> str:
        """Where the shards' leases are."""
        return self.join(BOOKKEEPING_DIR, "locks")

    def lock_path(self, shard_name: str) -> str:
        """A shard's lease."""
        return self.join(BOOKKEEPING_DIR, "locks", shard_name + ".json")

    def run_summary_path(self, run_id: str) -> str:
        """A run's summary."""
        return self.join(BOOKKEEPING_DIR, "runs", f"{run_id}.json")

    def run_summary_paths(self) -> list[str]:
        """Every run summary present, sorted (run ids start with their UTC start time)."""
        return sorted(self.fs.glob(self.run_summary_path("*")))

    def input_pin_path(self) -> str:
        """The input table's version (snapshot) the job reads until it is done with it."""
        return self.join(BOOKKEEPING_DIR, "input_pin.json")

    def auto_choice_path(self, key: str) -> str:
        """A ``speculative: auto`` choice stored under its key."""
        return self.join(BOOKKEEPING_DIR, "auto", f"{key}.json")

    def tmp_dir(self) -> str:
        """Where shards are written before commit: beside the output on local disk (the commit
        is then an atomic rename), a local spool directory for object stores."""
        if self.is_local:
            path = self.join(BOOKKEEPING_DIR, "tmp")
            os.makedirs(path, mode=0o700, exist_ok=True)
            return path
        return spool_dir()

    # ------------------------------------------------------------------ small JSON objects

    def read_json(self, path: str) -> dict | None:
        """A small JSON object, or None if it is missing or torn."""

        def read():
            try:
                with self.fs.open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno == errno.ENAMETOOLONG:
                    return None  # a name the file system cannot hold: no such file
                raise

        data = retry(read, f"reading {path}")
        if data is None:
            return None
        try:
            record = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            record = None  # not JSON, too deep, an integer past Python's digit limit
        if not isinstance(record, dict):
            # a torn record is no record: what it stood for is done again
            log.warning("%s is not a JSON object (torn, or written by another program): ignored", path)
            return None
        return record

    def read_manifest(self, shard_name: str) -> dict | None:
        """The committed record of a shard, or None where there is none or it is not of the
        shape batchspec writes (then the shard is done again)."""
        path = self.manifest_path(shard_name)
        record = self.read_json(path)
        if record is not None and not _manifest_shaped(record):
            log.warning("%s is not a manifest batchspec wrote (a field of another type): ignored", path)
            return None
        return record

    def invalidate_manifest(self, shard_name: str) -> None:
        """Remove a shard's manifest (if any) before its files are replaced: from the first
        publish until the new manifest is written, the shard is ``partial``, never an old
        record over files of two runs (a crash between an ``openai`` output's two files)."""
        path = self.manifest_path(shard_name)
        self.remove(path)
        if self.is_local and os.path.isdir(posixpath.dirname(path)):
            fsync_dir(posixpath.dirname(path))  # gone for good before the first rename

    def write_json(self, path: str, record: dict) -> None:
        """Write a small JSON object in one put (a rename on local disk)."""
        data = (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()
        if self.is_local:
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            # beside it, named so that it fits wherever the name itself does
            tmp = posixpath.join(
                posixpath.dirname(path),
                f"{short_name(posixpath.basename(path))}.{os.getpid()}.{os.urandom(4).hex()}.tmp",
            )
            with open(tmp, "wb") as f:
                f.write(data)
            replace_durably(tmp, path)
        else:
            retry(lambda: self.fs.pipe_file(path, data), f"writing {path}")

    def remove(self, path: str) -> None:
        def rm():
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        retry(rm, f"removing {path}")

    def exists(self, path: str) -> bool:
        return retry(lambda: self.fs.exists(path), f"checking {path}")

    def output_info(self, shard: Shard) -> dict | None:
        """The committed output file's size and identity (see :meth:`file_info`), or None if
        absent."""
        return self.file_info(self.output_path(shard))

    def file_info(self, path: str) -> dict | None:
        """A file's size and identity, or None if it is absent: on an object store its version
        (ETag, generation), on local disk its inode and modification time in nanoseconds (a
        file rewritten with other bytes, even as many, has another). The manifest records it
        for each file of a shard; :meth:`inspect` compares every field it recorded."""
        if self.is_local:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno == errno.ENAMETOOLONG:
                    return None  # a name the file system cannot hold (a bad shard's): no such file
                raise
            return {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}

        def info():
            try:
                return self.fs.info(path)
            except FileNotFoundError:
                return None

        found = retry(info, f"checking {path}")
        if found is None:
            return None
        return {"size": int(found.get("size") or 0), **store_version(found)}

    def inspect(self, shard: Shard, spec_fingerprint: dict | None = None) -> tuple[ShardState, list[str]]:
        """A shard's state and, for ``stale``, the spec components that changed.

        ``committed``: the manifest, the shard's files (each one's size and identity as
        recorded, see :meth:`file_info`) and the current input agree, and the spec fingerprint
        matches; ``stale``: all that, but written under a different spec; ``partial``: a record
        or a file without the other, or they disagree (a crash between steps, a file written
        again, an input changed since, a truncated upload); ``pending``: nothing yet. A
        manifest of an older batchspec (local: the size alone) is judged on the fields it
        has. A table output: see :meth:`_inspect_table`."""
        if self.format.table:
            return self._inspect_table(shard, spec_fingerprint)
        record = self.read_manifest(shard.name)
        found = self.output_info(shard)
        # the files committed with the results file (an openai output's errors file)
        others = list(self.part_paths(shard).items())[1:]
        if record is None and found is None:
            if any(self.file_info(path) is not None for _, path in others):
                return ShardState.PARTIAL, []  # a first file, alone
            return ShardState.PENDING, []
        if (
            record is None
            or found is None
            or not same_input(record.get("input_fingerprint"), shard.fingerprint)
        ):
            return ShardState.PARTIAL, []
        expected = record.get("output_info")
        if expected and any(found.get(k) != v for k, v in expected.items()):
            return ShardState.PARTIAL, []
        for part, path in others:
            info = self.file_info(path)
            expected = record.get(f"{part}_info")
            if info is None or not expected or any(info.get(k) != v for k, v in expected.items()):
                return ShardState.PARTIAL, []
        if spec_fingerprint is not None:
            from batchspec.spec.fingerprint import describe_changes

            changed = describe_changes(record.get("spec_fingerprint") or {}, spec_fingerprint)
            if changed:
                return ShardState.STALE, changed
        return ShardState.COMMITTED, []

    def _inspect_table(self, shard: Shard, spec_fingerprint: dict | None) -> tuple[ShardState, list[str]]:
        """A shard of a table output: ``committed`` when the table records it (its ``txn``, its
        snapshot summary), whatever batchspec's manifest says: a run killed between the table
        commit and the manifest left it committed; ``stale`` where its manifest was written
        under another spec, or for another version of its input; ``pending`` otherwise (a data
        file written but never committed is named by no table commit: invisible)."""
        if not self.table_state.is_committed(shard.name):
            return ShardState.PENDING, []
        record = self.read_manifest(shard.name)
        if record is None:
            return ShardState.COMMITTED, []
        if not same_input(record.get("input_fingerprint"), shard.fingerprint):
            # the table keeps the rows of the input as it was: redoing them would add more
            return ShardState.STALE, ["input (changed since its rows were committed to the table)"]
        if spec_fingerprint is not None:
            from batchspec.spec.fingerprint import describe_changes

            changed = describe_changes(record.get("spec_fingerprint") or {}, spec_fingerprint)
            if changed:
                return ShardState.STALE, changed
        return ShardState.COMMITTED, []

    def shard_state(self, shard: Shard, spec_fingerprint: dict | None = None) -> ShardState:
        """``committed``, ``stale``, ``partial`` or ``pending`` (see :meth:`inspect`)."""
        return self.inspect(shard, spec_fingerprint)[0]

    def list_outputs(self) -> list[str]:
        """Shard names of the output files present (bookkeeping excluded); a table output's:
        the shards of batchspec's data files among the table's current files."""
        if self.format.table:
            return sorted(self.table_state.files)

        def find():
            try:
                return self.fs.find(self.path)
            except FileNotFoundError:
                return []

        names = []
        suffix = self.format.suffix
        for p in retry(find, f"listing {self.display_url}"):
            rel = p[len(self.path) :].lstrip("/")
            if rel.endswith(suffix) and not rel.startswith(BOOKKEEPING_DIR + "/"):
                names.append(rel[: -len(suffix)])
        return sorted(names)
