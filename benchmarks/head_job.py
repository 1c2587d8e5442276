"""A new EAGLE-3 head and the distilled draft on one fixed small job, with distill's defaults.

The job: 100 code prompts (tools/demo_data.py: standard-library snippets the tiny models never
saw), greedy, ``max_tokens`` 64, k = 3, the tiny target. Two drafters, each by the real command
with its defaults: ``batchspec distill --method eagle3`` (a new head) and ``batchspec distill
--draft .models/draft --force`` (the draft, installed whatever its gate says, so that it is
measured). Each is then measured on 64 other prompts of the same kind, which neither saw: the
mean acceptance length and the acceptance rate greedy speculation reaches with it over all of
them (distill's own evaluation, batchspec.distill.session.evaluate: one engine, 16 in flight).

This is what a change to distill's trainers or to its data sizing does to heads and drafts: run
it before and after (BENCHMARKS.md, "A head on a small job").

Usage: ``python benchmarks/head_job.py [--models .models] [--work bench-results/head-job]
[--json bench-results/head-job.json]``."""

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
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import print_report  # noqa: E402

ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}
MAX_TOKENS, K = 64, 3


def write_job(
    work: Path, name: str, rows: int, seed: int, first_id: int, target: Path, exclude: set[str] = frozenset()
) -> Path:
    """A job over ``rows`` code prompts, none of them one of ``exclude``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from demo_data import prompt_table

    table = prompt_table(rows * 2, seed, first_id=first_id).select(["id", "prompt"])
    keep = [i for i, p in enumerate(table.column("prompt").to_pylist()) if p not in exclude][:rows]
    (work / name).mkdir(parents=True, exist_ok=True)
    pq.write_table(table.take(pa.array(keep, pa.int64())), work / name / "part-00000.parquet")
    spec = {
        "name": name,
        "input": {"path": str(work / name / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(work / f"{name}-out")},
        "model": {"target": str(target), "engine": dict(ENGINE)},
        "speculative": {
            "method": "draft_model",
            "model": str(target.parent / "draft"),
            "num_speculative_tokens": K,
        },
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        "execution": {"dedupe_window": 0},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def distill(job: Path, out: Path, *args: str) -> dict:
    command = [
        str(Path(sys.executable).with_name("batchspec")),
        "distill",
        str(job),
        "--out",
        str(out),
        *args,
        "--json",
    ]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"distill exited {done.returncode}")
    said = [
        line.split("distill: ", 1)[-1]
        for line in done.stderr.splitlines()
        if "data:" in line or "train step" in line
    ]
    return {"wall_s": round(time.monotonic() - started, 1), "said": said[:1] + said[-1:]}


def measure(hidden: Path, method: str, model: Path) -> dict:
    from batchspec.distill.data import draw_sample
    from batchspec.distill.session import evaluate
    from batchspec.spec.load import load_spec

    spec = load_spec(hidden)
    rows = draw_sample(spec, 10_000, 0, seed=0).train
    result = evaluate(spec, str(model), rows, K, 16, method=method)
    return {
        k: result[k]
        for k in ("prompts", "mean_acceptance_length", "acceptance_rate", "acceptance_per_position")
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-results" / "head-job")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    models, work = args.models.resolve(), args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = write_job(work, "train", 100, seed=101, first_id=0, target=models / "target")
    import pyarrow.parquet as pq

    seen = set(pq.read_table(work / "train").column("prompt").to_pylist())
    hidden = write_job(work, "hidden", 64, seed=202, first_id=10_000, target=models / "target", exclude=seen)
    report: dict = {
        "job": "100 code prompts, max_tokens 64, k 3, greedy, the tiny target",
        "hidden_prompts": 64,
    }
    report["head_distill"] = distill(train, work / "head", "--method", "eagle3")
    report["draft_distill"] = distill(train, work / "draft", "--draft", str(models / "draft"), "--force")
    report["head"] = measure(hidden, "eagle3", work / "head")
    report["draft"] = measure(hidden, "draft_model", work / "draft")
    report["starting_draft"] = measure(hidden, "draft_model", models / "draft")
    print_report(report, args.json)
    print(json.dumps({k: report[k]["mean_acceptance_length"] for k in ("head", "draft", "starting_draft")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
