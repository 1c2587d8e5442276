"""Distill's training: build the student draft (an existing draft, or a new one from the target's
own embeddings, first layers and head), train it on the target's continuations (cross-entropy on
the target's tokens, plus KL on the target's top-K where kept), and save a model directory vLLM
loads as a draft.

Imports torch and transformers, never vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchspec.distill.recipe import init_draft_from_target, lr_at
from batchspec.errors import SpecError

#: At most this many CPU threads for training: the machine is shared with the engine's processes.
MAX_TORCH_THREADS = 2


#: Longest training sequence (prompt + continuation); longer prompts lose their beginning.
MAX_TRAIN_TOKENS = 512


def tokenizer_vocab(path: str) -> tuple[dict[str, int], dict[str, Any]]:
    """A model directory's tokenizer vocabulary (token -> id, added tokens included) and its
    special token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    special = {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "unk": tok.unk_token_id,
    }
    return tok.get_vocab(), special


def check_vocabulary(target: str, draft: str, key: str = "--draft") -> None:
    """Refuse a draft whose vocabulary size, tokens or special tokens differ from the target's:
    its proposals would be other tokens than the target verifies. A SpecError (exit 2) that
    names the first difference."""
    from transformers import AutoConfig

    if not Path(draft).is_dir():
        raise SpecError(key, f"{draft}: no such model directory")
    try:
        t_cfg, d_cfg = AutoConfig.from_pretrained(target), AutoConfig.from_pretrained(draft)
        t_vocab, t_special = tokenizer_vocab(target)
        d_vocab, d_special = tokenizer_vocab(draft)
    except Exception as exc:  # tokenizers raises a bare Exception for a broken tokenizer.json
        raise SpecError(key, f"cannot read the tokenizer or config of {draft} or {target}: {exc}") from exc
    where = f"the draft {draft} and the target {target}"
    t_size, d_size = getattr(t_cfg, "vocab_size", None), getattr(d_cfg, "vocab_size", None)
    if t_size != d_size:
        raise SpecError(
            key,
            f"{where} have different vocabulary sizes ({d_size} vs {t_size}): "
            "a draft must share the target's tokenizer",
        )
    if d_vocab != t_vocab:
        only_d = sorted(set(d_vocab) - set(t_vocab))[:3]
        moved = sorted(t for t in set(d_vocab) & set(t_vocab) if d_vocab[t] != t_vocab[t])[:3]
        detail = (
            f"tokens only in the draft: {only_d}"
            if only_d
            else f"tokens with other ids: {moved}"
            if moved
            else f"{len(d_vocab)} vs {len(t_vocab)} tokens"
        )
        raise SpecError(
            key, f"{where} have different tokenizers ({detail}): a draft must share the target's tokenizer"
        )
    if d_special != t_special:
        raise SpecError(key, f"{where} have different special tokens ({d_special} vs {t_special})")


def draft_from_target(target_dir: str, layers: int):
    """A new ``layers``-layer draft with the target's architecture, embeddings, first layers,
    final norm and head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    total = getattr(config, "num_hidden_layers", None)
    if total is None or not 1 <= layers <= total:
        raise SpecError("--layers", f"expected 1 to {total} (the target's layers), got {layers}")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config.num_hidden_layers = layers
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_draft_from_target(draft, target)
    return draft


class Objective(Protocol):
    """What a draft learns other than the next token (:func:`train_draft`'s ``objective``): its
    batches and its validation figure."""

    def batch(self, examples: list[Example], idx: list[int], pad_id: int, topk: bool, gen: Any) -> tuple:
        """:func:`_batch`'s inputs, attention mask (or a dict of the model's keyword arguments:
        its own attention mask and positions), labels and teacher, and each labelled position's
        share of the loss (a tensor like the labels, summing to 1 over them)."""
        ...

    def acceptance(self, draft: Any, examples: list[Example], k: int, device: str) -> float:
        """The validation figure: :func:`greedy_acceptance`'s, for this way of drafting."""
        ...


#: Evaluations of the validation figure without a new best before training stops.
PATIENCE = 3


@dataclass
class TrainResult:
    #: Steps run (fewer than planned where the validation figure stopped rising).
    steps: int
    #: The last step's training loss and top-1 agreement.
    loss: float | None
    top1_agreement: float | None
    wall_s: float
    device: str
    #: The step whose weights were kept (0: the starting weights; None: no validation, the last).
    best_step: int | None = None
    #: The validation figure (:attr:`metric`) of the kept weights, and of the starting ones.
    validation_agreement: float | None = None
    start_validation_agreement: float | None = None
    stopped_early: bool = False
    #: (step, validation figure) at each evaluation.
    history: list = field(default_factory=list)
    #: What the validation figure is.
    metric: str = "validation greedy acceptance at the job's k, first max_tokens"


class EarlyStop:
    """Keep the best validation figure; say stop after ``patience`` evaluations in a row
    without a new best (strictly higher)."""

    def __init__(self, patience: int = PATIENCE):
        self.patience = max(1, patience)
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0

    def record(self, step: int, value: float) -> bool:
        """Record an evaluation; True when it is a new best (keep these weights)."""
        if self.best is None or value > self.best:
            self.best, self.best_step, self.since_best = value, step, 0
            return True
        self.since_best += 1
        return False

    @property
    def stop(self) -> bool:
        return self.since_best >= self.patience


def eval_interval(steps: int) -> int:
    """Steps between two evaluations of the validation figure: about 20 over the run, at least 10."""
    return max(10, steps // 20)


@dataclass
class Example:
    """One generated row as tensors: prompt + continuation (truncated to MAX_TRAIN_TOKENS), where
    the continuation starts, and the target's top-K ids and probabilities per output token."""

    tokens: Any
    prompt_len: int
    topk_ids: Any = None
    topk_prob: Any = None


def prepare_examples(rows: list[dict], window: int | None = None) -> list[Example]:
    """Turn generated rows into tensors once (not at every step). With ``window``, each
    continuation is cut into windows of that many tokens, one example each: the prompt and the
    continuation before the window are its context, the window's tokens its labels."""
    examples = []
    for row in rows:
        output = row["output_token_ids"]
        step = window or max(1, len(output))
        for start in range(0, len(output), step):
            examples.append(_example(row, start, min(len(output), start + step)))
    return examples


def _example(row: dict, start: int, end: int) -> Example:
    """One window: the context (prompt + output[:start], cut from the left to fit
    MAX_TRAIN_TOKENS) and the labels output[start:end] with their top-K."""
    import torch

    output = row["output_token_ids"][start:end]
    context = [*row["prompt_token_ids"], *row["output_token_ids"][:start]]
    context = context[-max(1, MAX_TRAIN_TOKENS - len(output)) :]
    output = output[: MAX_TRAIN_TOKENS - len(context)]
    ex = Example(torch.tensor(context + output, dtype=torch.long), len(context))
    tids, tlps = row.get("topk_token_ids"), row.get("topk_logprobs")
    if tids and tlps:
        tids, tlps = tids[start : start + len(output)], tlps[start : start + len(output)]
    if tids and tlps:
        k = max(len(t) for t in tids)
        ex.topk_ids = torch.zeros((len(output), k), dtype=torch.long)
        lps = torch.full((len(output), k), float("-inf"))
        for j, (ids_j, lps_j) in enumerate(zip(tids, tlps, strict=False)):
            ex.topk_ids[j, : len(ids_j)] = torch.tensor(ids_j, dtype=torch.long)
            lps[j, : len(lps_j)] = torch.tensor(lps_j).clamp(min=-1e4)
        # the top-K renormalised: the rest of the target's distribution is unknown
        ex.topk_prob = torch.softmax(lps, -1)
    return ex


def _batch(examples: list[Example], idx: list[int], pad_id: int, topk: bool):
    """Right-padded inputs (prompt + continuation, less the last token), the continuation's
    positions as labels (-100 elsewhere) and, with top-K, the teacher's ids and probabilities
    at those positions."""
    import torch

    chosen = [examples[i] for i in idx]
    width = max(len(ex.tokens) - 1 for ex in chosen)
    ids = torch.full((len(chosen), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chosen), width), dtype=torch.long)
    labels = torch.full((len(chosen), width), -100, dtype=torch.long)
    k = max((ex.topk_ids.shape[1] for ex in chosen if ex.topk_ids is not None), default=0)
    teacher = None
    if topk and k:
        teacher = (
            torch.zeros((len(chosen), width, k), dtype=torch.long),
            torch.zeros((len(chosen), width, k)),
        )
    for b, ex in enumerate(chosen):
        n = len(ex.tokens) - 1
        ids[b, :n] = ex.tokens[:-1]
        mask[b, :n] = 1
        start = ex.prompt_len - 1  # the position whose next token is the first output token
        labels[b, start:n] = ex.tokens[ex.prompt_len :]
        if teacher is not None and ex.topk_ids is not None:
            m, kk = ex.topk_ids.shape
            teacher[0][b, start : start + m, :kk] = ex.topk_ids
            teacher[1][b, start : start + m, :kk] = ex.topk_prob
    return ids, mask, labels, teacher


def _logits(draft, ids, mask, on):
    """The draft's logits at the label positions ``on`` (fp32). ``mask``: the attention mask, or
    a dict of the model's keyword arguments (an objective's own attention mask and positions)."""
    if isinstance(mask, dict):
        return draft.lm_head(draft.model(input_ids=ids, **mask).last_hidden_state[on]).float()
    # Right padding under causal attention: no real token attends to a pad, so no mask is
    # needed (building one cost a third of each step here). The head runs on the labels'
    # positions only: prompts are most of the tokens.
    if hasattr(draft, "model") and hasattr(draft, "lm_head"):
        hidden = draft.model(input_ids=ids).last_hidden_state
        return draft.lm_head(hidden[on]).float()
    return draft(input_ids=ids, attention_mask=mask).logits[on].float()


def greedy_acceptance(
    draft, examples: list[Example], k: int, device: str = "cpu", batch_size: int = 16
) -> float:
    """The acceptance rate greedy speculative decoding with ``draft`` proposing ``k`` tokens a
    step would reach on ``examples`` (each one window: its context, then the target's greedy
    tokens as labels), computed from one teacher-forced pass. Exact for greedy drafting: while
    the draft's proposals match the target's tokens its context is the target's, so the run of
    matches from a step's first position is what the target accepts; then the target's own
    token follows and the next step starts after it. Accepted / proposed (``k`` a step), as
    vLLM counts acceptance."""
    import torch

    accepted = proposed = 0
    was_training = draft.training
    draft.eval()
    try:
        with torch.no_grad():
            for first in range(0, len(examples), batch_size):
                idx = list(range(first, min(len(examples), first + batch_size)))
                ids, mask, labels, _ = _batch(examples, idx, 0, False)
                ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
                on = labels != -100
                hits = (_logits(draft, ids, mask, on).argmax(-1) == labels[on]).tolist()
                counts = on.sum(1).tolist()
                at = 0
                for n in counts:
                    a, p = _steps(hits[at : at + n], k)
                    accepted, proposed, at = accepted + a, proposed + p, at + n
    finally:
        draft.train(was_training)
    return accepted / proposed if proposed else 0.0


def _steps(hits: list[bool], k: int) -> tuple[int, int]:
    """(accepted, proposed) of greedy speculation over one continuation, from whether the
    draft's teacher-forced prediction matched the target at each position."""
    accepted = proposed = pos = 0
    while pos < len(hits):
        run = 0
        while run < k and pos + run < len(hits) and hits[pos + run]:
            run += 1
        accepted, proposed, pos = accepted + run, proposed + k, pos + run + 1
    return accepted, proposed


def first_windows(rows: list[dict], window: int | None) -> list[Example]:
    """Each row's first ``window`` target tokens as one example: what the job's requests of
    ``max_tokens = window`` draft over (the whole continuation without ``window``)."""
    return [
        _example(row, 0, window or len(row["output_token_ids"])) for row in rows if row["output_token_ids"]
    ]


def train_draft(
    draft,
    examples: list[dict],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    pad_id: int,
    kl_weight: float = 1.0,
    progress: Callable[[str], None] | None = None,
    interval_s: float = 10.0,
    *,
    window: int | None = None,
    validation: list[dict] | None = None,
    patience: int = PATIENCE,
    eval_every: int | None = None,
    deadline: float | None = None,
    device: str | None = None,
    k: int = 4,
    objective: Objective | None = None,
) -> TrainResult:
    """Train ``draft`` in place on the target's continuations (cut into ``window``-token
    windows): cross-entropy on the target's tokens plus ``kl_weight`` x KL(target top-K ||
    draft) where the top-K was kept. With ``validation`` rows, the greedy acceptance the draft
    would reach proposing ``k`` tokens a step over their first ``window`` tokens (the job's
    settings: :func:`greedy_acceptance`) is measured before training and every ``eval_every``
    steps (default :func:`eval_interval`); training stops after ``patience`` evaluations without a new best,
    and the best weights (the starting ones included) are what the draft holds at the end.
    Training also stops at ``deadline`` (``time.monotonic()``), where given.
    ``device``: ``"cuda"`` trains in bf16 autocast with fp32 master weights, ``"cpu"`` in fp32
    with at most :data:`MAX_TORCH_THREADS` threads; None: CUDA where present
    (:func:`batchspec.distill.device.resolve`). ``objective``: another objective's batches and
    validation figure (a parallel draft's: batchspec/distill/pard.py); None: the next token's."""
    import torch
    import torch.nn.functional as F

    from batchspec.distill import device as devices

    say = progress or (lambda msg: None)
    device = device or devices.resolve("auto")
    autocast = devices.autocast(device)
    started = last = time.monotonic()
    loss_value = agree = None
    held = first_windows(validation, window) if validation else []
    watch = EarlyStop(patience)
    every = eval_every or eval_interval(steps)
    best_state = None
    history: list[tuple[int, float]] = []
    run = 0

    def check(step: int) -> None:
        nonlocal best_state
        value = (objective.acceptance if objective else greedy_acceptance)(draft, held, k, device)
        history.append((step, round(value, 4)))
        if watch.record(step, value):
            best_state = {n: v.detach().to("cpu", copy=True) for n, v in draft.state_dict().items()}
        say(
            f"validation acceptance at k={k} at step {step}: {value:.3f} (best {watch.best:.3f} at "
            f"step {watch.best_step})"
        )

    with devices.cpu_threads(device, MAX_TORCH_THREADS):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        draft.to(device)
        draft.train()
        opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        examples = prepare_examples(examples, window)
        topk = any(ex.topk_ids is not None for ex in examples)
        warmup = max(1, min(50, steps // 10))
        if held:
            check(0)
        for step in range(steps):
            if deadline is not None and time.monotonic() > deadline:
                say(f"--max-minutes reached: training stopped at step {run} of {steps}")
                break
            idx = torch.randint(0, len(examples), (batch_size,), generator=gen).tolist()
            if objective is None:
                ids, mask, labels, teacher = _batch(examples, idx, pad_id, topk)
                weight = None
            else:
                ids, mask, labels, teacher, weight = objective.batch(examples, idx, pad_id, topk, gen)
            ids, labels = ids.to(device), labels.to(device)
            mask = {k: v.to(device) for k, v in mask.items()} if isinstance(mask, dict) else mask.to(device)
            on = labels != -100
            with autocast:
                logits = _logits(draft, ids, mask, on)
            logp = F.log_softmax(logits, dim=-1)
            target_tokens = labels[on]
            # each labelled position's share of the loss: equal, or the objective's
            share = None if weight is None else weight.to(device)[on]
            if share is None:
                loss = F.nll_loss(logp, target_tokens)
            else:
                loss = (F.nll_loss(logp, target_tokens, reduction="none") * share).sum()
            if teacher is not None and kl_weight:
                t_ids, t_prob = teacher[0].to(device)[on], teacher[1].to(device)[on]
                student = logp.gather(-1, t_ids)
                kl = (t_prob * (torch.log(t_prob.clamp(min=1e-12)) - student)).sum(-1)
                loss = loss + kl_weight * (kl.mean() if share is None else (kl * share).sum())
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            run = step + 1
            loss_value = loss.item()
            agree = (logp.argmax(-1) == target_tokens).float().mean().item()
            now = time.monotonic()
            if now - last >= interval_s or step in (0, steps - 1):
                last = now
                say(
                    f"train step {run}/{steps}: loss {loss_value:.3f}, top-1 agreement "
                    f"{agree:.3f} ({now - started:.0f}s)"
                )
            if held and (run % every == 0 or run == steps):
                check(run)
                if watch.stop:
                    say(
                        f"validation acceptance has not risen for {watch.patience} evaluations: "
                        f"stopped at step {run} of {steps}"
                    )
                    break
        if best_state is not None:
            draft.load_state_dict(best_state)
            if watch.best_step != run:
                say(f"kept the weights of step {watch.best_step} (validation acceptance {watch.best:.3f})")
        draft.eval()
        draft.to("cpu")
    if device == "cuda":
        devices.release_gpu()
    return TrainResult(
        steps=run,
        loss=loss_value,
        top1_agreement=agree,
        wall_s=time.monotonic() - started,
        device=device,
        best_step=watch.best_step,
        validation_agreement=None if watch.best is None else round(watch.best, 4),
        start_validation_agreement=history[0][1] if history else None,
        stopped_early=bool(held) and run < steps,
        history=history,
    )


def save_draft(draft, tokenizer_dir: str, out: Path) -> None:
    """Write weights (safetensors), config and the tokenizer into ``out``: a directory vLLM
    loads as a draft."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    draft.generation_config.do_sample = False
    draft.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)


def load_draft(path: str):
    """An existing draft, in fp32, to train further."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
