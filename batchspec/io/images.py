"""Images in rows: what a row's image is (:data:`ImageRef`), where batchspec may read one from, and
decoding it within the job's limits, one row at a time.

A row's images come from ``input.image_columns`` (a cell of bytes, or of a URL, or a list of
them) or from ``image_url`` parts of its chat messages (JSON lines, Parquet, OpenAI Batch
files). Either way the row's messages hold ``{"type": "image", "image": i}`` parts, ``i`` an
index into :attr:`batchspec.io.rows.Row.images`, and nothing is read until the engine takes
the row (:func:`read_image`): a row's images are fetched, checked and decoded then, handed to
vLLM, and released when its request is processed, so that memory follows the requests in flight,
not the shard.

An image is that row's error, never the run's, when it is: not bytes or a URL; a URL of a scheme
batchspec does not read (``http://`` is never fetched), or outside every ``input.image_roots``
location; missing; over ``input.max_image_bytes``; not one of :data:`IMAGE_FORMATS`; over
``input.max_image_pixels`` (checked from its header, before any pixel is decoded: a small file
that would decode to gigabytes is refused unread); or corrupt. A URL is shown with
:func:`batchspec.redact.sanitize_url` (no login, no query string) wherever batchspec prints it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchspec.redact import sanitize_url

#: What a row's image is before it is read: its bytes (a Parquet ``binary`` cell), or a URL (a
#: local path, ``s3://``, ``gs://``, ``az://``, ``memory://``, or a ``data:`` URL holding it).
ImageRef = bytes | str

#: The image formats batchspec decodes (Pillow's names); anything else is that row's error.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

#: URL schemes batchspec reads an image from (fsspec's spellings of local disk and the stores),
#: besides ``data:`` URLs and plain local paths. Never http(s), ftp or a chained ``a::b`` URL.
READ_SCHEMES = frozenset({"file", "local", "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class ImageError(ValueError):
    """Why one image of a row cannot be used: that row's error."""


@dataclass(frozen=True)
class ImageLimits:
    """What a job allows of an image: its bytes, its pixels, and the locations a URL may name
    (``input.image_roots``, read with ``input.storage_options``)."""

    max_bytes: int
    max_pixels: int
    roots: tuple[str, ...] = ()
    storage_options: dict = field(default_factory=dict)

    @classmethod
    def of(cls, input_spec) -> ImageLimits:
        """The limits of a job's ``input`` section (an InputSpec)."""
        return cls(
            input_spec.max_image_bytes,
            input_spec.max_image_pixels,
            tuple(input_spec.image_roots),
            dict(input_spec.storage_options),
        )


def image_refs(value: Any, where: str) -> list[ImageRef]:
    """A cell of an image column as the row's images: bytes or a URL, or a list of them.
    ImageError naming ``where`` (the column) for a null, an empty value or another type."""
    values = value if isinstance(value, list | tuple) else [value]
    if value is None or not values:
        raise ImageError(f"no image in {where}")
    return [image_ref(v, where) for v in values]


def image_ref(value: Any, where: str) -> ImageRef:
    """One image value: bytes (Parquet ``binary``) or a URL string."""
    if isinstance(value, bytes | bytearray | memoryview):
        if not len(value):
            raise ImageError(f"empty image bytes in {where}")
        return bytes(value)
    if isinstance(value, str):
        if not value.strip():
            raise ImageError(f"empty image URL in {where}")
        return value.strip()
    if value is None:
        raise ImageError(f"null image in {where}")
    raise ImageError(f"image in {where} is a {type(value).__name__}, expected bytes or a URL")


def shown(ref: ImageRef) -> str:
    """An image for a message: its size for bytes and ``data:`` URLs, else its URL without login
    or query string."""
    if isinstance(ref, bytes):
        return f"image bytes ({len(ref):,} bytes)"
    if ref[:5].lower() == "data:":
        return f"data: URL ({len(ref):,} characters)"
    return repr(sanitize_url(ref))


def ref_digest(ref: ImageRef) -> str:
    """What identifies an image among a row's inputs (the twins of ``run/twins.py``): its bytes,
    or its URL as written."""
    data = ref if isinstance(ref, bytes) else ref.encode()
    return ("b:" if isinstance(ref, bytes) else "u:") + hashlib.blake2b(data, digest_size=16).hexdigest()


# ------------------------------------------------------------------ chat content parts


def content_parts(messages: list[Mapping], images: list[ImageRef], where: str) -> list[dict]:
    """Chat messages whose contents may be lists of OpenAI parts (``text``, ``image_url``) in
    batchspec's form: a message without images keeps its text (its text parts joined); a
    message with them gets ``[{"type": "image", "image": i}, {"type": "text", ...}]`` parts,
    each image's URL appended to ``images``. ImageError naming ``where`` for another part."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list | tuple):
            out.append({**message} if isinstance(message, Mapping) else message)
            continue
        parts: list[dict] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, Mapping) else url
                if not isinstance(url, str) or not url.strip():
                    raise ImageError(f"{where}[{i}].content[{j}] has no image_url.url")
                parts.append({"type": "image", "image": len(images)})
                images.append(url.strip())
            else:
                raise ImageError(
                    f"{where}[{i}].content[{j}] is a part of type {kind!r}: batchspec reads text and "
                    "image_url parts"
                )
        if any(p["type"] == "image" for p in parts):
            out.append({**message, "content": parts})
        else:
            out.append({**message, "content": "".join(p["text"] for p in parts)})
    return out


def attach(messages: list[dict] | None, prompt: str | None, first: int, count: int) -> list[dict]:
    """A row's messages with ``count`` images (indices from ``first``) put before the text of
    its first user message (a text prompt becomes that one user message)."""
    images = [{"type": "image", "image": first + k} for k in range(count)]
    if messages is None:
        return [{"role": "user", "content": [*images, {"type": "text", "text": prompt or ""}]}]
    out = [dict(m) for m in messages]
    at = next((i for i, m in enumerate(out) if m.get("role") == "user"), 0)
    content = out[at].get("content")
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    out[at]["content"] = [*images, *text]
    return out


def text_only(messages: list[dict]) -> list[dict]:
    """Messages with image parts dropped and text parts joined: what a text-only renderer (a
    reasoning parser's check of the prompt's end) is given."""
    return [
        {
            **m,
            "content": m["content"]
            if isinstance(m.get("content"), str)
            else "".join(p.get("text", "") for p in m.get("content") or () if p.get("type") == "text"),
        }
        for m in messages
    ]


# ------------------------------------------------------------------ reading one image


def read_image(ref: ImageRef, limits: ImageLimits):
    """The image ``ref`` names, fetched and decoded within ``limits``: an RGB ``PIL.Image``,
    loaded (the file closed). ImageError where the row must get an error instead."""
    return decode(image_bytes(ref, limits), limits.max_pixels)


def image_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    """An image's encoded bytes: as given, from a ``data:`` URL, or read from storage."""
    if isinstance(ref, bytes):
        data = ref
    elif ref[:5].lower() == "data:":
        data = _data_url(ref, limits.max_bytes)
    else:
        data = _fetch(ref, limits)
    if len(data) > limits.max_bytes:
        raise ImageError(f"{shown(ref)} is over input.max_image_bytes ({limits.max_bytes:,} bytes)")
    return data


def _data_url(url: str, max_bytes: int) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head[5:].endswith(";base64"):
        raise ImageError("a data: URL image must be base64 (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > max_bytes + 3:  # refused before it is decoded
        raise ImageError(f"{shown(url)} is over input.max_image_bytes ({max_bytes:,} bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"a data: URL image is not valid base64: {exc}") from exc


def scheme_of(url: str) -> str | None:
    """A URL's scheme, lower-cased (None: a plain path)."""
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else None


def check_readable(url: str) -> None:
    """ImageError unless batchspec reads images from URLs of this kind."""
    scheme = scheme_of(url)
    if "::" in url or (scheme is not None and scheme not in READ_SCHEMES):
        raise ImageError(
            f"image URL {shown(url)}: batchspec reads images from local paths, s3://, gs://, az:// "
            "and memory:// (under input.image_roots) and data: URLs, never "
            + (f"{scheme}://" if scheme and "::" not in url else "a chained URL")
        )


def under_roots(url: str, roots: tuple[str, ...], storage_options: dict) -> bool:
    """Whether every spelling of ``url`` lies inside one of ``roots`` on the same store (the
    spellings of :func:`batchspec.io.locations.store_location`: symlinks, ``..`` and doubled
    slashes resolved)."""
    from batchspec.errors import SpecError
    from batchspec.io.locations import store_location
    from batchspec.io.urls import inside

    try:
        where = store_location(url, storage_options, "input.image_roots")
    except SpecError as exc:
        raise ImageError(f"image URL {shown(url)}: {exc}") from exc
    for root in roots:
        loc = store_location(root, storage_options, "input.image_roots")
        if loc.realm != where.realm or loc.endpoint.key != where.endpoint.key:
            continue
        if all(any(inside(p, r) for r in loc.paths) for p in where.paths):
            return True
    return False


def _fetch(url: str, limits: ImageLimits) -> bytes:
    from batchspec.errors import SpecError
    from batchspec.io.retry import retry
    from batchspec.io.urls import is_local_fs, open_url

    check_readable(url)
    if not limits.roots:
        raise ImageError(f"image URL {shown(url)}: input.image_roots names no location images are read from")
    if not under_roots(url, limits.roots, limits.storage_options):
        raise ImageError(f"image URL {shown(url)} is outside input.image_roots")
    try:
        fs, path = open_url(url, limits.storage_options, "input.image_roots")
    except SpecError as exc:
        raise ImageError(f"image URL {shown(url)}: {exc}") from exc

    def read() -> bytes:
        with fs.open(path, "rb") as handle:
            return handle.read(limits.max_bytes + 1)

    try:
        return read() if is_local_fs(fs) else retry(read, f"reading image {shown(url)}")
    except FileNotFoundError as exc:
        raise ImageError(f"image not found: {shown(url)}") from exc
    except (IsADirectoryError, PermissionError) as exc:
        raise ImageError(f"cannot read image {shown(url)}: {type(exc).__name__}") from exc
    except OSError as exc:
        raise ImageError(f"cannot read image {shown(url)}: {exc}") from exc


def decode(data: bytes, max_pixels: int):
    """Encoded image bytes as a loaded RGB ``PIL.Image`` (a multi-frame image's first frame)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            width, height = image.size
            if width * height > max_pixels:  # from the header: nothing decoded yet
                raise ImageError(
                    f"image of {width}x{height} pixels is over input.max_image_pixels ({max_pixels:,})"
                )
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError(f"corrupt, or not an image batchspec reads ({', '.join(IMAGE_FORMATS)})") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image refused as a decompression bomb: {exc}") from exc
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise ImageError(f"corrupt image: {exc}") from exc
