"""Grow the EAGLE-3 head of the tiny target for the target grown from it (tools/grow_model.py).

The head distill trained for ``.models/target`` is given the same zero padding as the target:
on the grown target's hidden states (the source's, padded with zeros) it computes what it
computed on the source's, which is checked (max absolute logit difference over three draft
steps) before the grown head is swapped in. Skipped when the output is current. Usage:
``python tools/grow_head.py --head .models/head --target .models/target-large --out
.models/head-large``"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grow_model import MAX_LOGIT_DIFFERENCE, SEED, WEIGHTS_FILE, log, pad  # noqa: E402
from model_files import INFO_FILE, file_sha256, is_current, publish, scratch_dir  # noqa: E402


def grow_head_state(state: dict, hidden_old: int, hidden: int, aux: int) -> dict:
    """An EAGLE-3 head's weights (speculators' names) for the grown target: the same zero
    padding as the target's, so that on the grown target's hidden states (the source's, padded
    with zeros) it computes what it computed on the source's. Its attention heads and MLP keep
    their sizes (the config says so); ``fc`` takes each auxiliary layer's padded block."""
    import torch

    ratio = hidden_old / hidden
    out: dict = {}
    for name, weight in state.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = pad(weight * math.sqrt(ratio), (hidden,))
        elif name == "fc.weight":  # [h, aux * h] -> [H, aux * H], each block in its corner
            grown = torch.zeros(hidden, aux * hidden, dtype=weight.dtype)
            for j in range(aux):
                grown[:hidden_old, j * hidden : j * hidden + hidden_old] = weight[
                    :, j * hidden_old : (j + 1) * hidden_old
                ]
            out[name] = grown
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            # input: [embedding, fused state], each padded: [rows, 2h] -> [rows, 2H]
            grown = torch.zeros(weight.shape[0], 2 * hidden, dtype=weight.dtype)
            grown[:, :hidden_old] = weight[:, :hidden_old]
            grown[:, hidden : hidden + hidden_old] = weight[:, hidden_old:]
            out[name] = grown
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # rows: the residual stream
            out[name] = pad(weight, (hidden, weight.shape[1]))
        elif name.endswith(("gate_proj.weight", "up_proj.weight", "lm_head.weight")):  # columns
            out[name] = pad(weight, (weight.shape[0], hidden))
        else:
            raise ValueError(f"grow: unexpected head weight {name}")
    return out


def grow_head(source: Path, target: Path, out: Path, force: bool = False) -> dict:
    """Grow the EAGLE-3 head at ``source`` (trained for the source target by ``batchspec
    distill --method eagle3``) for ``target``, grown from that source target; checked like the
    target: the grown head's proposals on the grown target's hidden states must equal the
    source head's on the source target's. Skipped when current."""
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from batchspec.distill import eagle3

    if not (source / INFO_FILE).exists():
        raise FileNotFoundError(f"grow: head {source} is not built (no {INFO_FILE})")
    settings = {"target": target.name}
    weights = source / WEIGHTS_FILE
    if not force and is_current(out, weights, settings):
        log(f"{out} already grown from {source}; skipping (use --force to rebuild)")
        return json.loads((out / INFO_FILE).read_text())
    started = time.time()
    config = json.loads((source / "config.json").read_text())
    big = json.loads((target / "config.json").read_text())
    layer = config["transformer_layer_config"]
    hidden_old, hidden = layer["hidden_size"], big["hidden_size"]
    aux = config["eagle_aux_hidden_state_layer_ids"]
    new_config = eagle3.head_config(
        big,
        aux,
        k=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
        verifier=str(target),
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
    )
    tmp = scratch_dir(out)
    save_file(grow_head_state(load_file(str(weights)), hidden_old, hidden, len(aux)), str(tmp / WEIGHTS_FILE))
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    # the check: the same tokens and hidden states (padded) through both heads
    small_target = Path(json.loads((target / INFO_FILE).read_text())["grown_from"])
    small_target = target.parent / small_target
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(3, big["vocab_size"], (2, 24), generator=gen)
    states = torch.randn(2, 24, len(aux) * hidden_old, generator=gen)
    padded = torch.zeros(2, 24, len(aux) * hidden)
    for j in range(len(aux)):
        padded[..., j * hidden : j * hidden + hidden_old] = states[..., j * hidden_old : (j + 1) * hidden_old]
    with torch.no_grad():
        want = eagle3.load_head(str(source), str(small_target)).unroll(tokens, states, 3)
        got = eagle3.load_head(str(tmp), str(target)).unroll(tokens, padded, 3)
    diff = max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True))
    log(f"max |logit difference| of the grown head against {source}: {diff:.2e}")
    if diff > MAX_LOGIT_DIFFERENCE:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"grow: the head grown from {source} differs by {diff:.2e}; {out} left as it was")
    card = json.loads((source / INFO_FILE).read_text())
    info = {
        **card,
        "target": str(target),
        "grown_from": str(source),
        "source_sha256": file_sha256(weights),
        **settings,
        "max_logit_difference": diff,
        "note": (
            f"the head distill trained for {small_target.name}, grown like {target.name} "
            "(the same function on its hidden states); its card's training figures are the source's"
        ),
    }
    publish(tmp, out, info)
    log(f"done in {time.time() - started:.0f}s: {out}")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--head", type=Path, required=True, help="the EAGLE-3 head trained for the source target"
    )
    parser.add_argument("--target", type=Path, default=Path(".models/target-large"))
    parser.add_argument("--out", type=Path, default=Path(".models/head-large"))
    parser.add_argument("--force", action="store_true", help="rebuild even if already grown")
    args = parser.parse_args(argv)
    try:
        grow_head(args.head, args.target, args.out, args.force)
    except (ValueError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
