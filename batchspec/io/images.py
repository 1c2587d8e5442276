"""Images in rows: what a row's image is (:data:`ImageRef`), where batchspec may read one from, and
decoding it within the job's limits, one row at a time.

A row's images come from ``input.image_columns`` (a cell of bytes, or of a URL, or a list of
them) or from ``image_url`` parts of its chat messages (JSON lines, Parquet, OpenAI Batch
files). Either way the row's messages hold ``{"type": "image", "image": i}`` parts, ``i`` an
index into :attr:`batchspec.io.rows.Row.images`, and nothing is read until the engine takes
the row (:func:`batchspec.io.image_reader.read_image`): a row's images are fetched, checked and
decoded then, handed to vLLM, and released when its request is processed, so that memory follows
the requests in flight, not the shard.

An image is that row's error, never the run's, when it is: not bytes or a URL; a URL of a scheme
batchspec does not read (``http://`` is never fetched), or outside every ``input.image_roots``
location; missing; over ``input.max_image_bytes``; not one of :data:`IMAGE_FORMATS`; over
``input.max_image_pixels`` (checked from its header, before any pixel is decoded: a small file
that would decode to gigabytes is refused unread); or corrupt. A URL is shown with
:func:`batchspec.redact.sanitize_url` (no login, no query string) wherever batchspec prints it."""

from __future__ import annotations

import hashlib
import re
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
