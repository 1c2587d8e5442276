"""Input shards over fsspec: find them, name their outputs, assign them to workers, and know
which are committed.

Bookkeeping lives under ``<output.path>/_batchspec/``:

- ``manifest/<shard>.json``: one small object per committed shard (its row count, the input's
  fingerprint, the run that committed it). One object per shard, never a shared file, so that
  workers never read-modify-write the same object.
- ``runs/<run_id>.json``: the summary of each run.
- ``locks/<shard>.json``: the lease of the process working on a shard (run id, host, pid,
  heartbeat), so that a second process started on the same job by mistake leaves it alone
  (see :mod:`batchspec.leases`).
- ``tmp/``: files being written (local output only; for object stores they are spooled on
  local disk and committed with a single put).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from batchspec.errors import InputDataError, SpecError
from batchspec.leases import LEASE_S as LEASE_S  # re-exported: the runner imports it from here
from batchspec.leases import ShardLeases, read_holder
from batchspec.redact import sanitize_url
from batchspec.storage import pid_alive, retry, this_host

BOOKKEEPING_DIR = "_batchspec"
OUTPUT_SUFFIX = ".parquet"
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Shard:
    """One input Parquet file and the output name it maps to."""

    #: Full fsspec URL of the input file.
    url: str
    #: Path on ``fs`` (protocol stripped).
    path: str
    #: Unique output stem: the output file is ``<name>.parquet``.
    name: str
    fs: Any
    #: Size, modification time or ETag: changes when the input file changes.
    fingerprint: dict

    @property
    def output_file(self) -> str:
        return self.name + OUTPUT_SUFFIX


def _has_glob(path: str) -> bool:
    return any(c in _GLOB_CHARS for c in path)


def _glob_base(path: str) -> str:
    """The directory part of a glob before its first wildcard."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _has_glob(part):
            return "/".join(parts[:i])
    return posixpath.dirname(path)


def _full_url(fs, path: str) -> str:
    if is_local_fs(fs):
        return path
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{path}"


def _version(info: dict) -> dict:
    """The version tag an object store gives a file (ETag, GCS generation), if any."""
    for key in ("ETag", "etag", "generation"):
        if info.get(key) is not None:
            return {key.lower(): str(info[key])}
    return {}


def fingerprint(info: dict) -> dict:
    """What identifies a version of an input file: size plus ETag or modification time."""
    out: dict[str, Any] = {"size": int(info.get("size") or 0)}
    for key in ("ETag", "etag", "md5Hash", "content_md5", "mtime", "LastModified", "last_modified",
                "created"):
        value = info.get(key)
        if value is not None:
            out[key.lower()] = str(value) if not isinstance(value, int | float) else value
            break
    return out


def is_local_fs(fs) -> bool:
    """Whether an fsspec filesystem is this machine's own disk (renames are atomic there)."""
    return isinstance(fs, fsspec.implementations.local.LocalFileSystem)


def _store_identity(fs, storage_options: dict) -> tuple:
    """What tells two filesystems apart: protocol family and, for object stores, the endpoint."""
    if is_local_fs(fs):
        return ("file",)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    endpoint = storage_options.get("endpoint_url") or (
        storage_options.get("client_kwargs") or {}).get("endpoint_url")
    return (protocol, endpoint)


def _norm(fs, path: str) -> str:
    """A path comparable with another on the same filesystem (symlinks resolved on local disk)."""
    path = path.rstrip("/") or "/"
    if is_local_fs(fs):
        return os.path.realpath(path)
    return path


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_no_overlap(paths: tuple[str, ...] | list[str], input_options: dict, output_url: str,
                     output_options: dict) -> None:
    """Exit 2 when the output location equals, lies inside, or contains an input location: a run
    would overwrite its own inputs, or read its own outputs back on the next run."""
    out_fs, out_path = _open_url(output_url, output_options, "output.path")
    out_id, out_norm = _store_identity(out_fs, output_options), _norm(out_fs, out_path)
    for url in paths:
        fs, path = _open_url(url, input_options, "input.path")
        if _store_identity(fs, input_options) != out_id:
            continue
        base = _glob_base(path) if _has_glob(path) else path
        base = _norm(fs, base)
        if _inside(out_norm, base) or _inside(base, out_norm):
            where = ("is the same location as" if out_norm == base else
                     "lies inside" if _inside(out_norm, base) else "contains")
            raise SpecError("output.path",
                            f"the output location {sanitize_url(output_url)!r} {where} the input "
                            f"location {sanitize_url(url)!r}: a run would overwrite or re-read its "
                            "own files; write the output to a separate directory or bucket prefix")


def same_store(paths, input_options: dict, out: OutputDir) -> bool:
    """Whether any input pattern lives on the output's store (then listing must skip it)."""
    out_id = _store_identity(out.fs, out.storage_options)
    return any(_store_identity(_open_url(u, input_options, "input.path")[0], input_options) == out_id
               for u in paths)


def _open_url(url: str, storage_options: dict, key: str):
    try:
        return url_to_fs(url, **storage_options)
    except ImportError as exc:
        raise SpecError(key, f"no fsspec backend for {sanitize_url(url)!r}: {exc} "
                             "(install batchspec[s3], [gcs] or [azure])") from exc
    except (ValueError, TypeError) as exc:
        raise SpecError(key, f"cannot open {sanitize_url(url)!r}: {exc}") from exc


def discover_shards(paths: tuple[str, ...] | list[str], storage_options: dict,
                    exclude: str | None = None, allow_empty: bool = False) -> list[Shard]:
    """List the input shards matched by ``input.path``, sorted by name.

    A shard's output name is its path relative to the pattern's base (the directory before the
    first wildcard, or the directory given), without ``.parquet``: it depends on that file's own
    path only, never on its siblings. Files under ``exclude`` (the output path) are never listed."""
    found: list[tuple[Any, str, str]] = []  # (fs, path, path relative to its base)
    for url in paths:
        fs, path = _open_url(url, storage_options, "input.path")
        shown = sanitize_url(url)
        skip = _norm(fs, exclude) if exclude else None
        try:
            if _has_glob(path):
                base = _glob_base(path)
                listed = retry(partial(fs.glob, path, detail=True), f"listing {shown}")
                matches = sorted(p for p, info in listed.items() if info.get("type") != "directory")
            elif retry(partial(fs.isdir, path), f"listing {shown}"):
                base = path.rstrip("/")
                matches = sorted(p for p in retry(partial(fs.find, path), f"listing {shown}")
                                 if p.endswith(OUTPUT_SUFFIX) and f"/{BOOKKEEPING_DIR}/" not in p)
            elif retry(partial(fs.exists, path), f"checking {shown}"):
                base, matches = posixpath.dirname(path), [path]
            elif allow_empty:
                continue
            else:
                raise InputDataError(shown, "no such input file or directory")
        except (re.error, ValueError) as exc:  # fsspec: "Invalid pattern: '**' can only be ..."
            raise SpecError("input.path", f"bad glob pattern {shown!r}: {exc}") from exc
        if skip is not None:
            matches = [p for p in matches if not _inside(_norm(fs, p), skip)]
        if not matches and not allow_empty:
            raise InputDataError(shown, "no input shards matched this path")
        for p in matches:
            rel = p[len(base):].lstrip("/") if base and p.startswith(base) else posixpath.basename(p)
            found.append((fs, p, rel))

    shards: dict[str, Shard] = {}
    for fs, p, rel in found:
        url = _full_url(fs, p)
        if _is_http(fs):  # a presigned URL's query (its signature) never names anything
            rel = rel.split("#", 1)[0].split("?", 1)[0]
        name = shard_name(rel)
        if name in shards:
            if shards[name].url == url:
                continue  # the same file matched by two patterns is one shard
            raise SpecError("input.path",
                            f"two input files map to one output name {name!r}: "
                            f"{sanitize_url(shards[name].url)} and {sanitize_url(url)}; list them "
                            "under one pattern whose base keeps their directories apart (e.g. "
                            "data/*/*.parquet rather than data/a/*.parquet and data/b/*.parquet)")
        info = retry(partial(fs.info, p), f"reading the size of {sanitize_url(url)}")
        shards[name] = Shard(url=url, path=p, name=name, fs=fs, fingerprint=fingerprint(info))
    return sorted(shards.values(), key=lambda s: s.name)


def _is_http(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return any(p in ("http", "https") for p in protocols)


def shard_name(rel: str) -> str:
    """A shard's output name: its path relative to the input base, without ``.parquet``.
    Subdirectories are kept (``day=1/part-0``), so no two input files can share a name."""
    if rel.endswith(OUTPUT_SUFFIX):
        rel = rel[: -len(OUTPUT_SUFFIX)]
    return rel


def worker_of(shard_name: str, num_workers: int) -> int:
    """The worker a shard belongs to: stable, whatever the listing order or the other shards."""
    digest = hashlib.sha256(shard_name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % num_workers


def check_worker(worker_index: int, num_workers: int) -> None:
    """Exit 2 unless ``0 <= worker_index < num_workers``."""
    if num_workers < 1 or not 0 <= worker_index < num_workers:
        raise SpecError("--worker-index",
                        f"expected 0 <= I < N, got I={worker_index} N={num_workers}")


def assign(shards: list[Shard], worker_index: int, num_workers: int) -> list[Shard]:
    """The shards that belong to worker ``worker_index`` of ``num_workers``."""
    check_worker(worker_index, num_workers)
    return [s for s in shards if worker_of(s.name, num_workers) == worker_index]


_TMP_NAME = re.compile(r"^(?P<shard>.+)~(?P<host>[^~]+)~(?P<pid>\d+)~[0-9a-f]+\.parquet\.tmp$")


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
        pid = name[len(_SPOOL_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # only our own real directories, left by a process that is gone
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and pid.isdigit() \
                and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def tmp_file_name(shard_name: str) -> str:
    """A temporary file name that says which process owns it (flat: shard names may hold /)."""
    flat = shard_name.replace("%", "%25").replace("/", "%2F")
    return f"{flat}~{this_host()}~{os.getpid()}~{os.urandom(6).hex()}.parquet.tmp"


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


class OutputDir:
    """The output directory and its bookkeeping, on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict):
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, self.path = url_to_fs(self.url, **storage_options)
        self.path = self.path.rstrip("/")
        self.display_url = _full_url(self.fs, self.path)

    @property
    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def output_path(self, shard: Shard) -> str:
        return self.join(shard.output_file)

    def manifest_path(self, shard_name: str) -> str:
        return self.join(BOOKKEEPING_DIR, "manifest", shard_name + ".json")

    def lock_path(self, shard_name: str) -> str:
        return self.join(BOOKKEEPING_DIR, "locks", shard_name + ".json")

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

        data = retry(read, f"reading {path}")
        if data is None:
            return None
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # a torn record is no record

    def read_manifest(self, shard_name: str) -> dict | None:
        """The committed record of a shard, or None."""
        return self.read_json(self.manifest_path(shard_name))

    def write_json(self, path: str, record: dict) -> None:
        """Write a small JSON object in one put (a rename on local disk)."""
        data = (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()
        if self.is_local:
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
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
        """The committed output file's size and version (ETag, generation), or None if absent."""
        def info():
            try:
                return self.fs.info(self.output_path(shard))
            except FileNotFoundError:
                return None

        found = retry(info, f"checking {self.output_path(shard)}")
        if found is None:
            return None
        return {"size": int(found.get("size") or 0), **_version(found)}

    def inspect(self, shard: Shard, spec_fingerprint: dict | None = None) -> tuple[str, list[str]]:
        """A shard's state and, for ``stale``, the spec components that changed.

        ``committed``: the manifest, the output file (its size and version as recorded) and the
        current input agree, and the spec fingerprint matches; ``stale``: all that, but written
        under a different spec; ``partial``: a record or a file without the other, or they
        disagree (a crash between steps, an input changed since, a truncated upload);
        ``pending``: nothing yet."""
        record = self.read_manifest(shard.name)
        found = self.output_info(shard)
        if record is None and found is None:
            return "pending", []
        if record is None or found is None or record.get("input_fingerprint") != shard.fingerprint:
            return "partial", []
        expected = record.get("output_info")
        if expected and any(found.get(k) != v for k, v in expected.items()):
            return "partial", []
        if spec_fingerprint is not None:
            from batchspec.fingerprint import describe_changes

            changed = describe_changes(record.get("spec_fingerprint") or {}, spec_fingerprint)
            if changed:
                return "stale", changed
        return "committed", []

    def shard_state(self, shard: Shard, spec_fingerprint: dict | None = None) -> str:
        """``committed``, ``stale``, ``partial`` or ``pending`` (see :meth:`inspect`)."""
        return self.inspect(shard, spec_fingerprint)[0]

    def list_outputs(self) -> list[str]:
        """Shard names of the output files present (bookkeeping excluded)."""
        def find():
            try:
                return self.fs.find(self.path)
            except FileNotFoundError:
                return []

        names = []
        for p in retry(find, f"listing {self.display_url}"):
            rel = p[len(self.path):].lstrip("/")
            if rel.endswith(OUTPUT_SUFFIX) and not rel.startswith(BOOKKEEPING_DIR + "/"):
                names.append(rel[: -len(OUTPUT_SUFFIX)])
        return sorted(names)

    # ------------------------------------------------------------------ leases (see leases.py)
    # Thin delegates for callers that still pass ``owner`` on each call; new code uses
    # batchspec.leases.ShardLeases directly.

    def _leases(self, owner: dict) -> ShardLeases:
        sets = self.__dict__.setdefault("_lease_sets", {})
        key = (owner.get("run_id"), owner.get("pid"))
        if key not in sets:
            sets[key] = ShardLeases(self, owner)
        return sets[key]

    def read_lock(self, shard_name: str) -> dict | None:
        """Who holds a shard's lease, or None."""
        return read_holder(self, shard_name)

    def acquire(self, shard_name: str, owner: dict) -> dict | None:
        """Take the lease on a shard: None when taken, else the holder's record."""
        return self._leases(owner).acquire(shard_name)

    def renew(self, shard_name: str, owner: dict) -> bool:
        """Renew our lease now; False if it is not ours any more."""
        return self._leases(owner).confirm(shard_name)

    def holds(self, shard_name: str, owner: dict) -> bool:
        """Whether the lease is still ours (renews it: call right before committing)."""
        return self._leases(owner).confirm(shard_name)

    def release(self, shard_name: str, owner: dict) -> None:
        """Give a lease back (only ours)."""
        self._leases(owner).release(shard_name)
