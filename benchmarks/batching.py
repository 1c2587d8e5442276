"""What a batch runner does with the whole dataset, against the same job in input order with it
all off: identical requests generated once (``execution.dedupe_window``) and rows sharing a
prefix sent together (``execution.prefix_window``, with the engine holding a request whose first
cache block another is computing).

Three workloads, each run by ``run_job`` on one engine (started once; start-up excluded), with
the defaults (``on``) and with ``dedupe_window: 0, prefix_window: 0`` (``off``), alternating A B
A B so that drift hits both alike:

- ``documents``: ``--documents`` documents of about 380 tokens, ``--questions`` questions about
  each, every prompt the document then the question, in a shuffled order (tools/demo_data.py);
- ``duplicates``: ``--prompts`` rows of which ``--share`` (30%) repeat an earlier row's prompt
  and ``max_tokens`` (as a dataset with repeated questions has them), shuffled;
- ``distinct``: the same number of rows, every prompt different and none sharing a prefix (what
  this costs where it finds nothing: hashing and sorting each row, no holding).

Greedy, ``ignore_eos``; documents 24 tokens a row, the others log-uniform between 4 and 160; draft
model k = 4; ``max_in_flight`` 64. The engine's KV cache is ``--kv-blocks`` blocks of 128 tokens
(64k tokens by default): a scaled-down dataset needs a scaled-down cache, since a real one of
millions of prompts dwarfs any cache and the cache then keeps only what is close together. Prints
the wall time of each run, the median ratio per workload, the prefix-cache hit rates and whether
the texts agree.

Usage: ``python benchmarks/batching.py [--documents 200] [--questions 4] [--prompts 768]
[--share 0.3] [--repeats 3] [--kv-blocks 512]``
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import TINY_DRAFT, TINY_ENGINE, print_report  # noqa: E402


def workload(n: int, share: float, seed: int = 5) -> tuple[list[str], list[int]]:
    """``n`` prompts, ``share`` of them repeats of earlier ones (prompt and length), shuffled."""
    from tiny_models import held_out_snippets

    rng = random.Random(seed)
    distinct = n - round(n * share)
    prompts = held_out_snippets(distinct, seed=seed)
    lengths = [int(math.exp(rng.uniform(math.log(4), math.log(160)))) for _ in range(distinct)]
    rows = list(zip(prompts, lengths, strict=True))
    rows += [rows[rng.randrange(distinct)] for _ in range(n - distinct)]
    rng.shuffle(rows)
    return [p for p, _ in rows], [m for _, m in rows]


#: The two ways each workload runs: the defaults, and everything in this file off.
MODES = {
    "on": {"dedupe_window": 10000, "prefix_window": 1024},
    "off": {"dedupe_window": 0, "prefix_window": 0},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=768)
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.engine.llm import Engine
    from batchspec.run.events import EventLog
    from batchspec.run.job import RunOptions, run_job
    from batchspec.spec.build import build_spec

    work = Path(tempfile.mkdtemp(prefix="batchspec-bench-"))
    base = {
        "name": "bench",
        "model": {"target": str(ROOT / ".models" / "target"), "engine": dict(TINY_ENGINE)},
        "speculative": dict(TINY_DRAFT),
        "sampling": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True},
    }
    from demo_data import document_questions_table

    base["model"]["engine"]["num_gpu_blocks_override"] = args.kv_blocks
    docs = document_questions_table(args.documents, args.questions, seed=11)
    sets = {
        "documents": (docs["prompt"].to_pylist(), docs["max_tokens"].to_pylist()),
        "duplicates": workload(args.prompts, args.share),
        "distinct": workload(args.prompts, 0.0, seed=6),
    }
    specs = {}
    for name, (prompts, lengths) in sets.items():
        (work / name).mkdir()
        pq.write_table(
            pa.table(
                {"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts, "max_tokens": lengths}
            ),
            work / name / "part-0.parquet",
        )
        for mode, windows in MODES.items():
            specs[name, mode] = build_spec(
                {
                    **base,
                    "input": {
                        "path": str(work / name / "*.parquet"),
                        "prompt_column": "prompt",
                        "id_column": "id",
                        "sampling_columns": {"max_tokens": "max_tokens"},
                    },
                    "output": {"path": str(work / f"out-{name}-{mode}")},
                    "execution": {"max_in_flight": 64, **windows},
                }
            )
    engine = Engine(specs["distinct", "off"])
    engine.llm.generate(sets["distinct"][0][:16], use_tqdm=False)  # warm-up

    def one(key) -> dict:
        out = Path(specs[key].output.path)
        shutil.rmtree(out, ignore_errors=True)
        engine.llm.reset_prefix_cache()  # nothing left from the run before
        t0 = time.monotonic()
        result = run_job(
            specs[key],
            RunOptions(
                engine=engine, progress_bars=False, events=EventLog("bench", "json", open("/dev/null", "w"))
            ),
        )
        wall = time.monotonic() - t0
        texts = {
            r["request_id"]: r["generated_text"] for r in pq.read_table(out / "part-0.parquet").to_pylist()
        }
        return {
            "wall_s": round(wall, 3),
            "rows_from_twin": result.summary["totals"]["rows_from_twin"],
            "prefix_cache_hit_rate": (result.summary.get("prefix_cache") or {}).get("hit_rate"),
            "texts": texts,
        }

    report: dict = {
        "documents": args.documents,
        "questions": args.questions,
        "prompts": args.prompts,
        "duplicate_share": args.share,
        "kv_blocks": args.kv_blocks,
        "workloads": {},
    }
    for name in sets:
        runs: dict[str, list] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(one((name, mode)))
        same = runs["on"][-1]["texts"] == runs["off"][-1]["texts"]
        ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["on"], runs["off"], strict=True)]
        report["workloads"][name] = {
            "rows": len(sets[name][0]),
            "wall_s": {m: [r["wall_s"] for r in rs] for m, rs in runs.items()},
            "rows_from_twin": runs["on"][-1]["rows_from_twin"],
            "prefix_cache_hit_rate": {m: rs[-1]["prefix_cache_hit_rate"] for m, rs in runs.items()},
            "median_wall_ratio_on_vs_off": round(statistics.median(ratios), 3),
            "texts_identical": same,
        }
    engine.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
