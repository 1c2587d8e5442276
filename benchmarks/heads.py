"""EAGLE-3 heads against the draft model, on the large tier, on prompts no drafter was trained on.

The domain is JSON records cut off mid-way (tools/domain_data.py), which neither the tiny draft
nor the generic head (`make models`, trained on code) saw. Two prompt sets: one the job-trained
drafters learn from, one they never see, which every candidate is measured on.

1. the draft model distilled on the training set (``batchspec distill --draft .models/draft``);
2. a head trained on the same set (``batchspec distill --method eagle3``, from scratch), on the
   tiny target, then grown for ``target-large`` as ``make models`` grows its head
   (``tools/grow_head.py``: the same function on the grown target's states);
3. an untrained head for ``target-large`` (what distill starts from: the target's output layer,
   the rest random);
4. ``batchspec tune`` on the hidden set, ``target-large``, greedy, ``--max-tokens`` tokens, at 1,
   16 and 64 in flight: speculation off and the four drafters (the distilled draft, the random
   head, `make models`' head-large, the job-trained head) at k 3 (the draft steps the heads are
   trained to; ``--k 2,3,4`` measures more, at about 4 minutes an engine here): output tok/s,
   acceptance per position and mean acceptance length of each, tune's recommendation (what
   ``speculative: auto`` with these drafters would run) and its noise.

Usage: ``python benchmarks/heads.py [--models .models] [--work bench-results/heads]
[--json bench-results/heads.json]``. Drafters built by an earlier run in ``--work`` are reused
(``--fresh`` builds them again)."""

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
sys.path.insert(0, str(ROOT))

from common import print_report  # noqa: E402

ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}


def write_job(work: Path, name: str, prompts: Path, target: Path, max_tokens: int) -> Path:
    import yaml

    spec = {
        "name": name,
        "input": {"path": str(prompts / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(work / f"{name}-out")},
        "model": {"target": str(target), "engine": dict(ENGINE)},
        "speculative": None,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
        "execution": {"dedupe_window": 0},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def batchspec(*args: str) -> dict:
    exe = Path(sys.executable).with_name("batchspec")
    command = [str(exe), *args]
    print("$ " + " ".join(command), flush=True)
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode not in (0, 4):
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{args[0]} exited {proc.returncode}")
    out = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    out["_wall_s"] = round(time.monotonic() - started, 1)
    return out


def random_head(models: Path, out: Path) -> None:
    from batchspec.distill import eagle3

    target = str(models / "target-large")
    config = eagle3.head_config(eagle3.target_config(target), [1, 2, 3], k=3)
    eagle3.save_head(eagle3.new_head(target, config, seed=0), out)


def level_rows(tune: dict, labels: dict[str, str]) -> list[dict]:
    """One row per (level, candidate): tok/s, acceptance per position, mean acceptance length."""
    rows = []
    for entry in tune["candidates"]:
        family = entry["label"].rsplit(" k=", 1)[0]
        name = labels.get(family, family)
        rows.append(
            {
                "concurrency": entry["concurrency"],
                "candidate": name,
                "label": entry["label"],
                "k": entry["speculative"]["num_speculative_tokens"] if entry["speculative"] else 0,
                "output_tokens_per_s": entry["output_tokens_per_s"],
                "predicted_output_tokens_per_s": entry["predicted_output_tokens_per_s"],
                "acceptance_rate": entry["acceptance_rate"],
                "mean_acceptance_length": entry["mean_acceptance_length"],
                "acceptance_per_position": entry["acceptance_per_position"],
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """The table BENCHMARKS.md shows: per level and candidate, tok/s (and against off), mean
    acceptance length, acceptance per position, and the time of one step per sequence."""
    off = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["candidate"] == "off"}
    lines = [
        "| in flight | candidate | k | output tok/s | vs off | mean acceptance length | "
        "accepted at positions 1..k | ms per step per sequence |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["candidate"] != "off", r["candidate"])):
        tps, c = r["output_tokens_per_s"], r["concurrency"]
        if tps is None:
            continue
        length = r["mean_acceptance_length"] or 1.0
        step_ms = 1000.0 * c * length / tps  # tokens per step per sequence / its tok/s
        ratio = f"{tps / off[c]:.2f}x" if off.get(c) else "-"
        per_pos = ", ".join(f"{p:.2f}" for p in r["acceptance_per_position"] or ()) or "-"
        lines.append(
            f"| {c} | {r['candidate']} | {r['k']} | {tps:.1f} | {ratio} | {length:.2f} | {per_pos} "
            f"| {step_ms:.0f} |"
        )
    return "\n".join(lines)


def large_tier_arguments(doc: str, work: str, train_rows: int, concurrency: str, sample: int):
    """The options of a benchmark that trains drafters on one prompt set with the tiny target and
    measures them with ``target-large`` on another (this one and benchmarks/parallel_drafts.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-results" / work)
    parser.add_argument("--train-rows", type=int, default=train_rows)
    parser.add_argument("--hidden-rows", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--concurrency", default=concurrency)
    parser.add_argument("--k", default="3")
    parser.add_argument("--sample", type=int, default=sample)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def large_tier_jobs(args, seeds: tuple[int, int]) -> tuple[Path, Path, Path, Path]:
    """(models, work, the training job on the tiny target, the hidden job on ``target-large``):
    JSON-record prompts (tools/domain_data.py) written once into the work folder (``--fresh``:
    again), with ``seeds`` for the two sets."""
    from domain_data import write_shards

    models, work = args.models.resolve(), args.work.resolve()
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "train").exists():
        write_shards(work / "train", rows=args.train_rows, shards=2, seed=seeds[0])
        write_shards(work / "hidden", rows=args.hidden_rows, shards=1, seed=seeds[1])
    train = write_job(work, "train", work / "train", models / "target", args.max_tokens)
    hidden = write_job(work, "hidden", work / "hidden", models / "target-large", args.max_tokens)
    return models, work, train, hidden


def tune_drafts(hidden: Path, args, drafts: list[Path], labels: dict[str, str]) -> dict:
    """``batchspec tune`` of the hidden job with these drafters (no n-gram, no batch knobs) at the
    options' concurrency, k and sample: what it recommends, its noise and losslessness, and a row per
    level and candidate (:func:`level_rows`)."""
    tune = batchspec(
        "tune",
        str(hidden),
        "--concurrency",
        args.concurrency,
        "--k",
        args.k,
        "--no-ngram",
        "--no-batch-knobs",  # the drafters are compared, not the batch knobs
        "--sample",
        str(args.sample),
        *(arg for path in drafts for arg in ("--draft", str(path))),
        "--json",
    )
    return {
        "recommended": tune.get("recommended"),
        "noise": tune.get("noise"),
        "lossless": tune.get("lossless"),
        "wall_s": tune.get("wall_s"),
        "rows": level_rows(tune, labels),
    }


def main() -> int:
    args = large_tier_arguments(__doc__, "heads", train_rows=600, concurrency="1,16,64", sample=32)
    models, work, train, hidden = large_tier_jobs(args, seeds=(11, 12))
    report: dict = {"domain": "JSON records (tools/domain_data.py)", "max_tokens": args.max_tokens}
    common = [
        "--sample",
        str(args.train_rows),
        "--holdout",
        "60",
        "--steps",
        str(args.steps),
        "--k",
        "3",
        "--json",
    ]

    draft = work / "draft-json"
    if not (draft / "batchspec-model.json").exists():
        report["distill_draft"] = batchspec(
            "distill",
            str(train),
            "--draft",
            str(models / "draft"),
            "--out",
            str(draft),
            "--logprobs",
            "8",
            "--force",
            *common,
        )
    small_head = work / "head-json-tiny"
    if not (small_head / "batchspec-model.json").exists():
        report["distill_head"] = batchspec(
            "distill", str(train), "--method", "eagle3", "--out", str(small_head), *common
        )
    head = work / "head-json"
    if not (head / "batchspec-model.json").exists():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "tools" / "grow_head.py"),
                "--head",
                str(small_head),
                "--target",
                str(models / "target-large"),
                "--out",
                str(head),
            ],
            check=True,
        )
    untrained = work / "head-random"
    if not (untrained / "config.json").exists():
        random_head(models, untrained)

    labels = {
        "draft-json": "distilled draft (1 layer)",
        "eagle3:head-random": "untrained head",
        "eagle3:head-large": "make models head (code)",
        "eagle3:head-json": "job-trained head",
        "off": "off",
    }
    report["tune"] = tune_drafts(hidden, args, [draft, untrained, models / "head-large", head], labels)
    report["load_average"] = os.getloadavg()
    print_report(report, args.json)
    print(markdown(report["tune"]["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
