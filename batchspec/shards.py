"""Input shards over fsspec: find them, name their outputs, assign them to workers, and know
which are committed.

Bookkeeping lives under ``<output.path>/_batchspec/``:

- ``manifest/<shard>.json``: one small object per committed shard (its row count, the input's
  fingerprint, the run that committed it). One object per shard, never a shared file, so that
  workers never read-modify-write the same object.
- ``runs/<run_id>.json``: the summary of each run.
- ``locks/<shard>.json``: the lease of the process working on a shard (run id, host, pid,
  heartbeat), so that a second process started on the same job by mistake leaves it alone.
- ``tmp/``: files being written (local output only; for object stores they are spooled on
  local disk and committed with a single put).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from batchspec.errors import InputDataError, SpecError
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
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return path
    return f"{protocol}://{path}"


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


def discover_shards(paths: tuple[str, ...] | list[str], storage_options: dict) -> list[Shard]:
    """List the input shards matched by ``input.path``, with unique output names, sorted."""
    found: list[tuple[Any, str, str]] = []  # (fs, path, path relative to its base)
    for url in paths:
        try:
            fs, path = url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as exc:
            raise SpecError("input.path", f"cannot open {url!r}: {exc}") from exc
        if _has_glob(path):
            base = _glob_base(path)
            listed = retry(partial(fs.glob, path, detail=True), f"listing {url}")
            matches = sorted(p for p, info in listed.items() if info.get("type") != "directory")
        elif retry(partial(fs.isdir, path), f"listing {url}"):
            base = path.rstrip("/")
            matches = sorted(p for p in retry(partial(fs.find, path), f"listing {url}")
                             if p.endswith(OUTPUT_SUFFIX) and f"/{BOOKKEEPING_DIR}/" not in p)
        elif retry(partial(fs.exists, path), f"checking {url}"):
            base, matches = posixpath.dirname(path), [path]
        else:
            raise InputDataError(url, "no such input file or directory")
        if not matches:
            raise InputDataError(url, "no input shards matched this path")
        for p in matches:
            rel = p[len(base):].lstrip("/") if base and p.startswith(base) else posixpath.basename(p)
            found.append((fs, p, rel))

    names: dict[str, int] = {}
    for _, _, rel in found:
        stem = _stem(rel)
        names[stem] = names.get(stem, 0) + 1
    shards, seen_urls = [], set()
    for fs, p, rel in found:
        url = _full_url(fs, p)
        if url in seen_urls:
            continue  # the same file matched by two patterns is one shard
        seen_urls.add(url)
        stem = _stem(rel)
        if names[stem] > 1:  # two inputs would write one output name: make both unique
            stem = f"{stem}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"
        info = retry(partial(fs.info, p), f"reading the size of {url}")
        shards.append(Shard(url=url, path=p, name=stem, fs=fs, fingerprint=fingerprint(info)))
    return sorted(shards, key=lambda s: s.name)


def _stem(rel: str) -> str:
    if rel.endswith(OUTPUT_SUFFIX):
        rel = rel[: -len(OUTPUT_SUFFIX)]
    return rel.replace("/", "__")


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


#: A lease not renewed for this long is abandoned (its process died on another host).
LEASE_S = float(os.environ.get("BATCHSPEC_LEASE_S", "120"))
_TMP_NAME = re.compile(r"^(?P<shard>.+)~(?P<host>[^~]+)~(?P<pid>\d+)~[0-9a-f]+\.parquet\.tmp$")


def spool_dir() -> str:
    """Local directory for files on their way to an object store."""
    path = os.path.join(tempfile.gettempdir(), "batchspec-spool")
    os.makedirs(path, exist_ok=True)
    return path


def tmp_file_name(shard_name: str) -> str:
    """A temporary file name that says which process owns it."""
    return f"{shard_name}~{this_host()}~{os.getpid()}~{os.urandom(6).hex()}.parquet.tmp"


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
        self.fs, self.path = url_to_fs(self.url, **storage_options)
        self.path = self.path.rstrip("/")
        self.display_url = _full_url(self.fs, self.path)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)

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
            os.makedirs(path, exist_ok=True)
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
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
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

    def shard_state(self, shard: Shard) -> str:
        """``committed`` (output and record agree with the current input), ``partial`` or
        ``pending``."""
        record = self.read_manifest(shard.name)
        exists = self.exists(self.output_path(shard))
        if record is not None and exists and record.get("input_fingerprint") == shard.fingerprint:
            return "committed"
        if record is not None or exists:
            return "partial"  # a crash between steps, or the input changed since
        return "pending"

    # ------------------------------------------------------------------ leases

    def read_lock(self, shard_name: str) -> dict | None:
        return self.read_json(self.lock_path(shard_name))

    @staticmethod
    def lock_is_live(lock: dict | None, now: float | None = None) -> bool:
        """Whether a lease still holds: renewed recently, by a process that may be alive."""
        if not lock:
            return False
        now = time.time() if now is None else now
        if now - float(lock.get("heartbeat", 0)) > float(lock.get("lease_s", LEASE_S)):
            return False
        if lock.get("host") == this_host():
            return pid_alive(int(lock.get("pid", 0)))
        return True

    def acquire(self, shard_name: str, owner: dict) -> dict | None:
        """Take the lease on a shard. Returns None when taken, or the live lease of the process
        that holds it."""
        path = self.lock_path(shard_name)
        current = self.read_lock(shard_name)
        if self.lock_is_live(current) and current.get("run_id") != owner["run_id"]:
            return current
        record = {**owner, "heartbeat": time.time(), "lease_s": LEASE_S}
        if self.is_local:
            # O_EXCL makes the take atomic on one filesystem; a dead holder's lease goes first
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            if current is not None or os.path.exists(path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return self.read_lock(shard_name) or {"run_id": "unknown"}
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            return None
        # object stores: write, then read back; whoever wrote last holds it
        self.write_json(path, record)
        time.sleep(0.2)
        current = self.read_lock(shard_name)
        if current is not None and current.get("run_id") != owner["run_id"]:
            return current
        return None

    def renew(self, shard_name: str, owner: dict) -> bool:
        """Renew our lease; False if another process has taken the shard over."""
        current = self.read_lock(shard_name)
        if current is not None and current.get("run_id") != owner["run_id"]:
            return False
        self.write_json(self.lock_path(shard_name),
                        {**owner, "heartbeat": time.time(), "lease_s": LEASE_S})
        return True

    def holds(self, shard_name: str, owner: dict) -> bool:
        current = self.read_lock(shard_name)
        return current is not None and current.get("run_id") == owner["run_id"]

    def release(self, shard_name: str, owner: dict) -> None:
        """Give a lease back (only ours)."""
        if self.holds(shard_name, owner):
            self.remove(self.lock_path(shard_name))
