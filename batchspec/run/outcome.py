"""The run's outcome: what each shard produced (:class:`ShardStats`), what happened to every shard
(:class:`RunOutcome`), the summary's totals, the summary JSON, the last line a person reads."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from batchspec.columns import error_reason
from batchspec.errors import RuntimeFailure
from batchspec.io.output_dir import OutputDir
from batchspec.stats import acceptance_rate, mean_acceptance_length, tokens_per_s


@dataclass
class ShardStats:
    """What one shard produced."""

    rows: int = 0
    errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    duplicate_ids: int = 0
    #: rows written from an identical request's result (batchspec/run/twins.py)
    from_twin: int = 0
    #: images the rows carried (batchspec/io/images.py), a bad one included
    images: int = 0

    def add(self, result: dict) -> None:
        self.rows += 1
        if result.get("twin_of") is not None:
            self.from_twin += 1
        if result.get("error") is not None:
            self.errors += 1
            reason = error_reason(result["error"])
            self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + 1
        self.output_tokens += result.get("num_output_tokens") or 0
        self.prompt_tokens += result.get("num_prompt_tokens") or 0
        self.spec_steps += result.get("spec_num_steps") or 0
        self.draft_tokens += result.get("spec_num_draft_tokens") or 0
        self.accepted_tokens += result.get("spec_num_accepted_tokens") or 0

    def merge(self, other: dict) -> None:
        """Add a shard summary (``as_dict`` output) into these totals."""
        for key in ("rows", "errors", "output_tokens", "prompt_tokens", "duplicate_ids"):
            setattr(self, key, getattr(self, key) + other[key])
        self.spec_steps += other["spec_num_steps"]
        self.draft_tokens += other["spec_num_draft_tokens"]
        self.accepted_tokens += other["spec_num_accepted_tokens"]
        self.from_twin += other.get("rows_from_twin", 0)
        self.images += other.get("images", 0)
        for reason, n in other["errors_by_reason"].items():
            self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + n

    def as_dict(self, wall_s: float | None = None) -> dict[str, Any]:
        out = {
            "rows": self.rows,
            "errors": self.errors,
            "errors_by_reason": dict(sorted(self.errors_by_reason.items())),
            "duplicate_ids": self.duplicate_ids,
            "rows_from_twin": self.from_twin,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "spec_num_steps": self.spec_steps,
            "spec_num_draft_tokens": self.draft_tokens,
            "spec_num_accepted_tokens": self.accepted_tokens,
            "acceptance_rate": acceptance_rate(self.accepted_tokens, self.draft_tokens),
            "mean_acceptance_length": mean_acceptance_length(self.accepted_tokens, self.spec_steps),
        }
        if self.images:  # a job whose rows carry images (a text job's summary keeps its keys)
            out["images"] = self.images
        if wall_s is not None:
            out["wall_s"] = round(wall_s, 3)
            out["output_tokens_per_s"] = tokens_per_s(self.output_tokens, wall_s)
        return out


@dataclass
class RunOutcome:
    """What happened to each shard a run (or one Ray replica's task) took on, by shard name.

    Plain data: a replica returns its own to the Ray driver, which merges it into the run's
    (:meth:`merge_settled`). :meth:`summary_sections` is what the run summary JSON holds of it."""

    #: committed by this run: the shard's stats (:meth:`ShardStats.as_dict`) -> ``shards``
    committed: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: unreadable, skipped (``input.on_bad_shard: skip``): the error -> ``bad_shards``
    bad: dict[str, str] = field(default_factory=dict)
    #: held by another run and left alone: the holder -> ``busy_shards``
    busy: dict[str, str] = field(default_factory=dict)
    #: lost its lease to another run before commit: why, and the holder -> ``lost_shards``
    lost: dict[str, str] = field(default_factory=dict)
    #: failed on every try (Ray: its replica died each time): why -> ``failed_shards``
    failed: dict[str, str] = field(default_factory=dict)
    #: the executor's own section of the summary (Ray: replicas and their deaths) -> ``executor``
    executor: dict[str, Any] | None = None
    #: each time the engine was brought up again (batchspec/engine/supervise.py's ``Restart``)
    #: -> ``engine_restarts``
    engine_restarts: list[dict[str, Any]] = field(default_factory=list)
    #: requests that killed the engine, written as error rows -> ``quarantined_requests``
    quarantined: list[dict[str, Any]] = field(default_factory=list)

    def merge_settled(self, other: RunOutcome) -> None:
        """Take in what another outcome (a Ray replica's task) settled: committed, bad, lost and
        failed shards. Its busy shards are left to the caller, whose lease wait decides whether
        they are retried or stay busy (:class:`batchspec.run.lease_wait.LeaseWait`)."""
        self.committed.update(other.committed)
        self.bad.update(other.bad)
        self.lost.update(other.lost)
        self.failed.update(other.failed)
        self.engine_restarts.extend(other.engine_restarts)
        self.quarantined.extend(other.quarantined)

    def take_busy(self) -> dict[str, str]:
        """The busy shards recorded so far (shard -> holder), removed from this outcome."""
        busy, self.busy = self.busy, {}
        return busy

    def incomplete(self) -> RuntimeFailure | None:
        """Exit 1 naming every shard the run left undone (busy, lost or failed), or None."""
        for shards, what in (
            (self.busy, "are being processed by another run and were left alone"),
            (self.lost, "lost their lease to another run and were not committed by this one"),
            (self.failed, "failed on every try"),
        ):
            if shards:
                return RuntimeFailure(
                    f"{len(shards)} shards {what}: "
                    + "; ".join(f"{k} ({v})" for k, v in sorted(shards.items()))
                )
        return None

    def summary_sections(self) -> dict[str, Any]:
        """The run summary's shard sections (``failed_shards`` and ``executor`` only when
        there is something to say)."""
        sections: dict[str, Any] = {
            "shards": self.committed,
            "bad_shards": self.bad,
            "busy_shards": self.busy,
            "lost_shards": self.lost,
        }
        if self.executor is not None:
            sections["executor"] = self.executor
        if self.failed:
            sections["failed_shards"] = self.failed
        if self.engine_restarts:
            sections["engine_restarts"] = self.engine_restarts
        if self.quarantined:
            sections["quarantined_requests"] = self.quarantined
        return sections

    def totals(self, wall_s: float, generation_wall_s: float) -> dict[str, Any]:
        """The summary's totals over the committed shards."""
        totals = ShardStats()
        for shard in self.committed.values():
            totals.merge(shard)
        out = totals.as_dict(wall_s)
        out["shards_committed"] = len(self.committed)
        out["generation_wall_s"] = round(generation_wall_s, 3)
        out["generation_output_tokens_per_s"] = tokens_per_s(totals.output_tokens, generation_wall_s)
        return out


# ---------------------------------------------------------------------------- 4. summarise


def summarise(
    summary: dict, outcome: RunOutcome, wall_s: float, generation_wall_s: float, per_position: dict | None
) -> dict:
    """Fill in the run summary's shard sections, totals (over the committed shards) and end
    time."""
    summary.update(outcome.summary_sections())
    summary["totals"] = outcome.totals(wall_s, generation_wall_s)
    summary.setdefault("exit_code", 0)
    if per_position is not None:
        summary["acceptance_per_position"] = per_position
    summary["ended_at"] = dt.datetime.now(dt.UTC).isoformat()
    return summary


def write_summary(out: OutputDir, run_id: str, summary: dict) -> str:
    """Write the run summary to ``_batchspec/runs/<run_id>.json``; returns its path."""
    path = out.run_summary_path(run_id)
    out.write_json(path, summary)
    return path


def human_summary(summary: dict) -> str:
    """One line a person reads at the end of a run."""
    t = summary["totals"]
    parts = [
        f"{summary.get('status', '?')}: {t['shards_committed']} shards committed",
        f"{t['rows']} rows",
        f"{t['errors']} errors",
        f"{t['output_tokens']} output tokens",
        f"{t['wall_s']:.1f}s",
    ]
    if t.get("generation_output_tokens_per_s"):
        parts.append(f"{t['generation_output_tokens_per_s']:.0f} tok/s")
    if t.get("acceptance_rate") is not None:
        parts.append(f"acceptance {t['acceptance_rate']:.3f}, mean length {t['mean_acceptance_length']:.2f}")
    if summary.get("bad_shards"):
        parts.append(f"{len(summary['bad_shards'])} bad shards skipped")
    if summary.get("failed_shards"):
        parts.append(f"{len(summary['failed_shards'])} shards failed")
    if summary.get("engine_restarts"):
        parts.append(f"{len(summary['engine_restarts'])} engine restarts")
    if summary.get("quarantined_requests"):
        parts.append(f"{len(summary['quarantined_requests'])} requests quarantined")
    return ", ".join(parts)


class SupervisionLog:
    """What the run's engine supervisor (batchspec/engine/supervise.py) reports, into the run's
    outcome (the summary) and its events: ``engine_restarted`` for each engine brought up again,
    ``request_quarantined`` for each request that killed it, written as an error row."""

    def __init__(self, events, outcome: RunOutcome):
        self.events, self.outcome = events, outcome

    def restarted(self, restart) -> None:
        record = restart.as_dict()
        self.outcome.engine_restarts.append(record)
        what = "for a quarantine search" if restart.search else f"{restart.restarts_left} restarts left"
        self.events.emit(
            "engine_restarted",
            f"the vLLM engine died ({restart.reason}) and was started again in "
            f"{record['seconds']:.1f}s ({what}); the {restart.in_flight} requests it had go to the new one",
            level="warning",
            **record,
        )

    def quarantined(self, row, deaths: int, reason: str) -> None:
        record = {"shard": row.shard, "request_id": row.request_id, "deaths": deaths, "reason": reason}
        self.outcome.quarantined.append(record)
        self.events.emit(
            "request_quarantined",
            f"request {row.request_id!r} of shard {row.shard} killed the engine on its own "
            f"({deaths} deaths): written as an error row",
            level="warning",
            **record,
        )
