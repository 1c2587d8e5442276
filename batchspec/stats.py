"""Acceptance and throughput arithmetic, in one place for the runner, progress, summary and report.

vLLM's definitions: the acceptance rate is draft tokens accepted over draft tokens proposed; the
mean acceptance length is tokens emitted per verification step of the target, the bonus token
included, so 1 + accepted / steps.
"""

from __future__ import annotations


def acceptance_rate(accepted: int | None, drafted: int | None) -> float | None:
    """Accepted over proposed draft tokens; None when nothing was proposed."""
    return accepted / drafted if drafted else None


def mean_acceptance_length(accepted: int | None, steps: int | None) -> float | None:
    """Tokens per target step, bonus token included; None when there was no step."""
    return 1.0 + (accepted or 0) / steps if steps else None


def tokens_per_s(tokens: int | None, seconds: float | None) -> float | None:
    """A rate, None when no time passed."""
    return tokens / seconds if tokens is not None and seconds and seconds > 0 else None


def acceptance_per_position(before: dict, after: dict) -> dict | None:
    """vLLM's per-position acceptance over an interval, from its engine counters taken before and
    after: {num_drafts, accepted: [per position], rate: [accepted / num_drafts]}; None without
    speculation."""
    per_pos = after.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is None:
        return None
    old = before.get("spec_decode_num_accepted_tokens_per_pos") or []
    drafts = (after.get("spec_decode_num_drafts") or 0) - (before.get("spec_decode_num_drafts") or 0)
    accepted = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(per_pos)]
    return {
        "num_drafts": drafts,
        "accepted": accepted,
        "rate": [acceptance_rate(a, drafts) for a in accepted],
    }


def prefix_cache(before: dict, after: dict) -> dict | None:
    """vLLM's prefix cache over an interval, from its engine counters before and after: prompt
    tokens looked up (``queries``), found cached (``hits``), and ``hit_rate``; None where the
    engine does not count them."""
    if after.get("prefix_cache_queries") is None:
        return None
    queries = int(after["prefix_cache_queries"] - (before.get("prefix_cache_queries") or 0))
    hits = int((after.get("prefix_cache_hits") or 0) - (before.get("prefix_cache_hits") or 0))
    return prefix_cache_figures(queries, hits)


def prefix_cache_figures(queries: int, hits: int) -> dict:
    """``{queries, hits, hit_rate}`` (hit_rate None without a lookup)."""
    return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries > 0 else None}


#: Result columns that count something: summed over a row's samples for progress.
_COUNTED = ("num_output_tokens", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_steps")


def request_totals(results: list[dict]) -> dict:
    """One input row's results (one per sample) as progress counts them: one row, its error if
    any sample failed, the counts summed."""
    if len(results) == 1:
        return results[0]
    totals = {key: sum(r.get(key) or 0 for r in results) for key in _COUNTED}
    totals["error"] = next((r["error"] for r in results if r.get("error") is not None), None)
    return totals
