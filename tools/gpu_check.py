"""Run distill's training functions, the draft's and the head's, on whatever device is here, and
print ONE JSON line: for each, the device, the wall time, the held-out figure before and after,
and the peak GPU memory (null on the CPU). No vLLM: the target's greedy continuations are made
with transformers (on the CPU; they are the data, not what is measured).

Usage: ``python tools/gpu_check.py [--device auto|cpu|cuda] [--sequences 224] [--heldout 32]
[--prompt-tokens 48] [--new-tokens 64] [--draft-steps 300] [--head-steps 150] [--batch-size 16]
[--random-target HIDDEN,LAYERS,INTERMEDIATE]`` (the defaults are the sizes of the measurements in
the issue "GPU and gain"). Progress goes to stderr. The tiny models (``.models/target``,
``.models/draft``) come from ``make models``. ``--random-target 2048,16,8192`` measures a target
of a real size instead (a Llama of about 1.07B parameters with random weights and the tiny
tokenizer, built from a config into a temporary folder, bf16): its held-out figures mean nothing,
its times and memory are what a 1B target costs.

- **draft**: ``train_draft`` on the continuations (one window each), held-out figure: the
  greedy acceptance at k=4 the draft would reach on the held-out continuations (distill's
  validation figure), before training and of the weights kept;
- **head**: a new EAGLE-3 head for the target, the target's features (``collect_features``, on the
  device: bf16 on CUDA, in passes sized to the free memory) then ``train_head``; held-out figure:
  tokens right in a row, of 3 draft steps. ``wall_s`` is both; ``features_s`` the first."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def target_shape(text: str) -> str:
    """``--random-target``'s value: three positive integers, the width a multiple of 64 (heads of
    64), else an argparse error naming the option."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % 64:
        raise argparse.ArgumentTypeError(
            f"expected HIDDEN,LAYERS,INTERMEDIATE, three positive integers with HIDDEN a multiple of "
            f"64, got {text!r}"
        )
    return text


def positive(text: str) -> int:
    """A count's value (sizes, steps, batch size, patience): a positive integer, else an argparse
    error naming the option, before any work."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def random_target(shape: str, tokenizer_dir: Path, out: Path) -> Path:
    """A Llama of ``shape`` (``HIDDEN,LAYERS,INTERMEDIATE``) with random weights in bf16 and the
    tokenizer of ``tokenizer_dir``, saved into ``out``."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, intermediate = (int(v) for v in shape.split(","))
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    log(f"random target {shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
    return out


def continuations(
    target_dir: Path, sequences: int, prompt_tokens: int, new_tokens: int, seed: int, device: str = "cpu"
):
    """``sequences`` rows of the target's greedy continuations (``new_tokens``) of windows of
    ``prompt_tokens`` tokens of code the tiny models never saw, all in one batch (on ``device``:
    bf16 on CUDA)."""
    import torch
    from tiny_models import encode_corpus, held_out_snippets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    corpus = encode_corpus(tokenizer, held_out_snippets(max(64, sequences * 2), seed=seed))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(corpus) - prompt_tokens - 1, (sequences,), generator=gen).tolist()
    ids = torch.stack([corpus[s : s + prompt_tokens] for s in starts]).to(device)
    tokens = [ids]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(new_tokens):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
    seqs = torch.cat(tokens, dim=1).tolist()
    del model, out
    if device == "cuda":
        torch.cuda.empty_cache()
    return [{"prompt_token_ids": s[:prompt_tokens], "output_token_ids": s[prompt_tokens:]} for s in seqs]


def _peak_reset(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    return round(torch.cuda.max_memory_allocated() / (1 << 20), 1)


def check_draft(args, device: str, train_rows: list[dict], held_rows: list[dict]) -> dict:
    from batchspec.distill import train

    draft = train.load_draft(str(args.draft))
    _, special = train.tokenizer_vocab(str(args.target))
    pad_id = next((v for v in (special["pad"], special["eos"], 0) if v is not None), 0)
    _peak_reset(device)
    started = time.monotonic()
    result = train.train_draft(
        draft,
        train_rows,
        args.draft_steps,
        2e-3,
        args.batch_size,
        args.seed,
        pad_id,
        progress=log,
        window=args.new_tokens,
        validation=held_rows,
        patience=args.patience,
        device=device,
    )
    return {
        "device": result.device,
        "wall_s": round(time.monotonic() - started, 2),
        "steps": result.steps,
        "metric": result.metric,
        "heldout_before": result.start_validation_agreement,
        "heldout_after": result.validation_agreement,
        "peak_gpu_mib": _peak_mib(device),
    }


def check_head(args, device: str, train_rows: list[dict], held_rows: list[dict], work: Path) -> dict:
    from batchspec.distill import eagle3, features

    target_dir = str(args.target)
    config = eagle3.head_config(eagle3.target_config(target_dir), k=3)
    head = eagle3.new_head(target_dir, config, seed=args.seed)
    aux = config["eagle_aux_hidden_state_layer_ids"]
    _peak_reset(device)
    started = time.monotonic()
    target = features.Target(target_dir, device, log)
    try:
        train = features.collect_features(target_dir, train_rows, aux, work / "train", say=log, target=target)
        held = features.collect_features(target_dir, held_rows, aux, work / "held", say=log, target=target)
    finally:
        target.close()
    features_s = time.monotonic() - started
    result = eagle3.train_head(
        head,
        train.files,
        held.files,
        args.head_steps,
        1e-3,
        args.batch_size,
        args.seed,
        say=log,
        patience=args.patience,
        device=device,
    )
    return {
        "device": result.device,
        "wall_s": round(time.monotonic() - started, 2),
        "features_s": round(features_s, 2),
        "steps": result.steps,
        "metric": result.metric,
        "heldout_before": result.start_validation_agreement,
        "heldout_after": result.validation_agreement,
        "peak_gpu_mib": _peak_mib(device),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--target", type=Path, default=ROOT / ".models" / "target")
    parser.add_argument("--draft", type=Path, default=ROOT / ".models" / "draft")
    parser.add_argument("--sequences", type=positive, default=224, help="held-out ones included")
    parser.add_argument("--heldout", type=positive, default=32)
    parser.add_argument("--prompt-tokens", type=positive, default=48)
    parser.add_argument("--new-tokens", type=positive, default=64)
    parser.add_argument("--draft-steps", type=positive, default=300)
    parser.add_argument("--head-steps", type=positive, default=150)
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument(
        "--patience",
        type=positive,
        default=1000,
        help="held-out checks without a new best before training stops (default: never, so that "
        "every device runs the same steps)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--random-target",
        type=target_shape,
        metavar="HIDDEN,LAYERS,INTERMEDIATE",
        help="measure a Llama of this shape with random weights (and the tiny tokenizer) instead "
        "of .models/target: times and memory of a real size, held-out figures meaningless",
    )
    args = parser.parse_args(argv)
    if not args.heldout < args.sequences:
        parser.error("--heldout must be fewer than --sequences")

    import torch

    from batchspec.distill.device import resolve
    from batchspec.errors import SpecError

    try:
        device = resolve(args.device)
    except SpecError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        if args.random_target:
            args.target = random_target(args.random_target, args.target, Path(work) / "target")
        log(f"device {device}; the target's greedy continuations ({args.sequences} sequences)")
        started = time.monotonic()
        rows = continuations(
            args.target, args.sequences, args.prompt_tokens, args.new_tokens, args.seed, device
        )
        made_s = time.monotonic() - started
        train_rows, held_rows = rows[args.heldout :], rows[: args.heldout]
        report = {
            "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "torch": torch.__version__,
            "sequences": args.sequences,
            "heldout": args.heldout,
            "tokens": [args.prompt_tokens, args.new_tokens],
            "target": args.random_target or "tiny",
            "continuations_s": round(made_s, 2),
            "draft": check_draft(args, device, train_rows, held_rows),
            "head": check_head(args, device, train_rows, held_rows, Path(work)),
        }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
