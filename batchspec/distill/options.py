"""distill's options and result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchspec.spec.methods import DRAFT_MODEL, reads_hidden_states
from batchspec.spec.model import JobSpec

#: Speculative tokens per step when the job names no draft.
DEFAULT_K = 4


@dataclass
class DistillOptions:
    """What ``batchspec distill`` was asked to do (its command-line options)."""

    out: Path
    draft: str | None = None
    #: What to train: ``draft_model`` (a small model) or ``eagle3`` (a head on the target's
    #: hidden states, batchspec/distill/eagle3.py).
    method: str = DRAFT_MODEL.name
    #: The EAGLE-3 head to start from (and to compare against) with ``method: eagle3``; None:
    #: a new head.
    head: str | None = None
    #: The target's layers whose hidden states a new head reads (None: eagle3.default_aux_layers).
    aux_layers: tuple[int, ...] | None = None
    #: Wall-clock minutes for the data and the training (the evaluation that follows runs to
    #: its end); None: no bound.
    max_minutes: float | None = None
    #: "draft": start from ``draft``; "target": a new draft from the target's first ``layers``.
    init: str = "draft"
    layers: int = 1
    sample: int = 2000
    heldout: int = 200
    #: Keep the target's top-K log-probabilities per token for the KL term (0: cross-entropy only).
    logprobs: int = 0
    steps: int = 300
    lr: float = 2e-3
    batch_size: int = 16
    seed: int = 0
    #: Speculative tokens per step in the evaluation (None: the job's, else DEFAULT_K).
    k: int | None = None
    #: Requests in flight during the evaluation (None: the job's execution.max_in_flight).
    eval_concurrency: int | None = None
    evaluate: bool = True
    #: Install the new drafter even where it does not beat the starting one by more than the noise.
    force: bool = False
    #: Prompts of the sample whose continuations judge the training (None: validation_size's default).
    validation: int | None = None
    #: Evaluations of held-out agreement without a new best before training stops.
    patience: int = 3
    #: Generated rows per committed chunk (what a killed run can lose).
    chunk_rows: int = 128
    job_path: str | None = None
    #: The ``--set`` overrides, as given (the card shows them as written).
    overrides: tuple[str, ...] = ()

    @property
    def start(self) -> str | None:
        """The drafter a new one starts from and must beat: ``--head`` for a head, else ``--draft``."""
        return self.head if reads_hidden_states(self.method) else self.draft

    @property
    def start_key(self) -> str:
        return "--head" if reads_hidden_states(self.method) else "--draft"


@dataclass
class DistillResult:
    out: str
    before: dict | None
    after: dict | None
    card: dict = field(default_factory=dict)
    #: The install decision (batchspec.distill.gate.Decision.as_json()).
    decision: dict | None = None

    def as_json(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after, "out": self.out, "decision": self.decision}


def job_k(spec: JobSpec) -> int:
    spec_cfg = spec.speculative or {}
    return int(spec_cfg.get("num_speculative_tokens") or DEFAULT_K)
