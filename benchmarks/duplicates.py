"""Identical requests generated once (``execution.dedupe_window``) against every row generated.

Two workloads, each run by ``run_job`` on one engine (started once; start-up excluded), with
duplicates served from a twin (the default) and with ``dedupe_window: 0``, alternating A B A B so
that drift hits both alike:

- ``duplicates``: ``--prompts`` rows of which ``--share`` (30%) repeat an earlier row's prompt
  and ``max_tokens`` (as a dataset with repeated questions has them), shuffled;
- ``distinct``: the same number of rows, every prompt different (what dedupe costs where it
  finds nothing: hashing each row's request).

Greedy, per-row ``max_tokens`` log-uniform between 4 and 160 with ``ignore_eos``, draft model
k = 4. Prints the wall time of each run, the median ratio per workload and the texts' agreement.

Usage: ``python benchmarks/duplicates.py [--prompts 384] [--share 0.3] [--repeats 3]``
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.engine.llm import Engine
    from batchspec.run.events import EventLog
    from batchspec.run.job import run_job
    from batchspec.spec.build import build_spec

    work = Path(tempfile.mkdtemp(prefix="batchspec-bench-"))
    base = {
        "name": "bench",
        "model": {"target": str(ROOT / ".models" / "target"), "engine": dict(TINY_ENGINE)},
        "speculative": dict(TINY_DRAFT),
        "sampling": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True},
    }
    sets = {"duplicates": workload(args.prompts, args.share),
            "distinct": workload(args.prompts, 0.0, seed=6)}
    specs = {}
    for name, (prompts, lengths) in sets.items():
        (work / name).mkdir()
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts,
                                 "max_tokens": lengths}), work / name / "part-0.parquet")
        for mode, window in (("dedupe", 10000), ("every", 0)):
            specs[name, mode] = build_spec({
                **base,
                "input": {"path": str(work / name / "*.parquet"), "prompt_column": "prompt",
                          "id_column": "id", "sampling_columns": {"max_tokens": "max_tokens"}},
                "output": {"path": str(work / f"out-{name}-{mode}")},
                "execution": {"max_in_flight": 256, "dedupe_window": window}})
    engine = Engine(specs["distinct", "every"])
    engine.llm.generate(sets["distinct"][0][:16], use_tqdm=False)  # warm-up

    def one(key) -> dict:
        out = Path(specs[key].output.path)
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.monotonic()
        result = run_job(specs[key], engine=engine, progress_bars=False,
                         events=EventLog("bench", "json", open("/dev/null", "w")))
        wall = time.monotonic() - t0
        texts = {r["request_id"]: r["generated_text"]
                 for r in pq.read_table(out / "part-0.parquet").to_pylist()}
        return {"wall_s": round(wall, 3), "rows_from_twin": result.summary["totals"]["rows_from_twin"],
                "texts": texts}

    report: dict = {"prompts": args.prompts, "duplicate_share": args.share, "workloads": {}}
    for name in sets:
        runs = {"dedupe": [], "every": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(one((name, mode)))
        same = runs["dedupe"][-1]["texts"] == runs["every"][-1]["texts"]
        ratios = [d["wall_s"] / e["wall_s"] for d, e in zip(runs["dedupe"], runs["every"],
                                                           strict=True)]
        report["workloads"][name] = {
            "wall_s": {m: [r["wall_s"] for r in rs] for m, rs in runs.items()},
            "rows_from_twin": runs["dedupe"][-1]["rows_from_twin"],
            "median_wall_ratio_dedupe_vs_every": round(statistics.median(ratios), 3),
            "texts_identical": same,
        }
    engine.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
