"""Peak memory of a run as a shard grows tenfold: large shards must stream through.

Runs ``batchspec run`` as a subprocess on one shard of N rows, then of 10 x N rows, and samples
the RSS of the batchspec process (and, separately, of its whole process tree, vLLM's engine
processes included) every 50 ms. The batchspec process's peak should grow by less than 10%.

Usage: ``python benchmarks/memory.py [--rows 2000] [--factor 10]``

``--format openai --mb 100``: an OpenAI Batch request file of 100 MB, then of 1 GB (``--factor``),
read and answered as OpenAI Batch result files (``input.format`` and ``output.format: openai``).
Each line is a short chat request padded to ``--line-kb`` with ``body.metadata`` (a field batchspec
accepts and ignores), so that a 1 GB file holds about 10,000 requests a CPU answers in minutes: what
is measured is the file streaming through, not generation.
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

from common import print_report  # noqa: E402


def write_shard(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tiny_models import held_out_snippets

    snippets = held_out_snippets(997, seed=11)  # cycled: content does not matter, size does
    writer = None
    for start in range(0, rows, 5000):
        n = min(5000, rows - start)
        table = pa.table(
            {
                "id": [f"r{start + i}" for i in range(n)],
                "prompt": [snippets[(start + i) % len(snippets)] for i in range(n)],
            }
        )
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=1000)
    writer.close()


def write_requests(path: Path, mb: int, line_kb: int) -> int:
    """An OpenAI Batch request file of about ``mb`` MiB; returns its line count."""
    from tiny_models import held_out_snippets

    snippets = held_out_snippets(997, seed=11)
    pad = {f"k{i}": "x" * 500 for i in range(max(1, line_kb * 1024 // 510))}
    written = lines = 0
    with open(path, "w") as f:
        while written < mb * 2**20:
            line = json.dumps(
                {
                    "custom_id": f"r{lines}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "tiny",
                        "metadata": pad,
                        "messages": [{"role": "user", "content": snippets[lines % len(snippets)]}],
                    },
                }
            )
            f.write(line + "\n")
            written += len(line) + 1
            lines += 1
    return lines


def measure(work: Path, rows: int, fmt: str = "parquet", mb: int = 0, line_kb: int = 100) -> dict:
    in_dir = work / f"in-{rows}-{mb}"
    in_dir.mkdir()
    if fmt == "openai":
        shard = in_dir / "requests.jsonl"
        rows = write_requests(shard, mb, line_kb)
        io_keys = {
            "input": {"path": str(shard), "format": "openai"},
            "output": {"path": str(work / f"out-{mb}"), "format": "openai"},
        }
    else:
        shard = in_dir / "big.parquet"
        write_shard(shard, rows)
        io_keys = {
            "input": {"path": str(shard), "prompt_column": "prompt", "id_column": "id"},
            "output": {"path": str(work / f"out-{rows}")},
        }
    job = work / f"job-{rows}.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": f"memory-{rows}",
                **io_keys,
                "model": {
                    "target": str(ROOT / ".models" / "target"),
                    "engine": {
                        "max_model_len": 512,
                        "enforce_eager": True,
                        "dtype": "float32",
                        **({"served_model_name": "tiny"} if fmt == "openai" else {}),
                    },
                },
                "speculative": {
                    "method": "draft_model",
                    "model": str(ROOT / ".models" / "draft"),
                    "num_speculative_tokens": 4,
                },
                "sampling": {"temperature": 0.0, "max_tokens": 4},
                # the snippets are cycled: every row generated, not written from a twin
                "execution": {"dedupe_window": 0},
            }
        )
    )
    exe = Path(sys.executable).with_name("batchspec")
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(exe), "run", str(job), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    return {
        "rows": rows,
        "input_mb": round(shard.stat().st_size / 2**20, 2),
        "wall_s": round(time.monotonic() - started, 1),
        "peak_rss_batchspec_mb": round(peak_main / 2**20, 1),
        "peak_rss_tree_mb": round(peak_tree / 2**20, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--format", choices=("parquet", "openai"), default="parquet")
    parser.add_argument("--mb", type=int, default=100, help="openai: the smaller file's MiB")
    parser.add_argument("--line-kb", type=int, default=100, help="openai: KiB a line")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchspec-memory-") as tmp:
        small = measure(Path(tmp), args.rows, args.format, args.mb, args.line_kb)
        large = measure(Path(tmp), args.rows * args.factor, args.format, args.mb * args.factor, args.line_kb)
    growth = large["peak_rss_batchspec_mb"] / small["peak_rss_batchspec_mb"] - 1
    report = {
        "small": small,
        "large": large,
        "batchspec_peak_rss_growth": round(growth, 4),
        "tree_peak_rss_growth": round(large["peak_rss_tree_mb"] / small["peak_rss_tree_mb"] - 1, 4),
        "target": f"batchspec peak RSS grows < 10% for a {args.factor}x larger shard",
        "met": growth < 0.10,
    }
    print_report(report, args.json)
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
