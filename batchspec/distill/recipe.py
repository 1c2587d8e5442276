"""What the model builders (tools/tiny_models.py, tools/tiny_reasoner.py, tools/tiny_lora.py)
share with distill's training: the learning-rate schedule and a draft started from the target.

A module of its own, so that the builders' model-cache keys (tools/model_cache.py: the files a
builder imports) name these and not the rest of distill's training: a change there retrains no
model `make models` builds."""

from __future__ import annotations

import math


def lr_at(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up to ``peak``, then a cosine down to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def init_draft_from_target(draft, target) -> None:
    """Start the draft as the target's first layers (as many as the draft has) plus its
    embeddings, final norm and head."""
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())
    for i, layer in enumerate(draft.model.layers):
        layer.load_state_dict(target.model.layers[i].state_dict())
