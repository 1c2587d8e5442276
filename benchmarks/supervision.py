"""What an engine death costs a run (batchspec/engine/supervise.py), against a cold start of the
same job, and what one quarantine costs.

One process, timed from its first line (before vLLM is imported), with the engine in processes of
its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as a production run has it), the tiny target,
greedy, ``--max-tokens`` tokens a row, ``--in-flight`` requests in flight:

1. **cold start**: from the process's start (imports, the engine's start-up) to the first result
   row, as a fresh ``batchspec run`` of the job pays it (its planning and reading aside: ms);
2. **one death**: ``--rows`` rows stream through the engine under a :class:`Supervisor`; after
   ``--kill-after`` results the EngineCore is killed with SIGKILL, and the time from the kill to
   the next result row is measured (the death noticed, what is left shut down, a new engine
   started, the requests it had sent again), with the restart's own seconds and the requests it
   had;
3. **one quarantine**: the same rows on the restarted engine, once as they are and once with one
   row holding the marker of the tests' fault (batchspec/engine/faults.py: the EngineCore exits
   on it); the cost is the difference of the two wall times, with the restarts it took.

A 2-core machine shares its cores between the engine's processes and their start-ups, so each
figure is one run's; rerun to see the spread.

Usage: ``python benchmarks/supervision.py [--rows 200] [--in-flight 16] [--max-tokens 16]
[--kill-after 50] [--json FILE]``
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before any import that costs: a cold run pays those too

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from common import ROOT, TINY_ENGINE, print_report  # noqa: E402

MARKER = "XYZZY"


class Told:
    """What the supervisor reports (batchspec/engine/supervise.py's Report)."""

    def __init__(self):
        self.restarts: list[dict] = []
        self.quarantines: list[dict] = []

    def restarted(self, restart):
        self.restarts.append(restart.as_dict())

    def quarantined(self, row, deaths, reason):
        self.quarantines.append({"request_id": row.request_id, "deaths": deaths})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kill-after", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from batchspec.engine.faults import DIE_ON_PROMPT_ENV

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ[DIE_ON_PROMPT_ENV] = MARKER  # the engine processes inherit it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from batchspec.engine.llm import Engine
    from batchspec.engine.supervise import Supervisor
    from batchspec.io.rows import Row
    from batchspec.spec.build import build_spec

    spec = build_spec(
        {
            "name": "supervision-bench",
            "input": {"path": "/nonexistent/*.parquet", "prompt_column": "prompt"},
            "output": {"path": "/nonexistent-out"},
            "model": {"target": str(ROOT / ".models" / "target"), "engine": dict(TINY_ENGINE)},
            "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True},
        }
    )

    def rows(marked: int | None = None) -> list[Row]:
        return [
            Row(
                shard="s",
                index=i,
                request_id=f"r{i}",
                kept={},
                prompt=(f"{MARKER} " if i == marked else "") + f"def f{i}(x, y):",
            )
            for i in range(args.rows)
        ]

    told = Told()
    engine_started = time.monotonic()
    engine = Engine(spec)
    supervisor = Supervisor(engine, restarts=3, report=told)
    first = killed = after_kill = None
    done = 0
    for _row, _results in supervisor.stream(iter(rows()), args.in_flight):
        now = time.monotonic()
        done += 1
        if first is None:
            first = now
        if killed is not None and after_kill is None and told.restarts:
            after_kill = now  # the new engine's first (the old one's last step may still yield)
        if done == args.kill_after:
            core = [p for p, name in engine.processes if "EngineCore" in name]
            killed = time.monotonic()
            for p in core:
                p.kill()
    assert after_kill is not None and len(told.restarts) == 1, told.restarts
    death = told.restarts[0]

    def timed(rows_) -> tuple[float, int]:
        start = time.monotonic()
        out = list(supervisor.stream(iter(rows_), args.in_flight))
        return time.monotonic() - start, sum(1 for _, r in out if r[0]["error"])

    plain_s, _ = timed(rows())
    before = len(told.restarts)
    poisoned_s, errors = timed(rows(marked=args.rows // 2))
    search = told.restarts[before:]
    engine.shutdown()
    report = {
        "rows": args.rows,
        "in_flight": args.in_flight,
        "max_tokens": args.max_tokens,
        "cold_start_to_first_result_s": round(first - STARTED, 2),
        "engine_start_to_first_result_s": round(first - engine_started, 2),
        "death_to_first_result_s": round(after_kill - killed, 2),
        "death_restart_s": death["seconds"],
        "death_requests_in_flight": death["in_flight"],
        "quarantine": {
            "wall_s_without": round(plain_s, 2),
            "wall_s_with": round(poisoned_s, 2),
            "cost_s": round(poisoned_s - plain_s, 2),
            "restarts": len(search),
            "search_restarts": sum(1 for r in search if r["search"]),
            "restart_s": round(sum(r["seconds"] for r in search), 2),
            "quarantined": told.quarantines,
            "error_rows": errors,
        },
    }
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
