"""Greedy acceptance of the tiny draft against the tiny target, on held-out prompts.

Measured with bare vLLM (LLM.generate) and vLLM's own per-request speculative metrics, on code
snippets from standard-library files neither model was trained on.

Usage: ``python benchmarks/acceptance.py [--models .models] [--prompts 200] [--k 4]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))


def measure(models: Path, prompts: int, k: int, max_tokens: int, temperature: float) -> dict:
    from tiny_models import held_out_snippets
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(models / "target"),
        max_model_len=512,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
        per_request_spec_decode_metrics="summary",
        speculative_config={
            "method": "draft_model",
            "model": str(models / "draft"),
            "num_speculative_tokens": k,
        },
    )
    texts = held_out_snippets(prompts, seed=12345)
    outs = llm.generate(
        texts, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    )
    drafted = accepted = steps = 0
    for out in outs:
        m = out.outputs[0].spec_decode_metrics.to_dict()
        drafted += m["num_draft_tokens"]
        accepted += m["num_accepted_draft_tokens"]
        steps += m["num_spec_steps"]
    return {
        "prompts": prompts,
        "num_speculative_tokens": k,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4),
        "mean_acceptance_length": round(1 + accepted / steps, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(".models"))
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    result = measure(args.models, args.prompts, args.k, args.max_tokens, args.temperature)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
