"""Write containment: the one check that a name batchspec builds a path from stays below its root.

A shard's name comes from its input: a file's path under an input directory, or a data file a
table's log names. A log is data someone else wrote, so a name may hold ``..``, a leading ``/``,
another scheme (``s3://other/...``) or a NUL. :func:`plain_relative` says why such a name is not
a plain relative name; :class:`batchspec.io.output_dir.OutputDir` refuses every path built from
one, and the table readers refuse a log's data file outside the table's root with it.

A name is also bounded: a file name on local disk holds at most ``NAME_MAX`` bytes (255 on
Linux's file systems). :func:`short_name` gives the files batchspec names after a shard
(temporary files, a Lance dataset's data files) names that do not grow with the shard's, and
:func:`too_long` says which segment of a name that cannot be shortened is over the limit."""

from __future__ import annotations

import hashlib
import os
import urllib.parse

#: The bytes one path segment may hold where the file system does not say (POSIX ``NAME_MAX``
#: on Linux's file systems, and on macOS's).
NAME_MAX = 255


def plain_relative(name: str) -> str | None:
    """Why ``name`` is not a plain relative path (segments joined by ``/``, none empty, ``.``
    or ``..``, no scheme, no NUL), or None where it is one. Such a name, joined to any root,
    names a path below that root, and one path only: no other spelling reaches it."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if "\x00" in name:
        return "it holds a NUL character"
    if "://" in name:
        return "it names another store (a URL)"
    if name.startswith("/"):
        return "it is an absolute path"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return f"it has a {segment!r} segment" if segment else "it has an empty segment"
    return None


def table_relative(root: str, path: str) -> tuple[str | None, str | None]:
    """A data file a table's log or manifest names (``path``: a full URI, a local path, or a
    path relative to the table, %-encoded or not), relative to the table's root ``root``.
    Returns ``(relative, None)``, or ``(None, why)`` for a file outside the root: ``..``, an
    absolute path elsewhere, another bucket or scheme, a NUL (``%00`` too)."""
    if "%00" in path.lower() or "\x00" in path:
        return None, "it holds a NUL character"
    decoded = urllib.parse.unquote(path)
    root = urllib.parse.unquote(root).rstrip("/")
    scheme, _, rest = root.rpartition("://")
    local = scheme in ("", "file")
    relative = None
    for prefix in (root, rest, "file://" + rest) if local else (root,):
        if prefix and decoded.startswith(prefix + "/"):
            relative = decoded[len(prefix) + 1 :]
            break
    if relative is None:
        if "://" in decoded or decoded.startswith("/"):
            return None, "it is outside the table's root"
        relative = decoded
    why = plain_relative(relative)
    return (relative, None) if why is None else (None, why)


def short_name(name: str, keep: int = 40) -> str:
    """A file name standing for ``name`` that does not grow with it: ``name``'s first ``keep``
    bytes (whole characters, for whoever looks at the folder), then ``-`` and 16 hex digits of
    a hash of all of ``name`` (two names share one only where their hashes collide). The
    caller makes ``name`` one segment first (``/`` escaped)."""
    head = name.encode()[:keep].decode(errors="ignore")
    return f"{head}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def name_max(path: str) -> int:
    """The longest file name (bytes) the local file system at ``path`` (or the nearest folder
    above it that exists) takes."""
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return int(os.pathconf(path or "/", "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def too_long(relative: str, limit: int) -> str | None:
    """The first segment of ``relative`` over ``limit`` bytes, or None where every one fits."""
    for segment in relative.split("/"):
        if len(segment.encode()) > limit:
            return segment
    return None
