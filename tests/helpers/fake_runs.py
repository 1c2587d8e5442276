"""Runs on the fake engine (no vLLM) that several test files share: a spec over a temporary
directory, its input shards, a run with its events captured, the committed outputs."""

from __future__ import annotations

import pyarrow.parquet as pq

from batchspec.run.events import EventLog
from batchspec.run.job import RunOptions, run_job
from batchspec.spec.build import build_spec
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet


def make_spec(tmp_path, **input_extra):
    raw = {
        "name": "unit",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", **input_extra},
        "output": {"path": str(tmp_path / "out"), "row_group_rows": 4},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 5, "read_batch_rows": 3},
    }
    return build_spec(raw)


def shards(tmp_path, n=3, rows=10):
    for i in range(n):
        write_parquet(
            tmp_path / "in" / f"s{i}.parquet",
            {"prompt": [f"prompt {i}-{j}" for j in range(rows)], "k": list(range(rows))},
        )


def run(spec, engine=None, **options):
    """A run on ``engine`` (a FakeEngine by default) with its events captured; ``options`` are
    :class:`RunOptions` fields."""
    events = []
    log = EventLog("test", "json")
    log.emit = lambda event, message="", level="info", **f: events.append((event, f))
    result = run_job(
        spec, RunOptions(engine=engine or FakeEngine(), events=log, progress_bars=False, **options)
    )
    return result, events


def outputs(tmp_path):
    return {p.stem: pq.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet"))}
