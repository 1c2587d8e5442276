"""Input shards over fsspec: find them, name their outputs, assign them to workers, and know
which are committed.

Bookkeeping lives under ``<output.path>/_batchspec/``:

- ``manifest/<shard>.json``: one small object per committed shard (its row count, the input's
  fingerprint, the run that committed it). One object per shard, never a shared file, so that
  workers never read-modify-write the same object.
- ``runs/<run_id>.json``: the summary of each run.
- ``tmp/``: files being written (local output only; object stores get a single put).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from batchspec.errors import InputDataError, SpecError

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
            matches = [p for p in sorted(fs.glob(path)) if not fs.isdir(p)]
        elif fs.isdir(path):
            base = path.rstrip("/")
            matches = sorted(p for p in fs.find(path) if p.endswith(OUTPUT_SUFFIX)
                             and f"/{BOOKKEEPING_DIR}/" not in p)
        elif fs.exists(path):
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
        shards.append(Shard(url=url, path=p, name=stem, fs=fs, fingerprint=fingerprint(fs.info(p))))
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


class OutputDir:
    """The output directory and its bookkeeping, on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict):
        self.url = url.rstrip("/")
        self.fs, self.path = url_to_fs(self.url, **storage_options)
        self.path = self.path.rstrip("/")

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def output_path(self, shard: Shard) -> str:
        return self.join(shard.output_file)

    def manifest_path(self, shard_name: str) -> str:
        return self.join(BOOKKEEPING_DIR, "manifest", shard_name + ".json")

    def read_manifest(self, shard_name: str) -> dict | None:
        """The committed record of a shard, or None."""
        path = self.manifest_path(shard_name)
        try:
            with self.fs.open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            return None  # a torn record is no record: the shard is redone

    def write_json(self, path: str, record: dict) -> None:
        """Write a small JSON object in one put (a rename on local disk)."""
        data = (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if self.is_local:
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def shard_state(self, shard: Shard) -> str:
        """``committed`` (output and record agree with the current input), ``partial`` or
        ``pending``."""
        record = self.read_manifest(shard.name)
        exists = self.fs.exists(self.output_path(shard))
        if record is not None and exists and record.get("input_fingerprint") == shard.fingerprint:
            return "committed"
        if record is not None or exists:
            return "partial"  # a crash between steps, or the input changed since
        return "pending"
