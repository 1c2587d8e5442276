"""Parallel drafting (PARD): a draft that proposes all k tokens of a step in one forward pass.

How vLLM runs one (``speculative_config`` with ``parallel_drafting: true``): after the request's
tokens it appends the token the target just produced and k - 1 copies of the draft's mask token,
at the positions that follow, and reads the draft's greedy token at each of those k positions:
the target's token's position proposes the first token, the i-th mask the (i + 1)-th. The draft's
``config.json`` names its mask token (``pard_token``; vLLM also reads ``mask_token_id`` and
``ptd_token_id``).

What distill teaches it (:class:`ParallelObjective`): on each training window, the target's
next token at every position of the window (as a sequential draft learns it), and, from
:data:`POINTS` points of the window drawn at random, the k - 1 tokens after the next with mask
tokens in their places: the PARD objective (Chen et al., "PARD: Accelerating LLM Inference with
Low-Cost PARallel Draft Model Adaptation", 2025). The points' masks are packed after the window
in one pass, each group at the rotary positions it would hold and seeing only the window up to
its point and its own earlier masks (an attention mask per row), so that a window trains every
point at the cost of its masks alone. The two halves weigh the same in the loss. The
validation figure is the acceptance greedy parallel drafting reaches on the held-out windows,
stepped as vLLM steps (:func:`parallel_acceptance`).

Imports torch inside the calls that need it, never vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchspec.errors import SpecError
from batchspec.spec.methods import mask_token

#: Points a training window is drafted from in parallel (each k - 1 masks packed after it).
POINTS = 4
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
        """Each window's tokens, then for each of :data:`POINTS` points drawn in it ``k - 1``
        mask tokens: labels are the target's next token at every position of the window, and at
        each point's masks the tokens after the point's next; the two groups weigh half the loss
        each. The attention mask is a dict of the model's keyword arguments (a boolean mask per
        row and the positions), which the training loop passes on."""
        import torch

        chosen = [examples[i] for i in idx]
        masks = self.k - 1
        rows = []
        for ex in chosen:
            tokens, start = ex.tokens.tolist(), ex.prompt_len
            n = len(tokens)
            # a point: the index of the token the last real position before the masks predicts,
            # from start (the window's first token) to its last
            points = [start + int(torch.randint(0, n - start, (1,), generator=gen)) for _ in range(POINTS)]
            labels = [-100] * (start - 1) + tokens[start:] + [-100]
            where = [*range(start - 1), *range(start, n), -1]  # the index of each label's token
            for p in points:
                labels += [tokens[p + j] if p + j < n else -100 for j in range(1, masks + 1)]
                where += [p + j for j in range(1, masks + 1)]
            rows.append((tokens, points, labels, where))
        width = max(len(r[0]) + POINTS * masks for r in rows)
        b = len(rows)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        allowed = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)  # a pad sees itself only
        positions = torch.zeros((b, width), dtype=torch.long)
        labels = torch.full((b, width), -100, dtype=torch.long)
        is_mask = torch.zeros((b, width), dtype=torch.bool)
        k_top = max((ex.topk_ids.shape[1] for ex in chosen if ex.topk_ids is not None), default=0)
        teacher = None
        if topk and k_top:
            teacher = (torch.zeros((b, width, k_top), dtype=torch.long), torch.zeros((b, width, k_top)))
        group = torch.ones(masks, masks, dtype=torch.bool).tril()
        for r, ((tokens, points, row_labels, where), ex) in enumerate(zip(rows, chosen, strict=True)):
            n = len(tokens)
            ids[r, :n] = torch.tensor(tokens)
            ids[r, n : n + POINTS * masks] = self.mask
            allowed[r, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            positions[r, :n] = torch.arange(n)
            for g, p in enumerate(points):
                at = slice(n + g * masks, n + (g + 1) * masks)
                # mask j of the point sits where token p + j - 1 would: after the real tokens
                # up to p - 1, which it sees, and its group's earlier masks
                allowed[r, at, :p] = True
                allowed[r, at, at] = group
                positions[r, at] = torch.arange(p, p + masks)
                is_mask[r, at] = True
            labels[r, : len(row_labels)] = torch.tensor(row_labels)
            if teacher is not None and ex.topk_ids is not None:
                for j, t in enumerate(where):
                    o = t - ex.prompt_len  # the output token's index
                    if 0 <= o < ex.topk_ids.shape[0] and labels[r, j] != -100:
                        kk = ex.topk_ids.shape[1]
                        teacher[0][r, j, :kk] = ex.topk_ids[o]
                        teacher[1][r, j, :kk] = ex.topk_prob[o]
        on = labels != -100
        weight = torch.zeros((b, width))
        for part in (on & ~is_mask, on & is_mask):
            count = int(part.sum())
            if count:
                weight[part] = 0.5 / count if int((on & is_mask).sum()) else 1.0 / count
        inputs = {"attention_mask": allowed.unsqueeze(1), "position_ids": positions}
        return ids, inputs, labels, teacher, weight

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
