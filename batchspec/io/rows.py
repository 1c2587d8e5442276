"""One input row on its way to the engine, whichever format it was read from."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchspec.io.images import ImageError, attach, content_parts, image_refs, ref_digest


def id_digest(request_id: str) -> bytes:
    """An 8-byte digest of a request id: what a check for repeated ids keeps of each (about 70
    bytes an id in a set, whatever the id's length)."""
    return hashlib.blake2b(request_id.encode(), digest_size=8).digest()


@dataclass
class Row:
    """One input row on its way to the engine."""

    shard: str
    index: int
    request_id: str
    kept: dict[str, Any]
    prompt: str | None = None
    #: Chat messages; a message with images has a list of parts as its content, ``{"type":
    #: "text", "text": ...}`` and ``{"type": "image", "image": i}`` (``i`` an index into
    #: :attr:`images`; batchspec/io/images.py).
    messages: list[dict[str, Any]] | None = None
    #: Per-row SamplingParams overrides (only the non-null ones).
    overrides: dict[str, Any] = field(default_factory=dict)
    #: The LoRA adapter the row's ``input.lora_column`` names (None: the job's choice).
    lora: str | None = None
    #: Set when the row cannot be sent to the engine; it is written as an error row.
    error: str | None = None
    #: ``task: score``: the pair's second text (``input.pair_columns``; ``prompt`` is the first).
    pair: str | None = None
    #: The row's images, unread (bytes or URLs: batchspec/io/images.py), in the order its
    #: messages' image parts name them.
    images: list[bytes | str] | None = None


def asked_digest(row: Row) -> bytes:
    """What a row asks the engine, hashed: its prompt or messages, its adapter, its per-row
    sampling and, for a score row, its pair's second text. Two rows with one digest get the same
    result from the engine (the twins of ``run/twins.py``) and kill it alike (the quarantine of
    ``engine/supervise.py``); a field that changes the request belongs here, or the two would take
    one row's result, or its quarantine, for another's."""
    asked = [row.prompt, row.messages, row.lora, sorted(row.overrides.items())]
    if row.pair is not None:
        asked.append(row.pair)
    if row.images:  # bytes by their digest, URLs as written
        asked.append([ref_digest(ref) for ref in row.images])
    return hashlib.blake2b(json.dumps(asked, sort_keys=True, default=str).encode(), digest_size=16).digest()


def pair_error(text: Any, column: str) -> str | None:
    """Why a pair's second text cannot be scored (None: it can)."""
    if text is None:
        return f"null pair text in {column!r}"
    if not isinstance(text, str):
        return f"pair text in {column!r} is no text: {type(text).__name__}"
    if not text.strip():
        return f"empty pair text in {column!r}"
    return None


def check_messages(messages: Any) -> str | None:
    """Why a chat messages value cannot be rendered, or None if it can."""
    if messages is None:
        return "null messages"
    if not messages:
        return "empty messages"
    for i, message in enumerate(messages):
        if not message or not isinstance(message.get("role"), str) or not message["role"]:
            return f"message {i} has no role"
        content = message.get("content")
        if isinstance(content, list):  # parts: text and images (batchspec/io/images.py)
            if not content or not all(
                isinstance(p, dict) and p.get("type") in ("text", "image") for p in content
            ):
                return f"message {i} has no text content"
        elif not isinstance(content, str):
            return f"message {i} has no text content"
    if not any(_has_content(m["content"]) for m in messages):
        return "empty messages"
    return None


def set_messages(row: Row, messages: Any) -> str | None:
    """Set the row's chat messages, their ``image_url`` parts taken as its images
    (batchspec/io/images.py); why they cannot be rendered (None: they can)."""
    if isinstance(messages, list) and any(
        isinstance(m, Mapping) and isinstance(m.get("content"), list | tuple) for m in messages
    ):
        images: list[bytes | str] = []
        try:
            messages = content_parts(messages, images, "messages")
        except ImageError as exc:
            return f"bad image: {exc}"
        row.images = images or None
    row.messages = messages
    return check_messages(messages)


def add_image_columns(row: Row, columns: tuple[str, ...], values: Mapping[str, Any]) -> str | None:
    """The images of the row's ``input.image_columns`` (``values``: column -> cell) put before
    the text of its first user message (a text prompt becomes that message); why they cannot be
    (None: done)."""
    if not columns:
        return None
    images = list(row.images or ())
    first = len(images)
    try:
        for column in columns:
            images += image_refs(values.get(column), f"column {column!r}")
    except ImageError as exc:
        return f"bad image: {exc}"
    row.messages = attach(row.messages, row.prompt, first, len(images) - first)
    row.prompt = None
    row.images = images
    return None


def _has_content(content: str | list[dict]) -> bool:
    """Text that is not blank, or an image."""
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == "image" or p.get("text", "").strip() for p in content)


class SeenIds:
    """Request ids seen in this run, across shards, as their :func:`id_digest`."""

    def __init__(self):
        self._seen: set[bytes] = set()

    def add(self, request_id: str) -> bool:
        """Record an id; True if it was seen before."""
        key = id_digest(request_id)
        if key in self._seen:
            return True
        self._seen.add(key)
        return False
