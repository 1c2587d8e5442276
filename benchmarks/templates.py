"""What a prompt template costs against a precomputed prompt column.

- ``render``: the reader alone (no engine): the same rows read from a Parquet shard as a
  precomputed ``prompt`` column and rendered by ``input.prompt_template`` from two columns whose
  concatenation is that prompt; the difference per row is the template's cost, which is all it
  adds to a run (rendering happens in the reader, as each record batch's rows are made).
- ``--throughput``: ``run_job`` on one engine over the throughput benchmark's workload
  (benchmarks/throughput.py: 384 held-out prompts, per-row ``max_tokens`` log-uniform 4..320,
  ``ignore_eos``), once with the prompt column and once with the template, interleaved; the
  same prompts token for token, so the same output tokens.

Usage: ``python benchmarks/templates.py [--rows 20000] [--throughput] [--spec off|ngram|draft]``
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import TINY_ENGINE, print_report  # noqa: E402

#: Renders exactly the precomputed prompt: ``subject`` + ``body``.
TEMPLATE = "{{ subject }}{{ body }}"


def split(prompts: list[str]) -> tuple[list[str], list[str]]:
    """Each prompt cut in two columns at its middle."""
    return [p[: len(p) // 2] for p in prompts], [p[len(p) // 2 :] for p in prompts]


def write_shards(root: Path, prompts: list[str], lengths: list[int], shards: int) -> None:
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    subjects, bodies = split(prompts)
    per = math.ceil(len(prompts) / shards)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        sl = slice(i * per, (i + 1) * per)
        pq.write_table(
            pa.table(
                {
                    "id": [f"r{j}" for j in range(len(prompts))][sl],
                    "prompt": prompts[sl],
                    "subject": subjects[sl],
                    "body": bodies[sl],
                    "max_tokens": lengths[sl],
                }
            ),
            root / f"part-{i}.parquet",
        )


def raw_spec(work: Path, templated: bool, out: str, speculative=None) -> dict:
    source = {"prompt_template": TEMPLATE} if templated else {"prompt_column": "prompt"}
    return {
        "name": "bench-templates",
        "input": {
            "path": str(work / "in" / "*.parquet"),
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens"},
            **source,
        },
        # the same columns kept either way: only where the prompt comes from differs
        "output": {"path": str(work / out), "keep_columns": ["id", "subject", "body"]},
        "model": {"target": str(ROOT / ".models" / "target"), "engine": dict(TINY_ENGINE)},
        "speculative": speculative,
        "sampling": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True},
        "execution": {"max_in_flight": 256, "dedupe_window": 0},
    }


def reader_seconds(spec, repeats: int) -> tuple[float, int]:
    """Best wall time of reading every row of the spec's shards (rows made, prompts set)."""
    from batchspec.io.listing import discover_shards
    from batchspec.io.reader import open_reader

    shards = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    best, rows = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        rows = 0
        for shard in shards:
            reader = open_reader(shard, spec)
            for row in reader.rows():
                assert row.error is None and row.prompt
                rows += 1
            reader.close()
        best = min(best, time.perf_counter() - started)
    return best, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000, help="rows the reader-only measure reads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput", action="store_true", help="also time run_job on the engine")
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--spec", choices=("off", "ngram", "draft"), default="off")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from throughput import SPECULATIVE, workload

    from batchspec.spec.build import build_spec

    report: dict = {"template": TEMPLATE}
    work = Path(tempfile.mkdtemp(prefix="batchspec-bench-templates-"))
    try:
        prompts, lengths = workload(args.rows)
        write_shards(work / "in", prompts, lengths, shards=4)
        column = build_spec(raw_spec(work, False, "out-column"))
        template = build_spec(raw_spec(work, True, "out-template"))
        column_s, rows = reader_seconds(column, args.repeats)
        template_s, _ = reader_seconds(template, args.repeats)
        report["reader"] = {
            "rows": rows,
            "column_us_per_row": round(column_s / rows * 1e6, 2),
            "template_us_per_row": round(template_s / rows * 1e6, 2),
            "template_overhead_us_per_row": round((template_s - column_s) / rows * 1e6, 2),
        }
        if args.throughput:
            report["throughput"] = throughput(args, work, SPECULATIVE[args.spec], workload, build_spec)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(report, args.json)
    return 0


def throughput(args, work: Path, speculative, workload, build_spec) -> dict:
    from batchspec.engine.llm import Engine
    from batchspec.run.events import EventLog
    from batchspec.run.job import RunOptions, run_job

    shutil.rmtree(work / "in", ignore_errors=True)
    prompts, lengths = workload(args.prompts)
    write_shards(work / "in", prompts, lengths, shards=4)
    specs = {
        "column": build_spec(raw_spec(work, False, "out-column", speculative)),
        "template": build_spec(raw_spec(work, True, "out-template", speculative)),
    }
    engine = Engine(specs["column"])
    results: dict[str, list[float]] = {m: [] for m in specs}
    tokens = {}
    try:
        engine.llm.generate(prompts[:16], use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            for mode, spec in specs.items():  # interleaved, so drift hits both alike
                shutil.rmtree(Path(spec.output.path), ignore_errors=True)
                started = time.monotonic()
                with open("/dev/null", "w") as sink:
                    result = run_job(
                        spec,
                        RunOptions(engine=engine, progress_bars=False, events=EventLog("b", "json", sink)),
                    )
                wall = time.monotonic() - started
                tokens[mode] = result.summary["totals"]["output_tokens"]
                results[mode].append(round(tokens[mode] / wall, 1))
    finally:
        engine.shutdown()
    assert tokens["column"] == tokens["template"], tokens
    best = {m: max(r) for m, r in results.items()}
    return {
        "prompts": args.prompts,
        "speculative": args.spec,
        "output_tokens": tokens["column"],
        "tokens_per_s": results,
        "best_tokens_per_s": best,
        "ratio_template_vs_column": round(best["template"] / best["column"], 3),
    }


if __name__ == "__main__":
    sys.exit(main())
