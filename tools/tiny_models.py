"""Build the tiny target/draft model pair used by the demo, the tests and the benchmarks.

No model hub is reachable, so the project trains its own pair, from the Python standard
library's source (it ships with every Python):

1. a byte-level BPE tokenizer (vocabulary 2048) with a small chat template;
2. a Llama target (4 layers, hidden 256; about 3.6M parameters), trained on the corpus;
3. a Llama draft (1 layer, same width and tokenizer; about 1.6M parameters), initialised from
   the target's embeddings, first layer and head, then distilled on the target's own greedy
   continuations so that it proposes what the target would say;
4. a larger draft, ``draft-large`` (2 layers, from the target's first two), distilled the same
   way: it accepts more and costs more per proposed token, the other end of that trade-off.

Deterministic (seeded, single source order); a model directory is skipped when it is already
complete. Usage: ``python tools/tiny_models.py [--out .models] [--only pair|draft-large]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

# what `batchspec distill --init target` does, and its learning-rate schedule: one copy of each
from batchspec.distill.recipe import init_draft_from_target, lr_at

SEED = 1234
VOCAB_SIZE = 2048
SEQ_LEN = 128
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
COMPLETE_MARKER = ".batchspec-complete"


def log(msg: str) -> None:
    print(f"[tiny-models {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- corpus


def stdlib_files() -> list[Path]:
    """The standard library's top-level and package sources, in a fixed order (tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in ("test", "site-packages", "idlelib", "lib2to3", "__phello__")):
            continue
        files.append(path)
    return files


def is_held_out(path: Path) -> bool:
    """One file in ten is never trained on: prompts for demos, tests and benchmarks come from it."""
    return int(hashlib.sha1(path.name.encode()).hexdigest(), 16) % 10 == 0


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def training_texts(max_chars: int = 6_000_000) -> list[str]:
    texts, total = [], 0
    for path in stdlib_files():
        if is_held_out(path):
            continue
        text = read_text(path)
        if not text:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def held_out_snippets(count: int, seed: int = 7, min_lines: int = 2, max_lines: int = 6) -> list[str]:
    """Code snippets (a few consecutive non-empty lines) from files the models never saw."""
    rng = random.Random(seed)
    pools = []
    for path in stdlib_files():
        if is_held_out(path):
            lines = [ln for ln in read_text(path).splitlines() if ln.strip()]
            if len(lines) > max_lines:
                pools.append(lines)
    snippets = []
    while len(snippets) < count:
        lines = rng.choice(pools)
        n = rng.randint(min_lines, max_lines)
        start = rng.randrange(0, len(lines) - n)
        snippets.append("\n".join(lines[start : start + n]) + "\n")
    return snippets


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(texts: list[str], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def encode_corpus(tokenizer, texts: list[str]):
    import torch

    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id
    ids: list[int] = []
    for text in texts:
        ids.append(bos)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- models


def llama_config(tokenizer, layers: int, hidden: int, heads: int, intermediate: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def train_target(model, data, steps: int, batch: int, peak_lr: float, gen) -> None:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    started = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    model.eval()


def greedy_continuations(model, data, count: int, prompt_len: int, new_tokens: int, gen):
    """The target's own greedy continuations of corpus windows: what the draft must imitate."""
    import torch

    seqs = []
    batch = 128
    with torch.no_grad():
        for _ in range(0, count, batch):
            starts = torch.randint(0, len(data) - prompt_len - 1, (batch,), generator=gen)
            ids = torch.stack([data[s : s + prompt_len] for s in starts.tolist()])
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            tokens = [ids]
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(new_tokens):
                tokens.append(nxt)
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seqs.append(torch.cat(tokens, dim=1))
    return torch.cat(seqs)[:count]


def distill_draft(draft, target, seqs, corpus, steps: int, batch: int, peak_lr: float, gen):
    """Train the draft to match the target's next-token distribution (KL) on the target's own
    greedy continuations, mixed with corpus windows so that prompts are covered too."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(draft.parameters(), lr=peak_lr, weight_decay=0.0, betas=(0.9, 0.95))
    draft.train()
    width = seqs.shape[1]
    started = time.time()
    for step in range(steps):
        idx = torch.randint(0, len(seqs), (batch,), generator=gen)
        x = seqs[idx]
        starts = torch.randint(0, len(corpus) - width - 1, (batch // 4,), generator=gen)
        x = torch.cat([x, torch.stack([corpus[s : s + width] for s in starts.tolist()])])
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=x).logits, dim=-1)
        student = F.log_softmax(draft(input_ids=x).logits, dim=-1)
        kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean") / width
        greedy = F.nll_loss(student.flatten(0, 1), teacher.argmax(-1).flatten())
        loss = kl + greedy
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=20)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean().item()
            log(
                f"draft step {step}/{steps} loss {loss.item():.3f} "
                f"top-1 agreement {agree:.3f} ({time.time() - started:.0f}s)"
            )
    draft.eval()


def save_model(model, tokenizer, out_dir: Path, info: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "batchspec-model.json").write_text(json.dumps(info, indent=2) + "\n")
    (out_dir / COMPLETE_MARKER).write_text("ok\n")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).exists()


def build_draft_large(target, tokenizer, data, out_dir: Path, steps: int, layers: int = 2) -> int:
    """Distil a ``layers``-layer draft from ``target`` with the 1-layer draft's recipe, into
    ``out_dir``; returns its parameter count.

    Its own seeded generator, drawn from after the target and the draft are built, keeps their
    outputs exactly what they were before this model existed, and makes this one the same
    whether or not they were built in the same run. The distillation set is half the draft's and
    ``steps`` defaults to 200 (300 gained 0.005 acceptance): about 2.5 minutes on two busy cores.
    """
    import torch
    from transformers import LlamaForCausalLM

    # One thread: the weights then do not depend on the machine's core count, and on a shared
    # machine these small matmuls ran 3x faster on one thread than on two fighting for cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch_generator(SEED + 1)
        started = time.time()
        seqs = greedy_continuations(target, data, count=1024, prompt_len=32, new_tokens=64, gen=gen)
        log(f"draft-large distillation set: {tuple(seqs.shape)} target greedy sequences")
        draft = LlamaForCausalLM(llama_config(tokenizer, layers, 256, 4, 512))
        init_draft_from_target(draft, target)
        n = sum(p.numel() for p in draft.parameters())
        log(f"draft-large: {n / 1e6:.2f}M parameters, {layers} layers, {steps} steps")
        distill_draft(draft, target, seqs, data, steps, batch=16, peak_lr=2e-3, gen=gen)
        save_model(
            draft,
            tokenizer,
            out_dir,
            {
                "role": "draft",
                "parameters": n,
                "layers": layers,
                "steps": steps,
                "seed": SEED + 1,
                "build_s": round(time.time() - started, 1),
            },
        )
    finally:
        torch.set_num_threads(threads)
    return n


def torch_generator(seed: int):
    """A seeded torch CPU generator."""
    import torch

    return torch.Generator().manual_seed(seed)


#: What ``--only`` builds: the pair (tokenizer, target, draft), or ``draft-large`` from a built
#: target (one thread: `make -j` trains it beside the LoRA adapters, which also need the target).
PARTS = ("pair", "draft-large")


def build(
    out: Path,
    target_steps: int,
    draft_steps: int,
    force: bool,
    draft_large_steps: int = 200,
    only: str | None = None,
) -> None:
    target_dir, draft_dir, draft_large_dir = out / "target", out / "draft", out / "draft-large"
    wanted = {"pair": (target_dir, draft_dir), "draft-large": (draft_large_dir,)}.get(
        only, (target_dir, draft_dir, draft_large_dir)
    )
    if not force and all(is_complete(d) for d in wanted):
        log(f"{', '.join(map(str, wanted))} already built; skipping (use --force to rebuild)")
        return
    if only == "draft-large" and not is_complete(target_dir):
        raise SystemExit(f"tiny_models: --only draft-large needs {target_dir} built first")

    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gen = torch.Generator().manual_seed(SEED)
    started = time.time()

    texts = training_texts()
    log(f"corpus: {len(texts)} standard-library files, {sum(map(len, texts)):,} characters")
    tok_dir = out / "tokenizer"
    if only != "draft-large":  # which reads the pair's, as its target does
        build_tokenizer(texts, tok_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    data = encode_corpus(tokenizer, texts)
    log(f"tokenizer: vocabulary {len(tokenizer)}, corpus {len(data):,} tokens")

    if only != "draft-large" and (force or not is_complete(target_dir)):
        target = LlamaForCausalLM(llama_config(tokenizer, 4, 256, 4, 512))
        n = sum(p.numel() for p in target.parameters())
        log(f"target: {n / 1e6:.2f}M parameters, {target_steps} steps")
        train_target(target, data, target_steps, batch=16, peak_lr=3e-3, gen=gen)
        save_model(
            target,
            tokenizer,
            target_dir,
            {"role": "target", "parameters": n, "steps": target_steps, "seed": SEED},
        )
        # the drafts are rebuilt whenever the target is
        for drafts_dir in (draft_dir, draft_large_dir):
            if (drafts_dir / COMPLETE_MARKER).exists():
                (drafts_dir / COMPLETE_MARKER).unlink()
    target = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)

    if only != "draft-large" and (force or not is_complete(draft_dir)):
        seqs = greedy_continuations(target, data, count=2048, prompt_len=32, new_tokens=64, gen=gen)
        log(f"distillation set: {tuple(seqs.shape)} target greedy sequences")
        draft = LlamaForCausalLM(llama_config(tokenizer, 1, 256, 4, 512))
        init_draft_from_target(draft, target)
        n = sum(p.numel() for p in draft.parameters())
        log(f"draft: {n / 1e6:.2f}M parameters, {draft_steps} steps")
        distill_draft(draft, target, seqs, data, draft_steps, batch=16, peak_lr=2e-3, gen=gen)
        save_model(
            draft,
            tokenizer,
            draft_dir,
            {"role": "draft", "parameters": n, "steps": draft_steps, "seed": SEED},
        )
    if only != "pair" and (force or not is_complete(draft_large_dir)):
        build_draft_large(target, tokenizer, data, draft_large_dir, draft_large_steps)
    log(f"done in {time.time() - started:.0f}s: {', '.join(map(str, wanted))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".models"))
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=300)
    parser.add_argument("--draft-large-steps", type=int, default=200)
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    parser.add_argument("--only", choices=PARTS, help="build only the pair or only draft-large")
    args = parser.parse_args(argv)
    build(args.out, args.target_steps, args.draft_steps, args.force, args.draft_large_steps, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
