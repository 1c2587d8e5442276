"""Whether a distilled drafter replaces the one it started from: only when its held-out
acceptance beats the starting drafter's by more than the noise of the held-out prompts.

The noise is the prompt-to-prompt spread of the paired difference. Acceptance is a ratio of
sums over the held-out prompts (accepted / drafted tokens); the difference after - before is
judged on the same prompts (paired), and its standard error is the delta method's for a ratio
of sums: each prompt's share z_i = (a'_i - R' d'_i) / D' - (a_i - R d_i) / D (a accepted,
d drafted, R = A / D, primes after), SE = sqrt(n / (n - 1) * sum z_i^2). The gain must exceed
:data:`NOISE_SE` standard errors, and never less than :data:`MIN_MARGIN`.

Pure Python: no torch, no vLLM."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

#: The gain must exceed this many standard errors of the paired difference (about a one-sided
#: 97.7% confidence that the new drafter accepts more on prompts like the held-out ones).
NOISE_SE = 2.0

#: The smallest margin: a gain of less than this is no reason to replace a drafter.
MIN_MARGIN = 0.005


@dataclass
class Decision:
    """The install decision, as distill's output and card report it."""

    install: bool
    #: after - before acceptance rate on the held-out prompts (None: nothing compared).
    gain: float | None
    #: What the gain had to exceed (None: nothing compared).
    margin: float | None
    #: Held-out prompts both evaluations answered (the pairs compared).
    prompts: int
    forced: bool
    reason: str

    def as_json(self) -> dict:
        return asdict(self)


def paired_gain(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> tuple[float, float, int]:
    """(gain, standard error, pairs) of the acceptance rate after - before, over the prompts
    both sides answered; each side maps a request id to (accepted, drafted) tokens. The
    standard error is infinite with fewer than two pairs or no drafted token on a side."""
    ids = sorted(set(before) & set(after))
    n = len(ids)
    a_b = sum(before[i][0] for i in ids)
    d_b = sum(before[i][1] for i in ids)
    a_a = sum(after[i][0] for i in ids)
    d_a = sum(after[i][1] for i in ids)
    if not d_b or not d_a:
        return 0.0, math.inf, n
    r_b, r_a = a_b / d_b, a_a / d_a
    gain = r_a - r_b
    if n < 2:
        return gain, math.inf, n
    z = [(after[i][0] - r_a * after[i][1]) / d_a - (before[i][0] - r_b * before[i][1]) / d_b for i in ids]
    return gain, math.sqrt(n / (n - 1) * sum(v * v for v in z)), n


def margin_for(se: float) -> float:
    """What a gain must exceed given the standard error of the paired difference."""
    return max(MIN_MARGIN, NOISE_SE * se)


def decide(
    before: dict[str, tuple[int, int]] | None,
    after: dict[str, tuple[int, int]] | None,
    force: bool,
    baseline: bool = True,
) -> Decision:
    """Install only when after beats before by more than the margin, or when forced. Without a
    starting drafter (``baseline`` False) there is nothing to beat: install. A side that was not
    evaluated (None) leaves nothing to compare: only ``force`` installs."""
    if not baseline:
        return Decision(True, None, None, len(after or {}), False, "no starting drafter to compare with")
    if before is None or after is None:
        return Decision(force, None, None, 0, force, "no held-out comparison was made")
    gain, se, n = paired_gain(before, after)
    margin = margin_for(se)
    better = gain > margin
    if better:
        reason = f"held-out acceptance rose by {gain:+.4f}, more than the noise margin {margin:.4f}"
    elif math.isinf(margin):
        reason = f"{n} held-out prompt(s) with drafted tokens on both sides: too few to judge"
    else:
        reason = (
            f"held-out acceptance changed by {gain:+.4f}, not more than the noise margin "
            f"{margin:.4f} ({NOISE_SE:g} standard errors of the paired difference over {n} prompts)"
        )
    return Decision(
        better or force,
        round(gain, 4),
        None if math.isinf(margin) else round(margin, 4),
        n,
        force and not better,
        reason,
    )
