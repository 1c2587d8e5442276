"""Speculation tiers on the large target: no speculation, the 1-layer draft and draft-large.

The target is `.models/target-large` (the tiny target grown to 205M parameters, same function;
tools/grow_model.py): a large model's cost with the tiny model's quality, so the drafts keep
the acceptance they have against the tiny target. Bare ``LLM.generate``, greedy, ``ignore_eos``
(every request makes exactly ``--max-tokens`` tokens), fp32, enforce_eager; start-up and a
warm-up excluded.

One engine per speculation setting, each in its own process (one at a time), with
``max_num_seqs`` equal to the largest concurrency. Concurrency 1 sends the requests one after
another (one in flight: what ``max_num_seqs: 1`` would schedule); a larger concurrency sends
``--prompts`` requests in one call with ``max_num_seqs`` of them in flight.

Usage: ``python benchmarks/speculation_tiers.py [--models .models] [--prompts 64] [--k 4]``
(prints a Markdown table; ``--json FILE`` also writes the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

#: Speculation settings, in table order: name -> draft model directory under --models (or None).
TIERS = {"off": None, "draft": "draft", "draft-large": "draft-large"}
#: Requests sent one at a time at concurrency 1 (enough for a stable rate, few enough to be quick).
SERIAL_PROMPTS = 8


def measure_tier(config: dict) -> dict:
    """Start one engine for ``config`` and time each concurrency; runs in its own process."""
    from tiny_models import held_out_snippets
    from vllm import LLM, SamplingParams

    kwargs = {
        "max_model_len": 512,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
        "max_num_seqs": max(config["concurrency"]),
    }
    if config["draft"]:
        kwargs.update(
            speculative_config={
                "method": "draft_model",
                "model": config["draft"],
                "num_speculative_tokens": config["k"],
            },
            disable_log_stats=False,
            per_request_spec_decode_metrics="summary",
        )
    started = time.monotonic()
    llm = LLM(model=config["target"], **kwargs)
    startup_s = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], ignore_eos=True)
    prompts = held_out_snippets(config["prompts"], seed=12345)
    llm.generate(held_out_snippets(4, seed=1), params, use_tqdm=False)  # warm-up

    results = []
    for concurrency in config["concurrency"]:
        outputs = []
        started = time.monotonic()
        if concurrency == 1:
            for prompt in prompts[:SERIAL_PROMPTS]:
                outputs += llm.generate([prompt], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.monotonic() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        row = {
            "concurrency": concurrency,
            "requests": len(outputs),
            "output_tokens": tokens,
            "wall_s": round(wall_s, 2),
            "tokens_per_s": round(tokens / wall_s, 1),
        }
        if config["draft"]:
            totals = {"num_draft_tokens": 0, "num_accepted_draft_tokens": 0, "num_spec_steps": 0}
            for out in outputs:
                metrics = out.outputs[0].spec_decode_metrics.to_dict()
                for key in totals:
                    totals[key] += metrics[key]
            row["acceptance_rate"] = round(
                totals["num_accepted_draft_tokens"] / totals["num_draft_tokens"], 3
            )
            row["mean_acceptance_length"] = round(
                1 + totals["num_accepted_draft_tokens"] / totals["num_spec_steps"], 2
            )
        results.append(row)
    return {"startup_s": round(startup_s, 1), "results": results}


def run_tier(name: str, config: dict) -> dict:
    """``measure_tier`` in a fresh process, so that each engine is gone before the next starts."""
    with tempfile.TemporaryDirectory(prefix="batchspec-tiers-") as tmp:
        config_path, out_path = Path(tmp) / "config.json", Path(tmp) / "out.json"
        config_path.write_text(json.dumps(config))
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}
        proc = subprocess.run(
            [sys.executable, __file__, "--measure", str(config_path), str(out_path)],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(
                f"tier {name}: the engine process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return json.loads(out_path.read_text())


def markdown(rows: list[dict], k: int) -> str:
    """The figures as a Markdown table, one row per concurrency and speculation setting."""
    lines = [
        "| concurrency | speculation | tok/s | vs off | acceptance | mean acceptance length |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    off = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["tier"] == "off"}
    for r in sorted(rows, key=lambda r: (r["concurrency"], list(TIERS).index(r["tier"]))):
        label = "off" if r["tier"] == "off" else f"{r['tier']}, k={k}"
        ratio = r["tokens_per_s"] / off[r["concurrency"]] if r["concurrency"] in off else None
        lines.append(
            f"| {r['concurrency']} | {label} | {r['tokens_per_s']:.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {r.get('acceptance_rate', '')} | "
            f"{r.get('mean_acceptance_length', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--target", default="target-large", help="target directory under --models")
    parser.add_argument("--tiers", nargs="+", choices=list(TIERS), default=list(TIERS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=64, help="requests at concurrency > 1")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--measure", nargs=2, type=Path, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.measure:
        config_path, out_path = args.measure
        out_path.write_text(json.dumps(measure_tier(json.loads(config_path.read_text()))))
        return 0

    for name in [args.target] + [TIERS[t] for t in args.tiers if TIERS[t]]:
        if not (args.models / name / ".batchspec-complete").exists():
            print(f"{args.models / name} is not built: run `make models`", file=sys.stderr)
            return 2
    rows = []
    for tier in args.tiers:
        config = {
            "target": str(args.models / args.target),
            "draft": str(args.models / TIERS[tier]) if TIERS[tier] else None,
            "k": args.k,
            "concurrency": args.concurrency,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
        }
        measured = run_tier(tier, config)
        print(
            f"{tier}: engine start {measured['startup_s']} s; "
            + "; ".join(
                f"concurrency {r['concurrency']}: {r['tokens_per_s']} tok/s" for r in measured["results"]
            ),
            file=sys.stderr,
            flush=True,
        )
        rows += [{"tier": tier, **r} for r in measured["results"]]
    table = markdown(rows, args.k)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "k": args.k, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
