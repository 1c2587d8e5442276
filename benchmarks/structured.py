"""What a JSON-schema constraint does to speculative decoding: tok/s and acceptance with and without
the grammar, speculation off, a draft model and n-gram lookup, on the tiny pair.

The grammar masks the target's logits; a drafted token the grammar forbids is rejected, so it
costs a verification slot without adding a token. Each mode is one vLLM engine (bare
``LLM.generate``, the job's engine arguments, compact JSON engine-wide as
examples/requests/extract.yaml sets it), the same held-out code prompts, greedy, both runs of a
mode on the same engine after one warm-up batch.

Usage: ``python benchmarks/structured.py [--models .models] [--prompts 64] [--max-tokens 48]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

#: A field of code the tiny model can fill: it writes what it would write anyway, inside JSON.
SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "maxLength": 120}},
    "required": ["code"],
    "additionalProperties": False,
}


def _speculative(mode: str, models: Path, k: int) -> dict | None:
    if mode == "draft":
        return {"method": "draft_model", "model": str(models / "draft"), "num_speculative_tokens": k}
    if mode == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    return None


def measure_mode(mode: str, models: Path, prompts: list[str], k: int, max_tokens: int) -> list:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # as batchspec's engine sets it
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = (
        {"speculative_config": _speculative(mode, models, k), "per_request_spec_decode_metrics": "summary"}
        if mode != "off"
        else {}
    )
    llm = LLM(
        model=str(models / "target"),
        max_model_len=512,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        **kwargs,
    )
    rows = []
    try:
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        for constrained in (False, True):
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None,
            )
            started = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - started
            tokens = drafted = accepted = steps = stopped = valid = 0
            for out in outs:
                c = out.outputs[0]
                tokens += len(c.token_ids)
                stopped += c.finish_reason == "stop"
                if constrained and c.finish_reason == "stop":
                    try:
                        valid += isinstance(json.loads(c.text).get("code"), str)
                    except ValueError:
                        pass
                m = getattr(c, "spec_decode_metrics", None)
                if m is not None:
                    m = m.to_dict()
                    drafted += m["num_draft_tokens"]
                    accepted += m["num_accepted_draft_tokens"]
                    steps += m["num_spec_steps"]
            rows.append(
                {
                    "mode": mode,
                    "grammar": constrained,
                    "prompts": len(prompts),
                    "output_tokens": tokens,
                    "wall_s": round(wall, 2),
                    "tokens_per_s": round(tokens / wall, 1),
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "mean_acceptance_length": round(1 + accepted / steps, 2) if steps else None,
                    "finished_stop": stopped,
                    "valid_json": valid if constrained else None,
                }
            )
    finally:
        del llm
        gc.collect()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(".models"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", default="off,draft,ngram")
    args = parser.parse_args()
    from tiny_models import held_out_snippets

    prompts = held_out_snippets(args.prompts, seed=12345)
    for mode in args.modes.split(","):
        for row in measure_mode(mode, args.models, prompts, args.k, args.max_tokens):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
