"""Peak memory and time of reading a JSON-lines shard with one huge line, against its length.

Each file holds a short line, then one line of N MiB (``{"prompt": "xxx..."}``, 14 bytes over
N MiB), then a short line; the 512 MiB one is a gzip file of about half a MiB that decompresses
to it. Each file is read as a run reads it, in a fresh subprocess: the reader opened (its first
records settle the columns), its records counted (the check stage), its rows read. The
subprocess reports its own wall time and peak RSS (``getrusage``), and its RSS before reading.

Each file is read twice: with ``input.max_line_bytes`` at its default, 64 MiB (every line but
the 16 MiB one is over it: one error row, read past in constant memory), and with a cap above the
line (it is parsed: memory grows with the line, time linearly).

Usage: ``python benchmarks/line_memory.py [--sizes 16 64 256] [--gzip-mib 512] [--json FILE]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, print_report

MIB = 2**20


def write_file(path: Path, mib: int) -> int:
    """A short line, one line of ``mib`` MiB of prompt, a short line (gzip where the name ends
    .gz); returns the long line's bytes."""
    head, tail = b'{"prompt": "', b'"}'
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(b'{"prompt": "first"}\n' + head)
        block = b"x" * MIB
        for _ in range(mib):
            f.write(block)
        f.write(tail + b'\n{"prompt": "last"}\n')
    return len(head) + mib * MIB + len(tail)


def read_once(path: str, cap: int | None) -> dict:
    """In the subprocess: read ``path`` as a run does, with ``input.max_line_bytes`` ``cap``
    (None: the key left out, the code's default)."""
    from batchspec.io.listing import discover_shards
    from batchspec.io.reader import open_reader
    from batchspec.spec.build import build_spec

    inp = {"path": path, "prompt_column": "prompt"}
    if cap is not None:
        inp["max_line_bytes"] = cap
    spec = build_spec(
        {"input": inp, "output": {"path": str(Path(path).parent / "out")}, "model": {"target": "unused"}}
    )
    [shard] = discover_shards(spec.input.paths, {})
    before = _rss()
    started = time.perf_counter()
    reader = open_reader(shard, spec)  # the first records: the columns
    counted = reader.num_rows  # the check stage's count
    rows = errors = 0
    for row in reader.rows():
        rows += 1
        errors += row.error is not None
    reader.close()
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "counted": counted,
        "rows": rows,
        "error_rows": errors,
        "rss_before_mb": round(before / MIB, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(path: Path, cap: int | None) -> dict:
    args = [sys.executable, __file__, "--child", str(path)]
    if cap is not None:
        args += ["--cap", str(cap)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"reading {path.name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=[16, 64, 256], help="MiB of the long line of each plain file"
    )
    parser.add_argument(
        "--gzip-mib", type=int, default=512, help="MiB of the long line of the gzip file (0: none)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(read_once(args.child, args.cap)))
        return 0

    from batchspec.spec.model import InputSpec

    default_cap = InputSpec.__dataclass_fields__["max_line_bytes"].default
    cases = [(mib, f"line-{mib}.jsonl") for mib in args.sizes]
    if args.gzip_mib:
        cases.append((args.gzip_mib, f"line-{args.gzip_mib}.jsonl.gz"))
    results = []
    with tempfile.TemporaryDirectory(prefix="batchspec-lines-") as tmp:
        for mib, name in cases:
            path = Path(tmp) / name
            line_bytes = write_file(path, mib)
            for label, cap in (("default cap", None), ("cap above the line", line_bytes + MIB)):
                result = measure(path, cap)
                result.update(
                    line_mib=mib,
                    line_bytes=line_bytes,
                    file=name,
                    file_mb=round(path.stat().st_size / MIB, 2),
                    cap=label,
                    max_line_bytes=default_cap if cap is None else cap,
                )
                print(json.dumps(result), file=sys.stderr, flush=True)
                results.append(result)
            path.unlink()
    over = [r["peak_rss_mb"] for r in results if r["cap"] == "default cap" and r["line_bytes"] > default_cap]
    report = {
        "max_line_bytes_default": default_cap,
        "reads": results,
        "peak_rss_mb_over_the_cap": {"min": min(over, default=None), "max": max(over, default=None)},
    }
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
