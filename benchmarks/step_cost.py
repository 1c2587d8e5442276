"""What one engine step costs at each k: why tune fits a step's cost through three k.

Bare vLLM (no batchspec in the loop), one request in flight: the large target (or ``--target
target``) with the tiny draft at each k (k = 0: speculation off), greedy, 32 tokens a prompt,
``ignore_eos``, on held-out prompts sent one after another. Each ``engine.step()`` is timed; the
median of the decode steps (a prompt's first steps, where it is prefilled, left out) is the cost
of one target step with k drafted tokens, each k in a fresh process with its own engine.

``--kernel`` times vLLM's CPU matrix kernel alone instead (``ops.onednn_mm``, what the CPU build's
linear layers call): the target's linear layers (its ``config.json`` shapes, random weights) over
1..8 rows, as a step verifying that many tokens of one sequence runs them.

Usage: ``python benchmarks/step_cost.py [--target target-large] [--k 0 1 2 3 4] [--kernel]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPTS, MAX_TOKENS = 24, 32


def one_k(target: Path, k: int) -> dict:
    """The decode steps of one engine at k (run in its own process)."""
    from tiny_models import held_out_snippets
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = (
        None
        if k == 0
        else {"method": "draft_model", "model": str(ROOT / ".models" / "draft"), "num_speculative_tokens": k}
    )
    llm = LLM(
        model=str(target),
        max_model_len=512,
        enforce_eager=True,
        dtype="float32",
        max_num_seqs=64,
        seed=0,
        speculative_config=spec,
    )
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    decode, prefill = [], []
    for i, text in enumerate(held_out_snippets(PROMPTS, seed=777)):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=tokenizer.encode(text)), params)
        first = True
        while True:
            started = time.perf_counter()
            outputs = engine.step()
            (prefill if first else decode).append(time.perf_counter() - started)
            first = False
            if any(o.finished for o in outputs):
                break
    warm = decode[len(decode) // 8 :]  # the first prompts' steps meet every shape the first time
    return {
        "k": k,
        "decode_step_ms_median": round(statistics.median(warm) * 1000, 1),
        "decode_step_ms_mean": round(statistics.fmean(warm) * 1000, 1),
        "decode_steps": len(warm),
        "prefill_step_ms_median": round(statistics.median(prefill) * 1000, 1),
    }


def kernel(target: Path, rows: range = range(1, 9), repeats: int = 20) -> list[dict]:
    """ms for one pass of the target's linear layers through ``ops.onednn_mm`` per row count."""
    import torch
    from vllm import _custom_ops as ops

    config = json.loads((target / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config.get("head_dim") or hidden // config["num_attention_heads"],
    )
    shapes = [((heads + 2 * kv) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)]
    torch.manual_seed(0)
    handlers = [(ops.create_onednn_mm(torch.randn(n, k).t(), 32), k) for n, k in shapes]
    out = []
    for m in rows:
        inputs = [torch.randn(m, k) for _, k in handlers]

        def one_pass(inputs=inputs):
            for _ in range(config["num_hidden_layers"]):
                for (handler, _), x in zip(handlers, inputs, strict=True):
                    ops.onednn_mm(handler, x, None)

        one_pass()
        started = time.perf_counter()
        for _ in range(repeats):
            one_pass()
        out.append({"rows": m, "ms": round((time.perf_counter() - started) / repeats * 1000, 1)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="target-large", help="target-large or target")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--kernel", action="store_true", help="time the matrix kernel alone")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    target = ROOT / ".models" / args.target
    if args.one is not None:
        print(json.dumps(one_k(target, args.one)))
        return 0
    if not (target / ".batchspec-complete").exists():
        print(f"{target} is not built: run `make models`", file=sys.stderr)
        return 2
    from common import print_report

    if args.kernel:
        print_report({"target": args.target, "kernel": "onednn_mm", "by_rows": kernel(target)}, args.json)
        return 0
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    rows = []
    for k in args.k:
        done = subprocess.run(
            [sys.executable, __file__, "--target", args.target, "--one", str(k)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        rows.append(next(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"k": ')))
        print(f"k={k}: {rows[-1]}", file=sys.stderr, flush=True)

    print_report(
        {"target": args.target, "in_flight": 1, "max_tokens": MAX_TOKENS, "prompts": PROMPTS, "by_k": rows},
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
