"""What Ray costs on one machine: the same job locally and with ``--executor ray`` (1 and 2 replicas).

Each configuration is one whole ``run_job`` from a fresh output directory, engine start-up
included (``wall_s``), and the generation phase alone (``generation_wall_s``, its output tok/s),
as the run summary reports them. The Ray cluster is local (``ray.init(num_cpus=CPUS)``), started
once before the Ray runs; each replica reserves ``CPUS / replicas`` CPUs.

Usage: ``python benchmarks/ray_executor.py [--prompts 192] [--shards 8] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

from common import TINY_DRAFT, TINY_ENGINE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import ray
    from throughput import workload, write_shards

    from batchspec.run.events import EventLog
    from batchspec.run.job import RunOptions, run_job
    from batchspec.spec.build import build_spec

    prompts, lengths = workload(args.prompts)
    work = Path(tempfile.mkdtemp(prefix="batchspec-bench-ray-"))
    (work / "in").mkdir()
    write_shards(work / "in", prompts, lengths, args.shards)

    def spec(kind: str, replicas: int = 1):
        return build_spec(
            {
                "name": "bench-ray",
                "input": {
                    "path": str(work / "in" / "*.parquet"),
                    "prompt_column": "prompt",
                    "id_column": "id",
                    "sampling_columns": {"max_tokens": "max_tokens"},
                },
                "output": {"path": str(work / f"out-{kind}-{replicas}")},
                "model": {"target": str(ROOT / ".models" / "target"), "engine": dict(TINY_ENGINE)},
                "speculative": dict(TINY_DRAFT),
                "sampling": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True},
                "execution": {"max_in_flight": 256, "dedupe_window": 0},  # every row generated
                "executor": {
                    "kind": kind,
                    "replicas": replicas,
                    "resources_per_replica": {"CPU": args.cpus / replicas},
                },
            }
        )

    quiet = EventLog("bench", "json", open(os.devnull, "w"))  # noqa: SIM115
    results = []
    for kind, replicas in (("local", 1), ("ray", 1), ("ray", 2)):
        if kind == "ray" and not ray.is_initialized():
            ray.init(
                num_cpus=args.cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}},
            )
        t0 = time.monotonic()
        summary = run_job(spec(kind, replicas), RunOptions(events=quiet, progress_bars=False)).summary
        wall = time.monotonic() - t0
        t = summary["totals"]
        results.append(
            {
                "executor": kind,
                "replicas": replicas,
                "wall_s": round(wall, 1),
                "generation_wall_s": t["generation_wall_s"],
                "output_tokens": t["output_tokens"],
                "generation_output_tokens_per_s": t["generation_output_tokens_per_s"],
                "output_tokens_per_s_whole_run": round(t["output_tokens"] / wall, 1),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    if ray.is_initialized():
        ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    report = {"prompts": args.prompts, "shards": args.shards, "cpus": args.cpus, "runs": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
