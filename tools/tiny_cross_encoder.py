"""Build a tiny cross-encoder from the tiny target, for ``task: score`` with a sequence classifier
of one label and its tests: the target with a one-output linear head on its last token's final
hidden state, read over both texts of a pair in one input, as vLLM's ``LLM.score`` builds it for
a cross-encoder (the tokenizer's pair encoding, here ``<s> query \\n document``), its score the
sigmoid of that output.

The pairs: a query naming the kind of text asked for (``python``, ``json`` or ``prose``) and a
document, a snippet of one of those kinds (tools/tiny_classifier.py makes them). A pair is
relevant when the query asks for Python and the document is Python code. The target stays frozen
and only the head (``score.weight``, ``[1, hidden]``) is trained, by logistic regression on
features computed once (seconds). A linear head on the frozen states of a 3.7M-parameter model
learns what the document is far more than what the query asks: it scores Python code high and
the rest low, whichever the query (a match of any kind to any kind is beyond it). That is enough
for what the tests check (vLLM's own scores, the same through batchspec). The build checks the
head's balanced accuracy on held-out pairs (at least :data:`MIN_ACCURACY`, or it fails and leaves
the old directory as it was).

On disk: the target's weights under ``LlamaForSequenceClassification``'s names (``model.*`` and
``score.weight``), its config (one label, ``relevant``), the tokenizer (its pair template
changed: :func:`pair_tokenizer`), ``batchspec-model.json`` and the ``.batchspec-complete`` stamp
(built beside the directory and renamed into place). Deterministic (seeded, one thread). Usage:
``python tools/tiny_cross_encoder.py [--target .models/target] [--out .models/cross-encoder]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_files import file_sha256, is_current, publish, scratch_dir  # noqa: E402
from tiny_classifier import LABELS, examples  # noqa: E402

SEED = 131
#: The kind a relevant pair's query asks for (and its document is).
RELEVANT = "python"
PER_LABEL = 80  # training snippets of each kind (and half as many held out)
STEPS = 400
MIN_ACCURACY = 0.85
MAX_TOKENS = 256


def log(msg: str) -> None:
    print(f"[tiny_cross_encoder] {msg}", file=sys.stderr, flush=True)


def pairs(count: int, seed: int) -> list[tuple[str, str, int]]:
    """(query, document, relevant) for ``count`` snippets of each kind: each snippet asked for
    by its own kind's query and by another kind's."""
    rng = random.Random(seed)
    out = []
    for text, kind in examples(count, seed):
        other = rng.choice([k for k in range(len(LABELS)) if k != kind])
        for query in (kind, other):
            out.append((LABELS[query], text, int(LABELS[query] == LABELS[kind] == RELEVANT)))
    return out


def pair_tokenizer(tokenizer):
    """The target's tokenizer with a pair encoded as ``<s> query \\n document``: the target's own
    pair template starts the document with ``<s>`` again, after which the tiny target's last
    state no longer depends on what came before (it was trained on documents that each start
    there), so a head on it could not read the query at all."""
    from tokenizers import processors

    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    sep = tokenizer.convert_ids_to_tokens(newline)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {sep} $B",
        special_tokens=[(bos, tokenizer.bos_token_id), (sep, newline)],
    )
    return tokenizer


def features(model, tokenizer, batch: list[tuple[str, str, int]]):
    """Each pair's last token's final hidden state (after the model's norm), as vLLM pools it,
    over the pair encoding vLLM's ``LLM.score`` gives a cross-encoder."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(batch), 16):
            chunk = batch[start : start + 16]
            ids = [tokenizer(q, text_pair=d)["input_ids"][:MAX_TOKENS] for q, d, _ in chunk]
            width = max(map(len, ids))
            padded = torch.tensor([i + [0] * (width - len(i)) for i in ids])
            mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
            hidden = model.model(input_ids=padded, attention_mask=mask).last_hidden_state
            out.extend(hidden[row, len(i) - 1] for row, i in enumerate(ids))
    return torch.stack(out)


def balanced_accuracy(logits, labels) -> float:
    """The mean of the accuracy on relevant pairs and on the others."""
    predicted = logits > 0
    positive = labels > 0.5
    return float(
        ((predicted & positive).sum() / positive.sum() + (~predicted & ~positive).sum() / (~positive).sum())
        / 2
    )


def build(target: Path, out: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    started = time.monotonic()
    tokenizer = pair_tokenizer(AutoTokenizer.from_pretrained(target))
    causal = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    train = pairs(PER_LABEL, SEED)
    held = pairs(PER_LABEL // 2, SEED + 1)
    x, hx = features(causal, tokenizer, train), features(causal, tokenizer, held)
    y = torch.tensor([float(r) for *_, r in train])
    hy = torch.tensor([float(r) for *_, r in held])
    head = torch.nn.Linear(x.shape[1], 1, bias=False)
    torch.nn.init.zeros_(head.weight)
    opt = torch.optim.AdamW(head.parameters(), lr=0.05, weight_decay=0.01)
    weight = (len(y) - y.sum()) / y.sum()  # the relevant pairs weigh as much as the others
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x).squeeze(-1), y, pos_weight=weight)
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = balanced_accuracy(head(hx).squeeze(-1), hy)
    log(f"held-out balanced accuracy {accuracy:.3f} on {len(held)} pairs, loss {loss.item():.3f}")
    if accuracy < MIN_ACCURACY:
        raise SystemExit(f"tiny_cross_encoder: held-out balanced accuracy {accuracy:.3f} < {MIN_ACCURACY}")
    model = LlamaForSequenceClassification.from_pretrained(
        target,
        num_labels=1,
        id2label={0: "relevant"},
        label2id={"relevant": 0},
        torch_dtype=torch.float32,
    )
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.no_grad():
        model.score.weight.copy_(head.weight)
    tmp = scratch_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {
        "built_by": "tools/tiny_cross_encoder.py",
        "source": str(target),
        "source_sha256": file_sha256(target / "model.safetensors"),
        "relevant": f"query {RELEVANT!r} and a {RELEVANT} document",
        "seed": SEED,
        "held_out_balanced_accuracy": round(accuracy, 4),
        "seconds": round(time.monotonic() - started, 1),
    }
    publish(tmp, out, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=Path(".models/target"))
    parser.add_argument("--out", type=Path, default=Path(".models/cross-encoder"))
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if not args.force and is_current(args.out, args.target / "model.safetensors", {"seed": SEED}):
        log(f"{args.out} is current")
        return 0
    info = build(args.target, args.out)
    log(f"built {args.out} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
