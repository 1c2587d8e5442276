"""``batchspec distill`` on small jobs, as a user runs it: two domains the tiny draft accepts
poorly (tools/domain_data.py: ``json`` records and service ``logs``), jobs of 200, 400 and 1,000
prompts, greedy, the job's ``max_tokens`` 32, k = 4, and distill's defaults (no option but
``--draft`` and ``--out``). Each run is the real command end to end: the sample (the whole job),
the held-out share, the target's continuations, training, the evaluation of the starting and
the new draft on the held-out prompts with vLLM, and the install decision.

Usage: ``python benchmarks/distill_small.py [--domains json logs] [--sizes 200 400 1000]
[--models .models] [--json bench-results/distill_small.json] [--logprobs K]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import print_report  # noqa: E402
from distill import write_job  # noqa: E402

MAX_TOKENS = 32


def one_job(domain: str, size: int, args: argparse.Namespace) -> dict:
    """Distill with its defaults on a job of ``size`` prompts of ``domain``."""
    from domain_data import write_shards

    work = (args.work / f"{domain}-{size}").resolve()
    shutil.rmtree(work, ignore_errors=True)
    write_shards(work / "prompts", rows=size, shards=2, seed=0, domain=domain)
    job = write_job(work, args.models.resolve(), "target", args.models.resolve() / "draft", MAX_TOKENS)
    command = [
        str(Path(sys.executable).with_name("batchspec")),
        "distill",
        str(job),
        "--draft",
        str(args.models.resolve() / "draft"),
        "--out",
        str(work / "draft"),
        "--json",
    ]
    if args.logprobs:
        command += ["--logprobs", str(args.logprobs)]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    if done.returncode not in (0, 4):  # 4: measured, and not installed (no gain past the noise)
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"distill on {domain}-{size} exited {done.returncode}")
    measured = json.loads(done.stdout)
    said = [
        line for line in done.stderr.splitlines() if "target tokens to train on" in line or "sample:" in line
    ]
    before, after, decision = measured["before"], measured["after"], measured["decision"]
    return {
        "domain": domain,
        "job_prompts": size,
        "heldout_prompts": decision["prompts"],
        "before": before["acceptance_rate"],
        "after": after["acceptance_rate"],
        "gain": round(after["acceptance_rate"] - before["acceptance_rate"], 4),
        "margin": decision["margin"],
        "installed": decision["install"],
        "wall_s": round(wall, 1),
        "said": [line.split("distill: ", 1)[-1] for line in said],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-results" / "distill-small")
    parser.add_argument("--domains", nargs="+", default=["json", "logs"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[200, 400, 1000])
    parser.add_argument("--logprobs", type=int, default=0, help="distill's --logprobs (default: its own, 0)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = [one_job(domain, size, args) for domain in args.domains for size in args.sizes]
    print_report({"max_tokens": MAX_TOKENS, "num_speculative_tokens": 4, "runs": runs}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
