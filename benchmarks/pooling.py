"""An embedding job (``task: embed``) against bare ``LLM.embed`` on the same rows, whole process.

Both are timed as a scheduler runs them, start-up included: ``batchspec run`` on Parquet shards
of N rows (the tiny target converted to embed, vLLM's pooling runner), and a bare script that reads
the same shards with pyarrow and calls ``LLM.embed`` once over every text (vLLM's best case: one
call, no writing). Each is sampled for its peak RSS (the process and its whole tree, vLLM's engine
processes included) every 50 ms. Rows per second is N over the wall time; batchspec's should be at
least 0.97x bare's.

``--orders`` instead times ``batchspec run`` alone in three row orders, and its peak memory
against the dataset's size: file order (``prefix_window: 0``); text order (``prefix_window``'s
default, each window of 1,024 rows sorted by text); length order (every shard's rows sorted by
length in characters, shortest first, before the run, with ``prefix_window: 0``: the most a sort by
length within a shard could give); and file order over twice the rows in twice the shards of the
same size (peak memory should follow the shard, not the dataset).

Usage: ``python benchmarks/pooling.py [--rows 20000] [--shards 10] [--repeats 1] [--orders]``
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


def embed_job(work: Path, name: str, inputs: Path, target: str, prefix_window: int | None) -> Path:
    """An embedding job over ``inputs``/*.parquet, every row embedded (the snippets are distinct)."""
    execution: dict = {"dedupe_window": 0}
    if prefix_window is not None:
        execution["prefix_window"] = prefix_window
    job = work / f"job-{name}.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "pooling-bench",
                "task": "embed",
                "input": {"path": str(inputs / "*.parquet"), "prompt_column": "text"},
                "output": {"path": str(work / f"out-{name}")},
                "model": {"target": target, "engine": ENGINE},
                "execution": execution,
            }
        )
    )
    return job


def orders(args: argparse.Namespace, target: str, exe: str) -> dict:
    """``batchspec run`` in file, text and length order, and over twice the rows (see above)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    results: dict = {"rows": args.rows, "shards": args.shards}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("in", "sorted", "double"):
            (work / name).mkdir()
        paths = snippet_shards(work / "in", args.rows, args.shards, "text", seed=13)
        for path in paths:
            table = pq.read_table(path)
            by_length = pc.sort_indices(pc.utf8_length(table["text"]))
            pq.write_table(table.take(by_length), work / "sorted" / path.name)
        snippet_shards(work / "double", 2 * args.rows, 2 * args.shards, "text", seed=13)
        runs = {
            "file_order": embed_job(work, "file", work / "in", target, 0),
            "text_order": embed_job(work, "text", work / "in", target, None),
            "length_order": embed_job(work, "length", work / "sorted", target, 0),
            "file_order_twice_the_rows": embed_job(work, "double", work / "double", target, 0),
        }
        for name, job in runs.items():
            rows = 2 * args.rows if name.endswith("twice_the_rows") else args.rows
            measured = timed([exe, "run", str(job), "--no-progress"])
            results[name] = {**measured, "rows": rows, "rows_per_s": round(rows / measured["wall_s"], 1)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--orders", action="store_true", help="batchspec alone: row orders and memory")
    args = parser.parse_args()
    target = str(ROOT / ".models" / "target")
    if args.orders:
        print_report(orders(args, target, str(Path(sys.executable).with_name("batchspec"))), args.json)
        return 0
    results: dict = {"rows": args.rows, "shards": args.shards, "bare": [], "batchspec": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "in").mkdir()
        paths = snippet_shards(work / "in", args.rows, args.shards, "text", seed=13)
        (work / "bare.py").write_text(BARE % {"engine": ENGINE})
        exe = str(Path(sys.executable).with_name("batchspec"))
        for r in range(args.repeats):
            job = embed_job(work, str(r), work / "in", target, None)
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
