"""Build the tiny reasoning target (``.models/reasoner``) and its draft (``.models/reasoner-draft``).

A reasoning model thinks between markers before it answers. This one is the tiny target
(``tools/tiny_models.py``) taught to do so, so that the reasoning features (``model.reasoning_parser``,
``thinking_token_budget``, ``chat_template_kwargs``, constraints on the answer only) are tested on
the real engine with no model hub:

1. the target's tokenizer gains ``<think>`` and ``</think>`` as single tokens (added, not special:
   they stay in decoded text, as Qwen3's do, so vLLM's ``qwen3`` parser finds them), and a chat
   template that honours ``enable_thinking: false`` the way Qwen3's does (an empty think block
   written into the prompt);
2. the target's weights (embeddings grown by two rows) are fine-tuned on chats over snippets of
   the standard library's source: the user sends a few lines of code; the assistant thinks in a
   short, regular form (how many lines it read and how each starts) and then answers with the
   code that follows. One chat in five is written with thinking off, as the template writes it;
3. the target's 1-layer draft (``.models/draft``, grown by the same two rows) is distilled further
   on the reasoner's own greedy replies to those chats, thinking included (sequence-level
   distillation: the draft learns the reasoner's outputs token by token, with no teacher pass per
   step, which keeps the build to about a minute on one core).

Deterministic (seeded, one thread); skipped when complete. Usage:
``python tools/tiny_reasoner.py --target .models/target --out .models``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import (  # noqa: E402  (a sibling script, not a package)
    COMPLETE_MARKER,
    is_complete,
    is_held_out,
    read_text,
    save_model,
    stdlib_files,
)

from batchspec.distill.recipe import lr_at  # noqa: E402

SEED = 4321
THINK_START, THINK_END = "<think>", "</think>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}"
)
MAX_LEN = 192


def log(msg: str) -> None:
    print(f"[tiny-reasoner {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def thinking(lines: list[str]) -> str:
    """The reasoner's thoughts on a snippet: regular, short, and about the prompt."""
    said = [f"I read {len(lines)} line{'s' if len(lines) > 1 else ''} of code."]
    for i, line in enumerate(lines[:3], 1):
        words = line.strip().split()[:3]
        said.append(f"Line {i} starts with {' '.join(words)}.")
    said.append("Now I write what comes next.")
    return "\n".join(said)


def chats(count: int, rng: random.Random, held_out: bool) -> list[tuple[str, str, bool]]:
    """``(user text, answer, thinking on)`` triples from snippets of the standard library: files
    the target trained on (``held_out`` False) or the tenth it never saw."""
    pools = []
    for path in stdlib_files():
        if is_held_out(path) != held_out:
            continue
        lines = [ln for ln in read_text(path).splitlines() if ln.strip() and len(ln) < 100]
        if len(lines) > 12:
            pools.append(lines)
        if len(pools) >= 400:
            break
    out = []
    while len(out) < count:
        lines = rng.choice(pools)
        n = rng.randint(1, 4)
        start = rng.randrange(0, len(lines) - n - 3)
        user = lines[start : start + n]
        answer = "\n".join(lines[start + n : start + n + 2])
        out.append(("\n".join(user), answer, rng.random() >= 0.2))
    return out


def prompt_text(tokenizer, user: str, think: bool) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=think,
    )


def completion_text(user: str, answer: str, think: bool) -> str:
    if not think:  # the template wrote the empty think block
        return f"{answer}<|end|>"
    return f"{THINK_START}\n{thinking(user.splitlines())}\n{THINK_END}\n\n{answer}<|end|>"


def encode(tokenizer, examples):
    """Token ids and labels (the prompt's masked) of each chat, cut to MAX_LEN."""
    rows = []
    for user, answer, think in examples:
        prompt = tokenizer(prompt_text(tokenizer, user, think), add_special_tokens=False)["input_ids"]
        reply = tokenizer(completion_text(user, answer, think), add_special_tokens=False)["input_ids"]
        reply.append(tokenizer.eos_token_id)
        ids = ([tokenizer.bos_token_id] + prompt + reply)[:MAX_LEN]
        labels = ([-100] * (1 + len(prompt)) + reply)[:MAX_LEN]
        rows.append((ids, labels))
    return rows


def batch_of(rows, pad: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
    return ids, labels


def fine_tune(model, rows, steps: int, peak_lr: float, rng: random.Random, pad: int, name: str):
    """Next-token training on ``rows`` (ids, labels), 16 a step."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    started = time.time()
    for step in range(steps):
        ids, labels = batch_of(rng.sample(rows, 16), pad)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=20)
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"{name} step {step}/{steps} loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    model.eval()


def greedy_replies(model, tokenizer, examples, new_tokens: int):
    """The reasoner's own greedy replies to chats: each chat's ids (prompt and reply) and its
    labels (the reply's; the prompt's masked), what its draft learns to propose."""
    import torch

    tokenizer.padding_side = "left"
    ids, labels = [], []
    with torch.no_grad():
        for i in range(0, len(examples), 64):
            texts = [prompt_text(tokenizer, u, t) for u, _, t in examples[i : i + 64]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=True)
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            width = enc["input_ids"].shape[1]
            for row, mask in zip(out.tolist(), enc["attention_mask"].tolist(), strict=True):
                prompt = row[width - sum(mask) : width]
                reply = row[width:]
                while reply and reply[-1] == tokenizer.pad_token_id:
                    reply.pop()
                ids.append(prompt + reply)
                labels.append([-100] * len(prompt) + reply)
    return ids, labels


def grown(target, tokenizer):
    """The target with an embedding row and an output row for each token the tokenizer gained,
    each set to the mean of the existing rows."""
    import torch

    old = target.get_input_embeddings().weight.shape[0]
    target.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for matrix in (target.get_input_embeddings().weight, target.get_output_embeddings().weight):
            matrix[old:] = matrix[:old].mean(0)
    target.config.vocab_size = len(tokenizer)
    return target


def build(target_dir: Path, out: Path, steps: int, draft_steps: int, force: bool) -> None:
    reasoner_dir, draft_dir = out / "reasoner", out / "reasoner-draft"
    if not force and is_complete(reasoner_dir) and is_complete(draft_dir):
        log(f"{reasoner_dir}, {draft_dir} already built; skipping (use --force to rebuild)")
        return
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # weights independent of the core count; see tiny_models.py
    rng = random.Random(SEED)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer(THINK_START + THINK_END, add_special_tokens=False)["input_ids"]) == 2

    if force or not is_complete(reasoner_dir):
        model = grown(LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32), tokenizer)
        rows = encode(tokenizer, chats(4000, rng, held_out=False))
        log(f"reasoner: {len(rows)} chats, {steps} steps")
        fine_tune(model, rows, steps, 2e-3, rng, tokenizer.pad_token_id, "reasoner")
        info = {"role": "target", "reasoning_parser": "qwen3", "steps": steps, "seed": SEED}
        save_model(model, tokenizer, reasoner_dir, info)
        (draft_dir / COMPLETE_MARKER).unlink(missing_ok=True)
    reasoner = LlamaForCausalLM.from_pretrained(reasoner_dir, torch_dtype=torch.float32).eval()
    for p in reasoner.parameters():
        p.requires_grad_(False)

    if force or not is_complete(draft_dir):
        seqs, masks = greedy_replies(reasoner, tokenizer, chats(384, rng, held_out=False), new_tokens=72)
        log(f"reasoner-draft distillation set: {len(seqs)} greedy replies")
        # the target's draft already proposes the code the answers are made of: it learns the
        # thinking (and the reasoner's drift) on top
        draft = grown(LlamaForCausalLM.from_pretrained(target_dir.parent / "draft"), tokenizer)
        rows = list(zip(seqs, masks, strict=True))
        fine_tune(draft, rows, draft_steps, 2e-3, rng, tokenizer.pad_token_id, "reasoner-draft")
        info = {"role": "draft", "of": "reasoner", "steps": draft_steps, "seed": SEED}
        save_model(draft, tokenizer, draft_dir, info)
    log(f"done in {time.time() - started:.0f}s: {reasoner_dir}, {draft_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=Path(".models/target"))
    parser.add_argument("--out", type=Path, default=Path(".models"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--draft-steps", type=int, default=200)
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    args = parser.parse_args(argv)
    for needed in (args.target, args.target.parent / "draft"):
        if not is_complete(needed):
            raise SystemExit(f"tiny_reasoner: build {needed} first (make models)")
    build(args.target, args.out, args.steps, args.draft_steps, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
