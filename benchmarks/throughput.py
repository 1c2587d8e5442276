"""Throughput of batchspec against bare vLLM on the same engine, prompts and settings.

Three ways to run the same requests through one engine (started once; start-up excluded):

- ``bare``: ``LLM.generate`` over the whole list (vLLM's best case: no I/O, one call);
- ``batchspec``: ``run_job`` over Parquet shards, reading, writing and committing included;
- ``naive``: a loop that calls ``LLM.generate`` once per batch of ``--batch`` prompts, which
  stalls at every batch boundary until the batch's longest request finishes.

Output lengths vary widely between rows (per-row ``max_tokens``, log-uniform, with
``ignore_eos``), which is where keeping the engine fed matters.

Usage: ``python benchmarks/throughput.py [--prompts 384] [--repeats 2] [--spec draft|ngram|off]``
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import TINY_DRAFT, TINY_ENGINE, print_report  # noqa: E402

SPECULATIVE = {
    "draft": dict(TINY_DRAFT),
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "off": None,
}


def workload(n: int, seed: int = 3) -> tuple[list[str], list[int]]:
    from tiny_models import held_out_snippets

    rng = random.Random(seed)
    prompts = held_out_snippets(n, seed=seed)
    # log-uniform between 4 and 320 tokens: most rows short, a few very long
    lengths = [int(math.exp(rng.uniform(math.log(4), math.log(320)))) for _ in range(n)]
    return prompts, lengths


def write_shards(root: Path, prompts: list[str], lengths: list[int], shards: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    per = math.ceil(len(prompts) / shards)
    for i in range(shards):
        sl = slice(i * per, (i + 1) * per)
        pq.write_table(
            pa.table(
                {
                    "id": [f"r{j}" for j in range(len(prompts))][sl],
                    "prompt": prompts[sl],
                    "max_tokens": lengths[sl],
                }
            ),
            root / f"part-{i}.parquet",
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="batch size of the naive loop")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spec", choices=sorted(SPECULATIVE), default="draft")
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from batchspec.engine.llm import Engine
    from batchspec.run.events import EventLog
    from batchspec.run.job import RunOptions, run_job
    from batchspec.spec.build import build_spec

    prompts, lengths = workload(args.prompts)
    work = Path(tempfile.mkdtemp(prefix="batchspec-bench-"))
    (work / "in").mkdir()
    write_shards(work / "in", prompts, lengths, args.shards)
    raw = {
        "name": "bench",
        "input": {
            "path": str(work / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens"},
        },
        "output": {"path": str(work / "out")},
        "model": {"target": str(ROOT / ".models" / "target"), "engine": dict(TINY_ENGINE)},
        "speculative": SPECULATIVE[args.spec],
        "sampling": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True},
        # every row generated, as bare vLLM and the naive loop do (a repeated snippet would
        # otherwise be written from its twin: batchspec/run/twins.py, benchmarks/batching.py)
        "execution": {"max_in_flight": args.max_in_flight, "dedupe_window": 0},
    }
    spec = build_spec(raw)
    started = time.monotonic()
    engine = Engine(spec)
    startup_s = time.monotonic() - started
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine.llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up

    def bare() -> int:
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def naive() -> int:
        total = 0
        for i in range(0, len(prompts), args.batch):
            outs = engine.llm.generate(
                prompts[i : i + args.batch], params[i : i + args.batch], use_tqdm=False
            )
            total += sum(len(o.outputs[0].token_ids) for o in outs)
        return total

    def batchspec() -> int:
        shutil.rmtree(work / "out", ignore_errors=True)
        result = run_job(
            spec,
            RunOptions(
                engine=engine, progress_bars=False, events=EventLog("bench", "json", open("/dev/null", "w"))
            ),
        )
        return result.summary["totals"]["output_tokens"]

    modes = {"bare": bare, "batchspec": batchspec, "naive": naive}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for name, fn in modes.items():  # interleaved, so drift hits every mode alike
            t0 = time.monotonic()
            tokens = fn()
            wall = time.monotonic() - t0
            results[name].append(
                {"output_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}
            )
    engine.shutdown()
    shutil.rmtree(work, ignore_errors=True)

    best = {m: max(r["tokens_per_s"] for r in runs) for m, runs in results.items()}
    report = {
        "prompts": args.prompts,
        "shards": args.shards,
        "speculative": args.spec,
        "output_tokens": results["bare"][0]["output_tokens"],
        "max_tokens_range": [min(lengths), max(lengths)],
        "naive_batch": args.batch,
        "engine_startup_s": round(startup_s, 1),
        "runs": results,
        "best_tokens_per_s": best,
        "ratio_batchspec_vs_bare": round(best["batchspec"] / best["bare"], 3),
        "ratio_batchspec_vs_naive": round(best["batchspec"] / best["naive"], 3),
    }
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
