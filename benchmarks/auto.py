"""``speculative: auto`` against always off and a fixed draft at k = 4, at 1, 16 and 64 in flight,
on both model tiers.

For each tier (tiny: ``.models/target``; large: ``.models/target-large``, 205M parameters; the
1-layer ``.models/draft`` for both), one job over the same prompts (greedy, 32 tokens a row with
``ignore_eos``, ``max_num_seqs`` 64) is run three ways at each concurrency (``max_in_flight`` 1, 16,
64; 12, 64 and 192 rows):

- ``off``: ``speculative: null``;
- ``k4``: the draft at ``num_speculative_tokens: 4``;
- ``auto``: ``speculative: {method: auto, drafts: [draft], k: [1, 2, 3, 4], ngram: false,
  concurrency: [LEVEL]}``: the job at each level measures at that level (tune's machinery on 64
  sampled rows, the time reported as ``measuring_s``), stores its choice and runs with it.

``off`` and ``k4`` start one engine each and run the three levels on it; each ``auto`` run starts
its own after measuring (start-up and measuring excluded from the figure compared: the generation
rate of the run summary, output tokens over the generation wall time). ``auto`` should never be
below the better of ``off`` and ``k4`` beyond the noise tune measured (the record's threshold).
Also printed: what auto chose, its measuring time, and its predicted rate and generation time
(from the record) against the real ones.

Usage: ``python benchmarks/auto.py [--tiers tiny,large] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import TINY_ENGINE, print_report  # noqa: E402

LEVELS = {1: 12, 16: 64, 64: 192}  # in flight -> rows run at that level
TOKENS = 32
TIERS = {"tiny": "target", "large": "target-large"}


def job(tier: str, work: Path, level: int, speculative, name: str) -> dict:
    return {
        "name": f"auto-bench-{tier}",
        "input": {"path": str(work / f"in-{level}" / "*.parquet"), "prompt_column": "prompt",
                  "id_column": "id"},
        "output": {"path": str(work / f"out-{name}")},
        "model": {"target": str(ROOT / ".models" / TIERS[tier]),
                  "engine": {**TINY_ENGINE, "max_num_seqs": 64}},
        "speculative": speculative,
        "sampling": {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True},
        "execution": {"max_in_flight": level, "dedupe_window": 0, "prefix_window": 0},
    }


def run_tier(tier: str, work: Path) -> dict:
    import pyarrow.parquet as pq
    from demo_data import prompt_table

    from batchspec.engine.llm import Engine
    from batchspec.run.events import EventLog
    from batchspec.run.job import run_job
    from batchspec.spec.build import build_spec

    draft = str(ROOT / ".models" / "draft")
    for level, rows in LEVELS.items():
        (work / f"in-{level}").mkdir(parents=True)
        pq.write_table(prompt_table(rows, seed=900 + level, first_id=0, max_tokens=(TOKENS, TOKENS)),
                       work / f"in-{level}" / "part-0.parquet")
    ways = {
        "off": None,
        "k4": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
        "auto": {"method": "auto", "drafts": [draft], "k": [1, 2, 3, 4], "ngram": False,
                 "sample": 64, "max_minutes": 20},
    }
    out: dict = {"levels": {}}
    for name, speculative in ways.items():
        engine = None
        for level in LEVELS:
            if name == "auto":  # the job's own concurrency, as a job run at that level has it
                speculative = {**speculative, "concurrency": [level]}
            spec = build_spec(job(tier, work, level, speculative, name))
            if name != "auto" and engine is None:
                engine = Engine(spec)
            started = time.monotonic()
            result = run_job(spec, engine=engine, overwrite=True, progress_bars=False,
                             events=EventLog("bench", "json", open("/dev/null", "w")))
            wall = time.monotonic() - started
            totals = result.summary["totals"]
            entry = {"tokens_per_s": totals.get("generation_output_tokens_per_s"),
                     "generation_s": round(totals["output_tokens"]
                                           / totals["generation_output_tokens_per_s"], 2),
                     "run_wall_s": round(wall, 1), "rows": totals["rows"]}
            if name == "auto":
                auto = result.summary["speculative_auto"]
                record = json.loads(Path(auto["record"]).read_text())
                predicted = record["predicted"]["per_level"][str(level)]
                entry.update(chosen=auto["chosen"], reused=auto["reused"],
                             measuring_s=record["measuring_s"],
                             noise_threshold=record["measurements"]["noise"][str(level)]["threshold"],
                             predicted_tokens_per_s=predicted["tokens_per_s"])
            out["levels"].setdefault(str(level), {})[name] = entry
        if engine is not None:
            engine.shutdown()
    for level, by_way in out["levels"].items():
        auto = by_way["auto"]
        best = max(by_way["off"]["tokens_per_s"], by_way["k4"]["tokens_per_s"])
        by_way["auto_vs_best"] = round(auto["tokens_per_s"] / best, 3)
        if auto["predicted_tokens_per_s"]:
            rows = LEVELS[int(level)]
            by_way["auto_predicted"] = {
                "generation_s": round(rows * TOKENS / auto["predicted_tokens_per_s"], 2),
                "error": round(abs(auto["predicted_tokens_per_s"] - auto["tokens_per_s"])
                               / auto["tokens_per_s"], 3)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="tiny,large")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    report = {"tokens_per_row": TOKENS, "rows_per_level": LEVELS, "tiers": {}}
    for tier in args.tiers.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"batchspec-auto-{tier}-"))
        try:
            report["tiers"][tier] = run_tier(tier, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({tier: report["tiers"][tier]}, indent=2), file=sys.stderr, flush=True)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
