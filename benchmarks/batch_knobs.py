"""The batch knobs ``batchspec tune`` chooses against vLLM's defaults, at the job's concurrency.

One job per tier (tiny: ``.models/target``; large: ``.models/target-large``), speculation off,
greedy, ``--max-tokens`` tokens a row with ``ignore_eos``, fp32, enforce_eager, ``max_in_flight``
= ``--concurrency`` and no ``max_num_seqs`` or ``max_num_batched_tokens`` of its own (vLLM's
defaults). Steps, one engine at a time:

1. ``batchspec tune JOB --sample 64 --no-ngram --json --write tuned.yaml``: speculation off, then
   the batch-knob stage; its ``batch_knobs`` (each configuration, the choice) is kept.
2. ``batchspec run`` of the job as given and of the job tune wrote, alternating (given, tuned,
   given, tuned: drift hits both alike), ``--runs`` times each, on ``--rows`` held-out prompts;
   output tok/s from each run summary (generation only: start-up excluded). Where tune kept the
   job's values the two jobs are the same and the ratio shows the noise.

Usage: ``python benchmarks/batch_knobs.py [--tiers tiny,large] [--concurrency 16] [--rows 256]
[--runs 2] [--max-tokens 32] [--json FILE]`` (prints the figures as JSON).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import print_report  # noqa: E402
from tune import cli  # noqa: E402

TIERS = {"tiny": "target", "large": "target-large"}


def job_spec(target: Path, inputs: Path, out: Path, concurrency: int, max_tokens: int) -> dict:
    return {
        "name": "batch-knobs-bench",
        "input": {"path": str(inputs / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out)},
        "model": {
            "target": str(target),
            "engine": {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"},
        },
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        "execution": {"max_in_flight": concurrency, "dedupe_window": 0, "prefix_window": 0},
    }


def write_rows(folder: Path, n: int, seed: int) -> None:
    from tiny_models import held_out_snippets

    folder.mkdir(parents=True)
    texts = held_out_snippets(n, seed=seed)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "prompt": texts}), folder / "prompts.parquet")


def run_tok_s(job: Path, rows: Path, out: Path) -> float:
    """One ``batchspec run`` of ``job`` on ``rows``: its generation tok/s."""
    cli("run", str(job), "--overwrite", "--no-progress", "--set", f"input.path={rows}/*.parquet",
        "--set", f"output.path={out}")  # fmt: skip
    summary = json.loads(
        max((out / "_batchspec" / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text()
    )
    totals = summary["totals"]
    return round(totals["generation_output_tokens_per_s"], 1)


def run_tier(tier: str, root: Path, args) -> dict:
    target = ROOT / ".models" / TIERS[tier]
    write_rows(root / "tune-in", 128, 777)
    write_rows(root / "run-in", args.rows, 12345)
    job = root / "job.yaml"
    job.write_text(
        yaml.safe_dump(job_spec(target, root / "tune-in", root / "out", args.concurrency, args.max_tokens))
    )
    tune_args = [
        "tune",
        str(job),
        "--sample",
        "64",
        "--no-ngram",
        "--json",
        "--write",
        str(root / "tuned.yaml"),
    ]
    print("$ batchspec " + " ".join(tune_args), file=sys.stderr, flush=True)
    started = time.monotonic()
    tuned = json.loads(cli(*tune_args).stdout)
    tune_s = round(time.monotonic() - started, 1)
    knobs = tuned["batch_knobs"]
    print(f"{tier}: tune {tune_s} s; {knobs['decision']}", file=sys.stderr, flush=True)
    written = yaml.safe_load((root / "tuned.yaml").read_text())
    rates: dict[str, list[float]] = {"given": [], "tuned": []}
    for i in range(args.runs):
        for name, spec in (("given", job), ("tuned", root / "tuned.yaml")):
            rates[name].append(run_tok_s(spec, root / "run-in", root / f"out-{name}-{i}"))
            print(f"{tier} run {i} {name}: {rates[name][-1]} tok/s", file=sys.stderr, flush=True)
    given, tuned_rate = statistics.fmean(rates["given"]), statistics.fmean(rates["tuned"])
    return {
        "concurrency": args.concurrency,
        "tune_s": tune_s,
        "batch_knobs": knobs,
        "written": {
            "model.engine": {k: v for k, v in written["model"]["engine"].items() if k.startswith("max_num")},
            "execution.max_in_flight": written["execution"]["max_in_flight"],
        },
        "runs_tokens_per_s": rates,
        "tuned_vs_given": round(tuned_rate / given, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    report: dict = {"rows": args.rows, "max_tokens": args.max_tokens, "tiers": {}}
    for tier in args.tiers.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"batchspec-knobs-{tier}-"))
        try:
            report["tiers"][tier] = run_tier(tier, root, args)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
