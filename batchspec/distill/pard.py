"""Parallel drafting (PARD): a draft that proposes all k tokens of a step in one forward pass.

How vLLM runs one (``speculative_config`` with ``parallel_drafting: true``): after the request's
tokens it appends the token the target just produced and k - 1 copies of the draft's mask token,
at the positions that follow, and reads the draft's greedy token at each of those k positions:
the target's token's position proposes the first token, the i-th mask the (i + 1)-th. The draft's
``config.json`` names its mask token (``pard_token``; vLLM also reads ``mask_token_id`` and
``ptd_token_id``).

What distill teaches it (:class:`ParallelObjective`): on each training window, the target's
next token at every position of the window (as a sequential draft learns it), and, from one
point of the window drawn at random, the k - 1 tokens after the next with mask tokens in their
places: the PARD objective (Chen et al., "PARD: Accelerating LLM Inference with Low-Cost
PARallel Draft Model Adaptation", 2025), one drawn point a window. The two halves weigh the same
in the loss. The validation figure is the acceptance greedy parallel drafting reaches on the
held-out windows, stepped as vLLM steps (:func:`parallel_acceptance`).

Imports torch inside the calls that need it, never vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchspec.errors import SpecError
from batchspec.spec.methods import mask_token

#: What distill writes the mask token as in a draft's ``config.json``.
WRITTEN_KEY = "pard_token"


def choose_mask_token(draft_config: dict, vocab_size: int, special: dict[str, Any], given: int | None) -> int:
    """The mask token a new parallel draft reads: ``given`` (``--mask-token``), else the one the
    draft's config already names, else the tokenizer's pad token where it is neither the
    beginning nor the end of a sequence (a token the target never generates). A SpecError
    naming ``--mask-token`` where there is none, or it is out of the vocabulary."""
    chosen = given if given is not None else mask_token(draft_config)
    if chosen is None:
        pad = special.get("pad")
        if pad is not None and pad not in (special.get("eos"), special.get("bos")):
            chosen = pad
    if chosen is None:
        raise SpecError(
            "--mask-token",
            "the tokenizer has no pad token apart from its begin and end tokens: give the id of a "
            "token the target never writes (a reserved one) for the draft to read in the places it "
            "predicts",
        )
    if not 0 <= chosen < vocab_size:
        raise SpecError("--mask-token", f"{chosen} is not a token id of the vocabulary (0..{vocab_size - 1})")
    return chosen


def write_mask_token(model_dir: Path, mask: int) -> None:
    """Name the mask token in a saved draft's ``config.json`` (where vLLM reads it)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    config[WRITTEN_KEY] = mask
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@dataclass
class ParallelObjective:
    """The PARD objective for :func:`batchspec.distill.train.train_draft` (module docstring)."""

    k: int
    mask: int

    def batch(self, examples: list, idx: list[int], pad_id: int, topk: bool, gen: Any) -> tuple:
        """Each window's tokens up to a point drawn in it, then ``k - 1`` mask tokens: labels
        are the target's next token at every position of the window before the point (and at
        the point), and the tokens after it at the masks; the two groups weigh half the loss
        each."""
        import torch

        chosen = [examples[i] for i in idx]
        rows = []
        for ex in chosen:
            tokens, start = ex.tokens.tolist(), ex.prompt_len
            # the first token predicted from the masks' row: from start (the window's first
            # token) to its last
            point = start + int(torch.randint(0, len(tokens) - start, (1,), generator=gen))
            masks = self.k - 1
            ids = tokens[:point] + [self.mask] * masks
            labels = [-100] * (start - 1) + tokens[start : point + 1]
            labels += [tokens[point + j] if point + j < len(tokens) else -100 for j in range(1, masks + 1)]
            # the index in the window's tokens of each label (for the teacher's top-K)
            where = [*range(start, point + 1), *range(point + 1, point + 1 + masks)]
            rows.append((ids, labels, where, point - start + 1))
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        is_mask = torch.zeros((len(rows), width), dtype=torch.bool)
        k_top = max((ex.topk_ids.shape[1] for ex in chosen if ex.topk_ids is not None), default=0)
        teacher = None
        if topk and k_top:
            teacher = (
                torch.zeros((len(rows), width, k_top), dtype=torch.long),
                torch.zeros((len(rows), width, k_top)),
            )
        for b, ((row_ids, row_labels, where, ar), ex) in enumerate(zip(rows, chosen, strict=True)):
            n = len(row_ids)
            ids[b, :n] = torch.tensor(row_ids)
            attn[b, :n] = 1
            labels[b, : len(row_labels)] = torch.tensor(row_labels)
            first = ex.prompt_len - 1
            is_mask[b, first + ar : n] = True
            if teacher is not None and ex.topk_ids is not None:
                for j, t in enumerate(where):
                    o = t - ex.prompt_len  # the output token's index
                    if 0 <= o < ex.topk_ids.shape[0] and labels[b, first + j] != -100:
                        kk = ex.topk_ids.shape[1]
                        teacher[0][b, first + j, :kk] = ex.topk_ids[o]
                        teacher[1][b, first + j, :kk] = ex.topk_prob[o]
        on = labels != -100
        weight = torch.zeros((len(rows), width))
        for group in (on & ~is_mask, on & is_mask):
            count = int(group.sum())
            if count:
                weight[group] = 0.5 / count if int((on & is_mask).sum()) else 1.0 / count
        return ids, attn, labels, teacher, weight

    def acceptance(self, draft: Any, examples: list, k: int, device: str, batch_size: int = 16) -> float:
        """:func:`parallel_acceptance` at this objective's mask token (``k``: the job's)."""
        return parallel_acceptance(draft, examples, k, self.mask, device, batch_size)


def parallel_acceptance(
    draft: Any, examples: list, k: int, mask: int, device: str = "cpu", batch_size: int = 16
) -> float:
    """The acceptance rate greedy parallel drafting reaches on ``examples`` (each one window: its
    context, then the target's greedy tokens), stepped as vLLM steps: from the context and the
    tokens accepted so far, one pass with ``k - 1`` masks after them proposes ``k`` tokens; the
    run of them that match the target's is accepted, the target's own token follows, and the
    next step starts after it. Accepted / proposed (``k`` a step), as vLLM counts acceptance."""
    import torch

    seqs = [(ex.tokens.tolist(), ex.prompt_len) for ex in examples if len(ex.tokens) > ex.prompt_len]
    at = [start for _, start in seqs]
    accepted = proposed = 0
    was_training = draft.training
    draft.eval()
    try:
        with torch.no_grad():
            active = list(range(len(seqs)))
            while active:
                for first in range(0, len(active), batch_size):
                    chunk = active[first : first + batch_size]
                    inputs = [seqs[i][0][: at[i]] + [mask] * (k - 1) for i in chunk]
                    width = max(len(x) for x in inputs)
                    ids = torch.full((len(chunk), width), mask, dtype=torch.long)
                    for b, x in enumerate(inputs):
                        ids[b, : len(x)] = torch.tensor(x)
                    ids = ids.to(device)
                    hidden = draft.model(input_ids=ids).last_hidden_state
                    for b, i in enumerate(chunk):
                        n = len(inputs[b])
                        proposal = draft.lm_head(hidden[b, n - k : n]).argmax(-1).tolist()
                        tokens, pos = seqs[i][0], at[i]
                        run = 0
                        while run < k and pos + run < len(tokens) and proposal[run] == tokens[pos + run]:
                            run += 1
                        accepted, proposed = accepted + run, proposed + k
                        at[i] = pos + run + 1
                active = [i for i in active if at[i] < len(seqs[i][0])]
    finally:
        draft.train(was_training)
    return accepted / proposed if proposed else 0.0
