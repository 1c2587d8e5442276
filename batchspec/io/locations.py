"""Which store a URL lives on (endpoint, bucket, account) and whether two locations overlap: the
input, output, target and draft must not."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from batchspec.errors import SpecError
from batchspec.io.output_dir import OutputDir
from batchspec.io.urls import (
    OBJECT_FAMILIES,
    glob_base,
    has_glob,
    inside,
    key_forms,
    open_url,
    path_forms,
    store_family,
    unwrap,
)
from batchspec.redact import sanitize_url

_DEFAULT_PORTS = {"http": 80, "https": 443}


#: The public clouds' own endpoints: every spelling of one of them names one namespace.
_AWS_HOST = re.compile(r"(^|\.)amazonaws\.com(\.cn)?$")


_GCS_HOST = re.compile(r"(^|\.)googleapis\.com$|^storage\.cloud\.google\.com$")


_AZURE_HOST = re.compile(
    r"^(?P<account>[a-z0-9]+)(-secondary)?\.(blob|dfs)\.core\."
    r"(windows\.net|chinacloudapi\.cn|usgovcloudapi\.net|cloudapi\.de)$"
)


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
                return f"Azure storage account {self.name[len('azure:') :]}"
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
        named += [
            getattr(fs, "endpoint_url", None),
            (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url"),
        ]
        if not any(named) and os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() not in (
            "true",
            "1",
        ):
            named = [os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")]
        return _one_endpoint(named, family, Endpoint("unknown", note=_AWS_DEFAULT))
    if family == "gs":
        try:
            named.append(fs._location)  # gcsfs: endpoint_url, STORAGE_EMULATOR_HOST or Google's
        except Exception:  # another gcsfs: resolve as it documents
            named.append(
                getattr(fs, "_endpoint", None)
                or os.environ.get("STORAGE_EMULATOR_HOST")
                or "https://storage.googleapis.com"
            )
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


def _http_location(url: str, pattern: bool) -> Location:
    """An https URL as the object it may name: on a cloud's endpoint, or path-style
    (``/bucket/key``), virtual-host-style (``bucket.host/key``), Azurite-style
    (``/account/container/key``) or GCS JSON-style (``/storage/v1/b/bucket/o/key``) on any
    other server."""
    parts = urlsplit(url)
    endpoint = parse_endpoint(f"{parts.scheme}://{parts.netloc}", "http")
    path = parts.path
    if pattern and has_glob(path):
        path = glob_base(path)
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
    forms = frozenset().union(*(key_forms(p, True) for p in spellings))
    return Location("object", endpoint, forms)


def store_location(url: str, storage_options: dict, key: str, pattern: bool = False) -> Location:
    """The store, endpoint and path a URL names, normalised (``pattern``: a glob stands for the
    directory before its first wildcard)."""
    fs, path = open_url(url, storage_options, key)
    fs, path = unwrap(fs, path)
    family = store_family(fs)
    if family == "http":
        return _http_location(path, pattern)
    if pattern and has_glob(path):
        path = glob_base(path) or ("/" if path.startswith("/") else "")
    if family == "file":
        return Location("file", _LOCAL, path_forms(fs, path))
    if family == "memory":
        return Location("memory", _LOCAL, path_forms(fs, path))
    if family in OBJECT_FAMILIES:
        return Location("object", _store_endpoint(fs, family, storage_options), path_forms(fs, path))
    return Location(family, Endpoint("unknown", note=f"a {family}:// server"), path_forms(fs, path))


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


def _overlap(inputs: frozenset, outputs: frozenset) -> tuple[str, str] | None:
    """The first (input, output) spellings where one is inside the other, or None."""
    for i in sorted(inputs):
        for o in sorted(outputs):
            if inside(o, i) or inside(i, o):
                return i, o
    return None


def _store_words(a: Endpoint, b: Endpoint) -> str:
    if a.kind == "local":
        return ""
    if a.key == b.key and a.kind != "unknown":
        return f" (both on {a.shown})"
    return (
        f" (the input's store, {a.shown}, and the output's, {b.shown}, cannot be told apart: "
        "they could be one)"
    )


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
    return (
        "is the same location as" if mine == other else "lies inside" if inside(mine, other) else "contains"
    )


def _store_identity(fs, storage_options: dict) -> tuple:
    """A comparable summary of a filesystem's store (realm and endpoint). Equal summaries are one
    store; unequal ones may still be one (an unnamed endpoint): judge overlap with
    :func:`store_location` and :func:`location_overlap`, as :func:`check_no_overlap` does."""
    fs, _ = unwrap(fs, "")
    family = store_family(fs)
    if family in ("file", "memory"):
        return (family,)
    if family in OBJECT_FAMILIES and family != "http":
        return ("object", _store_endpoint(fs, family, storage_options).key)
    return (family,)


def _norm(fs, path: str) -> str:
    """One normalised spelling of a path on ``fs`` (symlinks resolved on local disk)."""
    return min(path_forms(*unwrap(fs, path)))


def check_no_overlap(
    paths: tuple[str, ...] | list[str],
    input_options: dict,
    output_url: str,
    output_options: dict,
    image_roots: tuple[str, ...] | list[str] = (),
) -> None:
    """Exit 2 when the output location equals, lies inside, or contains an input location (or a
    location images are read from, ``input.image_roots``): a run would overwrite its own inputs,
    or read its own outputs back on the next run. Locations are compared by what they name
    (:func:`store_location`), and two that could be one count as one."""
    out = store_location(output_url, output_options, "output.path")
    named = [(url, "input.path", "input", True) for url in paths]
    named += [(url, "input.image_roots", "image", False) for url in image_roots]
    for url, key, what, pattern in named:
        loc = store_location(url, input_options, key, pattern=pattern)
        where = location_overlap(out, loc)
        if where is None:
            continue
        hint = (
            "; or, if these are two different stores, name each one's endpoint in its "
            "storage_options (endpoint_url) so that they can be told apart"
            if out.realm == "object" and "unknown" in (loc.endpoint.kind, out.endpoint.kind)
            else ""
        )
        raise SpecError(
            "output.path" if what == "input" else key,
            f"the output location {sanitize_url(output_url)!r} {where} the {what} "
            f"location {sanitize_url(url)!r}"
            f"{_store_words(loc.endpoint, out.endpoint)}: a run would overwrite or "
            "re-read its own files; write the output to a separate directory or "
            f"bucket prefix{hint}",
        )


def check_job_locations(spec) -> None:
    """:func:`check_no_overlap` for a job (a JobSpec): its input paths and image roots against
    its output."""
    inp, out = spec.input, spec.output
    check_no_overlap(inp.paths, inp.storage_options, out.path, out.storage_options, inp.image_roots)


def same_store(paths, input_options: dict, out: OutputDir) -> bool:
    """Whether any input pattern could live on the output's store (then listing must skip the
    output path): the same judgement as :func:`check_no_overlap`'s."""
    here = store_location(out.url, out.storage_options, "output.path")
    return any(
        same_location_store(store_location(u, input_options, "input.path", pattern=True), here) for u in paths
    )
