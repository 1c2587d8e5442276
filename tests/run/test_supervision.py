"""A run whose engine dies (batchspec/engine/supervise.py): restarted in place, a request that
kills it quarantined as an error row, every row once; the summary, events and report say so.

First on the fake engine that dies (seconds), then on vLLM with real deaths: the EngineCore
process killed with SIGKILL, or ended by the test-only fault in batchspec's vLLM plugin
(batchspec/engine/faults.py) on prompts that hold a marker. Each of those runs is a `batchspec
run` process whose engine runs in processes of its own, and each restart is an engine start
(about 30 s on 2 cores), so the runs are few, small and combined: SIGKILLs, one during a restart
(tests/run/test_recovery.py); a poisoned row among 40; a poison in every row, past the
budget; under Ray (tests/run/test_ray.py)."""

from __future__ import annotations

import dataclasses
import json
import time

import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import make_spec, outputs, run
from helpers.fakes import DyingEngine
from helpers.jobs import SEPARATE_ENGINE, read_output, write_job, write_parquet
from helpers.recovery import Job

from batchspec.engine.faults import DIE_ON_PROMPT_ENV
from batchspec.errors import RuntimeFailure
from batchspec.report.metrics import build_report
from batchspec.report.text import render_text


def _poisoned_shards(tmp_path, rows: int, poisoned: set[int]) -> None:
    prompts = [f"prompt {i}" + (" POISON" if i in poisoned else "") for i in range(rows)]
    write_parquet(tmp_path / "in" / "s0.parquet", {"prompt": prompts[: rows // 2]})
    write_parquet(tmp_path / "in" / "s1.parquet", {"prompt": prompts[rows // 2 :]})


@pytest.mark.vllm  # run_job checks the spec's keys against vLLM's classes
def test_a_run_restarts_its_engine_and_quarantines_the_request_that_kills_it(tmp_path):
    _poisoned_shards(tmp_path, 20, {13})
    engine = DyingEngine(poison="POISON", deaths_after=[3])
    result, events = run(make_spec(tmp_path), engine=engine)
    summary = result.summary
    assert summary["status"] == "ok"
    restarts = summary["engine_restarts"]
    assert len(restarts) == len(engine.deaths) == engine.starts - 1 >= 3
    assert [r["search"] for r in restarts[:3]] == [False, False, False]  # 1 death, then 13 twice
    assert {"reason", "seconds", "attempts", "search", "restarts_left"} <= set(restarts[0])
    assert restarts[2]["restarts_left"] == 0
    (quarantined,) = summary["quarantined_requests"]
    assert quarantined["shard"] == "s1" and quarantined["deaths"] >= 2
    assert [e for e, _ in events].count("engine_restarted") == len(restarts)
    assert [f["request_id"] for e, f in events if e == "request_quarantined"] == [quarantined["request_id"]]
    # every row once; the poisoned one an error row, committed with its shard
    rows = {
        (shard, p): (e, t)
        for shard, table in outputs(tmp_path).items()
        for p, e, t in zip(
            pq.read_table(tmp_path / "in" / f"{shard}.parquet")["prompt"].to_pylist(),
            table["error"].to_pylist(),
            table["generated_text"].to_pylist(),
            strict=False,
        )
    }
    assert len(rows) == 20
    out = outputs(tmp_path)
    errors = [e for t in out.values() for e in t["error"].to_pylist() if e]
    assert len(errors) == 1 and errors[0].startswith("the engine died on this request (")
    assert sum(t.num_rows for t in out.values()) == 20
    ids = [i for t in out.values() for i in t["request_id"].to_pylist()]
    assert len(ids) == len(set(ids))
    # the report says it; a rerun has nothing left to do (the error row is committed)
    text = render_text(build_report(str(tmp_path / "out")))
    assert "engine restarts" in text and "1 requests quarantined" in text
    again, _ = run(make_spec(tmp_path), engine=DyingEngine(poison="POISON"))
    assert again.summary["totals"]["rows"] == 0 and "engine_restarts" not in again.summary


@pytest.mark.vllm  # run_job checks the spec's keys against vLLM's classes
def test_past_engine_restarts_the_run_exits_1_with_nothing_partial(tmp_path):
    _poisoned_shards(tmp_path, 10, set(range(10)))
    spec = make_spec(tmp_path)
    spec = dataclasses.replace(spec, execution=dataclasses.replace(spec.execution, engine_restarts=1))
    with pytest.raises(RuntimeFailure, match="execution.engine_restarts"):
        run(spec, engine=DyingEngine(poison="POISON"))
    assert not list((tmp_path / "out").glob("*.parquet"))
    assert not list((tmp_path / "out" / "_batchspec" / "manifest").glob("*"))
    (summary_path,) = (tmp_path / "out" / "_batchspec" / "runs").glob("*.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert [r["search"] for r in summary["engine_restarts"]] == [False]
    assert "after 1 engine restarts in this run" in summary["error"], summary["error"]


def test_a_ray_replica_restarts_its_engine_within_the_runs_budget(tmp_path):
    """Without Ray: a replica's tasks, as the driver hands them out, run the same supervision;
    its budget is the run's (one task's restarts count against the next), a new run's is whole."""
    from batchspec.run.executors.ray_replica import Replica
    from batchspec.run.stages import plan

    _poisoned_shards(tmp_path, 8, set())
    spec = make_spec(tmp_path)
    spec = dataclasses.replace(spec, execution=dataclasses.replace(spec.execution, engine_restarts=1))
    p = plan(spec)
    engine = DyingEngine(deaths_after=[2, 6, 8])
    replica = Replica(spec, 0, engine_factory=lambda _: engine)

    def task(shard, run_id):
        return {
            "spec": spec,
            "shard": next(s for s in p.shards if s.name == shard),
            "run_id": run_id,
            "spec_fingerprint": p.spec_fingerprint,
            "overwrite": True,
            "grace_s": 1.0,
            "rows": 4,
            "die_on": None,
            "seen": {},
        }

    first = replica.process(task("s0", "run-a"))
    assert first["error"] is None and list(first["outcome"].committed) == ["s0"]
    assert [r["restarts_left"] for r in first["outcome"].engine_restarts] == [0]
    assert [e for e, *_ in first["events"] if e == "engine_restarted"] == ["engine_restarted"]
    second = replica.process(task("s1", "run-a"))  # the run's one restart is spent
    assert second["error"] is not None and "engine_restarts" in second["error"]["message"]
    assert not second["outcome"].committed
    third = replica.process(task("s1", "run-b"))
    assert third["error"] is None and list(third["outcome"].committed) == ["s1"]
    assert len(third["outcome"].engine_restarts) == 1


# ---------------------------------------------------------------------------- on vLLM

#: The marker the test-only fault (batchspec/engine/faults.py) kills the EngineCore on.
MARKER = "XYZZY"


def _marker_job(tmp_path, rows: int, marked: set[int], **execution):
    """One shard of short prompts, ``marked`` rows holding :data:`MARKER`, in file order (no
    prefix window), 4 greedy tokens each."""
    prompts = [f"{MARKER} def f{i}(x):" if i in marked else f"def g{i}(y):" for i in range(rows)]
    write_parquet(tmp_path / "in" / "s0.parquet", {"prompt": prompts, "id": [f"r{i}" for i in range(rows)]})
    return write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0, "max_tokens": 4},
        execution={"prefix_window": 0, **execution},
    )


def _faulty(job, *extra) -> Job:
    """`batchspec run JOB` whose engine runs in processes of its own, killed by the fault."""
    return Job(job, *extra, env={**SEPARATE_ENGINE, DIE_ON_PROMPT_ENV: MARKER})


def _gone(run: Job) -> bool:
    deadline = time.monotonic() + 15  # exited children are reaped by init within seconds
    while run.group_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    return not run.group_alive()


@pytest.mark.engine
def test_a_row_that_kills_the_engine_among_40_is_quarantined(tmp_path, models):
    """The row that kills the engine and the one in flight beside it die together, twice; the
    search tries each alone on an engine of its own and finds the first (four restarts in all,
    the default execution.engine_restarts of 3 not spent: search restarts are not counted), and
    the other 39 rows are generated, each once. (The search in halves over more suspects:
    tests/engine/test_supervise.py.)"""
    run = _faulty(_marker_job(tmp_path, 40, {0}, max_in_flight=2))
    assert run.wait(timeout=900) == 0, run.stderr[-3000:]
    table = read_output(tmp_path / "out")
    ids = table["request_id"].to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(40)) and len(set(ids)) == 40
    errors = {i: e for i, e in zip(ids, table["error"].to_pylist(), strict=True) if e is not None}
    assert sorted(errors) == ["r0"], errors
    for error in errors.values():
        assert error.startswith("the engine died on this request ("), error
        assert "VLLM::EngineCore" in error and "exit code 70" in error, error
    generated = [
        n for i, n in zip(ids, table["num_output_tokens"].to_pylist(), strict=True) if i not in errors
    ]
    assert len(generated) == 39 and all(n > 0 for n in generated)
    (finished,) = [r for r in run.records() if r["event"] == "run_finished"]
    summary = json.loads(open(finished["summary"]).read())
    assert [q["request_id"] for q in summary["quarantined_requests"]] == ["r0"]
    restarts = summary["engine_restarts"]
    assert [r["search"] for r in restarts].count(False) == 2, restarts
    assert len(restarts) == len([r for r in run.records() if r["event"] == "engine_restarted"])
    assert _gone(run), "engine processes left behind"


@pytest.mark.engine
def test_a_fault_on_every_request_ends_the_run_after_engine_restarts(tmp_path, models):
    """Every row kills the engine: one restart (execution.engine_restarts: 1), then exit 1
    naming the budget, nothing committed, no engine process left."""
    run = _faulty(_marker_job(tmp_path, 20, set(range(20)), max_in_flight=4, engine_restarts=1))
    assert run.wait(timeout=600) == 1, run.stderr[-3000:]
    out = tmp_path / "out"
    assert not list(out.glob("*.parquet")) and not list((out / "_batchspec" / "manifest").glob("*"))
    assert not list((out / "_batchspec" / "tmp").glob("*"))
    assert not list((out / "_batchspec" / "locks").glob("*.json"))
    (finished,) = [r for r in run.records() if r["event"] == "run_finished"]
    summary = json.loads(open(finished["summary"]).read())
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert "after 1 engine restarts in this run" in summary["error"], summary["error"]
    assert [r["search"] for r in summary["engine_restarts"]] == [False]
    assert _gone(run), "engine processes left behind"
