"""Speculation's pay-off on the reasoning target: ``.models/reasoner`` with the ``qwen3`` parser,
speculation off against its distilled draft (``.models/reasoner-draft``) at k = 4.

A batchspec job (``run_job``, one Parquet shard, reading, writing and committing included) over
held-out chats (snippets of standard-library files the models never trained on), greedy, with
``max_tokens`` large enough that every row thinks and answers in full. Each mode runs on its own
engine, started before the clock (start-up excluded), at each ``execution.max_in_flight`` given.
Reported per mode and concurrency: output tokens/s, thinking and answer tokens, and acceptance
in the thinking and in the answer (from each verify step's counts, ``per_request_spec_decode_metrics:
detailed``).

Usage: ``python benchmarks/reasoning.py [--prompts 96] [--concurrency 1 32] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, TINY_ENGINE, print_report  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))

MODES = {
    "off": None,
    "draft k=4": {
        "method": "draft_model",
        "model": str(ROOT / ".models" / "reasoner-draft"),
        "num_speculative_tokens": 4,
    },
}


def write_prompts(path: Path, count: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tiny_reasoner import chats

    rows = chats(count, random.Random(11), held_out=True)
    messages = [[{"role": "user", "content": user}] for user, _, _ in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"messages": messages}), path)


def measure(
    mode: str, speculative: dict | None, prompts: Path, work: Path, levels: list[int], max_tokens: int
):
    import pyarrow.parquet as pq

    from batchspec import RunOptions, run_job
    from batchspec.engine.llm import Engine
    from batchspec.run.events import EventLog
    from batchspec.spec.build import build_spec

    def spec_for(level: int):
        return build_spec(
            {
                "name": "reasoning-bench",
                "input": {"path": str(prompts), "messages_column": "messages"},
                "output": {"path": str(work / f"{mode.split()[0]}-{level}")},
                "model": {
                    "target": str(ROOT / ".models" / "reasoner"),
                    "engine": dict(TINY_ENGINE),
                    "reasoning_parser": "qwen3",
                },
                "speculative": speculative,
                "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
                "execution": {"max_in_flight": level, "dedupe_window": 0, "prefix_window": 0},
            }
        )

    engine = Engine(spec_for(levels[0]))
    results = []
    try:
        for level in levels:
            spec = spec_for(level)
            started = time.perf_counter()
            run_job(spec, RunOptions(engine=engine, events=EventLog(open(os.devnull, "w"))))
            elapsed = time.perf_counter() - started
            table = pq.read_table(next(Path(spec.output.path).glob("*.parquet"))).to_pylist()
            results.append(
                {
                    "mode": mode,
                    "max_in_flight": level,
                    "seconds": round(elapsed, 2),
                    **figures(table, elapsed),
                }
            )
            print(results[-1], file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    return results


def figures(rows: list[dict], elapsed: float) -> dict:
    from batchspec.stats import acceptance_rate

    def total(column):
        return sum(r[column] or 0 for r in rows)

    output = total("num_output_tokens")
    drafted, accepted = total("spec_num_draft_tokens"), total("spec_num_accepted_tokens")
    t_drafted = total("spec_reasoning_num_draft_tokens")
    t_accepted = total("spec_reasoning_num_accepted_tokens")
    steps = total("spec_num_steps")
    return {
        "rows": len(rows),
        "finish_reasons": {
            k: sum(r["finish_reason"] == k for r in rows) for k in {r["finish_reason"] for r in rows}
        },
        "output_tokens": output,
        "thinking_tokens": total("num_reasoning_tokens"),
        "answer_tokens": total("num_answer_tokens"),
        "output_tokens_per_s": round(output / elapsed, 1),
        "acceptance": acceptance_rate(accepted, drafted) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / steps, 2) if steps else None,
        "acceptance_thinking": acceptance_rate(t_accepted, t_drafted) if t_drafted else None,
        "acceptance_answer": acceptance_rate(accepted - t_accepted, drafted - t_drafted)
        if drafted - t_drafted
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "in" / "chats.parquet"
        write_prompts(prompts, args.prompts)
        results = []
        for mode, speculative in MODES.items():
            results += measure(mode, speculative, prompts, work, args.concurrency, args.max_tokens)
    off = {r["max_in_flight"]: r["output_tokens_per_s"] for r in results if r["mode"] == "off"}
    for r in results:
        r["speedup_vs_off"] = round(r["output_tokens_per_s"] / off[r["max_in_flight"]], 2)
    print_report({"prompts": args.prompts, "max_tokens": args.max_tokens, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
