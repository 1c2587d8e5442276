"""Tables against files: the same prompts as Parquet files, as a Delta table and as an Iceberg
table, in and out (``input.format``/``output.format`` parquet, delta, iceberg), and planning a
table of many data files.

What is measured is I/O: each job runs on the fake engine (tests/helpers/fakes.py, which answers
each prompt with its text upper-cased, so the output is as large as the input) in a process of
its own, its wall time taken and its RSS sampled every 20 ms; vLLM is not imported.

Usage::

    python benchmarks/tables.py io --mb 1024 --files 16      # ~1 GB in and out, per format
    python benchmarks/tables.py plan --files 1000            # planning a 1,000-file table
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The child: one run of a job on the fake engine, vLLM's checks stubbed (nothing of vLLM loads).
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import batchspec.engine.checks
batchspec.engine.checks.check_vllm_keys = lambda spec: None
batchspec.engine.checks.vllm_version = lambda: "none (fake engine)"
from helpers.fakes import FakeEngine
from batchspec.run.events import EventLog
from batchspec.run.job import RunOptions, run_job
from batchspec.spec.build import build_spec
import yaml
spec = build_spec(yaml.safe_load(open(sys.argv[2])))
log = EventLog("bench", "json")
log.emit = lambda *a, **k: None
result = run_job(spec, RunOptions(engine=FakeEngine(), events=log, progress_bars=False))
print(json.dumps({"rows": result.summary["totals"]["rows"]}))
"""


def prompt_batch(rng: random.Random, rows: int, prompt_bytes: int, first: int):
    """``rows`` prompts of ``prompt_bytes`` of random (incompressible) text each."""
    import base64

    import pyarrow as pa

    raw = prompt_bytes * 3 // 4
    text = [base64.b64encode(rng.randbytes(raw)).decode() for _ in range(rows)]
    return pa.table({"id": [f"r{first + i}" for i in range(rows)], "prompt": text})


def make_inputs(base: Path, mb: int, files: int, prompt_bytes: int) -> dict:
    """The same prompts as Parquet files, a Delta table and an Iceberg table."""
    import pyarrow.parquet as pq
    from deltalake import WriterProperties, write_deltalake
    from pyiceberg.catalog import load_catalog

    rows_per_file = max(1, mb * 2**20 // files // prompt_bytes)
    (base / "parquet").mkdir(parents=True)
    (base / "wh").mkdir()
    catalog = {"type": "sql", "uri": f"sqlite:///{base}/catalog.db", "warehouse": f"file://{base}/wh"}
    cat = load_catalog("default", **catalog)
    cat.create_namespace("bench")
    rng = random.Random(7)
    iceberg = None
    for i in range(files):
        table = prompt_batch(rng, rows_per_file, prompt_bytes, i * rows_per_file)
        # the same row groups in each (1,024 rows, 8 MB): a reader holds about one at a time
        pq.write_table(table, base / "parquet" / f"part-{i:05d}.parquet", row_group_size=1024)
        write_deltalake(
            str(base / "delta"),
            table,
            mode="append",
            writer_properties=WriterProperties(max_row_group_size=1024),
        )
        iceberg = iceberg or cat.create_table(
            "bench.prompts", schema=table.schema, properties={"write.parquet.row-group-limit": "1024"}
        )
        iceberg.append(table)
    return {"rows": rows_per_file * files, "catalog": catalog}


def job(base: Path, fmt: str, catalog: dict) -> dict:
    if fmt == "parquet":
        inp = {"path": str(base / "parquet" / "*.parquet")}
    elif fmt == "delta":
        inp = {"path": str(base / "delta"), "format": "delta"}
    else:
        inp = {"format": "iceberg", "table": "bench.prompts", "catalog": catalog}
    out = {"path": str(base / f"out-{fmt}"), "format": fmt}
    if fmt == "iceberg":
        out.update(table="bench.results", catalog=catalog)
    return {
        "name": f"bench-{fmt}",
        "input": {**inp, "prompt_column": "prompt", "id_column": "id"},
        "output": out,
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 64, "dedupe_window": 0, "prefix_window": 0},
    }


def run_child(spec_path: Path) -> dict:
    """One run in a process of its own; its RSS sampled every 20 ms (the kernel's high-water
    mark of a forked child starts at its parent's)."""
    import psutil

    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ROOT / "tests"), str(spec_path)], stdout=subprocess.PIPE, cwd=ROOT
    )
    watched, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    wall = time.monotonic() - started
    out = proc.stdout.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{spec_path}: the run failed")
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20, 1), **json.loads(out)}


def du(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def bench_io(args) -> dict:
    import yaml

    base = Path(tempfile.mkdtemp(prefix="bench-tables-", dir=args.dir))
    made = make_inputs(base, args.mb, args.files, args.prompt_bytes)
    results = {"rows": made["rows"], "input_mb": {}, "runs": {}}
    for fmt in ("parquet", "delta", "iceberg"):
        source = {"parquet": "parquet", "delta": "delta", "iceberg": "wh"}[fmt]
        results["input_mb"][fmt] = round(du(base / source), 1)
        spec = base / f"{fmt}.yaml"
        spec.write_text(yaml.safe_dump(job(base, fmt, made["catalog"])))
        results["runs"][fmt] = {**run_child(spec), "output_mb": round(du(base / f"out-{fmt}"), 1)}
        print(fmt, results["runs"][fmt], flush=True)
    return results


def bench_plan(args) -> dict:
    """Planning a Delta and an Iceberg table of ``--files`` data files (the log and manifests
    read, no footer): the time of ``plan`` and of the check stage."""
    import pyarrow as pa
    from deltalake import write_deltalake
    from pyiceberg.catalog import load_catalog

    from batchspec.run.stages import check_inputs, plan
    from batchspec.spec.build import build_spec

    base = Path(tempfile.mkdtemp(prefix="bench-plan-", dir=args.dir))
    (base / "wh").mkdir()
    catalog = {"type": "sql", "uri": f"sqlite:///{base}/catalog.db", "warehouse": f"file://{base}/wh"}
    cat = load_catalog("default", **catalog)
    cat.create_namespace("bench")
    iceberg = None
    for i in range(args.files):
        table = pa.table(
            {"id": [f"r{i}-{j}" for j in range(10)], "prompt": [f"prompt {i} {j}" for j in range(10)]}
        )
        write_deltalake(str(base / "delta"), table, mode="append")
        iceberg = iceberg or cat.create_table("bench.prompts", schema=table.schema)
        iceberg.append(table)
    results = {}
    for fmt in ("delta", "iceberg"):
        spec = build_spec(job(base, fmt, catalog))
        started = time.monotonic()
        p = plan(spec)
        planned = time.monotonic() - started
        todo = [s for s in p.shards if p.states[s.name].value != "committed"]
        started = time.monotonic()
        ok, counts = check_inputs(spec, todo, lambda s, e: (_ for _ in ()).throw(e), p.out)
        checked = time.monotonic() - started
        results[fmt] = {
            "data_files": len(p.shards),
            "rows": sum(counts.values()),
            "plan_s": round(planned, 2),
            "check_s": round(checked, 2),
        }
        print(fmt, results[fmt], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["io", "plan"])
    parser.add_argument("--mb", type=int, default=1024, help="prompts, in MiB of text")
    parser.add_argument("--files", type=int, default=16, help="data files")
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--dir", default=None, help="where the data goes (a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = bench_io(args) if args.what == "io" else bench_plan(args)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
