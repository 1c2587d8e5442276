"""Run every benchmark in turn (one vLLM engine at a time) and write results to bench-results/.

Usage: ``python benchmarks/run_all.py`` (what ``make bench`` runs). BENCHMARKS.md records the
numbers and the commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-results"

STEPS = [
    ["benchmarks/acceptance.py", "--prompts", "200"],
    ["benchmarks/overhead.py", "--json", str(OUT / "overhead.json")],
    ["benchmarks/throughput.py", "--spec", "draft", "--json", str(OUT / "throughput-draft.json")],
    ["benchmarks/throughput.py", "--spec", "off", "--json", str(OUT / "throughput-off.json")],
    ["benchmarks/memory.py", "--json", str(OUT / "memory.json")],
    ["benchmarks/memory.py", "--format", "openai", "--json", str(OUT / "memory-openai.json")],
    ["benchmarks/line_memory.py", "--json", str(OUT / "line-memory.json")],
    ["benchmarks/distill.py", "--json", str(OUT / "distill.json")],
    ["benchmarks/distill_small.py", "--json", str(OUT / "distill-small.json")],
    ["benchmarks/heads.py", "--fresh", "--json", str(OUT / "heads.json")],
    ["benchmarks/head_job.py", "--json", str(OUT / "head-job.json")],
    ["benchmarks/parallel_drafts.py", "--fresh", "--json", str(OUT / "parallel-drafts.json")],
    ["benchmarks/tune.py", "--json", str(OUT / "tune.json")],
    [
        "benchmarks/tune.py",
        "--predictions",
        "--target",
        "target-large",
        "--max-tokens",
        "32",
        "--json",
        str(OUT / "tune-predictions-large.json"),
    ],
    [
        "benchmarks/tune.py",
        "--predictions",
        "--target",
        "target",
        "--max-tokens",
        "32",
        "--json",
        str(OUT / "tune-predictions-tiny.json"),
    ],
    ["benchmarks/step_cost.py", "--json", str(OUT / "step-cost.json")],
    ["benchmarks/step_cost.py", "--kernel", "--json", str(OUT / "step-cost-kernel.json")],
    ["benchmarks/structured.py"],
    ["benchmarks/pooling.py", "--json", str(OUT / "pooling.json")],
    ["benchmarks/images.py", "--json", str(OUT / "images.json")],
    [
        "benchmarks/pooling.py",
        "--orders",
        "--rows",
        "10000",
        "--shards",
        "5",
        "--json",
        str(OUT / "pooling-orders.json"),
    ],
    ["benchmarks/templates.py", "--throughput", "--json", str(OUT / "templates.json")],
    ["benchmarks/feature_costs.py", "--json", str(OUT / "feature-costs.json")],
    [
        "benchmarks/reasoning.py",
        "--prompts",
        "64",
        "--concurrency",
        "1",
        "16",
        "--json",
        str(OUT / "reasoning.json"),
    ],
    ["benchmarks/tables.py", "io", "--mb", "1024", "--files", "16", "--json", str(OUT / "tables-io.json")],
    ["benchmarks/tables.py", "plan", "--files", "1000", "--json", str(OUT / "tables-plan.json")],
    ["benchmarks/batching.py", "--json", str(OUT / "batching.json")],
    ["benchmarks/auto.py", "--json", str(OUT / "auto.json")],
    ["benchmarks/batch_knobs.py", "--json", str(OUT / "batch-knobs.json")],
    ["benchmarks/supervision.py", "--json", str(OUT / "supervision.json")],
]


def main() -> int:
    OUT.mkdir(exist_ok=True)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CPU_KVCACHE_SPACE": "2"}
    for step in STEPS:
        print(f"$ python {' '.join(step)}", flush=True)
        done = subprocess.run([sys.executable, *step], cwd=ROOT, env=env)
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
