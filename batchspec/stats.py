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
