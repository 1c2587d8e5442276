"""`status` as a library call: each of a worker's shards with its state, and the orphan outputs."""

from __future__ import annotations

from typing import Any

from batchspec.io.states import STORED_STATES, ShardState
from batchspec.redact import sanitize_url
from batchspec.run.stages import plan
from batchspec.spec.model import JobSpec


def job_status(spec: JobSpec, worker_index: int = 0, num_workers: int = 1) -> dict[str, Any]:
    """{"shards": [{shard, state, input, output, changed}], "orphans": [output names with no
    current input]}: what ``batchspec status`` shows."""
    p = plan(spec, worker_index, num_workers)
    shards = [
        {
            "shard": s.name,
            "state": p.states[s.name].value,
            "input": sanitize_url(s.url),
            "output": (
                sanitize_url(p.out.output_path(s)) if p.states[s.name] is ShardState.COMMITTED else None
            ),
            "changed": p.stale.get(s.name, []),
        }
        for s in p.shards
    ]
    return {"shards": shards, "orphans": list(p.orphans)}


def state_counts(rows: list[dict]) -> dict[str, int]:
    """How many shards are in each state."""
    return {k: sum(1 for r in rows if r["state"] == k) for k in STORED_STATES}
