"""distill's options and result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchspec.distill.device import DEVICES
from batchspec.spec.methods import DRAFT_MODEL, TRAINABLE, reads_hidden_states
from batchspec.spec.model import JobSpec

#: Speculative tokens per step when the job names no draft.
DEFAULT_K = 4


def option(default: Any = None, help: str = "", flag: str | None = None, **click_kwargs: Any) -> Any:
    """A field of :class:`DistillOptions` and its command-line option, described once: the
    default and the help are the field's; ``flag`` is the option's name where it is not the
    field's (``--holdout``); ``click_kwargs`` go to ``click.option`` (a type, choices, a
    metavar). ``batchspec distill``'s options and the CLI reference are made from these."""
    return field(default=default, metadata={"cli": {"help": help, "flag": flag, **click_kwargs}})


@dataclass
class DistillOptions:
    """What ``batchspec distill`` was asked to do: each field one command-line option
    (``cli/distill.py`` builds them from :func:`option`), in the order ``--help`` lists them."""

    out: Path = option(
        help="Directory for the new draft or head (weights, config, batchspec-model.json), "
        "replaced whole when distill ends; .NAME.batchspec-distill/ beside it keeps "
        "the generated data for a restart.",
        path=True,
        required=True,
    )
    draft: str | None = option(
        help="The draft to start from (and to compare against); its tokenizer must be the target's.",
        path=True,
    )
    method: str = option(
        DRAFT_MODEL.name,
        "What to train: a draft model; a parallel draft (pard: a draft model that proposes a "
        "step's k tokens in one pass); an EAGLE-3 head on the target's hidden states; or a "
        "parallel EAGLE-3 head (peagle: a head that proposes a step's k tokens in one pass).",
        choices=TRAINABLE,
    )
    head: str | None = option(
        help="With --method eagle3 or peagle: the head to continue from (and to compare against); "
        "none: a new head.",
        path=True,
    )
    aux_layers: tuple[int, ...] | None = option(
        help="With --method eagle3 or peagle and no --head: the target's layers whose hidden states the new "
        "head reads (default: 1, the middle one, the last).",
        metavar="I,J,K",
        layer_ids=True,
    )
    mask_token: int | None = option(
        help="With --method pard or peagle: the id of the token the drafter reads in the places it "
        "predicts (default: the one --draft's or --head's config names, else the tokenizer's pad "
        "token).",
        type=int,
    )
    max_minutes: float | None = option(
        help="Bound the data and the training to this many minutes (the evaluation then runs to its end).",
        type=float,
    )
    init: str = option(
        "draft",
        "draft: train --draft further; target: a new draft from the target's own "
        "embeddings, first --layers layers and head.",
        choices=("draft", "target"),
    )
    layers: int = option(1, "Layers of the new draft with --init target.")
    sample: int = option(2000, "Prompts drawn from the job's input (seeded), held-out ones included.")
    heldout: int | None = option(
        help="Prompts of the sample kept for evaluation (default: a fifth of it, at most 200; "
        "never more than half).",
        flag="--holdout",
        type=int,
    )
    logprobs: int = option(
        0, "Keep the target's top-K log-probabilities per token and add a KL term.", metavar="K"
    )
    steps: int = option(300, "Training steps.")
    lr: float = option(2e-3, "Learning rate.")
    batch_size: int = option(16, "Sequences per training step.")
    seed: int = option(0, "Seeds the sample, the split and the training.")
    device: str = option(
        "auto",
        "Where the training and the target's forward pass for a head's features run: auto (CUDA "
        "where torch.cuda.is_available(), else the CPU), cpu, or cuda (refused where there is none). "
        "On CUDA in bf16 (training: autocast, fp32 master weights), on the CPU in fp32.",
        choices=DEVICES,
    )
    k: int | None = option(
        help=f"Speculative tokens per step in the evaluation (default: the job's, else {DEFAULT_K}).",
        type=int,
    )
    eval_concurrency: int | None = option(
        help="Requests in flight in the evaluation (default: execution.max_in_flight).", type=int
    )
    evaluate: bool = option(
        True, "Measure acceptance before and after on the held-out prompts.", "--eval/--no-eval"
    )
    force: bool = option(
        False,
        "Install the new draft even where its held-out acceptance does not beat --draft's by "
        "more than the noise (or was not measured: --no-eval).",
        is_flag=True,
    )
    validation: int | None = option(
        help="Prompts of the sample whose continuations judge the training as it goes, never "
        "trained on (default: a tenth of the rest, 2 to 200; none below 10).",
        type=int,
    )
    patience: int = option(
        3, "Evaluations of the validation figure without a new best before training stops."
    )
    chunk_rows: int = option(128, "Generated rows per committed chunk: a killed run loses at most this many.")
    #: The job file, as given (the card names it); the command's argument, not an option.
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
