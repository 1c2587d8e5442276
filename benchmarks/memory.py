"""Peak memory of a run as a shard grows tenfold: large shards must stream through.

Runs ``batchspec run`` as a subprocess on one shard of N rows, then of 10 x N rows, and samples
the RSS of the batchspec process (and, separately, of its whole process tree, vLLM's engine
processes included) every 50 ms. The batchspec process's peak should grow by less than 10%.

Usage: ``python benchmarks/memory.py [--rows 2000] [--factor 10]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def write_shard(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tiny_models import held_out_snippets

    snippets = held_out_snippets(997, seed=11)  # cycled: content does not matter, size does
    writer = None
    for start in range(0, rows, 5000):
        n = min(5000, rows - start)
        table = pa.table({"id": [f"r{start + i}" for i in range(n)],
                          "prompt": [snippets[(start + i) % len(snippets)] for i in range(n)]})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=1000)
    writer.close()


def measure(work: Path, rows: int) -> dict:
    in_dir = work / f"in-{rows}"
    in_dir.mkdir()
    write_shard(in_dir / "big.parquet", rows)
    job = work / f"job-{rows}.yaml"
    job.write_text(yaml.safe_dump({
        "name": f"memory-{rows}",
        "input": {"path": str(in_dir / "big.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(work / f"out-{rows}")},
        "model": {"target": str(ROOT / ".models" / "target"),
                  "engine": {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}},
        "speculative": {"method": "draft_model", "model": str(ROOT / ".models" / "draft"),
                        "num_speculative_tokens": 4},
        "sampling": {"temperature": 0.0, "max_tokens": 4},
    }))
    exe = Path(sys.executable).with_name("batchspec")
    started = time.monotonic()
    proc = subprocess.Popen([str(exe), "run", str(job), "--no-progress"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    main = psutil.Process(proc.pid)
    peak_main = peak_tree = 0
    while proc.poll() is None:
        try:
            rss_main = main.memory_info().rss
            tree = [main, *main.children(recursive=True)]
            rss_tree = sum(p.memory_info().rss for p in tree if p.is_running())
        except psutil.Error:
            continue
        peak_main, peak_tree = max(peak_main, rss_main), max(peak_tree, rss_tree)
        time.sleep(0.05)
    stderr = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}): {stderr[-2000:]}")
    return {"rows": rows, "input_mb": round((in_dir / "big.parquet").stat().st_size / 2**20, 2),
            "wall_s": round(time.monotonic() - started, 1),
            "peak_rss_batchspec_mb": round(peak_main / 2**20, 1),
            "peak_rss_tree_mb": round(peak_tree / 2**20, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchspec-memory-") as tmp:
        small = measure(Path(tmp), args.rows)
        large = measure(Path(tmp), args.rows * args.factor)
    growth = large["peak_rss_batchspec_mb"] / small["peak_rss_batchspec_mb"] - 1
    report = {"small": small, "large": large,
              "batchspec_peak_rss_growth": round(growth, 4),
              "tree_peak_rss_growth": round(large["peak_rss_tree_mb"] / small["peak_rss_tree_mb"] - 1, 4),
              "target": "batchspec peak RSS grows < 10% for a 10x larger shard",
              "met": growth < 0.10}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
