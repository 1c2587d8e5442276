"""One vocabulary of shard states: what storage says of a shard (:meth:`OutputDir.inspect`,
``batchspec status``) and where a shard is on its way through a run
(:class:`batchspec.run.stages.ShardRun`). Each state is its lower-case name as a string, the
word status prints and the JSON holds."""

from __future__ import annotations

import enum


class ShardState(enum.StrEnum):
    """A shard's state. On storage: ``PENDING``, ``PARTIAL``, ``STALE`` or ``COMMITTED``. In a
    run, a shard moves only forward, from ``PENDING`` through ``READING`` and ``READ`` (while
    its lease is ours) to one of ``COMMITTED``, ``FAILED`` or ``ABANDONED``, or from
    ``PENDING`` to ``BUSY`` or ``SKIPPED`` (see :data:`batchspec.run.stages.MOVES`)."""

    # on storage, and the start of a run
    PENDING = "pending"  # nothing committed yet; in a run: not claimed yet
    PARTIAL = "partial"  # a record or a file without the other, or they disagree
    STALE = "stale"  # committed under another spec (the fingerprint names what changed)
    COMMITTED = "committed"  # its files and manifest agree; in a run: its lease given back
    # on a shard's way through a run
    BUSY = "busy"  # another process holds its lease: left alone
    SKIPPED = "skipped"  # committed by another process since this run planned
    READING = "reading"  # its lease is ours; its rows are being read into the stream
    READ = "read"  # its lease is ours; every row read, committed when the last result arrives
    FAILED = "failed"  # unreadable midway: its copy discarded, its lease given back
    ABANDONED = "abandoned"  # its lease went to another process: its copy discarded


#: The states storage gives a shard (:meth:`OutputDir.inspect`), as ``batchspec status`` counts
#: them.
STORED_STATES = (ShardState.COMMITTED, ShardState.PARTIAL, ShardState.PENDING, ShardState.STALE)
