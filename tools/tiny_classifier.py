"""Build a tiny sequence classifier from the tiny target, for ``task: classify`` and its tests:
the target with a linear head on its last token's final hidden state (what vLLM's pooling runner
computes for a ``*ForSequenceClassification`` checkpoint: last-token pooling, ``score``, softmax).

The task is one the target can tell from its own states: what kind of text a snippet is,
``python`` (a few lines of standard-library source the target never trained on), ``json`` (a
JSON object of made-up records) or ``prose`` (English sentences from a small vocabulary). The
target stays frozen; only the head (``score.weight``, ``[3, hidden]``, no bias) is trained, by
logistic regression on features computed once (seconds on two cores). The build checks the
head's accuracy on held-out snippets of each kind (over 0.9, or it fails and leaves the old
directory as it was).

On disk: the target's weights under ``LlamaForSequenceClassification``'s names (``model.*`` and
``score.weight``), its config with ``id2label``, the tokenizer, ``batchspec-model.json`` and the
``.batchspec-complete`` stamp (built beside the directory and renamed into place). Deterministic
(seeded, one thread). Usage: ``python tools/tiny_classifier.py [--target .models/target]
[--out .models/classifier]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_files import file_sha256, is_current, publish, scratch_dir  # noqa: E402
from tiny_models import held_out_snippets  # noqa: E402

SEED = 97
LABELS = ("python", "json", "prose")
PER_LABEL = 160  # training snippets of each kind (and a quarter as many held out)
STEPS = 300
MIN_ACCURACY = 0.9
WORDS = (
    "the river runs past an old mill where children play in summer and farmers bring their grain "
    "before the rain comes over the hills a quiet town keeps its market open on sundays while "
    "the baker sells bread to travellers who stop on their way north people talk about weather "
    "and harvest and the long road home under a grey sky"
).split()


def log(msg: str) -> None:
    print(f"[tiny_classifier] {msg}", file=sys.stderr, flush=True)


def json_snippet(rng: random.Random) -> str:
    records = [
        {
            rng.choice(["id", "name", "count", "tags", "ok", "price"]): rng.choice(
                [rng.randint(0, 999), rng.choice(WORDS), rng.random() < 0.5, [rng.randint(0, 9)] * 2]
            )
            for _ in range(rng.randint(2, 4))
        }
        for _ in range(rng.randint(1, 3))
    ]
    return json.dumps(records if len(records) > 1 else records[0])


def prose_snippet(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 3)):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def examples(count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` snippets of each kind, labelled, shuffled."""
    rng = random.Random(seed)
    python = held_out_snippets(count, seed=seed)
    rows = [(text, 0) for text in python]
    rows += [(json_snippet(rng), 1) for _ in range(count)]
    rows += [(prose_snippet(rng), 2) for _ in range(count)]
    rng.shuffle(rows)
    return rows


def features(model, tokenizer, texts: list[str]):
    """Each text's last token's final hidden state (after the model's norm), as vLLM pools it."""
    import torch

    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :256]
            hidden = model.model(input_ids=ids).last_hidden_state
            out.append(hidden[0, -1])
    return torch.stack(out)


def build(target: Path, out: Path) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(target)
    causal = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    train = examples(PER_LABEL, SEED)
    held = examples(PER_LABEL // 4, SEED + 1)
    x = features(causal, tokenizer, [t for t, _ in train])
    y = torch.tensor([label for _, label in train])
    hx = features(causal, tokenizer, [t for t, _ in held])
    hy = torch.tensor([label for _, label in held])
    head = torch.nn.Linear(x.shape[1], len(LABELS), bias=False)
    torch.nn.init.zeros_(head.weight)
    opt = torch.optim.AdamW(head.parameters(), lr=0.05, weight_decay=0.01)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = float((head(hx).argmax(-1) == hy).float().mean())
    log(f"held-out accuracy {accuracy:.3f} on {len(held)} snippets, loss {float(loss):.3f}")
    if accuracy < MIN_ACCURACY:
        raise SystemExit(f"tiny_classifier: held-out accuracy {accuracy:.3f} is under {MIN_ACCURACY}")
    id2label = dict(enumerate(LABELS))
    model = LlamaForSequenceClassification.from_pretrained(
        target,
        num_labels=len(LABELS),
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
        torch_dtype=torch.float32,
    )
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.no_grad():
        model.score.weight.copy_(head.weight)
    tmp = scratch_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {
        "built_by": "tools/tiny_classifier.py",
        "source": str(target),
        "source_sha256": file_sha256(target / "model.safetensors"),
        "labels": list(LABELS),
        "seed": SEED,
        "held_out_accuracy": round(accuracy, 4),
        "seconds": round(time.monotonic() - started, 1),
    }
    publish(tmp, out, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=Path(".models/target"))
    parser.add_argument("--out", type=Path, default=Path(".models/classifier"))
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
