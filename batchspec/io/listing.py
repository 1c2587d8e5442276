"""Input shards over fsspec: find them, name their outputs, and assign them to workers. Which
are committed is the output's to say (:mod:`batchspec.io.output_dir`, which also lays out the
bookkeeping under ``<output.path>/_batchspec/``)."""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from functools import partial
from typing import Any

from fsspec.core import split_protocol

from batchspec.errors import InputDataError, SpecError
from batchspec.io.formats import file_format, is_input_file, output_stem
from batchspec.io.records import BOOKKEEPING_DIR, PARQUET_FILE, FileFormat, Shard
from batchspec.io.retry import retry
from batchspec.io.urls import (
    FAMILIES,
    OBJECT_FAMILIES,
    full_url,
    glob_base,
    has_glob,
    inside,
    open_url,
    path_forms,
    store_family,
    unwrap,
)
from batchspec.redact import sanitize_url


def fingerprint(info: dict) -> dict:
    """What identifies a version of an input file: size plus ETag or modification time."""
    out: dict[str, Any] = {"size": int(info.get("size") or 0)}
    for key in (
        "ETag",
        "etag",
        "md5Hash",
        "content_md5",
        "mtime",
        "LastModified",
        "last_modified",
        "created",
    ):
        value = info.get(key)
        if value is not None:
            out[key.lower()] = str(value) if not isinstance(value, int | float) else value
            break
    return out


def _exclusion(fs, exclude: str) -> frozenset | None:
    """The spellings of ``exclude`` on ``fs``: a path on ``fs`` (as :func:`plan` passes it) or a
    URL (as ``output.path`` is written); None when it names another kind of store."""
    fs, _ = unwrap(fs, "")
    last = exclude.rsplit("::", 1)[-1]
    protocol, _ = split_protocol(last)
    if protocol:
        if FAMILIES.get(protocol, protocol) != store_family(fs):
            return None
        # a URL as this filesystem's path: fsspec's API reference documents _strip_protocol
        # for it, and has no name without the underscore
        path = fs._strip_protocol(last)
    elif store_family(fs) in OBJECT_FAMILIES and os.path.isabs(exclude):
        return None  # a local output path: bucket keys never start with /
    else:
        path = exclude
    return path_forms(fs, path)


def discover_shards(
    paths: tuple[str, ...] | list[str],
    storage_options: dict,
    exclude: str | None = None,
    allow_empty: bool = False,
    input_format: str | None = None,
) -> list[Shard]:
    """List the input shards matched by ``input.path``, sorted by name.

    A shard's output name is its path relative to the pattern's base (the directory before the
    first wildcard, or the directory given), without its format's extensions (``.parquet``,
    ``.jsonl.gz``, ...): it depends on that file's own path only, never on its siblings. A
    directory's shards are its files of ``input_format`` (``input.format``; of any format named
    by its extension without it). Files under ``exclude`` (the output path) are never listed."""
    found: list[tuple[Any, str, str]] = []  # (fs, path, path relative to its base)
    for url in paths:
        fs, path = open_url(url, storage_options, "input.path")
        shown = sanitize_url(url)
        skip = _exclusion(fs, exclude) if exclude else None
        try:
            if has_glob(path):
                base = glob_base(path)
                listed = retry(partial(fs.glob, path, detail=True), f"listing {shown}")
                matches = sorted(p for p, info in listed.items() if info.get("type") != "directory")
            elif retry(partial(fs.isdir, path), f"listing {shown}"):
                base = path.rstrip("/")
                matches = sorted(
                    p
                    for p in retry(partial(fs.find, path), f"listing {shown}")
                    if is_input_file(p, input_format) and f"/{BOOKKEEPING_DIR}/" not in p
                )
            elif retry(partial(fs.exists, path), f"checking {shown}"):
                base, matches = posixpath.dirname(path), [path]
            elif allow_empty:
                continue
            else:
                raise InputDataError(shown, "no such input file or directory")
        except (re.error, ValueError) as exc:  # fsspec: "Invalid pattern: '**' can only be ..."
            raise SpecError("input.path", f"bad glob pattern {shown!r}: {exc}") from exc
        if skip:
            matches = [
                p for p in matches if not any(inside(f, s) for f in path_forms(*unwrap(fs, p)) for s in skip)
            ]
        if not matches and not allow_empty:
            raise InputDataError(shown, "no input shards matched this path")
        for p in matches:
            rel = p[len(base) :].lstrip("/") if base and p.startswith(base) else posixpath.basename(p)
            found.append((fs, p, rel))

    shards: dict[str, Shard] = {}
    for fs, p, rel in found:
        url = full_url(fs, p)
        if _is_http(fs):  # a presigned URL's query (its signature) never names anything
            rel = rel.split("#", 1)[0].split("?", 1)[0]
        file = file_format(rel, input_format, url)
        name = shard_name(rel, file)
        if name in shards:
            if shards[name].url == url:
                continue  # the same file matched by two patterns is one shard
            raise SpecError(
                "input.path",
                f"two input files map to one output name {name!r}: "
                f"{sanitize_url(shards[name].url)} and {sanitize_url(url)}; list them "
                "under one pattern whose base keeps their directories apart (e.g. "
                "data/*/*.parquet rather than data/a/*.parquet and data/b/*.parquet)",
            )
        info = retry(partial(fs.info, p), f"reading the size of {sanitize_url(url)}")
        shards[name] = Shard(url=url, path=p, name=name, fs=fs, fingerprint=fingerprint(info), format=file)
    return sorted(shards.values(), key=lambda s: s.name)


def _is_http(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return any(p in ("http", "https") for p in protocols)


def shard_name(rel: str, file: FileFormat = PARQUET_FILE) -> str:
    """A shard's output name: its path relative to the input base, without its format's
    extensions (``.parquet``, ``.jsonl.gz``, ...). Subdirectories are kept (``day=1/part-0``),
    so no two input files can share a name."""
    return output_stem(rel, file)


def worker_of(shard_name: str, num_workers: int) -> int:
    """The worker a shard belongs to: stable, whatever the listing order or the other shards."""
    digest = hashlib.sha256(shard_name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % num_workers


def check_worker(worker_index: int, num_workers: int) -> None:
    """Exit 2 unless ``0 <= worker_index < num_workers``."""
    if num_workers < 1 or not 0 <= worker_index < num_workers:
        raise SpecError("--worker-index", f"expected 0 <= I < N, got I={worker_index} N={num_workers}")


def assign(shards: list[Shard], worker_index: int, num_workers: int) -> list[Shard]:
    """The shards that belong to worker ``worker_index`` of ``num_workers``."""
    check_worker(worker_index, num_workers)
    return [s for s in shards if worker_of(s.name, num_workers) == worker_index]
