"""``speculative: auto`` against always off and a fixed draft at k = 4, at 1, 16 and 64 in flight,
on both model tiers.

For each tier (tiny: ``.models/target``; large: ``.models/target-large``, 205M parameters; the
1-layer ``.models/draft`` for both), one job over the same prompts (greedy, 32 tokens a row with
``ignore_eos``, ``max_num_seqs`` 64) is run three ways at each concurrency (``max_in_flight`` 1, 16,
64; tiny: 32, 256 and 768 rows; large: 12, 64 and 128):

- ``off``: ``speculative: null``;
- ``k4``: the draft at ``num_speculative_tokens: 4``;
- ``auto``: ``speculative: {method: auto, drafts: [draft], k: [1, 2, 3, 4], ngram: false,
  concurrency: [LEVEL]}``: the job at each level measures at that level (tune's machinery on 64
  sampled rows, the time reported as ``measuring_s``), stores its choice and runs with it.

Every way is timed alike at every level: a fresh engine for what it runs (for ``auto``, the choice
its first run made and stored), a warm-up, then the job (``auto`` reusing its choice, so nothing is
measured in the timed run). Compared: the generation rate of the run summary (output tokens over
the generation wall time; start-up excluded). ``auto`` should never be
below the better of ``off`` and ``k4`` beyond the noise tune measured (the record's threshold).
Also printed: what auto chose, its measuring time, and its predicted rate and generation time
(from the record) against the real ones.

Usage: ``python benchmarks/auto.py [--tiers tiny,large] [--json FILE]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import TINY_ENGINE, print_report  # noqa: E402

#: tier -> in flight -> rows run at that level (the large target is 20 times slower)
LEVELS = {"tiny": {1: 32, 16: 256, 64: 768}, "large": {1: 12, 16: 64, 64: 128}}
TOKENS = 32
TIERS = {"tiny": "target", "large": "target-large"}


def job(tier: str, work: Path, level: int, speculative, name: str) -> dict:
    return {
        "name": f"auto-bench-{tier}",
        "input": {
            "path": str(work / f"in-{level}" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
        },
        "output": {"path": str(work / f"out-{name}")},
        "model": {
            "target": str(ROOT / ".models" / TIERS[tier]),
            "engine": {**TINY_ENGINE, "max_num_seqs": 64},
        },
        "speculative": speculative,
        "sampling": {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True},
        "execution": {"max_in_flight": level, "dedupe_window": 0, "prefix_window": 0},
    }


def quiet():
    from batchspec.run.events import EventLog

    return EventLog("bench", "json", open(os.devnull, "w"))


def run_tier(tier: str, work: Path) -> dict:
    import pyarrow.parquet as pq
    from demo_data import prompt_table
    from vllm import SamplingParams

    from batchspec.engine.llm import Engine
    from batchspec.run.job import RunOptions, run_job
    from batchspec.spec.build import build_spec

    levels = LEVELS[tier]
    draft = str(ROOT / ".models" / "draft")
    warm = prompt_table(8, seed=77)["prompt"].to_pylist()
    for level, rows in levels.items():
        (work / f"in-{level}").mkdir(parents=True)
        pq.write_table(
            prompt_table(rows, seed=900 + level, first_id=0, max_tokens=(TOKENS, TOKENS)),
            work / f"in-{level}" / "part-0.parquet",
        )
    ways = {
        "off": None,
        "k4": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
        "auto": {
            "method": "auto",
            "drafts": [draft],
            "k": [1, 2, 3, 4],
            "ngram": False,
            "sample": 64,
            "max_minutes": 20,
            # the drafter alone, as the figures recorded: the batch knobs are benchmarks/batch_knobs.py's
            "batch_knobs": False,
        },
    }
    out: dict = {"levels": {}}
    for level in levels:
        for name, speculative in ways.items():
            if name == "auto":  # the job's own concurrency, as a job run at that level has it
                speculative = {**speculative, "concurrency": [level]}
            spec = build_spec(job(tier, work, level, speculative, name))
            entry: dict = {}
            runs = spec
            if name == "auto":  # the first run measures and chooses (its own engines)
                first = run_job(spec, RunOptions(progress_bars=False, events=quiet()))
                auto = first.summary["speculative_auto"]
                record = json.loads(Path(auto["record"]).read_text())
                entry.update(
                    chosen=auto["chosen"],
                    measuring_s=record["measuring_s"],
                    noise_threshold=record["measurements"]["noise"][str(level)]["threshold"],
                    predicted_tokens_per_s=record["predicted"]["per_level"][str(level)]["tokens_per_s"],
                )
                runs = dataclasses.replace(spec, speculative=auto["speculative"])
            # every way timed alike: a fresh engine, warmed up, then the job (auto reusing its
            # stored choice, so nothing is measured in this run)
            engine = Engine(runs)
            engine.llm.generate(warm, SamplingParams(max_tokens=8), use_tqdm=False)
            result = run_job(
                spec, RunOptions(engine=engine, overwrite=True, progress_bars=False, events=quiet())
            )
            engine.shutdown()
            totals = result.summary["totals"]
            entry.update(
                tokens_per_s=round(totals["generation_output_tokens_per_s"], 1),
                generation_s=round(totals["output_tokens"] / totals["generation_output_tokens_per_s"], 2),
                rows=totals["rows"],
            )
            if name == "auto":
                assert result.summary["speculative_auto"]["reused"], "the timed run measured"
            out["levels"].setdefault(str(level), {})[name] = entry
            print(f"{tier} c={level} {name}: {entry}", file=sys.stderr, flush=True)
    for level, by_way in out["levels"].items():
        auto = by_way["auto"]
        best = max(by_way["off"]["tokens_per_s"], by_way["k4"]["tokens_per_s"])
        by_way["auto_vs_best"] = round(auto["tokens_per_s"] / best, 3)
        if auto["predicted_tokens_per_s"]:
            rows = levels[int(level)]
            by_way["auto_predicted"] = {
                "generation_s": round(rows * TOKENS / auto["predicted_tokens_per_s"], 2),
                "error": round(
                    abs(auto["predicted_tokens_per_s"] - auto["tokens_per_s"]) / auto["tokens_per_s"], 3
                ),
            }
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
