"""Reading one image of a row: fetched (from its bytes, a ``data:`` URL, or storage under
``input.image_roots``), checked and decoded within the job's limits (:class:`ImageLimits`); what
an image is, and which URLs batchspec reads, are :mod:`batchspec.io.images`'. This module sits
above the location checks (:mod:`batchspec.io.locations`), which :mod:`batchspec.io.images`,
imported by the readers, must not import."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from urllib.parse import parse_qsl, urlsplit

from batchspec.errors import SpecError
from batchspec.io.images import IMAGE_FORMATS, ImageError, ImageLimits, ImageRef, check_readable, shown
from batchspec.io.locations import store_location
from batchspec.io.retry import retry
from batchspec.io.urls import inside, is_local_fs, open_url
from batchspec.redact import scrub_text


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


def under_roots(url: str, roots: tuple[str, ...], storage_options: dict) -> bool:
    """Whether every spelling of ``url`` lies inside one of ``roots`` on the same store (the
    spellings of :func:`batchspec.io.locations.store_location`: symlinks, ``..`` and doubled
    slashes resolved)."""
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
    """An image's bytes from storage, at most one more than the limit. A transient store error
    is retried under the storage retry policy; once its attempts are spent, RuntimeFailure (the
    run's failure, exit 1: the row is not written, and a rerun reads it again), never the row's
    error."""
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
        raise ImageError(f"cannot read image {shown(url)}: {_scrubbed(exc, url)}") from exc


def _scrubbed(exc: BaseException, url: str) -> str:
    """An error's message without the URL's query values or login, however the library spelt
    the URL in it (with or without its scheme)."""
    parts = urlsplit(url)
    secrets = [value for _, value in parse_qsl(parts.query)] + [parts.password or ""]
    return scrub_text(str(exc), secrets)


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
