"""URLs and fsspec paths: opening a URL, store families, globs, local or not, and the normalised
spellings of a path that overlap checks compare (:mod:`batchspec.io.locations`) and listing
skips (:mod:`batchspec.io.listing`)."""

from __future__ import annotations

import os
import posixpath
import re

import fsspec
from fsspec.core import url_to_fs

from batchspec.errors import SpecError
from batchspec.redact import sanitize_url

_GLOB_CHARS = set("*?[")


def has_glob(path: str) -> bool:
    """Whether a path holds a wildcard (``*``, ``?``, ``[``)."""
    return any(c in _GLOB_CHARS for c in path)


def glob_base(path: str) -> str:
    """The directory part of a glob before its first wildcard."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if has_glob(part):
            return "/".join(parts[:i])
    return posixpath.dirname(path)


def full_url(fs, path: str) -> str:
    """A path on ``fs`` as a URL (a local path stays a path)."""
    if is_local_fs(fs):
        return path
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{path}"


def store_version(info: dict) -> dict:
    """The version tag an object store gives a file (ETag, GCS generation), if any."""
    for key in ("ETag", "etag", "generation"):
        if info.get(key) is not None:
            return {key.lower(): str(info[key])}
    return {}


def is_local_fs(fs) -> bool:
    """Whether an fsspec filesystem is this machine's own disk (renames are atomic there)."""
    return isinstance(fs, fsspec.implementations.local.LocalFileSystem)


#: Calls that move a whole file, as long as its size needs: the clients' own per-request
#: timeouts bound them, never a deadline for the whole call.
_TRANSFERS = frozenset({"put_file", "get_file", "put", "get", "open", "open_async"})


def bound_requests(fs):
    """``fs`` with each call of an async fsspec filesystem (s3fs, gcsfs, adlfs) ended after
    :func:`batchspec.io.retry.request_timeout_s` (a transient error, so retried within the
    storage retries' budget): a store that takes the connection and never answers would
    otherwise hold a run for as long as its client's own defaults (minutes, for Azure's)."""
    import functools
    import inspect

    from fsspec.asyn import AsyncFileSystem, sync

    from batchspec.io import retry

    timeout_s = retry.request_timeout_s()
    if not isinstance(fs, AsyncFileSystem) or vars(fs).get("_batchspec_timeout_s") == timeout_s:
        return fs
    # each sync method whose coroutine ``_name`` exists calls it with a deadline (what
    # fsspec's own wrappers and adlfs's hand-written ones do, less the deadline)
    for name in sorted({n for n in dir(type(fs)) if not n.startswith("_")} - _TRANSFERS):
        coro = getattr(fs, "_" + name, None)
        if not inspect.iscoroutinefunction(coro):
            continue

        def timed(*args, _coro=coro, **kwargs):
            return sync(fs.loop, _coro, *args, timeout=kwargs.pop("timeout", timeout_s), **kwargs)

        setattr(fs, name, functools.wraps(coro)(timed))
    fs._batchspec_timeout_s = timeout_s
    return fs


def open_url(url: str, storage_options: dict, key: str):
    """``(filesystem, path)`` of a URL; a SpecError naming ``key`` when it cannot be opened."""
    try:
        fs, path = url_to_fs(url, **storage_options)
        return bound_requests(fs), path
    except ImportError as exc:
        raise SpecError(
            key,
            f"no fsspec backend for {sanitize_url(url)!r}: {exc} (install batchspec[s3], [gcs] or [azure])",
        ) from exc
    except (ValueError, TypeError) as exc:
        raise SpecError(key, f"cannot open {sanitize_url(url)!r}: {exc}") from exc


# ------------------------------------------------------------------ which store a location is on
#
# Overlap is judged on what a location names, never on how it is spelled: the kind of store, the
# server its client talks to, and the bucket and key path, each normalised. Where two locations
# could be one and nothing proves otherwise, they count as one: a false refusal costs a user one
# edit, a false acceptance costs their data.

#: fsspec protocol spellings of one store (s3a is s3, gcs is gs, abfs and abfss are az, ...).
FAMILIES = {
    "s3": "s3",
    "s3a": "s3",
    "s3n": "s3",
    "gs": "gs",
    "gcs": "gs",
    "az": "az",
    "abfs": "az",
    "abfss": "az",
    "file": "file",
    "local": "file",
    "memory": "memory",
    "http": "http",
    "https": "http",
}


#: Stores whose paths are ``bucket/key`` (a container for az) behind an endpoint. They form one
#: realm: S3 clients reach GCS through its interoperability API, an https URL may name any object.
OBJECT_FAMILIES = ("s3", "gs", "az", "http")


def store_family(fs) -> str:
    """The store family of a filesystem (:data:`FAMILIES`), else its first protocol."""
    if is_local_fs(fs):
        return "file"
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    for protocol in protocols:
        if protocol in FAMILIES:
            return FAMILIES[protocol]
    return str(protocols[0])


def unwrap(fs, path: str):
    """The filesystem that stores the bytes, under caches and directory wrappers."""
    from fsspec.implementations.cached import CachingFileSystem
    from fsspec.implementations.dirfs import DirFileSystem

    for _ in range(8):
        if isinstance(fs, DirFileSystem):
            fs, path = fs.fs, fs._join(path)
        elif isinstance(fs, CachingFileSystem) and getattr(fs, "fs", None) is not None:
            fs = fs.fs
        else:
            break
    return fs, path


def key_forms(path: str, bucket_first: bool) -> frozenset:
    """A store path's spellings: duplicate and trailing slashes dropped, the bucket (or
    container) lower-cased, and ``.``/``..`` resolved too (a store keeps them literally, so both
    forms count)."""
    collapsed = re.sub(r"/+", "/", path)
    absolute = collapsed.startswith("/") and not bucket_first
    collapsed = collapsed.strip("/")
    if bucket_first:
        bucket, sep, rest = collapsed.partition("/")
        collapsed = bucket.lower() + sep + rest
    resolved = posixpath.normpath(collapsed) if collapsed else ""
    forms = {collapsed, "" if resolved == "." else resolved}
    return frozenset(("/" + f if absolute else f) or ("/" if absolute else "") for f in forms)


def _local_form(path: str) -> str:
    """A local path with symlinks, ``.`` and ``..`` resolved."""
    return os.path.realpath(path.rstrip("/") or "/")


def path_forms(fs, path: str) -> frozenset:
    """The normalised spellings of a path on ``fs`` (see :class:`batchspec.io.locations.Location`)."""
    if is_local_fs(fs):
        return frozenset({_local_form(path)})
    return key_forms(path, store_family(fs) in OBJECT_FAMILIES)


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it (both normalised spellings)."""
    if root in ("", "/"):
        return True
    return path == root or path.startswith(root.rstrip("/") + "/")
