"""The run's outcome: the summary's totals, the summary JSON, the last line a person reads."""

from __future__ import annotations

import datetime as dt

from batchspec.io.output_dir import OutputDir
from batchspec.io.paths import BOOKKEEPING_DIR
from batchspec.run.stages import ShardStats
from batchspec.stats import tokens_per_s


def new_outcome() -> dict[str, dict]:
    """What the per-shard stages report, by shard name: the run summary's shard sections."""
    return {"shards": {}, "bad_shards": {}, "busy_shards": {}, "lost_shards": {}}




# ---------------------------------------------------------------------------- 4. summarise


def summarise(summary: dict, wall_s: float, generation_wall_s: float,
              per_position: dict | None) -> dict:
    """Fill in the run summary's totals (over its committed shards) and end time."""
    totals = ShardStats()
    for shard in summary["shards"].values():
        totals.merge(shard)
    summary["totals"] = totals.as_dict(wall_s)
    summary["totals"]["shards_committed"] = len(summary["shards"])
    summary["totals"]["generation_wall_s"] = round(generation_wall_s, 3)
    summary["totals"]["generation_output_tokens_per_s"] = tokens_per_s(totals.output_tokens,
                                                                       generation_wall_s)
    summary.setdefault("exit_code", 0)
    if per_position is not None:
        summary["acceptance_per_position"] = per_position
    summary["ended_at"] = dt.datetime.now(dt.UTC).isoformat()
    return summary




def write_summary(out: OutputDir, run_id: str, summary: dict) -> str:
    """Write the run summary to ``_batchspec/runs/<run_id>.json``; returns its path."""
    path = out.join(BOOKKEEPING_DIR, "runs", f"{run_id}.json")
    out.write_json(path, summary)
    return path




def human_summary(summary: dict) -> str:
    """One line a person reads at the end of a run."""
    t = summary["totals"]
    parts = [f"{summary.get('status', '?')}: {t['shards_committed']} shards committed",
             f"{t['rows']} rows", f"{t['errors']} errors", f"{t['output_tokens']} output tokens",
             f"{t['wall_s']:.1f}s"]
    if t.get("generation_output_tokens_per_s"):
        parts.append(f"{t['generation_output_tokens_per_s']:.0f} tok/s")
    if t.get("acceptance_rate") is not None:
        parts.append(f"acceptance {t['acceptance_rate']:.3f}, "
                     f"mean length {t['mean_acceptance_length']:.2f}")
    if summary.get("bad_shards"):
        parts.append(f"{len(summary['bad_shards'])} bad shards skipped")
    if summary.get("failed_shards"):
        parts.append(f"{len(summary['failed_shards'])} shards failed")
    return ", ".join(parts)
