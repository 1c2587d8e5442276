"""Shared prefixes together (``execution.prefix_window``), the order half.

A batch runner sees the whole dataset, which an engine never does: rows whose prompts share a
long prefix (several questions about one document, one few-shot block, one system prompt) are
cheaper when vLLM's prefix cache serves the shared part from KV blocks an earlier request
computed. That needs them close together: an engine with a small KV cache evicts a prefix long
before a row far down the file asks for it again. So each shard's rows are sent ``window`` at a
time, each window sorted by LoRA adapter (a cached block belongs to one adapter) and then by
prompt text (chat messages by role and content in order), which puts rows with a common prefix
next to each other. Memory stays bounded by the window; rows still belong to their shard, so
output and exactly-once are as before (a shard's rows are written as they complete anyway).

The pacing half lives with the engine (:class:`batchspec.engine.pacing.PrefixPacer`): vLLM V1
reuses a block only once a step has computed it, so rows of one prefix sent in one step would
each compute it again; the stream sends the first and holds the rest until its prefill ran."""

from __future__ import annotations

from collections.abc import Iterator

from batchspec.io.rows import Row


def prefix_order(rows: Iterator[Row], window: int) -> Iterator[Row]:
    """``rows`` (one shard's) in windows of ``window`` sendable rows, each sorted by
    :func:`sort_key` (stable: rows with the same text keep their order). A row the reader
    refused passes at once. ``window`` 0 or 1: file order."""
    if window <= 1:
        yield from rows
        return
    buffer: list[Row] = []
    for row in rows:
        if row.error is not None:
            yield row
            continue
        buffer.append(row)
        if len(buffer) >= window:
            buffer.sort(key=sort_key)
            yield from buffer
            buffer = []
    buffer.sort(key=sort_key)
    yield from buffer


def sort_key(row: Row) -> tuple[str, str]:
    """(LoRA adapter, the text the prompt starts with): rows sharing a prefix sort together."""
    if row.prompt is not None:
        text = row.prompt
    else:  # the chat template renders messages in order: system prompt, then turns
        text = "\x00".join(f"{m.get('role')}\x01{m.get('content')}" for m in row.messages or ())
    return row.lora or "", text
