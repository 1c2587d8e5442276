"""The runner's overhead: ``batchspec run`` against a bare ``vllm.LLM.generate`` script, whole
process, on the same prompts, engine and draft settings.

This is the comparison a user makes between tools: two commands, timed from start to exit. The
bare script reads the same Parquet shards with pyarrow, starts ``LLM`` with the job's engine
arguments and speculative config, and calls ``generate`` once over every prompt (vLLM's best case:
one call, no writing, no commit). ``batchspec run`` does the same work with its own features off:
every row generated in file order (``dedupe_window: 0``, ``prefix_window: 0``), a plain prompt
column, no template; it reads, writes and commits each shard as it always does.

The two alternate (bare first, then batchspec, ``--repeats`` times) so that a drift of the
machine falls on both. Printed: each run's wall time, the ratio batchspec / bare per pair, and
their median and spread. The goal is a median of at most 1.01 (BENCHMARKS.md keeps the figure of
each landing).

``--profile DIR`` also records each batchspec run's driver process with py-spy (``--idle``,
collapsed stacks in DIR, one file a run), which is where BENCHMARKS.md's profile comes from.

Usage: ``python benchmarks/overhead.py [--prompts 720] [--repeats 3] [--spec draft|ngram|off]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import TINY_DRAFT, print_report, snippet_shards  # noqa: E402

#: The engine both sides start: the tiny target, eager, fp32, vLLM's own batch defaults.
ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32", "seed": 0}
SPECULATIVE = {
    "draft": dict(TINY_DRAFT),
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "off": None,
}

BARE = """
import json, os, sys
import pyarrow.parquet as pq

def main():
    model, engine, speculative, max_tokens, *paths = sys.argv[1:]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # as batchspec's engine has it
    from vllm import LLM, SamplingParams
    prompts = []
    for path in paths:
        prompts += pq.read_table(path, columns=["prompt"])["prompt"].to_pylist()
    kwargs = json.loads(engine)
    if speculative != "null":
        kwargs["speculative_config"] = json.loads(speculative)
    llm = LLM(model=model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)

if __name__ == "__main__":
    main()
"""


def timed(cmd: list[str], profile: Path | None = None) -> float:
    """Wall time of one command, start to exit (under py-spy where ``profile`` is given)."""
    if profile is not None:
        spy = Path(sys.executable).with_name("py-spy")
        cmd = [
            str(spy),
            "record",
            "--idle",
            "--threads",
            "--rate",
            "200",
            "--format",
            "raw",
            "-o",
            str(profile),
            "--",
            *cmd,
        ]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{cmd[:3]} exited {done.returncode}: {done.stderr[-8000:]}")
    return round(wall, 2)


def job_spec(work: Path, out: Path, target: str, speculative: dict | None, max_tokens: int) -> Path:
    spec = {
        "name": "overhead-bench",
        "input": {"path": str(work / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out)},
        "model": {"target": target, "engine": {k: v for k, v in ENGINE.items() if k != "seed"}},
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
        # the same work as the bare script: every row, in file order
        "execution": {"dedupe_window": 0, "prefix_window": 0},
    }
    if speculative is not None:
        spec["speculative"] = speculative
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def summary(ratios: list[float]) -> dict:
    return {
        "median": round(statistics.median(ratios), 4),
        "min": round(min(ratios), 4),
        "max": round(max(ratios), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=720)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec", choices=sorted(SPECULATIVE), default="draft")
    parser.add_argument("--profile", type=Path, help="record each batchspec run with py-spy into this folder")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import json

    target = str(ROOT / ".models" / "target")
    speculative = SPECULATIVE[args.spec]
    results: dict = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "spec": args.spec,
        "bare_s": [],
        "batchspec_s": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "in").mkdir()
        paths = snippet_shards(work / "in", args.prompts, args.shards, "prompt", seed=5)
        (work / "bare.py").write_text(BARE)
        exe = str(Path(sys.executable).with_name("batchspec"))
        bare = [
            sys.executable,
            str(work / "bare.py"),
            target,
            json.dumps(ENGINE),
            json.dumps(speculative),
            str(args.max_tokens),
            *map(str, paths),
        ]
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        for r in range(args.repeats):
            results["bare_s"].append(timed(bare))
            job = job_spec(work, work / f"out-{r}", target, speculative, args.max_tokens)
            profile = args.profile / f"batchspec-{r}.txt" if args.profile else None
            results["batchspec_s"].append(timed([exe, "run", str(job), "--no-progress"], profile))
            print(
                f"repeat {r}: bare {results['bare_s'][-1]} s, batchspec {results['batchspec_s'][-1]} s",
                flush=True,
            )
    ratios = [b / a for a, b in zip(results["bare_s"], results["batchspec_s"], strict=True)]
    results["ratios"] = [round(x, 4) for x in ratios]
    results["ratio"] = summary(ratios)
    print_report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
