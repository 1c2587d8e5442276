"""``batchspec distill`` on a domain the tiny draft accepts poorly: JSON records cut off mid-way
(tools/domain_data.py, 2,400 prompts generated deterministically), greedy, k=4.

Runs the real command end to end (sample, the target's continuations, training, evaluation
before and after on the held-out prompts) and times it; the machine's load average is recorded
with the result, since the machine may be shared.

Usage: ``python benchmarks/distill.py [--models .models] [--json bench-results/distill.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def write_job(work: Path, models: Path, target: str, draft: Path, max_tokens: int,
              max_in_flight: int | None = None) -> Path:
    """The benchmark's job spec over the domain prompts in ``work/prompts``."""
    import yaml

    spec = {
        "name": "json-domain",
        "input": {"path": str(work / "prompts" / "*.parquet"), "prompt_column": "prompt",
                  "id_column": "id"},
        "output": {"path": str(work / "run-out")},
        "model": {"target": str(models / target),
                  "engine": {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}},
        "speculative": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
    }
    if max_in_flight:
        spec["execution"] = {"max_in_flight": max_in_flight}
    path = work / f"job-{target}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-results" / "distill")
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--sample", type=int, default=1400)
    parser.add_argument("--holdout", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--logprobs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from domain_data import write_shards

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: nothing reused from an earlier one
    write_shards(work / "prompts", rows=args.rows, shards=4, seed=0)
    job = write_job(work, args.models, "target", args.models / "draft", args.max_tokens)
    out = work / "draft-json"
    exe = Path(sys.executable).with_name("batchspec")
    command = [str(exe), "distill", str(job), "--draft", str(args.models / "draft"),
               "--out", str(out), "--sample", str(args.sample), "--holdout", str(args.holdout),
               "--steps", str(args.steps), "--logprobs", str(args.logprobs), "--json"]
    print("$ " + " ".join(command), flush=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    sys.stderr.write(done.stderr)
    if done.returncode:
        return done.returncode
    measured = json.loads(done.stdout)
    result = {
        "rows": args.rows, "sample": args.sample, "holdout": args.holdout, "steps": args.steps,
        "logprobs": args.logprobs, "max_tokens": args.max_tokens, "num_speculative_tokens": 4,
        "wall_s": round(wall, 1), "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "before": measured["before"], "after": measured["after"],
        "gain": round(measured["after"]["acceptance_rate"] - measured["before"]["acceptance_rate"], 4),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
