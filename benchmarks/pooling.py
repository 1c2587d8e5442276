"""An embedding job (``task: embed``) against bare ``LLM.embed`` on the same rows, whole process.

Both are timed as a scheduler runs them, start-up included: ``batchspec run`` on Parquet shards
of N rows (the tiny target converted to embed, vLLM's pooling runner), and a bare script that reads
the same shards with pyarrow and calls ``LLM.embed`` once over every text (vLLM's best case: one
call, no writing). Each is sampled for its peak RSS (the process and its whole tree, vLLM's engine
processes included) every 50 ms. Rows per second is N over the wall time; batchspec's should be at
least 0.97x bare's.

Usage: ``python benchmarks/pooling.py [--rows 20000] [--shards 10] [--repeats 1]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import print_report, snippet_shards  # noqa: E402

ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}

BARE = """
import os, sys
import pyarrow.parquet as pq

def main():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # as batchspec's engine has it
    from vllm import LLM
    texts = []
    for path in sys.argv[2:]:
        texts += pq.read_table(path, columns=["text"])["text"].to_pylist()
    llm = LLM(model=sys.argv[1], runner="pooling", convert="embed", seed=0, **%(engine)r)
    outputs = llm.embed(texts, use_tqdm=False)
    assert len(outputs) == len(texts)

if __name__ == "__main__":
    main()
"""


def timed(cmd: list[str]) -> dict:
    """Wall time and peak RSS (the process, and its tree) of one command."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    main = psutil.Process(proc.pid)
    peak_main = peak_tree = 0
    while proc.poll() is None:
        try:
            tree = [main, *main.children(recursive=True)]
            peak_main = max(peak_main, main.memory_info().rss)
            peak_tree = max(peak_tree, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} exited {proc.returncode}: {err[-2000:]}")
    return {
        "wall_s": round(time.monotonic() - started, 2),
        "peak_rss_mib": round(peak_main / 2**20),
        "peak_tree_rss_mib": round(peak_tree / 2**20),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target = str(ROOT / ".models" / "target")
    results: dict = {"rows": args.rows, "shards": args.shards, "bare": [], "batchspec": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "in").mkdir()
        paths = snippet_shards(work / "in", args.rows, args.shards, "text", seed=13)
        (work / "bare.py").write_text(BARE % {"engine": ENGINE})
        exe = str(Path(sys.executable).with_name("batchspec"))
        for r in range(args.repeats):
            out = work / f"out-{r}"
            job = work / f"job-{r}.yaml"
            job.write_text(
                yaml.safe_dump(
                    {
                        "name": "pooling-bench",
                        "task": "embed",
                        "input": {"path": str(work / "in" / "*.parquet"), "prompt_column": "text"},
                        "output": {"path": str(out)},
                        "model": {"target": target, "engine": ENGINE},
                        # every row embedded, as the bare script does (the snippets are distinct)
                        "execution": {"dedupe_window": 0},
                    }
                )
            )
            results["bare"].append(timed([sys.executable, str(work / "bare.py"), target, *map(str, paths)]))
            results["batchspec"].append(timed([exe, "run", str(job), "--no-progress"]))
    for side in ("bare", "batchspec"):
        best = min(r["wall_s"] for r in results[side])
        results[f"{side}_rows_per_s"] = round(args.rows / best, 1)
    results["ratio"] = round(results["batchspec_rows_per_s"] / results["bare_rows_per_s"], 3)
    print_report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
