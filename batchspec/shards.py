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
import ipaddress
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
from urllib.parse import unquote, urlsplit

import fsspec
from fsspec.core import split_protocol, url_to_fs

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


# ------------------------------------------------------------------ which store a location is on
#
# Overlap is judged on what a location names, never on how it is spelled: the kind of store, the
# server its client talks to, and the bucket and key path, each normalised. Where two locations
# could be one and nothing proves otherwise, they count as one: a false refusal costs a user one
# edit, a false acceptance costs their data.

#: fsspec protocol spellings of one store (s3a is s3, gcs is gs, abfs and abfss are az, ...).
_FAMILIES = {"s3": "s3", "s3a": "s3", "s3n": "s3", "gs": "gs", "gcs": "gs", "az": "az",
             "abfs": "az", "abfss": "az", "file": "file", "local": "file", "memory": "memory",
             "http": "http", "https": "http"}
#: Stores whose paths are ``bucket/key`` (a container for az) behind an endpoint. They form one
#: realm: S3 clients reach GCS through its interoperability API, an https URL may name any object.
_OBJECT_FAMILIES = ("s3", "gs", "az", "http")
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: The public clouds' own endpoints: every spelling of one of them names one namespace.
_AWS_HOST = re.compile(r"(^|\.)amazonaws\.com(\.cn)?$")
_GCS_HOST = re.compile(r"(^|\.)googleapis\.com$|^storage\.cloud\.google\.com$")
_AZURE_HOST = re.compile(r"^(?P<account>[a-z0-9]+)(-secondary)?\.(blob|dfs)\.core\."
                         r"(windows\.net|chinacloudapi\.cn|usgovcloudapi\.net|cloudapi\.de)$")
_AWS_DEFAULT = "AWS S3, or an endpoint the AWS configuration names (no endpoint_url given)"


@dataclass(frozen=True)
class Endpoint:
    """The server a location's client talks to.

    ``kind``: ``local`` (this machine's disk, this process's memory); ``cloud`` (a public cloud's
    own namespace; ``name`` is ``aws``, ``gcs`` or ``azure:<account>``); ``server`` (any other
    host; ``name`` is the host, lower-cased, and ``port`` its port, the scheme's default filled
    in); ``unknown`` (none named, or one that cannot be resolved: it could be any server)."""

    kind: str
    name: str = ""
    port: int | None = None
    #: What an ``unknown`` endpoint is, in words.
    note: str = ""

    @property
    def key(self) -> tuple:
        return (self.kind, self.name, self.port)

    @property
    def shown(self) -> str:
        """For messages: the normalised store, never a credential, never a raw option value (a
        run's log masks those)."""
        if self.kind == "cloud":
            if self.name.startswith("azure:"):
                return f"Azure storage account {self.name[len('azure:'):]}"
            return {"aws": "AWS S3", "gcs": "Google Cloud Storage"}.get(self.name, self.name)
        if self.kind == "server":
            host = f"[{self.name}]" if ":" in self.name else self.name
            return f"the server at {host}:{self.port}" if self.port else f"the server {host}"
        return self.note or ("this machine" if self.kind == "local" else "an unknown server")


_LOCAL = Endpoint("local")


@dataclass(frozen=True)
class Location:
    """What a URL names: its realm (``file``, ``memory``, ``object`` or another protocol), the
    endpoint it is reached through and the normalised spellings of its path (a path is inside
    another when any spelling of one is inside any spelling of the other)."""

    realm: str
    endpoint: Endpoint
    paths: frozenset


def _cloud(host: str, family: str) -> str | None:
    """The public cloud namespace a host belongs to, or None."""
    if family in ("s3", "gs", "http") and _AWS_HOST.search(host):
        return "aws"
    if family in ("s3", "gs", "http") and _GCS_HOST.search(host):
        return "gcs"
    m = _AZURE_HOST.match(host)
    if m and family in ("az", "http"):
        return f"azure:{m['account']}"
    return None


def parse_endpoint(url: str, family: str) -> Endpoint:
    """An endpoint URL as the server it names: scheme and trailing slash and path dropped, host
    lower-cased, the scheme's default port filled in, the clouds' endpoints recognised."""
    text = str(url).strip()
    parts = urlsplit(text if "://" in text else "//" + text)
    try:
        host, port = (parts.hostname or "").rstrip("."), parts.port
    except ValueError:  # a port that is not a number
        return Endpoint("unknown", note="an endpoint whose port is not a number")
    if not host:
        return Endpoint("unknown", note="an endpoint that names no host")
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        pass
    if port is None:
        port = _DEFAULT_PORTS.get(parts.scheme.lower())
    cloud = _cloud(host, family)
    if cloud is not None:
        return Endpoint("cloud", cloud, port)
    return Endpoint("server", host, port)


def _one_endpoint(candidates: list, family: str, default: Endpoint) -> Endpoint:
    """The endpoint every named candidate agrees on; ``unknown`` when they disagree."""
    found = {}
    for value in candidates:
        if value:
            endpoint = parse_endpoint(value, family)
            found.setdefault(endpoint.key, endpoint)
    if not found:
        return default
    if len(found) == 1:
        return next(iter(found.values()))
    shown = " and ".join(sorted({e.shown for e in found.values()}))
    return Endpoint("unknown", note=f"endpoints that disagree ({shown})")


def _azure_endpoint(connection_string: str) -> str | None:
    """The blob endpoint a connection string names (never the string: it holds the key)."""
    fields = {}
    for part in connection_string.split(";"):
        name, sep, value = part.partition("=")
        if sep:
            fields[name.strip().lower()] = value.strip()
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        return "http://127.0.0.1:10000/devstoreaccount1"
    if fields.get("blobendpoint"):
        return fields["blobendpoint"]
    if fields.get("accountname"):
        scheme = fields.get("defaultendpointsprotocol") or "https"
        return f"{scheme}://{fields['accountname']}.blob.{fields.get('endpointsuffix') or 'core.windows.net'}"
    return None


def _store_endpoint(fs, family: str, options: dict) -> Endpoint:
    """The endpoint an object store's client will talk to: what the filesystem resolved, and
    every spelling the storage options give (``endpoint_url``, ``client_kwargs.endpoint_url``,
    gcsfs's and adlfs's own), which must agree."""
    named = [options.get("endpoint_url"), (options.get("client_kwargs") or {}).get("endpoint_url")]
    if family == "s3":
        named += [getattr(fs, "endpoint_url", None),
                  (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")]
        if not any(named) and os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() \
                not in ("true", "1"):
            named = [os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")]
        return _one_endpoint(named, family, Endpoint("unknown", note=_AWS_DEFAULT))
    if family == "gs":
        try:
            named.append(fs._location)  # gcsfs: endpoint_url, STORAGE_EMULATOR_HOST or Google's
        except Exception:  # another gcsfs: resolve as it documents
            named.append(getattr(fs, "_endpoint", None)
                         or os.environ.get("STORAGE_EMULATOR_HOST")
                         or "https://storage.googleapis.com")
        return _one_endpoint(named, family, Endpoint("unknown", note="no endpoint"))
    # az (adlfs): a connection string wins, then account_host, then the account's own endpoint
    named.append(options.get("account_url"))
    connection_string = getattr(fs, "connection_string", None) or options.get("connection_string")
    account = getattr(fs, "account_name", None) or options.get("account_name")
    host = getattr(fs, "account_host", None) or options.get("account_host")
    if connection_string:
        named.append(_azure_endpoint(connection_string) or "")
        if not named[-1]:
            return Endpoint("unknown", note="a connection string that names no blob endpoint")
    elif host:
        named.append(f"https://{host}")
    elif account:
        named.append(f"https://{account}.blob.core.windows.net")
    return _one_endpoint(named, family, Endpoint("unknown", note="no account"))


def _family(fs) -> str:
    if is_local_fs(fs):
        return "file"
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    for protocol in protocols:
        if protocol in _FAMILIES:
            return _FAMILIES[protocol]
    return str(protocols[0])


def _unwrap(fs, path: str):
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


def _key_forms(path: str, bucket_first: bool) -> frozenset:
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


def _path_forms(fs, path: str) -> frozenset:
    """The normalised spellings of a path on ``fs`` (see :class:`Location`)."""
    if is_local_fs(fs):
        return frozenset({_local_form(path)})
    return _key_forms(path, _family(fs) in _OBJECT_FAMILIES)


def _http_location(url: str, pattern: bool) -> Location:
    """An https URL as the object it may name: on a cloud's endpoint, or path-style
    (``/bucket/key``), virtual-host-style (``bucket.host/key``), Azurite-style
    (``/account/container/key``) or GCS JSON-style (``/storage/v1/b/bucket/o/key``) on any
    other server."""
    parts = urlsplit(url)
    endpoint = parse_endpoint(f"{parts.scheme}://{parts.netloc}", "http")
    path = parts.path
    if pattern and _has_glob(path):
        path = _glob_base(path)
    spellings = {path, unquote(path)}
    json_api = re.match(r"^/(?:download/)?storage/v1/b/([^/]+)/o/(.+)$", path)
    if json_api:
        spellings.add(f"{json_api[1]}/{unquote(json_api[2])}")
    labels = (parts.hostname or "").split(".")
    if endpoint.kind != "cloud" or endpoint.name in ("aws", "gcs"):
        for i in range(1, len(labels)):  # a virtual-hosted bucket: its name leads the host
            spellings |= {".".join(labels[:i]) + "/" + p.lstrip("/") for p in (path, unquote(path))}
    if endpoint.kind != "cloud":
        spellings |= {p.lstrip("/").partition("/")[2] for p in (path, unquote(path))}
    forms = frozenset().union(*(_key_forms(p, True) for p in spellings))
    return Location("object", endpoint, forms)


def store_location(url: str, storage_options: dict, key: str, pattern: bool = False) -> Location:
    """The store, endpoint and path a URL names, normalised (``pattern``: a glob stands for the
    directory before its first wildcard)."""
    fs, path = _open_url(url, storage_options, key)
    fs, path = _unwrap(fs, path)
    family = _family(fs)
    if family == "http":
        return _http_location(path, pattern)
    if pattern and _has_glob(path):
        path = _glob_base(path) or ("/" if path.startswith("/") else "")
    if family == "file":
        return Location("file", _LOCAL, _path_forms(fs, path))
    if family == "memory":
        return Location("memory", _LOCAL, _path_forms(fs, path))
    if family in _OBJECT_FAMILIES:
        return Location("object", _store_endpoint(fs, family, storage_options),
                        _path_forms(fs, path))
    return Location(family, Endpoint("unknown", note=f"a {family}:// server"),
                    _path_forms(fs, path))


def _may_share(a: Endpoint, b: Endpoint) -> bool:
    """Whether two endpoints could be one server: only a different cloud namespace, or a
    different port, proves they are not."""
    if "unknown" in (a.kind, b.kind):
        return True
    if "local" in (a.kind, b.kind):
        return a.kind == b.kind
    if a.kind == b.kind == "cloud":
        return a.name == b.name
    if a.port is None or b.port is None:
        return True
    if a.kind == b.kind == "server":
        return a.port == b.port  # same port: one host, or two names nothing proves apart
    server = a if a.kind == "server" else b  # a cloud's endpoint listens on 80 and 443
    return server.port in (80, 443)


def same_location_store(a: Location, b: Location) -> bool:
    """Whether two locations could be on one store (their paths then compare)."""
    return a.realm == b.realm and _may_share(a.endpoint, b.endpoint)


def _inside(path: str, root: str) -> bool:
    if root in ("", "/"):
        return True
    return path == root or path.startswith(root.rstrip("/") + "/")


def _overlap(inputs: frozenset, outputs: frozenset) -> tuple[str, str] | None:
    """The first (input, output) spellings where one is inside the other, or None."""
    for i in sorted(inputs):
        for o in sorted(outputs):
            if _inside(o, i) or _inside(i, o):
                return i, o
    return None


def _store_words(a: Endpoint, b: Endpoint) -> str:
    if a.kind == "local":
        return ""
    if a.key == b.key and a.kind != "unknown":
        return f" (both on {a.shown})"
    return (f" (the input's store, {a.shown}, and the output's, {b.shown}, cannot be told apart: "
            "they could be one)")


def location_overlap(a: Location, b: Location) -> str | None:
    """How ``a`` sits against ``b`` when they could share storage: ``is the same location as``,
    ``lies inside`` or ``contains``; None when they are apart (another store, or disjoint
    paths)."""
    if not same_location_store(a, b):
        return None
    pair = _overlap(b.paths, a.paths)
    if pair is None:
        return None
    other, mine = pair
    return ("is the same location as" if mine == other else
            "lies inside" if _inside(mine, other) else "contains")


def _store_identity(fs, storage_options: dict) -> tuple:
    """A comparable summary of a filesystem's store (realm and endpoint). Equal summaries are one
    store; unequal ones may still be one (an unnamed endpoint): judge overlap with
    :func:`store_location` and :func:`location_overlap`, as :func:`check_no_overlap` does."""
    fs, _ = _unwrap(fs, "")
    family = _family(fs)
    if family in ("file", "memory"):
        return (family,)
    if family in _OBJECT_FAMILIES and family != "http":
        return ("object", _store_endpoint(fs, family, storage_options).key)
    return (family,)


def _norm(fs, path: str) -> str:
    """One normalised spelling of a path on ``fs`` (symlinks resolved on local disk)."""
    return min(_path_forms(*_unwrap(fs, path)))


def check_no_overlap(paths: tuple[str, ...] | list[str], input_options: dict, output_url: str,
                     output_options: dict) -> None:
    """Exit 2 when the output location equals, lies inside, or contains an input location: a run
    would overwrite its own inputs, or read its own outputs back on the next run. Locations are
    compared by what they name (:func:`store_location`), and two that could be one count as one."""
    out = store_location(output_url, output_options, "output.path")
    for url in paths:
        loc = store_location(url, input_options, "input.path", pattern=True)
        where = location_overlap(out, loc)
        if where is None:
            continue
        hint = ("; or, if these are two different stores, name each one's endpoint in its "
                "storage_options (endpoint_url) so that they can be told apart"
                if out.realm == "object" and "unknown" in (loc.endpoint.kind, out.endpoint.kind)
                else "")
        raise SpecError("output.path",
                        f"the output location {sanitize_url(output_url)!r} {where} the input "
                        f"location {sanitize_url(url)!r}"
                        f"{_store_words(loc.endpoint, out.endpoint)}: a run would overwrite or "
                        "re-read its own files; write the output to a separate directory or "
                        f"bucket prefix{hint}")


def same_store(paths, input_options: dict, out: OutputDir) -> bool:
    """Whether any input pattern could live on the output's store (then listing must skip the
    output path): the same judgement as :func:`check_no_overlap`'s."""
    here = store_location(out.url, out.storage_options, "output.path")
    return any(same_location_store(store_location(u, input_options, "input.path", pattern=True),
                                   here) for u in paths)


def _exclusion(fs, exclude: str) -> frozenset | None:
    """The spellings of ``exclude`` on ``fs``: a path on ``fs`` (as :func:`plan` passes it) or a
    URL (as ``output.path`` is written); None when it names another kind of store."""
    fs, _ = _unwrap(fs, "")
    last = exclude.rsplit("::", 1)[-1]
    protocol, _ = split_protocol(last)
    if protocol:
        if _FAMILIES.get(protocol, protocol) != _family(fs):
            return None
        path = fs._strip_protocol(last)
    elif _family(fs) in _OBJECT_FAMILIES and os.path.isabs(exclude):
        return None  # a local output path: bucket keys never start with /
    else:
        path = exclude
    return _path_forms(fs, path)


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
        skip = _exclusion(fs, exclude) if exclude else None
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
        if skip:
            matches = [p for p in matches
                       if not any(_inside(f, s) for f in _path_forms(*_unwrap(fs, p)) for s in skip)]
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
