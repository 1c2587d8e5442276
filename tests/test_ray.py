"""``--executor ray`` on a real local Ray cluster (2 CPUs) with 2 replicas of the tiny pair.

One Ray cluster and one set of replicas (a caller-owned RayExecutor) serve the whole module:
a clean run compared with a local run of the same job (greedy: identical text), a run in which
one replica's actor is killed (``ray.kill``) while it is on a shard, a run with a shard that
kills every replica it is given (the test-only hook) and ends failed, exit 1, and the CLI
(``--executor ray --ray-address``) finishing that run, then a replica whose engine vLLM refuses
ending a CLI run with exit 2. Before them, the driver's scheduling with
a stand-in engine (seconds, no vLLM).

Engine starts: 1 local, 2 replicas, 1 to replace the killed one, 1 in the CLI's replica, 1
refused (replacements started for the poison shard's victims are stopped when the run ends).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DRAFT, ENGINE, MODELS, read_output, run_cli, write_job

from batchspec.errors import BatchspecError, SpecError
from batchspec.events import EventLog
from batchspec.runner import plan, run_job
from batchspec.spec import build_spec

SHARDS, ROWS = 4, 16
MAX_TOKENS = 24


def _spec(inputs, out, **executor):
    raw = {
        "name": "ray-test",
        "input": {"path": str(inputs / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out)},
        "model": {"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        "speculative": dict(DRAFT),
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
        # few in flight: a shard takes a few seconds, so a kill lands while one is on it
        "execution": {"max_in_flight": 4},
        "executor": {"kind": "ray", "replicas": 2, "resources_per_replica": {"CPU": 1},
                     **executor},
    }
    return build_spec(raw)


class _Events(EventLog):
    """Keeps every event; ``hook(event, fields)`` runs as each one is emitted."""

    def __init__(self, hook=None):
        super().__init__("test", "json")
        self.seen: list[tuple[str, dict]] = []
        self.hook = hook

    def emit(self, event, message="", level="info", **fields):
        self.seen.append((event, fields))
        if self.hook is not None:
            self.hook(event, fields)


# ---------------------------------------------------------------------------- spec and CLI (fast)


def test_executor_section_is_checked():
    base = {"input": {"path": "in/*.parquet", "prompt_column": "p"}, "output": {"path": "out"},
            "model": {"target": "m"}}
    assert build_spec(base).executor.kind == "local"
    spec = build_spec({**base, "executor": {"kind": "ray", "replicas": 3,
                                            "resources_per_replica": {"GPU": 1}}})
    assert (spec.executor.kind, spec.executor.replicas) == ("ray", 3)
    for bad, key in (({"kind": "dask"}, "executor.kind"), ({"replicas": 0}, "executor.replicas"),
                     ({"replica": 2}, "executor"),
                     ({"resources_per_replica": {"GPU": "one"}}, "executor.resources_per_replica")):
        with pytest.raises(SpecError) as err:
            build_spec({**base, "executor": bad})
        assert key in str(err.value), (bad, str(err.value))


def test_actor_options_and_env():
    from batchspec.ray_executor import actor_options, replica_env

    assert actor_options({"CPU": 1}) == {"num_cpus": 1}
    assert actor_options({"CPU": 4, "GPU": 1, "accelerator_type:H100": 0.01}) == {
        "num_cpus": 4, "num_gpus": 1, "resources": {"accelerator_type:H100": 0.01}}
    env = replica_env({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HOME": "h", "PATH": "/bin", "HOME": "x"})
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HOME": "h"}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs for the module; replicas get the engine's env from it."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}})
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas get _SlowEcho by value
    yield ray
    ray.shutdown()


class _SlowEcho:
    """A stand-in engine for the scheduling checks: echoes each prompt, 100 ms a row (a shard
    takes 2 s, so a kill on its shard_started event lands while the replica is on it)."""

    max_model_len = 512

    def __init__(self, spec):
        pass

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        from batchspec.columns import empty_result

        for row in rows:
            time.sleep(0.1)
            result = empty_result()
            result.update(generated_text=row.prompt.upper(), finish_reason="stop",
                          num_prompt_tokens=1, num_output_tokens=1)
            yield row, result

    def spec_counters(self):
        return {}

    def shutdown(self):
        pass


def test_scheduling_kill_and_poison_with_a_stand_in_engine(ray_cluster, tmp_path, monkeypatch):
    """The driver's side with a stand-in engine (seconds, no vLLM): shards spread over both
    replicas; a killed replica's shard is redone elsewhere; a shard that kills its replica
    on every try ends failed (exit 1) after executor.max_shard_attempts, the rest committed."""
    from batchspec.ray_executor import DIE_ON_SHARD_ENV, RayExecutor

    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(SHARDS):
        pq.write_table(pa.table({"id": [f"r{i}-{j}" for j in range(20)],
                                 "prompt": [f"p {i} {j}" for j in range(20)]}),
                       inputs / f"s{i}.parquet")
    expected = {f"r{i}-{j}": f"P {i} {j}" for i in range(SHARDS) for j in range(20)}
    executor = RayExecutor(_spec(inputs, tmp_path / "unused"), engine_factory=_SlowEcho)
    try:
        events = _Events()
        result = run_job(_spec(inputs, tmp_path / "a"), executor=executor, events=events)
        assert _texts(tmp_path / "a") == expected
        assert {f["replica"] for e, f in events.seen if e == "shard_committed"} == {0, 1}

        killed = []

        def kill(event, fields):
            if event == "shard_started" and not killed:
                killed.append(fields)
                ray_cluster.kill(next(h.actor for h in executor.handles
                                      if h.index == fields["replica"]))

        result = run_job(_spec(inputs, tmp_path / "b"), executor=executor, events=_Events(kill))
        deaths = result.summary["executor"]["replica_deaths"]
        assert [(d["replica"], d["shard"]) for d in deaths] == [(killed[0]["replica"],
                                                                killed[0]["shard"])]
        assert _texts(tmp_path / "b") == expected

        monkeypatch.setenv(DIE_ON_SHARD_ENV, "s1")
        with pytest.raises(BatchspecError) as err:
            run_job(_spec(inputs, tmp_path / "c", max_shard_attempts=2), executor=executor,
                    events=_Events())
        assert err.value.exit_code == 1 and "s1" in str(err.value)
        assert sorted(p.stem for p in (tmp_path / "c").glob("*.parquet")) == ["s0", "s2", "s3"]
        assert _texts(tmp_path / "c") == {k: v for k, v in expected.items() if "r1-" not in k}
    finally:
        executor.shutdown()


# ---------------------------------------------------------------------------- on Ray (engine)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, models):
    from demo_data import prompt_table

    root = tmp_path_factory.mktemp("ray-inputs")
    for i in range(SHARDS):
        table = prompt_table(ROWS, seed=300 + i, first_id=i * ROWS).drop_columns(["max_tokens"])
        pq.write_table(table, root / f"s{i}.parquet")
    return root


def _texts(out) -> dict[str, str]:
    table = read_output(out)
    ids = table["request_id"].to_pylist()
    assert len(ids) == len(set(ids)), "a row is in the output twice"
    return dict(zip(ids, table["generated_text"].to_pylist(), strict=True))


@pytest.fixture(scope="module")
def local_texts(inputs, tmp_path_factory):
    """The same job run locally first (before any replica holds an engine)."""
    out = tmp_path_factory.mktemp("local") / "out"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run_job(_spec(inputs, out), executor="local", events=_Events(), progress_bars=False)
    return _texts(out)


@pytest.fixture(scope="module")
def replicas(ray_cluster, local_texts, inputs, tmp_path_factory):
    """One executor (2 replicas of the tiny pair) every test below shares."""
    from batchspec.ray_executor import RayExecutor

    executor = RayExecutor(_spec(inputs, tmp_path_factory.mktemp("unused")))
    yield executor
    executor.shutdown()


@pytest.mark.engine
def test_ray_run_writes_what_a_local_run_writes(replicas, inputs, local_texts, tmp_path):
    out = tmp_path / "out"
    events = _Events()
    result = run_job(_spec(inputs, out), executor=replicas, events=events, progress_bars=False)
    texts = _texts(out)
    assert len(texts) == SHARDS * ROWS
    assert texts == local_texts  # greedy: the same text for every request id
    assert sorted(p.name for p in out.glob("*.parquet")) == [f"s{i}.parquet" for i in range(SHARDS)]
    summary = result.summary
    assert summary["status"] == "ok" and summary["executor"]["replica_deaths"] == []
    assert summary["totals"]["rows"] == SHARDS * ROWS
    assert summary["totals"]["output_tokens"] == sum(read_output(out)["num_output_tokens"].to_pylist())
    # shards were handed out to both replicas, and each one's commit reached the driver's log
    committed_by = {f["replica"] for e, f in events.seen if e == "shard_committed"}
    assert committed_by == {h.index for h in replicas.handles}, events.seen
    assert summary["acceptance_per_position"]["num_drafts"] > 0
    # status and reruns see a finished job: every shard committed, nothing left to do
    p = plan(_spec(inputs, out))
    assert set(p.states.values()) == {"committed"}
    again = run_job(_spec(inputs, out), executor=replicas, events=_Events(), progress_bars=False)
    assert again.summary["totals"]["rows"] == 0


@pytest.mark.engine
def test_killed_replica_loses_only_its_shard(replicas, inputs, local_texts, tmp_path):
    import ray

    killed: list[dict] = []

    def kill_first_replica_on_a_shard(event, fields):
        if event == "shard_started" and not killed:
            victim = next(h for h in replicas.handles if h.index == fields["replica"])
            killed.append({"replica": victim.index, "shard": fields["shard"]})
            ray.kill(victim.actor)

    out = tmp_path / "out"
    events = _Events(kill_first_replica_on_a_shard)
    result = run_job(_spec(inputs, out), executor=replicas, events=events, progress_bars=False)
    assert killed, "no shard started"
    deaths = result.summary["executor"]["replica_deaths"]
    # the kill landed while the replica was on that shard, which another replica then redid
    assert [(d["replica"], d["shard"]) for d in deaths] == [(killed[0]["replica"],
                                                            killed[0]["shard"])], deaths
    assert deaths[0]["rows_done"] < ROWS
    assert [f["shard"] for e, f in events.seen if e == "replica_died"] == [killed[0]["shard"]]
    redone_by = [f["replica"] for e, f in events.seen
                 if e == "shard_committed" and f["shard"] == killed[0]["shard"]]
    assert len(redone_by) == 1 and redone_by[0] != killed[0]["replica"]
    assert _texts(out) == local_texts  # every row exactly once, the same text
    assert result.summary["status"] == "ok"


def _cli_job(path, inputs, out, **sections):
    """The module's job as a YAML file for `batchspec run` (one replica of one CPU)."""
    return write_job(path, **{
        "input": {"path": str(inputs / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out)}, "speculative": dict(DRAFT),
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
        "executor": {"replicas": 1, "resources_per_replica": {"CPU": 1}}, **sections})


def _json_events(stderr: str) -> list[dict]:
    """The events of a `--log-format json` run, from its stderr."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def poisoned_out(tmp_path_factory):
    """The output of the run with a poison shard, which the CLI test then finishes."""
    return tmp_path_factory.mktemp("poisoned") / "out"


@pytest.mark.engine
def test_shard_that_kills_every_replica_fails_after_bounded_tries(replicas, inputs, local_texts,
                                                                  poisoned_out, monkeypatch):
    """s3, the last shard handed out, kills whichever replica runs it (the test-only hook exits
    the actor's process on its first result): after 2 tries it is failed, the run exits 1."""
    from batchspec.ray_executor import DIE_ON_SHARD_ENV

    monkeypatch.setenv(DIE_ON_SHARD_ENV, "s3")
    out = poisoned_out
    with pytest.raises(BatchspecError) as err:
        run_job(_spec(inputs, out, max_shard_attempts=2), executor=replicas, events=_Events(),
                progress_bars=False)
    assert err.value.exit_code == 1
    assert "s3" in str(err.value) and "failed on every try" in str(err.value)
    runs = list((out / "_batchspec" / "runs").glob("*.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert list(summary["failed_shards"]) == ["s3"]
    deaths = summary["executor"]["replica_deaths"]
    assert [(d["shard"], d["attempt"]) for d in deaths] == [("s3", 1), ("s3", 2)]
    # every other shard is whole and committed; s3 has no output and no manifest
    assert sorted(p.name for p in out.glob("*.parquet")) == ["s0.parquet", "s1.parquet",
                                                             "s2.parquet"]
    assert not (out / "_batchspec" / "manifest" / "s3.json").exists()
    texts = _texts(out)
    assert texts == {k: v for k, v in local_texts.items() if k in texts}
    assert len(texts) == (SHARDS - 1) * ROWS


@pytest.mark.engine
def test_cli_executor_ray_finishes_the_failed_run(replicas, ray_cluster, inputs, local_texts,
                                                  poisoned_out, tmp_path):
    """`batchspec run JOB --executor ray --ray-address ADDR`, as a scheduler's retry would: it
    joins the running cluster (its CPUs freed first: the shared replicas stop), redoes only the
    shard the failed run left, and the output is then what the local run wrote, every row once.
    `--ray-address` without Ray is a command-line error."""
    replicas.shutdown()
    address = ray_cluster.get_runtime_context().gcs_address
    job = _cli_job(tmp_path / "job.yaml", inputs, poisoned_out)
    bad = run_cli("run", str(job), "--ray-address", address, "--no-progress")
    assert bad.returncode == 2 and "--ray-address" in bad.stderr, bad.stderr
    done = run_cli("run", str(job), "--executor", "ray", "--ray-address", address,
                   "--no-progress", "--log-format", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    events = _json_events(done.stderr)
    assert any(e["event"] == "replicas_started" for e in events)
    assert [e["shard"] for e in events if e["event"] == "shard_started"] == ["s3"]
    assert sorted(e["shard"] for e in events if e["event"] == "shard_skipped") == ["s0", "s1", "s2"]
    assert _texts(poisoned_out) == local_texts


@pytest.mark.engine
def test_replica_whose_engine_is_refused_ends_the_run_with_exit_2(replicas, ray_cluster, inputs,
                                                                 tmp_path):
    """A replica whose vLLM engine refuses the job's engine args (a context longer than the
    model's) ends the run as the local executor does: exit 2 naming vLLM's reason, nothing
    written, no lease held, a failed run summary, and no replica left holding the cluster."""
    replicas.shutdown()  # frees the cluster's CPUs (a no-op after the CLI test)
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "out"
    job = _cli_job(tmp_path / "job.yaml", inputs, out,
                   model={"target": str(MODELS / "target"),
                          "engine": {**ENGINE, "max_model_len": 100_000}})
    run = run_cli("run", str(job), "--executor", "ray", "--ray-address", address,
                  "--no-progress", "--log-format", "json")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "vLLM refused the engine configuration" in run.stderr, run.stderr[-3000:]
    assert "max_model_len" in run.stderr, run.stderr[-3000:]
    events = _json_events(run.stderr)
    assert any(e["event"] == "replicas_starting" for e in events)
    assert not any(e["event"] in ("replicas_started", "shard_started") for e in events)
    assert not list(out.glob("*.parquet"))
    assert not list((out / "_batchspec" / "locks").glob("*.json"))
    summaries = [json.loads(p.read_text()) for p in (out / "_batchspec" / "runs").glob("*.json")]
    assert [(s["status"], s["exit_code"]) for s in summaries] == [("failed", 2)], summaries
    # the refused replica was stopped: the cluster's CPUs are all free again
    deadline = time.monotonic() + 30
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) == 2
