"""Grow the tiny Llama target into a large one that computes the same function.

On a CPU every forward pass of the tiny target costs about the same fixed overhead, so
speculative decoding has nothing to save. Training a big target on a small machine is out of
reach; growing the trained tiny one is not. The grown model is a stand-in with a big model's
cost and the small model's quality: the same logits (to float rounding), the same greedy text,
so the drafts distilled for the tiny target keep their acceptance against it.

Function-preserving growth (Net2Net-style, with zeros):

- width: hidden ``H_old -> H_new`` with more attention heads of the same ``head_dim``, MLP
  ``I_old -> I_new``. Old weights sit in the top-left corner, new rows and columns are zero, so
  the residual stream's new coordinates stay exactly zero, new heads and MLP units output zero.
- RMSNorm: the mean of squares now runs over ``H_new`` coordinates of which only ``H_old`` are
  non-zero, so it shrinks by ``H_old/H_new``. Scaling every norm's eps by ``H_old/H_new`` and its
  weight by ``sqrt(H_old/H_new)`` gives back exactly the old normalised values.
- depth: new layers (appended after the old ones) have random q/k/v/gate/up projections and
  zero ``o_proj`` and ``down_proj``, so each is the identity on the residual stream while it
  costs what a real layer costs.

Works on the safetensors weights with torch; copies the tokenizer files; checks the grown model
against the source with transformers (max absolute logit difference) and writes that figure to
``batchspec-model.json``. Skipped when the output is complete and was grown from the same source
weights. Usage: ``python tools/grow_model.py --source .models/target --out .models/target-large``
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_files import COMPLETE_MARKER, INFO_FILE, file_sha256, is_current, publish, scratch_dir  # noqa: E402

WEIGHTS_FILE = "model.safetensors"
#: Files copied unchanged from the source model (those it has).
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
SEED = 4321
#: The grown model must reproduce the source's logits this closely (float32 rounding is ~1e-5).
MAX_LOGIT_DIFFERENCE = 1e-4
#: Standard deviation of the new layers' random (but output-free) projections.
INIT_STD = 0.02
#: Fixed prompts for the logit check: code, as the models were trained on.
CHECK_PROMPTS = (
    "def main(argv=None):\n    parser = argparse.ArgumentParser(",
    "import os\nimport sys\n\nclass Cache:\n    def __init__(self, size):\n",
    "    for key, value in sorted(items.items()):\n        if value is None:\n",
    "<|user|>\nWrite a function that reverses a list.<|end|>\n<|assistant|>\n",
)


def log(msg: str) -> None:
    print(f"[grow-model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pad(tensor, shape: tuple[int, ...]):
    """``tensor`` in the leading corner of a zero tensor of ``shape``."""
    import torch

    out = torch.zeros(shape, dtype=tensor.dtype)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def grow_state_dict(
    state: dict, config: dict, hidden: int, intermediate: int, layers: int, seed: int = SEED
) -> tuple[dict, dict]:
    """The grown weights and config for a Llama ``state``/``config`` pair.

    ``hidden`` must be a multiple of the source's ``head_dim``; ``hidden``, ``intermediate`` and
    ``layers`` must not be smaller than the source's. Raises ValueError naming the bad setting.
    """
    import torch

    h_old, i_old = config["hidden_size"], config["intermediate_size"]
    l_old, heads_old = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads_old = config.get("num_key_value_heads", heads_old)
    head_dim = config.get("head_dim") or h_old // heads_old
    if config.get("tie_word_embeddings"):
        raise ValueError("grow: tied word embeddings are not supported (tie_word_embeddings: true)")
    if hidden < h_old or intermediate < i_old or layers < l_old:
        raise ValueError(
            f"grow: hidden {hidden}, intermediate {intermediate}, layers {layers} must "
            f"be at least the source's {h_old}, {i_old}, {l_old}"
        )
    if hidden % head_dim:
        raise ValueError(f"grow: hidden {hidden} is not a multiple of head_dim {head_dim}")
    heads = hidden // head_dim
    # keep the source's grouping of query heads per key/value head
    group = heads_old // kv_heads_old
    if heads % group:
        raise ValueError(f"grow: {heads} heads cannot keep {group} query heads per key/value head")
    # grouped-query attention maps query head j to kv head j // group: old query heads keep their
    # kv heads and new ones land on new (zero) kv heads, so zero padding preserves the function
    kv_heads = heads // group
    ratio = h_old / hidden
    norm_scale = math.sqrt(ratio)
    gen = torch.Generator().manual_seed(seed)

    def norm(weight):
        # new coordinates are zero on the residual stream, so their weight never matters: zero
        return pad(weight * norm_scale, (hidden,))

    grown: dict = {}
    vocab = state["model.embed_tokens.weight"].shape[0]
    grown["model.embed_tokens.weight"] = pad(state["model.embed_tokens.weight"], (vocab, hidden))
    grown["lm_head.weight"] = pad(state["lm_head.weight"], (vocab, hidden))
    grown["model.norm.weight"] = norm(state["model.norm.weight"])
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
    }
    identity_zero = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    for i in range(layers):
        prefix = f"model.layers.{i}."
        if i < l_old:
            for name, shape in shapes.items():
                grown[prefix + name] = pad(state[prefix + name], shape)
            for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                grown[prefix + name] = norm(state[prefix + name])
            continue
        for name, shape in shapes.items():
            if name in identity_zero:
                grown[prefix + name] = torch.zeros(shape)
            else:
                grown[prefix + name] = torch.randn(shape, generator=gen) * INIT_STD
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            grown[prefix + name] = torch.full((hidden,), norm_scale)
    extra = sorted(k for k in state if k not in grown and "rotary_emb" not in k)
    if extra:
        raise ValueError(f"grow: source weights not handled: {', '.join(extra[:5])}")
    new_config = dict(
        config,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6) * ratio,
    )
    return {k: v.contiguous() for k, v in grown.items()}, new_config


def max_logit_difference(source: Path, grown: Path, prompts: tuple[str, ...] = CHECK_PROMPTS) -> float:
    """Largest absolute difference between the two models' logits (transformers, fp32) over every
    position of ``prompts``."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source)
    a = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    b = LlamaForCausalLM.from_pretrained(grown, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            diff = (a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max().item()
            worst = max(worst, diff)
    return worst


def grow(
    source: Path,
    out: Path,
    hidden: int = 1024,
    intermediate: int = 4096,
    layers: int = 12,
    force: bool = False,
    seed: int = SEED,
    max_difference: float = MAX_LOGIT_DIFFERENCE,
) -> dict:
    """Grow the model at ``source`` into ``out`` (skipped when current); returns its info dict.

    Raises ValueError, leaving ``out`` as it was, when the grown logits differ from the source's
    by more than ``max_difference``."""
    from safetensors.torch import load_file, save_file

    if not (source / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"grow: source model {source} is not built (no {COMPLETE_MARKER})")
    settings = {"hidden": hidden, "intermediate": intermediate, "layers": layers, "seed": seed}
    if not force and is_current(out, source / WEIGHTS_FILE, settings):
        log(f"{out} already grown from {source}; skipping (use --force to rebuild)")
        return json.loads((out / INFO_FILE).read_text())
    started = time.time()
    config = json.loads((source / "config.json").read_text())
    state = load_file(str(source / WEIGHTS_FILE))
    grown, new_config = grow_state_dict(state, config, hidden, intermediate, layers, seed)
    n_params = sum(t.numel() for t in grown.values())
    log(
        f"{source}: {sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters -> "
        f"{n_params / 1e6:.1f}M ({layers} layers, hidden {hidden}, MLP {intermediate})"
    )

    tmp = scratch_dir(out)
    save_file(grown, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, tmp / name)
    diff = max_logit_difference(source, tmp)
    log(f"max |logit difference| against {source}: {diff:.2e}")
    if diff > max_difference:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(
            f"grow: the model grown from {source} differs from it by {diff:.2e} "
            f"in the logits (limit {max_difference:.0e}); {out} left as it was"
        )
    info = {
        "role": "target",
        "grown_from": source.name,
        "source_sha256": file_sha256(source / WEIGHTS_FILE),
        "parameters": n_params,
        **settings,
        "max_logit_difference": diff,
        "build_s": round(time.time() - started, 1),
        "note": "a stand-in with a large model's cost and the source model's quality",
    }
    publish(tmp, out, info)
    log(f"done in {time.time() - started:.0f}s: {out}")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(".models/target"))
    parser.add_argument("--out", type=Path, default=Path(".models/target-large"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument(
        "--max-logit-difference",
        type=float,
        default=MAX_LOGIT_DIFFERENCE,
        help="fail (exit 1) when the grown model's logits differ by more",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already grown")
    args = parser.parse_args(argv)
    try:
        grow(
            args.source,
            args.out,
            args.hidden,
            args.intermediate,
            args.layers,
            args.force,
            max_difference=args.max_logit_difference,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
