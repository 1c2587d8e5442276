"""`status` as a library call: each of a worker's shards with its state, and the orphan outputs."""

from __future__ import annotations

from typing import Any

from batchspec.io.states import STORED_STATES, ShardState
from batchspec.redact import sanitize_url
from batchspec.run.stages import plan
from batchspec.spec.model import JobSpec


def job_status(spec: JobSpec, worker_index: int = 0, num_workers: int = 1) -> dict[str, Any]:
    """{"shards": [{shard, state, input, output, changed}], "orphans": [output names with no
    current input]}: what ``batchspec status`` shows; with a table output also ``table``
    ({format, exists, version}: the table's state), with a table input ``input_pin`` (the
    version or snapshot a run reads now)."""
    p = plan(spec, worker_index, num_workers)
    table = p.out.table_state if p.out.format.table else None

    def output(s) -> str | None:
        if p.states[s.name] is not ShardState.COMMITTED:
            return None
        if table is not None:  # its data file among the table's (none after a compaction)
            return sanitize_url(table.files.get(s.name) or p.out.display_url)
        return sanitize_url(p.out.output_path(s))

    shards = [
        {
            "shard": s.name,
            "state": p.states[s.name].value,
            "input": sanitize_url(s.url),
            "output": output(s),
            "changed": p.stale.get(s.name, []),
        }
        for s in p.shards
    ]
    status: dict[str, Any] = {"shards": shards, "orphans": list(p.orphans)}
    if table is not None:  # what the table holds now: readers see exactly the committed shards
        status["table"] = {"format": spec.output.format, "exists": table.exists, "version": table.version}
    if p.pin is not None:
        status["input_pin"] = p.pin
    return status


def state_counts(rows: list[dict]) -> dict[str, int]:
    """How many shards are in each state."""
    return {k: sum(1 for r in rows if r["state"] == k) for k in STORED_STATES}
