"""``batchspec distill`` on a domain the tiny draft accepts poorly: JSON records cut off mid-way
(tools/domain_data.py, 2,400 prompts generated deterministically), greedy, k=4.

Runs the real command end to end (sample, the target's continuations, training, evaluation
before and after on the held-out prompts) and times it; the machine's load average is recorded
with the result, since the machine may be shared.

Usage: ``python benchmarks/distill.py [--models .models] [--json bench-results/distill.json]
[--large N]``

``--large N`` then measures what the higher acceptance buys on the large target tier
(``.models/target-large``: the tiny target's function at a ~200M-parameter model's cost): the
starting and the distilled draft, k=4, one request at a time (concurrency 1), on the first N
held-out prompts, output tok/s of each. ``--large-only`` skips the distill run and measures the
draft an earlier run left in ``--work``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import print_report  # noqa: E402


def write_job(
    work: Path, models: Path, target: str, draft: Path, max_tokens: int, max_in_flight: int | None = None
) -> Path:
    """The benchmark's job spec over the domain prompts in ``work/prompts``."""
    import yaml

    spec = {
        "name": "json-domain",
        "input": {"path": str(work / "prompts" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(work / "run-out")},
        "model": {
            "target": str(models / target),
            "engine": {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"},
        },
        "speculative": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
    }
    spec["execution"] = {"dedupe_window": 0}  # every row generated: acceptance of each
    if max_in_flight:
        spec["execution"]["max_in_flight"] = max_in_flight
    path = work / f"job-{target}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def large_tier(job: Path, models: Path, distilled: Path, args: argparse.Namespace) -> dict:
    """Starting vs distilled draft on the large target at concurrency 1 (held-out prompts)."""
    from batchspec.distill.data import draw_sample
    from batchspec.distill.session import evaluate
    from batchspec.spec.load import load_spec

    spec = load_spec(str(job))
    large = dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, target=str(models / "target-large"))
    )
    heldout = draw_sample(spec, args.sample, args.holdout, seed=0).heldout[: args.large]
    before = evaluate(large, str(models / "draft"), heldout, 4, 1)
    after = evaluate(large, str(distilled), heldout, 4, 1)
    keys = ("acceptance_rate", "mean_acceptance_length", "output_tokens_per_s", "output_tokens")
    return {
        "target": "target-large",
        "concurrency": 1,
        "prompts": len(heldout),
        "before": {k: before[k] for k in keys},
        "after": {k: after[k] for k in keys},
        "speedup": round(after["output_tokens_per_s"] / before["output_tokens_per_s"], 3),
    }


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
    parser.add_argument(
        "--large",
        type=int,
        default=0,
        metavar="N",
        help="then measure both drafts on target-large at concurrency 1 (N prompts)",
    )
    parser.add_argument(
        "--large-only",
        action="store_true",
        help="measure on target-large only, with the draft an earlier run left in --work",
    )
    args = parser.parse_args()
    from domain_data import write_shards

    work = args.work.resolve()
    if args.large_only:
        job, out = work / "job-target.yaml", work / "draft-json"
        result = large_tier(job, args.models.resolve(), out, args)
        print(json.dumps(result, indent=2))
        return 0
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: nothing reused from an earlier one
    write_shards(work / "prompts", rows=args.rows, shards=4, seed=0)
    job = write_job(work, args.models, "target", args.models / "draft", args.max_tokens)
    out = work / "draft-json"
    exe = Path(sys.executable).with_name("batchspec")
    command = [
        str(exe),
        "distill",
        str(job),
        "--draft",
        str(args.models / "draft"),
        "--out",
        str(out),
        "--sample",
        str(args.sample),
        "--holdout",
        str(args.holdout),
        "--steps",
        str(args.steps),
        "--logprobs",
        str(args.logprobs),
        "--json",
    ]
    print("$ " + " ".join(command), flush=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    sys.stderr.write(done.stderr)
    if done.returncode not in (0, 4):  # 4: measured, and not installed (no gain past the noise)
        return done.returncode
    measured = json.loads(done.stdout)
    result = {
        "rows": args.rows,
        "sample": args.sample,
        "holdout": args.holdout,
        "steps": args.steps,
        "logprobs": args.logprobs,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": 4,
        "wall_s": round(wall, 1),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "before": measured["before"],
        "after": measured["after"],
        "gain": round(measured["after"]["acceptance_rate"] - measured["before"]["acceptance_rate"], 4),
        "decision": measured.get("decision"),
    }
    if args.large and done.returncode == 0:  # a draft was installed to measure there
        result["large_tier"] = large_tier(job, args.models.resolve(), out, args)
    print_report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
