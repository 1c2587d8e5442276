"""Every row exactly once: SIGKILL at random moments, SIGTERM/SIGINT, an engine killed twice
(restarted in place), and two runs on one job, all on the real engine.

What is killed or signalled is a `batchspec run` process of its own (an engine start-up each);
what needs no process of its own (the reference texts, the reruns that finish a job, the second
run racing a process) runs through the library on the session's shared engine
(tests/helpers/shared_engines.py).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time

import psutil
import pyarrow.parquet as pq
import pytest
from helpers.jobs import DRAFT, INLINE_ENGINE, read_output, run_cli_in_process, write_job
from helpers.recovery import Job, check_output, input_ids

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine
#: Where the SIGKILLs land, one process each (each costs an engine start-up): during start-up
#: (listing, reading footers, the engine coming up), a random moment into generating (requests
#: in flight, row groups being written), and a random moment after a shard's commit (others
#: mid-way, committing).
KILL_MOMENTS = ("start-up", "generating", "committing")
#: Rows per input shard of the workload (four shards).
ROWS = 24


@pytest.fixture(scope="module")
def workload(tmp_path_factory, models):
    from demo_data import prompt_table

    root = tmp_path_factory.mktemp("recovery")
    # four shards of 24 rows (three row groups each): several seconds of generating per run, so a
    # kill or signal lands with requests in flight, row groups written and other shards mid-way
    # (with up to 40 tokens a row the whole job once took under a second on one thread a process,
    # and an EngineCore killed half a second into it had nothing left to restart for)
    for i in range(4):
        pq.write_table(
            prompt_table(ROWS, seed=500 + i, first_id=ROWS * i, max_tokens=(24, 96)),
            root / "in" / f"shard-{i}.parquet"
            if (root / "in").exists()
            else _mk(root / "in") / f"shard-{i}.parquet",
            row_group_size=8,
        )
    return root


def _mk(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_job(root, name, out=None):
    return write_job(
        root / f"{name}.yaml",
        input={
            "path": str(root / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens"},
        },
        output={"path": str(out or root / name), "row_group_rows": 8},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 96},
        execution={"max_in_flight": 12, "read_batch_rows": 8},
    )


@pytest.fixture(scope="module")
def reference(workload, shared_engines):
    run = shared_engines.run(load_spec(make_job(workload, "reference")))
    assert run.exit_code == 0, run.log[-3000:]
    table = read_output(workload / "reference")
    return dict(zip(table["request_id"].to_pylist(), table["generated_text"].to_pylist(), strict=True))


def test_sigkill_at_random_moments_then_rerun(workload, reference, shared_engines):
    rng = random.Random(20261122)
    expected = input_ids(workload / "in")
    out = workload / "killed"
    job = make_job(workload, "killed")
    kills, rounds, moments = 0, 0, []
    while kills < len(KILL_MOMENTS):
        # the engine in the run's process (4 s to start, not 28): a SIGKILL of the group is the
        # same for the commit protocol, which is what is under test here
        run = Job(job, env=INLINE_ENGINE)
        moment = KILL_MOMENTS[kills]
        if moment == "start-up":
            delay = rng.uniform(2, 15)
            time.sleep(delay)
        else:
            reached = run.wait_for("shard_started" if moment == "generating" else "shard_committed")
            delay = rng.uniform(0, 3.0 if moment == "generating" else 1.0)
            if reached is not None:
                time.sleep(delay)
        if run.proc.poll() is None:
            run.kill_group()
            kills += 1
            moments.append(f"{moment}+{delay:.1f}s")
        run.wait()
        visible = check_output(out, expected, reference)
        if len(visible) == len(expected):  # everything done: verify, then start over
            rounds += 1
            shutil.rmtree(out)
    final = shared_engines.run(load_spec(job))  # the rerun
    assert final.exit_code == 0, final.log[-3000:]
    check_output(out, expected, reference)
    table = read_output(out)
    ids = table["request_id"].to_pylist()
    all_ids = [i for v in expected.values() for i in v]
    lost = len(set(all_ids) - set(ids))
    duplicated = len(ids) - len(set(ids))
    print(
        f"\nSIGKILL test: {kills} kills survived ({', '.join(moments)}), {rounds} full rounds, "
        f"rows lost {lost}, rows duplicated {duplicated}"
    )
    assert lost == 0 and duplicated == 0 and len(ids) == len(all_ids)
    assert not list((out / "_batchspec" / "tmp").glob("*")), "orphan temp files not cleaned"
    assert not list((out / "_batchspec" / "locks").glob("*.json")), "leases not released"
    status = run_cli_in_process("status", str(job))
    assert "4 committed, 0 partial, 0 pending" in status.stdout


def check_stopped_cleanly(run: Job, out) -> None:
    """What a stopped run leaves: no process of its group, a summary saying `interrupted`, and
    nothing a rerun would have to clean up (no temp files, every lease given back)."""
    deadline = time.monotonic() + 15  # exited children are reaped by init within seconds
    while run.group_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not run.group_alive(), "engine processes left behind"
    finished = [r for r in run.records() if r["event"] == "run_finished"]
    assert finished and finished[0]["status"] == "interrupted", run.stderr[-3000:]
    assert json.loads(open(finished[0]["summary"]).read())["status"] == "interrupted"
    assert not list((out / "_batchspec" / "tmp").glob("*"))
    assert not list((out / "_batchspec" / "locks").glob("*.json"))


def test_sigint_to_the_group_stops_cleanly_and_a_rerun_finishes(workload, reference, shared_engines):
    """Ctrl-C at a terminal reaches the whole process group, the engine's processes too.
    (SIGTERM to the main process, as Kubernetes and Airflow send it: the grace-period tests.)"""
    expected = input_ids(workload / "in")
    job = make_job(workload, "sigint")
    run = Job(job)
    assert run.wait_for("shard_started") is not None, run.stderr[-3000:]
    time.sleep(1.0)
    sent = time.monotonic()
    run.kill_group(signal.SIGINT)
    rc = run.wait(timeout=60)
    elapsed = time.monotonic() - sent
    assert rc == 130, run.stderr[-3000:]
    assert elapsed < 20, f"took {elapsed:.1f}s to stop"
    check_stopped_cleanly(run, workload / "sigint")
    check_output(workload / "sigint", expected, reference)  # nothing partial visible
    rerun = shared_engines.run(load_spec(job))
    assert rerun.exit_code == 0, rerun.log[-3000:]
    assert len(check_output(workload / "sigint", expected, reference)) == 4


def _engine_cores(pid: int, known: set[int]) -> list[psutil.Process]:
    """The EngineCore processes below ``pid`` that are not in ``known``."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.pid not in known and ("EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _kill_the_engine_and_find_the_next(run: Job) -> list[psutil.Process]:
    """SIGKILL the run's EngineCore once it generates; the EngineCore the restart starts."""
    assert run.wait_for("shard_started") is not None, run.stderr[-3000:]
    time.sleep(0.5)
    first = _engine_cores(run.proc.pid, set())
    assert first, [p.name() for p in psutil.Process(run.proc.pid).children(recursive=True)]
    for p in first:
        p.kill()
    deadline = time.monotonic() + 120
    second: list[psutil.Process] = []
    while not second and time.monotonic() < deadline and run.proc.poll() is None:
        second = _engine_cores(run.proc.pid, {p.pid for p in first})
        time.sleep(0.2)
    assert second, "no new engine was started"
    return second


def test_engine_killed_twice_once_while_restarting_is_restarted_in_place(workload, reference):
    """SIGKILL of the EngineCore in the middle of generating, then of the new one while it
    starts (batchspec/engine/supervise.py): the engine is started again each time, the requests
    it had are sent again, and the run exits 0 with every row once, each text as an undisturbed
    run's. The failed start counts as a restart of execution.engine_restarts (3)."""
    expected = input_ids(workload / "in")
    job = make_job(workload, "enginedeath")
    run = Job(job)
    second = _kill_the_engine_and_find_the_next(run)
    time.sleep(2.0)  # its start-up takes 20 s or more
    for p in second:
        p.kill()
    rc = run.wait(timeout=400)
    assert rc == 0, run.stderr[-3000:]
    assert len(check_output(workload / "enginedeath", expected, reference)) == len(expected)
    (restarted,) = [r for r in run.records() if r["event"] == "engine_restarted"]
    assert restarted["attempts"] == 2 and restarted["restarts_left"] == 1, restarted
    assert "killed by SIGKILL" in restarted["reason"], restarted
    finished = [r for r in run.records() if r["event"] == "run_finished"]
    assert finished and finished[0]["status"] == "ok", run.stderr[-3000:]
    assert not list((workload / "enginedeath" / "_batchspec" / "tmp").glob("*"))
    assert not list((workload / "enginedeath" / "_batchspec" / "locks").glob("*.json"))


def test_sigterm_while_the_engine_restarts_stops_the_run(workload, reference, shared_engines):
    """SIGKILL of the EngineCore in the middle of generating, then a SIGTERM to batchspec while
    the new engine starts: a stop, not a failed restart. The run ends with 143 within one engine
    start-up, what it committed before is complete, nothing partial is visible, no engine
    process is left, and a rerun finishes the job (on the shared engine: the runs after each
    kill in test_sigkill_at_random_moments_then_rerun are processes' reruns)."""
    expected = input_ids(workload / "in")
    job = make_job(workload, "restart-term")
    run = Job(job)
    _kill_the_engine_and_find_the_next(run)
    time.sleep(1.0)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.wait(timeout=120)
    assert rc == 143, run.stderr[-3000:]
    assert time.monotonic() - sent < 60  # one engine start-up at most, not the rest of the job
    (finished,) = [r for r in run.records() if r["event"] == "run_finished"]
    assert finished["status"] == "interrupted", run.stderr[-3000:]
    check_output(workload / "restart-term", expected, reference)  # only complete shards
    deadline = time.monotonic() + 15
    while run.group_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not run.group_alive(), "engine processes left behind"
    rerun = shared_engines.run(load_spec(job))
    assert rerun.exit_code == 0, rerun.log[-3000:]
    assert check_output(workload / "restart-term", expected, reference) == {
        shard: len(ids) for shard, ids in expected.items()
    }


def test_two_runs_on_one_job_never_clobber(workload, reference, shared_engines):
    """A `batchspec run` and, once it generates, a second run of the same job (through the
    library, its engine warm): each shard is committed by one of them, once."""
    expected = input_ids(workload / "in")
    job = make_job(workload, "twice")
    first = Job(job, env=INLINE_ENGINE)  # the engine in the run's process: 4 s to start, not 28
    assert first.wait_for("shard_started") is not None, first.stderr[-3000:]
    second = shared_engines.run(load_spec(job))
    runs = [(first.wait(), first.records(), first.stderr), (second.exit_code, second.records, second.log)]
    committed = {}
    for _, records, _ in runs:
        for r in records:
            if r["event"] == "shard_committed":
                assert r["shard"] not in committed, f"{r['shard']} committed twice"
                committed[r["shard"]] = r["run_id"]
    assert sorted(committed) == sorted(expected)
    assert len(set(committed.values())) == 2, f"one run did everything: {committed}"
    check_output(workload / "twice", expected, reference)
    for code, records, log in runs:
        if code != 0:  # a run that found shards held by the other says so and exits 1
            assert code == 1 and [r for r in records if r["event"] == "shard_busy"], log[-3000:]
            assert "being processed by another run" in log


def test_sigterm_during_engine_start_up_writes_summary(workload):
    """Handlers are installed before anything else: a SIGTERM while vLLM starts (a long call
    that cannot poll a flag) ends the run with 143, a summary and no engine left, as soon as
    vLLM's start-up hands control back to Python (measured: 10 s idle, 25 s on a loaded
    machine; before, the default action killed the run with no summary)."""
    job = make_job(workload, "startup-term")
    run = Job(job)
    assert run.wait_for("engine_starting") is not None, run.stderr[-3000:]
    time.sleep(1.5)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.wait(timeout=60)
    assert rc == 143, run.stderr[-3000:]
    assert time.monotonic() - sent < 60  # bounded by one engine start-up, not by the whole job
    finished = [r for r in run.records() if r["event"] == "run_finished"]
    assert len(finished) == 1 and finished[0]["status"] == "interrupted", run.stderr[-3000:]
    summary = json.loads(open(finished[0]["summary"]).read())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143
    deadline = time.monotonic() + 15
    while run.group_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not run.group_alive(), "engine processes left behind"


@pytest.fixture(scope="module")
def long_requests(tmp_path_factory, models):
    """Two shards of requests that together take several seconds: 48 rows of 300 tokens, EOS
    ignored, all in flight at once (about 5 s on the tiny pair; 24 rows, 2.5 s, once finished
    inside the 1 s sleep and 1 s of grace on a fast machine)."""
    from demo_data import prompt_table

    root = tmp_path_factory.mktemp("grace")
    (root / "in").mkdir()
    for i in range(2):
        pq.write_table(prompt_table(24, seed=700 + i, first_id=24 * i), root / "in" / f"g-{i}.parquet")
    return root


@pytest.mark.parametrize("grace_s", [1, 120])
def test_sigterm_drain_is_bounded_by_the_grace_period(long_requests, grace_s):
    """SIGTERM to the main process, as Kubernetes and Airflow send it: the requests of fully read
    shards may finish for --grace-seconds; then the rest are aborted, so a Kubernetes grace
    period is kept. With enough grace, every shard in flight is committed before the run exits
    143. Either way the run stops cleanly (nothing partial, no process, lease or temp file)."""
    name = f"grace-{grace_s}"
    job = write_job(
        long_requests / f"{name}.yaml",
        input={"path": str(long_requests / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(long_requests / name)},
        sampling={"temperature": 0.0, "max_tokens": 300, "ignore_eos": True},
        execution={"max_in_flight": 64},
    )
    run = Job(job, "--grace-seconds", str(grace_s), env=INLINE_ENGINE)  # engine in its process
    assert run.wait_for("shard_started") is not None, run.stderr[-3000:]
    time.sleep(1.0)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.wait(timeout=300)
    elapsed = time.monotonic() - sent
    assert rc == 143, run.stderr[-3000:]
    check_stopped_cleanly(run, long_requests / name)
    committed = [r["shard"] for r in run.records() if r["event"] == "shard_committed"]
    if grace_s == 1:
        # the grace, the engine step under way, then the engine's shutdown and the summary: 12 s
        # once on a loaded CI machine; the requests would have needed far longer (none committed)
        assert elapsed < grace_s + 20, f"took {elapsed:.1f}s to stop with {grace_s}s of grace"
        assert committed == [], "the requests needed more than 1 s: nothing could be committed"
        assert not list((long_requests / name).glob("*.parquet"))  # nothing partial visible
    else:
        assert sorted(committed) == ["g-0", "g-1"], run.stderr[-3000:]
        table = read_output(long_requests / name)
        assert table.num_rows == 48 and set(table["num_output_tokens"].to_pylist()) == {300}
