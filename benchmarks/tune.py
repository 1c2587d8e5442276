"""`batchspec tune` on the large tier, then the job it wrote against "always off" and "always the
job's k=4", each run with `batchspec run` at every concurrency.

The job: `.models/target-large` with the 1-layer draft at k=4 (the job's own choice), greedy, 48
tokens per request (``ignore_eos``), fp32, enforce_eager, on held-out prompts (`tools/`). Steps:

1. ``batchspec tune JOB --concurrency 1,16,64 --draft .models/draft-large --json --write
   tuned.yaml``: its JSON (predicted beside measured, recommendations, noise) is kept.
2. For each concurrency c: ``batchspec run`` of the tuned job, of the job with speculation off and
   of the job as given (k=4), each with ``max_num_seqs`` and ``execution.max_in_flight`` = c, on
   the same prompts (8 requests at c = 1, 64 otherwise); output tok/s from the run summary
   (output tokens / wall time of generation, start-up excluded).

Every command is one process with one engine, one after another. Usage:
``python benchmarks/tune.py [--models .models] [--concurrency 1 16 64] [--json FILE]``
(prints Markdown tables). ``--quick`` measures fewer candidates (k 2,4; no n-gram; one draft).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
EXE = Path(sys.executable).with_name("batchspec")


def write_inputs(root: Path, prompts: int) -> tuple[Path, Path]:
    """Two inputs: the tune sample's source, and the rows the comparison runs send."""
    from tiny_models import held_out_snippets

    tune_in, run_in = root / "tune-in", root / "run-in"
    for folder, n, seed in ((tune_in, 128, 777), (run_in, prompts, 12345)):
        folder.mkdir(parents=True)
        texts = held_out_snippets(n, seed=seed)
        pq.write_table(
            pa.table({"id": [f"r{i}" for i in range(n)], "prompt": texts}), folder / "prompts.parquet"
        )
    return tune_in, run_in


def job_spec(models: Path, inputs: Path, out: Path, max_tokens: int) -> dict:
    return {
        "name": "tune-bench",
        "input": {"path": str(inputs / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out)},
        "model": {
            "target": str(models / "target-large"),
            "engine": {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"},
        },
        "speculative": {"method": "draft_model", "model": str(models / "draft"), "num_speculative_tokens": 4},
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
    }


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run([str(EXE), *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"batchspec {' '.join(args[:2])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def run_tok_s(job: Path, out: Path, concurrency: int, rows_dir: Path) -> dict:
    """One `batchspec run` at a concurrency; output tok/s from its summary."""
    cli(
        "run",
        str(job),
        "--overwrite",
        "--no-progress",
        "--set",
        f"model.engine.max_num_seqs={concurrency}",
        "--set",
        f"execution.max_in_flight={concurrency}",
        "--set",
        "execution.dedupe_window=0",  # every row generated, as tune measured them
        "--set",
        f"input.path={rows_dir}/*.parquet",
        "--set",
        f"output.path={out}",
    )
    runs = sorted((out / "_batchspec" / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(runs[-1].read_text())
    totals = summary["totals"]
    wall = totals.get("generation_wall_s") or totals["wall_s"]  # start-up excluded where recorded
    return {
        "output_tokens": totals["output_tokens"],
        "wall_s": wall,
        "tokens_per_s": round(totals["output_tokens"] / wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="k 2,4, no n-gram, one draft")
    parser.add_argument(
        "--predictions",
        action="store_true",
        help="tune only, the job's draft at k 1..6 (k=1, 3 and 6 fitted, k=2, 4 "
        "and 5 predicted, then measured): how far predictions are from runs",
    )
    parser.add_argument("--target", default="target-large", help="target-large or target")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    for name in ("target-large", "draft", "draft-large"):
        if not (args.models / name / ".batchspec-complete").exists():
            print(f"{args.models / name} is not built: run `make models`", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="batchspec-tune-bench-") as tmp:
        root = Path(tmp)
        tune_in, _ = write_inputs(root, 64)
        job = root / "job.yaml"
        raw = job_spec(args.models, tune_in, root / "out", args.max_tokens)
        raw["model"]["target"] = str(args.models / args.target)
        job.write_text(yaml.safe_dump(raw, sort_keys=False))
        levels = ",".join(map(str, args.concurrency))
        tune_args = [
            "tune",
            str(job),
            "--concurrency",
            levels,
            "--sample",
            "64",
            "--json",
            "--write",
            str(root / "tuned.yaml"),
            "--no-batch-knobs",  # the drafters, as recorded; the knobs: benchmarks/batch_knobs.py
        ]
        if args.predictions:
            tune_args += ["--k", "1,2,3,4,5,6", "--no-ngram", "--top", "3"]
        else:
            tune_args += (
                ["--k", "2,4", "--no-ngram", "--top", "1"]
                if args.quick
                else ["--draft", str(args.models / "draft-large")]
            )
        print("$ batchspec " + " ".join(tune_args), file=sys.stderr, flush=True)
        tuned = json.loads(cli(*tune_args).stdout)
        print(f"tune: {tuned['wall_s']} s; recommended {tuned['recommended']}", file=sys.stderr)
        if args.predictions:
            errors = [
                c["prediction_error"]
                for c in tuned["candidates"]
                if c.get("prediction_error") is not None and not c.get("calibration")
            ]
            print(markdown(tuned, [], None).split("\n\nWritten")[0])
            print(
                f"\nprediction error of the predicted k: worst {max(errors) * 100:.1f}%, "
                f"mean {sum(errors) / len(errors) * 100:.1f}% over {len(errors)}"
            )
            if args.json:
                args.json.write_text(json.dumps({"tune": tuned}, indent=2))
            return 0
        off = job_spec(args.models, tune_in, root / "out", args.max_tokens)
        off["speculative"] = None
        (root / "off.yaml").write_text(yaml.safe_dump(off, sort_keys=False))
        comparisons = []
        for c in args.concurrency:
            rows_dir = root / f"rows-{c}"
            rows_dir.mkdir()
            from tiny_models import held_out_snippets

            n = 8 if c == 1 else 64
            pq.write_table(
                pa.table({"id": [f"q{i}" for i in range(n)], "prompt": held_out_snippets(n, seed=12345)}),
                rows_dir / "prompts.parquet",
            )
            row = {"concurrency": c}
            for name, spec_file in (
                ("off", root / "off.yaml"),
                ("given k=4", job),
                ("tuned", root / "tuned.yaml"),
            ):
                row[name] = run_tok_s(spec_file, root / f"out-{name.split()[0]}-{c}", c, rows_dir)
                print(f"run c={c} {name}: {row[name]['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
            comparisons.append(row)
        written = yaml.safe_load((root / "tuned.yaml").read_text())
    print(markdown(tuned, comparisons, written.get("speculative")))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"tune": tuned, "runs": comparisons, "tuned_speculative": written.get("speculative")},
                indent=2,
            )
        )
    return 0


def markdown(tuned: dict, runs: list[dict], section: dict | None) -> str:
    """Tune's candidates (measured and predicted) and the three jobs run at each concurrency."""
    lines = [
        "| concurrency | candidate | tok/s | predicted | error | acceptance | tokens/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in tuned["candidates"]:
        if c["output_tokens_per_s"] is None:
            continue
        star = " (recommended)" if tuned["recommended"].get(str(c["concurrency"])) == c["label"] else ""
        err = c.get("prediction_error")
        lines.append(
            f"| {c['concurrency']} | {c['label']}{star} | {c['output_tokens_per_s']} | "
            f"{c['predicted_output_tokens_per_s'] or ''}"
            f"{' (fit)' if c.get('calibration') else ''} | "
            f"{'' if err is None else f'{err * 100:.0f}%'} | {c['acceptance_rate'] or ''} | "
            f"{c['mean_acceptance_length'] or ''} |"
        )
    lines += [
        "",
        f"Written speculative section: `{json.dumps(section)}`",
        "",
        "| concurrency | off tok/s | given k=4 tok/s | tuned tok/s | tuned vs off | tuned vs k=4 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        off, given, tuned_r = (r[k]["tokens_per_s"] for k in ("off", "given k=4", "tuned"))
        lines.append(
            f"| {r['concurrency']} | {off} | {given} | {tuned_r} | {tuned_r / off:.2f}x | "
            f"{tuned_r / given:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
