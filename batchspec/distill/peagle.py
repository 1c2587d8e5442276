"""Parallel EAGLE-3 heads (P-EAGLE): an EAGLE-3 head that proposes all k tokens of a step in one
forward pass.

How vLLM runs one (``speculative_config`` ``eagle3`` with ``parallel_drafting: true``): after the
request's last position (the sampled token beside the target's hidden state, as a head's first
draft step reads it) it appends k - 1 places that read the head's mask token (``mask_token_id``
in its config) beside ``fc(mask_hidden)``, a learned vector in place of the target's hidden
states, at the rotary positions that follow, and reads a proposal at each.

What distill teaches it (:func:`parallel_losses`, :func:`parallel_pass`): every position as the
head's first draft step reads it, and from :data:`PARALLEL_POINTS` points of each sequence drawn
where vLLM drafts (:func:`draft_points`), the k - 1 tokens after the next from mask places that
see the sequence up to their point and their own earlier masks only; the two halves weigh the
same. The head itself, its training loop and its format are :mod:`batchspec.distill.eagle3`'s.

Imports torch inside the calls that need it, never vLLM."""

from __future__ import annotations

from typing import Any

from batchspec.spec.methods import mask_token

#: Drafting points a training sequence is drafted from in parallel in one pass, and evenly spread
#: points a held-out one is measured at.
PARALLEL_POINTS, EVAL_POINTS = 4, 8


def parallel_pass(head, tokens, aux, points, k: int) -> tuple[Any, Any]:
    """One pass of a parallel head (``Eagle3Head.make_parallel``) as vLLM drafts in parallel, for
    several drafting points at once.

    ``tokens`` (B, L) and ``aux`` (B, L, fed) as the head's ``unroll`` reads them; ``points``
    (B, G): positions to draft from. The pass holds every position ``t < L - 1`` (reading
    token ``t + 1`` and the target's state at ``t``, as the first draft step of ``unroll``) and,
    for each point ``p``, ``k - 1`` mask positions (the mask token's embedding beside
    ``fc(mask_hidden)``, rotary positions ``p + 1 ..``) that see the positions up to
    ``p`` and their own group's earlier masks, and that no other position sees. Returns
    (logits at every position (B, L - 1, V): each proposes token ``t + 2``; logits of
    the masks (B, G, k - 1, V): mask ``j`` of point ``p`` proposes token ``p + 2 + j``)."""
    import torch

    b, length = tokens.shape
    t, (_, groups), m = length - 1, points.shape, k - 1
    dev = tokens.device
    mask_id = mask_token(head.config)
    toks = torch.cat([tokens[:, 1:], torch.full((b, groups * m), mask_id, device=dev)], 1)
    fused = head.fc(torch.cat([aux[:, :-1].float(), head.mask_hidden.expand(b, groups * m, -1)], 1))
    steps = torch.arange(1, m + 1, device=dev)
    positions = torch.cat(
        [torch.arange(t, device=dev).expand(b, t), (points.unsqueeze(-1) + steps).reshape(b, -1)], 1
    )
    q, keys, values, residual = head.qkv(toks, fused, positions)
    n = t + groups * m
    allowed = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
    allowed[:, :t, :t] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    upto = torch.arange(t, device=dev)
    group_causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
    for g in range(groups):
        rows = slice(t + g * m, t + (g + 1) * m)
        allowed[:, rows, :t] = (upto <= points[:, g : g + 1]).unsqueeze(1)
        allowed[:, rows, rows] = group_causal
    scores = (q @ keys.transpose(-1, -2)) * head.head_dim**-0.5
    weights = torch.softmax(scores.masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1)
    logits, _ = head.finish(weights @ values, residual)
    return logits[:, :t], logits[:, t:].reshape(b, groups, m, -1)


def parallel_losses(head, batch: dict, k: int, points=None, gen=None) -> tuple[Any, int, int]:
    """(the loss, tokens right in a row summed over the drafting points, the points counted) of
    a batch drafted in parallel (:func:`parallel_pass`): the next token at every position
    and the ``k - 1`` after it from each point's masks, the two halves weighing the same.
    ``points`` (B, G): where to draft from; None: :data:`PARALLEL_POINTS` a row drawn with
    ``gen`` from the prompt's last position on (:func:`draft_points`: where vLLM drafts, the
    tokens after a point being the target's own)."""
    import torch
    import torch.nn.functional as F

    tokens, labels, lengths = batch["tokens"], batch["labels"], batch["lengths"]
    b, length = tokens.shape
    if length < 3:
        return head.fc.weight.sum() * 0.0, 0, 0
    if points is None:
        points = draft_points(batch, torch.rand(b, PARALLEL_POINTS, generator=gen))
    points = points.to(tokens.device)
    real, masks = parallel_pass(head, tokens, batch["aux"], points, k)
    pos = torch.arange(length - 1, device=tokens.device)
    valid = (pos + 1).unsqueeze(0) < lengths.unsqueeze(1)
    loss = F.cross_entropy(real[valid], labels[:, 1:][valid]) if valid.any() else real.sum() * 0.0
    # the label of the token each proposal is for: p + 1 + j, j = 0 (the real position) .. k - 1
    where = points.unsqueeze(-1) + 1 + torch.arange(k, device=tokens.device)  # (B, G, k)
    ok = where < lengths.view(b, 1, 1)
    wanted = labels.gather(1, where.clamp(max=length - 1).view(b, -1)).view(b, -1, k)
    first = real.gather(1, points.unsqueeze(-1).expand(-1, -1, real.shape[-1]))  # (B, G, V)
    if ok[..., 1:].any():
        mask_loss = F.cross_entropy(masks[ok[..., 1:]], wanted[..., 1:][ok[..., 1:]])
        loss = 0.5 * loss + 0.5 * mask_loss
    proposed = torch.cat([first.argmax(-1).unsqueeze(-1), masks.argmax(-1)], dim=-1)
    run = (proposed == wanted) & ok
    right = int(run.long().cumprod(-1).sum())
    return loss, right, int(ok[..., 0].sum())


def draft_points(batch: dict, where) -> Any:
    """Drafting points (B, G) at ``where`` (B, G, each in [0, 1)) of the way from each
    sequence's last prompt position (its first drafting point, where vLLM drafts the reply's
    second token) to its last position that reads a token (``length - 2``)."""
    import torch

    last = (batch["lengths"].cpu() - 2).clamp(min=0)
    first = torch.minimum((batch["prompts"].cpu() - 1).clamp(min=0), last)
    return first.unsqueeze(1) + (where * (last - first + 1).unsqueeze(1)).long()
