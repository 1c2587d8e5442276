"""What one engine step costs at each k: why tune fits a step's cost through three k.

Bare vLLM (no batchspec in the loop), one request in flight: the large target (or ``--target
target``) with the tiny draft at each k (k = 0: speculation off), greedy, 32 tokens a prompt,
``ignore_eos``, on held-out prompts sent one after another. Each ``engine.step()`` is timed; the
median of the decode steps (a prompt's first steps, where it is prefilled, left out) is the cost
of one target step with k drafted tokens, each k in a fresh process with its own engine.

Usage: ``python benchmarks/step_cost.py [--target target-large] [--k 0 1 2 3 4] [--json FILE]``.
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

    spec = None if k == 0 else {"method": "draft_model", "model": str(ROOT / ".models" / "draft"),
                                "num_speculative_tokens": k}
    llm = LLM(model=str(target), max_model_len=512, enforce_eager=True, dtype="float32",
              max_num_seqs=64, seed=0, speculative_config=spec)
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
    warm = decode[len(decode) // 8:]  # the first prompts' steps meet every shape the first time
    return {"k": k, "decode_step_ms_median": round(statistics.median(warm) * 1000, 1),
            "decode_step_ms_mean": round(statistics.fmean(warm) * 1000, 1),
            "decode_steps": len(warm), "prefill_step_ms_median":
                round(statistics.median(prefill) * 1000, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="target-large", help="target-large or target")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3, 4])
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
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    rows = []
    for k in args.k:
        done = subprocess.run([sys.executable, __file__, "--target", args.target, "--one", str(k)],
                              capture_output=True, text=True, env=env, check=True)
        rows.append(next(json.loads(line) for line in done.stdout.splitlines()
                         if line.startswith('{"k": ')))
        print(f"k={k}: {rows[-1]}", file=sys.stderr, flush=True)
    from common import print_report

    print_report({"target": args.target, "in_flight": 1, "max_tokens": MAX_TOKENS,
                  "prompts": PROMPTS, "by_k": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
