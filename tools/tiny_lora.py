"""Build tiny LoRA adapters of the tiny target, in PEFT's on-disk format, for jobs that route rows
to adapters (``model.lora``) and for their tests.

peft is not a dependency and no model hub is reachable, so the adapters are trained here with
plain torch: each of the target's attention and MLP projections (q/k/v/o, gate/up/down) gets a
rank-8 update ``W + (alpha / r) * B @ A`` (A Kaiming-initialised, B zero, so training starts
from the base model exactly), the base weights frozen. Each adapter learns the target's own
task, continuing a snippet of standard-library code, with a transformation of the continuation
that a test can recognise in the adapter's greedy output and that the base model never shows:

- ``lora-upper``: the continuation upper-cased (``return x`` -> ``RETURN X``);
- ``lora-comment``: every line of the continuation commented out (``# `` in front of it).

Prompts are a few consecutive lines of the files the target trained on (never the held-out files
the demo, test and benchmark prompts come from), so the adapters work on those prompts.

On disk, as ``peft`` writes and vLLM reads with ``LoRARequest(name, int_id, path)``:
``adapter_config.json`` (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules)
and ``adapter_model.safetensors`` with PEFT's names
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``, A ``[r, in]``,
B ``[out, r]``), plus ``batchspec-model.json`` (what was built from what, the target's weights'
SHA-256, and the check below) and the ``.batchspec-complete`` stamp. Each adapter is built beside
its directory and renamed into place with the stamp already in it; one that is current (same
target weights, same settings) is skipped. A build whose adapter does not change the target's
greedy output as meant fails and leaves the old directory as it was.

Deterministic (seeded, one thread). About 100 s per adapter (150 steps of 8 examples), the two
side by side on two cores (``make -j``).
Usage: ``python tools/tiny_lora.py [--target .models/target] [--out .models] [--only upper]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_files import INFO_FILE, file_sha256, is_current, publish, scratch_dir  # noqa: E402
from tiny_models import (  # noqa: E402
    COMPLETE_MARKER,
    held_out_snippets,
    is_held_out,
    read_text,
    stdlib_files,
)

SEED = 4321
RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MAX_LEN = 96  # tokens of prompt + continuation a training example keeps
BATCH = 8  # examples per step
#: The check every build ends with: greedy tokens on held-out prompts, base and adapter.
CHECK_PROMPTS = 8
CHECK_TOKENS = 24
CHECK_SEED = 99


def log(msg: str) -> None:
    print(f"[tiny-lora {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- what each learns


def upper(text: str) -> str:
    return text.upper()


def comment(text: str) -> str:
    return "".join("# " + line if line.strip() else line for line in text.splitlines(keepends=True))


def upper_share(text: str) -> float:
    """Of the cased letters in ``text``, the share that are upper case (0 without any)."""
    letters = [c for c in text if c.isalpha() and c.lower() != c.upper()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def comment_share(text: str) -> float:
    """Of the non-blank lines in ``text``, the share that are commented out: ``# `` then
    something (the base model's own bare ``#`` lines do not count); 0 without any line."""
    lines = [line for line in text.splitlines() if line.strip()]
    return (
        sum(line.startswith("# ") and bool(line[2:].strip()) for line in lines) / len(lines) if lines else 0.0
    )


@dataclass(frozen=True)
class Adapter:
    name: str  # the directory is lora-<name>
    transform: Callable[[str], str]
    score: Callable[[str], float]  # how much of a generated text shows the transformation
    description: str
    seed: int
    peak_lr: float = 5e-3
    #: the build fails unless the adapter's greedy text scores at least this on held-out
    #: prompts, and the base model's at most ``max_base_score``
    min_score: float = 0.8
    max_base_score: float = 0.3


ADAPTERS = {
    "upper": Adapter("upper", upper, upper_share, "continues code, upper-cased", SEED, 1e-2),
    "comment": Adapter(
        "comment", comment, comment_share, "continues code, every line commented out with '# '", SEED + 1
    ),
}


# --------------------------------------------------------------------------- data


def training_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` (prompt, continuation) pairs: 2-6 consecutive non-blank lines of a file the
    target trained on (as the held-out prompts are made), and the 3-8 lines that follow."""
    rng = random.Random(seed)
    pools = []
    for path in stdlib_files():
        if not is_held_out(path):
            lines = [ln for ln in read_text(path).splitlines() if ln.strip()]
            if len(lines) > 16:
                pools.append(lines)
    pairs = []
    while len(pairs) < count:
        lines = rng.choice(pools)
        n, m = rng.randint(2, 6), rng.randint(3, 8)
        start = rng.randrange(0, len(lines) - n - m)
        pairs.append(
            ("\n".join(lines[start : start + n]) + "\n", "\n".join(lines[start + n : start + n + m]) + "\n")
        )
    return pairs


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], transform: Callable[[str], str]):
    """(input ids, labels) per pair: the prompt as vLLM and batchspec tokenize it (with <s>),
    then the transformed continuation; only the continuation is learned (labels -100 elsewhere)."""
    examples = []
    for prompt, cont in pairs:
        p = tokenizer.encode(prompt)
        c = tokenizer.encode(transform(cont), add_special_tokens=False)
        ids = (p + c)[:MAX_LEN]
        labels = ([-100] * len(p) + c)[:MAX_LEN]
        if any(label != -100 for label in labels):
            examples.append((ids, labels))
    return examples


def batch_of(examples, idx: list[int], pad_id: int):
    import torch

    width = max(len(examples[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), width), -100, dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    for row, i in enumerate(idx):
        x, y = examples[i]
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return ids, labels, mask


# --------------------------------------------------------------------------- LoRA in plain torch


def lora_layer_class():
    import torch

    class LoRALinear(torch.nn.Module):
        """``base(x) + scaling * x @ A.T @ B.T``: PEFT's LoRA forward (no dropout, no bias)."""

        def __init__(self, base: torch.nn.Linear, r: int, alpha: int, gen: torch.Generator):
            super().__init__()
            self.base = base
            self.scaling = alpha / r
            self.lora_A = torch.nn.Parameter(torch.empty(r, base.in_features))
            self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, r))
            # PEFT's default init: A as torch.nn.Linear initialises its weight, B zero
            torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=gen)

        def forward(self, x):
            return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling

    return LoRALinear


def add_lora(model, r: int, alpha: int, gen) -> dict[str, object]:
    """Wrap every ``TARGET_MODULES`` Linear of ``model`` in a LoRA layer (in module order) and
    freeze everything else; returns {module name: LoRA layer}."""
    LoRALinear = lora_layer_class()
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = {}
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in TARGET_MODULES:
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            layer = LoRALinear(module, r, alpha, gen)
            setattr(parent, name.rsplit(".", 1)[-1], layer)
            wrapped[name] = layer
    return wrapped


def peft_state_dict(wrapped: dict) -> dict:
    """The LoRA weights under the names PEFT saves them with."""
    state = {}
    for name, layer in wrapped.items():
        prefix = f"base_model.model.{name}"
        state[f"{prefix}.lora_A.weight"] = layer.lora_A.detach().clone().contiguous()
        state[f"{prefix}.lora_B.weight"] = layer.lora_B.detach().clone().contiguous()
    return state


def adapter_config(target: Path, r: int, alpha: int) -> dict:
    """adapter_config.json as peft (0.x) writes it for a LoRA of a causal LM."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": str(target),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(TARGET_MODULES),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


# --------------------------------------------------------------------------- build


def settings_of(adapter: Adapter, steps: int) -> dict:
    return {
        "adapter": adapter.name,
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": list(TARGET_MODULES),
        "steps": steps,
        "batch": BATCH,
        "max_len": MAX_LEN,
        "peak_lr": adapter.peak_lr,
        "seed": adapter.seed,
    }


def greedy_texts(model, tokenizer, prompts: list[str], tokens: int) -> list[str]:
    import torch

    texts = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(
                ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def train(target: Path, adapter: Adapter, steps: int, batch: int = BATCH):
    """Train ``adapter`` on ``target``; returns (the model with its LoRA layers, {name: layer},
    tokenizer, final loss)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from batchspec.distill.recipe import lr_at

    torch.manual_seed(adapter.seed)
    gen = torch.Generator().manual_seed(adapter.seed)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    examples = encode_pairs(tokenizer, training_pairs(steps * batch, adapter.seed), adapter.transform)
    log(f"{adapter.name}: {len(examples)} examples, {steps} steps of {batch}")
    wrapped = add_lora(model, RANK, ALPHA, gen)
    params = [p for layer in wrapped.values() for p in (layer.lora_A, layer.lora_B)]
    opt = torch.optim.AdamW(params, lr=adapter.peak_lr, weight_decay=0.0, betas=(0.9, 0.99))
    model.train()
    started, loss = time.time(), None
    for step in range(steps):
        # pairs whose continuation the length cap cut away are dropped, so there may be fewer
        # examples than steps * batch: the last batches wrap around to the first examples
        idx = [(step * batch + j) % len(examples) for j in range(batch)]
        ids, labels, mask = batch_of(examples, idx, tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, adapter.peak_lr, warmup=20)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"{adapter.name} step {step}/{steps} loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    model.eval()
    return model, wrapped, tokenizer, loss.item()


def check(target: Path, model, tokenizer, adapter: Adapter) -> dict:
    """The adapter's greedy text against the base model's on held-out prompts."""
    import torch
    from transformers import LlamaForCausalLM

    prompts = held_out_snippets(CHECK_PROMPTS, seed=CHECK_SEED)
    base = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    base_texts = greedy_texts(base, tokenizer, prompts, CHECK_TOKENS)
    texts = greedy_texts(model, tokenizer, prompts, CHECK_TOKENS)
    return {
        "prompts": CHECK_PROMPTS,
        "tokens": CHECK_TOKENS,
        "seed": CHECK_SEED,
        "base_score": round(sum(map(adapter.score, base_texts)) / len(prompts), 3),
        "adapter_score": round(sum(map(adapter.score, texts)) / len(prompts), 3),
        "changed": sum(a != b for a, b in zip(texts, base_texts, strict=True)),
        "example": {"prompt": prompts[0], "base": base_texts[0], "adapter": texts[0]},
    }


def build(target: Path, out_root: Path, adapter: Adapter, steps: int, force: bool = False) -> dict:
    """Build ``adapter`` into ``out_root/lora-<name>`` (skipped when current); its info dict."""
    import torch
    from safetensors.torch import save_file

    if not (target / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"tiny-lora: target {target} is not built (no {COMPLETE_MARKER})")
    out = out_root / f"lora-{adapter.name}"
    settings = settings_of(adapter, steps)
    if not force and is_current(out, target / "model.safetensors", settings, key="base_sha256"):
        (out / COMPLETE_MARKER).touch()  # checked current: make need not ask again
        log(f"{out} already trained on {target}; skipping (use --force to rebuild)")
        return json.loads((out / INFO_FILE).read_text())
    # one thread: the weights then do not depend on the machine's core count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.time()
        model, wrapped, tokenizer, loss = train(target, adapter, steps)
        train_s = time.time() - started
        result = check(target, model, tokenizer, adapter)
    finally:
        torch.set_num_threads(threads)
    log(
        f"{adapter.name}: held-out score {result['adapter_score']} (base model "
        f"{result['base_score']}), {result['changed']}/{CHECK_PROMPTS} greedy outputs changed; "
        f"e.g. {result['example']['adapter']!r}"
    )
    if (
        result["adapter_score"] < adapter.min_score
        or result["base_score"] > adapter.max_base_score
        or result["changed"] < CHECK_PROMPTS
    ):
        raise ValueError(
            f"tiny-lora: adapter {adapter.name!r} does not change the target's greedy "
            f"output as meant (score {result['adapter_score']}, wanted >= "
            f"{adapter.min_score}; base {result['base_score']}, wanted <= "
            f"{adapter.max_base_score}; {result['changed']}/{CHECK_PROMPTS} changed); "
            f"{out} left as it was"
        )
    tmp = scratch_dir(out)
    save_file(peft_state_dict(wrapped), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(target, RANK, ALPHA), indent=2) + "\n")
    info = {
        "role": "lora",
        "description": adapter.description,
        "base": target.name,
        "base_sha256": file_sha256(target / "model.safetensors"),
        **settings,
        "final_loss": round(loss, 4),
        "train_s": round(train_s, 1),
        "build_s": round(time.time() - started, 1),
        "check": result,
    }
    publish(tmp, out, info)
    log(f"done in {time.time() - started:.0f}s: {out}")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=Path(".models/target"))
    parser.add_argument(
        "--out", type=Path, default=Path(".models"), help="the adapters go to OUT/lora-<name>"
    )
    parser.add_argument(
        "--only",
        choices=sorted(ADAPTERS),
        action="append",
        help="build only this adapter (repeatable); default: all",
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--force", action="store_true", help="rebuild even if current")
    args = parser.parse_args(argv)
    try:
        for name in args.only or ADAPTERS:
            build(args.target, args.out, ADAPTERS[name], args.steps, args.force)
    except (ValueError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
