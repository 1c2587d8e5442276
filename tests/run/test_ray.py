"""``--executor ray`` on a real local Ray cluster (2 CPUs) with 2 replicas of the tiny pair.

One Ray cluster and one set of replicas (a caller-owned RayExecutor) serve the whole module:
a clean run compared with a local run of the same job (greedy: identical text), a run on S3
(moto on 127.0.0.1, a short lease) in which one replica's actor is killed (``ray.kill``) while it
is on a shard, so that another replica must take its lease over, a run with a shard that
kills every replica it is given (the test-only hook) and ends failed, exit 1, and the CLI
(``--executor ray --ray-address``) finishing that run, then a replica whose engine vLLM refuses
ending a CLI run with exit 2. Before them, the driver's scheduling with
a stand-in engine (seconds, no vLLM), on local disk and on S3 (dead and live lease holders,
credentials kept out of Ray's runtime_env), and a replica's successive tasks without Ray.

Engine starts: 1 local, 2 replicas, 1 to replace the killed one, 2 in the CLI's replica (its
EngineCore killed once), 1 refused (replacements started for the poison shard's victims are
stopped when the run ends).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import uuid

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.jobs import (
    DRAFT,
    ENGINE,
    INLINE_ENGINE,
    MODELS,
    SEPARATE_ENGINE,
    read_output,
    run_cli,
    write_job,
)
from helpers.recovery import Job

from batchspec.errors import BatchspecError, SpecError
from batchspec.io.output_dir import OutputDir
from batchspec.leases.shard_leases import ShardLeases
from batchspec.run.events import EventLog
from batchspec.run.job import RunOptions, run_job
from batchspec.run.stages import plan
from batchspec.spec.build import build_spec

SHARDS, ROWS = 4, 16
MAX_TOKENS = 24
#: execution.lease_s of the runs on S3: short, so that a dead replica's lease is taken over soon,
#: and long enough that a renewal delayed by a loaded 2-core machine never loses a live lease
LEASE_S = 4.0


def _spec(inputs, out, storage_options=None, lease_s=None, on_bad_shard="fail", **executor):
    raw = {
        "name": "ray-test",
        "input": {
            "path": str(inputs / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "on_bad_shard": on_bad_shard,
        },
        "output": {"path": str(out), "storage_options": storage_options or {}},
        "model": {"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        "speculative": dict(DRAFT),
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
        # few in flight: a shard takes a few seconds, so a kill lands while one is on it
        "execution": {"max_in_flight": 4, **({"lease_s": lease_s} if lease_s else {})},
        "executor": {"kind": "ray", "replicas": 2, "resources_per_replica": {"CPU": 1}, **executor},
    }
    return build_spec(raw)


def _s3_output(s3_server) -> tuple[str, dict]:
    """A fresh bucket on the session's S3 server (moto): (output URL, storage options)."""
    import s3fs

    _, options = s3_server
    bucket = f"ray-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/out", options


@contextlib.contextmanager
def _deadline(seconds: int, what: str):
    """Fail, rather than hang, a run that does not end (SIGALRM in the test's main thread)."""

    def expire(signum, frame):
        raise TimeoutError(f"{what} still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _as_if_on_another_host(url: str, options: dict, shard: str, pid: int) -> None:
    """After a replica's process was killed holding ``shard``'s lease: make its record name
    another machine's pid space, as a replica on another node would leave it, so that only its
    heartbeat can tell it is dead (on this machine its gone pid would free the lease at once).
    Token and heartbeat are kept: the record's holder key is what it was."""
    import s3fs

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"replica process {pid} still runs")
    from batchspec.leases.s3 import S3Store

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    path = OutputDir(url, options).lock_path(shard)
    record, etag = S3Store(fs).read(path)
    assert record["pid"] == pid, record
    record["pid_space"] = "another-machine:4026531836"
    bucket, key, _ = fs.split_path(path)
    fs.call_s3("put_object", Bucket=bucket, Key=key, Body=json.dumps(record).encode(), IfMatch=etag)


def _dead_holder(url: str, options: dict, shard: str, run_id: str) -> None:
    """A lease on ``shard`` as a worker that died on another host leaves it: never renewed."""
    dead = ShardLeases(
        OutputDir(url, options),
        {"run_id": run_id, "host": "gone.example", "pid": 4242, "started_at": "then"},
        LEASE_S,
    )
    assert dead.acquire(shard) is None  # its keeper never starts: the heartbeat stays still


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
    base = {
        "input": {"path": "in/*.parquet", "prompt_column": "p"},
        "output": {"path": "out"},
        "model": {"target": "m"},
    }
    assert build_spec(base).executor.kind == "local"
    spec = build_spec(
        {**base, "executor": {"kind": "ray", "replicas": 3, "resources_per_replica": {"GPU": 1}}}
    )
    assert (spec.executor.kind, spec.executor.replicas) == ("ray", 3)
    for bad, key in (
        ({"kind": "dask"}, "executor.kind"),
        ({"replicas": 0}, "executor.replicas"),
        ({"replica": 2}, "executor"),
        ({"resources_per_replica": {"GPU": "one"}}, "executor.resources_per_replica"),
    ):
        with pytest.raises(SpecError) as err:
            build_spec({**base, "executor": bad})
        assert key in str(err.value), (bad, str(err.value))


def test_actor_options_and_env():
    """Settings go in Ray's runtime_env (recorded in Ray's job and actor metadata, shown on its
    dashboard); credentials only in replica_secrets, the replicas' constructor argument."""
    from batchspec.run.executors.ray import actor_options, replica_env, replica_secrets

    assert actor_options({"CPU": 1}) == {"num_cpus": 1}
    assert actor_options({"CPU": 4, "GPU": 1, "accelerator_type:H100": 0.01}) == {
        "num_cpus": 4,
        "num_gpus": 1,
        "resources": {"accelerator_type:H100": 0.01},
    }
    settings = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HOME": "h",
        "AWS_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://s3.example",
        "AZURE_STORAGE_ACCOUNT_NAME": "acct",
        "OMP_NUM_THREADS": "2",
        "TOKENIZERS_PARALLELISM": "false",
    }
    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIA1",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        "AWS_SESSION_TOKEN": "sess",
        "HF_TOKEN": "hf_x",
        "HUGGING_FACE_HUB_TOKEN": "hf_y",
        "AZURE_STORAGE_KEY": "k",
        "AZURE_STORAGE_CONNECTION_STRING": "c",
        "AZURE_STORAGE_SAS_TOKEN": "sv=1",
        "AZURE_CLIENT_SECRET": "cs",
        "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json",
        "VLLM_API_KEY": "v",
    }
    environ = {**settings, **secrets, "PATH": "/bin", "HOME": "x"}
    assert replica_env(environ) == settings
    assert replica_secrets(environ) == secrets


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs for the module; replicas get the engine's env from it."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
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
            result.update(
                generated_text=row.prompt.upper(),
                finish_reason="stop",
                num_prompt_tokens=1,
                num_output_tokens=1,
            )
            yield row, [result]

    def spec_counters(self):
        return {}

    def shutdown(self):
        pass


def _echo_inputs(root, shards=SHARDS, rows=20):
    """Shards of ``rows`` prompts; what _SlowEcho answers to each."""
    root.mkdir(exist_ok=True)
    for i in range(shards):
        pq.write_table(
            pa.table(
                {"id": [f"r{i}-{j}" for j in range(rows)], "prompt": [f"p {i} {j}" for j in range(rows)]}
            ),
            root / f"s{i}.parquet",
        )
    return {f"r{i}-{j}": f"P {i} {j}" for i in range(shards) for j in range(rows)}


@pytest.mark.vllm
def test_scheduling_kill_and_poison_with_a_stand_in_engine(ray_cluster, tmp_path, monkeypatch):
    """The driver's side with a stand-in engine (seconds, no vLLM): shards spread over both
    replicas; a killed replica's shard is redone elsewhere; a shard that kills its replica
    on every try ends failed (exit 1) after executor.max_shard_attempts, the rest committed."""
    from batchspec.run.executors.ray import DIE_ON_SHARD_ENV, RayExecutor

    inputs = tmp_path / "in"
    expected = _echo_inputs(inputs)
    executor = RayExecutor(_spec(inputs, tmp_path / "unused"), engine_factory=_SlowEcho)
    try:
        events = _Events()
        result = run_job(_spec(inputs, tmp_path / "a"), RunOptions(executor=executor, events=events))
        assert _texts(tmp_path / "a") == expected
        assert {f["replica"] for e, f in events.seen if e == "shard_committed"} == {0, 1}

        killed = []

        def kill(event, fields):
            if event == "shard_started" and not killed:
                killed.append(fields)
                ray_cluster.kill(next(h.actor for h in executor.handles if h.index == fields["replica"]))

        result = run_job(_spec(inputs, tmp_path / "b"), RunOptions(executor=executor, events=_Events(kill)))
        deaths = result.summary["executor"]["replica_deaths"]
        assert [(d["replica"], d["shard"]) for d in deaths] == [(killed[0]["replica"], killed[0]["shard"])]
        assert _texts(tmp_path / "b") == expected

        monkeypatch.setenv(DIE_ON_SHARD_ENV, "s1")
        with pytest.raises(BatchspecError) as err:
            run_job(
                _spec(inputs, tmp_path / "c", max_shard_attempts=2),
                RunOptions(executor=executor, events=_Events()),
            )
        assert err.value.exit_code == 1 and "s1" in str(err.value)
        assert sorted(p.stem for p in (tmp_path / "c").glob("*.parquet")) == ["s0", "s2", "s3"]
        assert _texts(tmp_path / "c") == {k: v for k, v in expected.items() if "r1-" not in k}
    finally:
        executor.shutdown()


def _garble_midway(path) -> None:
    """Rewrite a shard so that its schema reads (the driver's input check passes) but its
    third row group does not: a replica finds it unreadable midway."""
    pq.write_table(pq.read_table(path), path, row_group_size=3)
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(2).column(0).data_page_offset
    data[start : start + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))


@pytest.mark.vllm
def test_a_shard_a_replica_finds_unreadable_is_judged_by_the_run(ray_cluster, tmp_path):
    """A replica reports a shard unreadable midway; the driver's RunContext.bad_shard (the
    local run's) decides: ``on_bad_shard: skip`` records it and the rest commit, ``fail`` ends
    the run with exit 3 naming it."""
    from batchspec.run.executors.ray import RayExecutor

    inputs = tmp_path / "in"
    expected = _echo_inputs(inputs, shards=3, rows=8)
    _garble_midway(inputs / "s1.parquet")
    executor = RayExecutor(_spec(inputs, tmp_path / "unused", replicas=1), engine_factory=_SlowEcho)
    try:
        events = _Events()
        result = run_job(
            _spec(inputs, tmp_path / "skip", on_bad_shard="skip", replicas=1),
            RunOptions(executor=executor, events=events),
        )
        assert result.summary["status"] == "ok" and list(result.summary["bad_shards"]) == ["s1"]
        assert "s1.parquet" in result.summary["bad_shards"]["s1"]
        assert sorted(result.summary["shards"]) == ["s0", "s2"]
        assert _texts(tmp_path / "skip") == {k: v for k, v in expected.items() if "r1-" not in k}
        assert [f["shard"] for e, f in events.seen if e == "shard_failed"] == ["s1"]

        with pytest.raises(BatchspecError) as err:
            run_job(
                _spec(inputs, tmp_path / "fail", replicas=1), RunOptions(executor=executor, events=_Events())
            )
        assert err.value.exit_code == 3 and "s1.parquet" in str(err.value)
        assert not (tmp_path / "fail" / "s1.parquet").exists()
    finally:
        executor.shutdown()


def test_a_replicas_successive_tasks_take_a_dead_replicas_lease_over(s3_server, tmp_path):
    """Without Ray: one replica's tasks on S3, as the driver hands them out. Each task has its
    own lease set; what a task saw of a busy shard's holder goes back to the driver's rule
    (BusyRetry), which waits, and the shard's next task, seeded with that watch, takes over a
    lease whose heartbeat stayed still for lease_s (a replica of this run that died holding it)
    and commits every row once. A shard whose holder stays alive is busy after one wait, and
    the rule never waits on it again (it used to be re-queued for ever)."""
    from batchspec.leases.shard_leases import BusyRetry
    from batchspec.run.executors.ray import Replica

    expected = _echo_inputs(tmp_path / "in", shards=2, rows=4)
    url, options = _s3_output(s3_server)
    spec = _spec(tmp_path / "in", url, options, lease_s=LEASE_S)
    p = plan(spec)
    shards = {s.name: s for s in p.shards}
    _dead_holder(url, options, "s0", "this-run")
    replica, rule = Replica(spec, 0, engine_factory=_SlowEcho), BusyRetry(LEASE_S)

    def task(name):
        seen = rule.observation(name)
        return {
            "spec": spec,
            "shard": shards[name],
            "run_id": "this-run",
            "spec_fingerprint": p.spec_fingerprint,
            "overwrite": False,
            "grace_s": 1.0,
            "rows": 4,
            "die_on": None,
            "seen": {name: seen} if seen is not None else {},
        }

    live = ShardLeases(
        OutputDir(url, options),
        {"run_id": "live-run", "host": "elsewhere", "pid": 1, "started_at": "now"},
        LEASE_S,
    )
    with live:
        assert live.acquire("s1") is None  # renewed every lease_s / 4 from here on
        waits = {}
        for name, holder in (("s0", "this-run"), ("s1", "live-run")):
            result = replica.process(task(name))
            assert result["error"] is None and list(result["outcome"].busy) == [name]
            assert holder in result["outcome"].busy[name]
            waits[name] = rule.after(name, result["observed"][name])
            assert LEASE_S <= waits[name] <= LEASE_S + 1.5, waits
        time.sleep(max(waits.values()))
        taken = replica.process(task("s0"))
        assert taken["error"] is None and not taken["outcome"].busy, taken["outcome"]
        assert taken["outcome"].committed["s0"]["rows"] == 4
        still = replica.process(task("s1"))
        assert "live-run" in still["outcome"].busy["s1"]
        assert rule.after("s1", still["observed"]["s1"]) is None  # busy: the run ends
    texts = _texts(url, options)
    assert texts == {k: v for k, v in expected.items() if k.startswith("r0-")}


def _replica_env(self):
    """Run inside a replica (``__ray_call__``): what Ray recorded, and what the process has."""
    import ray

    recorded = ray.get_runtime_context().runtime_env.get("env_vars") or {}
    return dict(recorded), {
        k: os.environ.get(k) for k in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "HF_HUB_DISABLE_TELEMETRY")
    }


@pytest.mark.vllm
def test_on_s3_dead_replicas_and_crashed_runs_are_taken_over_and_live_holders_end_the_run(
    ray_cluster, s3_server, tmp_path, monkeypatch
):
    """The driver on S3 with a stand-in engine (no vLLM), lease_s 4. A replica killed while on
    a shard leaves its lease behind: another replica takes it over once its heartbeat has been
    still for lease_s, and every row is written once. A rerun after an earlier run's worker died
    holding a shard takes it over too (it used to exit 1 "busy"). A shard held by a live other
    run ends the run with exit 1 naming it, after one wait. Credentials reach the replicas,
    never the runtime_env Ray records."""
    from batchspec.run.executors.ray import RayExecutor

    expected = _echo_inputs(tmp_path / "in")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ray-secret-not-in-runtime-env")
    monkeypatch.setenv("HF_TOKEN", "hf_not_in_runtime_env")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    executor = RayExecutor(_spec(tmp_path / "in", tmp_path / "unused"), engine_factory=_SlowEcho)
    try:
        killed, problems = [], []
        url, options = _s3_output(s3_server)

        def kill(event, fields):
            """Runs in the driver's loop: the driver sees the death only after it returns."""
            if event == "shard_started" and not killed:
                killed.append(fields)
                victim = next(h for h in executor.handles if h.index == fields["replica"])
                ray_cluster.kill(victim.actor)
                try:  # (the driver's poll would swallow an error here)
                    _as_if_on_another_host(url, options, fields["shard"], victim.info["pid"])
                except Exception as exc:
                    problems.append(exc)

        events = _Events(kill)
        with _deadline(120, "the run with a killed replica"):
            result = run_job(
                _spec(tmp_path / "in", url, options, lease_s=LEASE_S),
                RunOptions(executor=executor, events=events),
            )
        assert not problems, problems
        deaths = result.summary["executor"]["replica_deaths"]
        assert [(d["replica"], d["shard"]) for d in deaths] == [(killed[0]["replica"], killed[0]["shard"])]
        assert _texts(url, options) == expected
        assert not result.summary["busy_shards"]
        waited = [f for e, f in events.seen if e == "shards_waiting"]
        assert [f["shards"] for f in waited] == [[killed[0]["shard"]]], waited
        redone_by = [
            f["replica"]
            for e, f in events.seen
            if e == "shard_committed" and f["shard"] == killed[0]["shard"]
        ]
        assert len(redone_by) == 1 and redone_by[0] != killed[0]["replica"]

        # credentials: in every replica's environment, not in what Ray records and shows
        for h in executor.handles:
            recorded, environ = ray_cluster.get(h.actor.__ray_call__.remote(_replica_env))
            assert environ == {
                "AWS_SECRET_ACCESS_KEY": "ray-secret-not-in-runtime-env",
                "HF_TOKEN": "hf_not_in_runtime_env",
                "HF_HUB_DISABLE_TELEMETRY": "1",
            }
            assert recorded.get("HF_HUB_DISABLE_TELEMETRY") == "1"
            assert "AWS_SECRET_ACCESS_KEY" not in recorded and "HF_TOKEN" not in recorded
            assert "not-in-runtime-env" not in json.dumps(recorded)

        # a rerun after a crash: an earlier run's worker died holding s2 (shorter shards now)
        expected = _echo_inputs(tmp_path / "short", rows=5)
        url, options = _s3_output(s3_server)
        _dead_holder(url, options, "s2", "crashed-run")
        with _deadline(120, "the rerun after a crash"):
            result = run_job(
                _spec(tmp_path / "short", url, options, lease_s=LEASE_S),
                RunOptions(executor=executor, events=_Events()),
            )
        assert result.summary["status"] == "ok" and not result.summary["busy_shards"]
        assert _texts(url, options) == expected

        # a live other run holds s0: one wait, then exit 1 naming it; the rest committed
        url, options = _s3_output(s3_server)
        with ShardLeases(
            OutputDir(url, options),
            {"run_id": "live-run", "host": "elsewhere", "pid": 1, "started_at": "now"},
            LEASE_S,
        ) as live:
            assert live.acquire("s0") is None
            started = time.monotonic()
            with _deadline(120, "the run beside a live holder"), pytest.raises(BatchspecError) as err:
                run_job(
                    _spec(tmp_path / "short", url, options, lease_s=LEASE_S),
                    RunOptions(executor=executor, events=_Events()),
                )
            assert time.monotonic() - started < 60
        assert err.value.exit_code == 1
        assert "s0" in str(err.value) and "live-run" in str(err.value), str(err.value)
        assert _texts(url, options) == {k: v for k, v in expected.items() if not k.startswith("r0-")}
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


def _texts(out, storage_options=None) -> dict[str, str]:
    """Every committed row's text by request id, from a local directory or an s3:// URL."""
    if storage_options is None:
        table = read_output(out)
    else:
        import s3fs

        fs = s3fs.S3FileSystem(**storage_options, skip_instance_cache=True)
        files = sorted(fs.glob(str(out).removeprefix("s3://") + "/*.parquet"))
        assert files, f"no output files in {out}"
        table = pa.concat_tables([pq.read_table(f, filesystem=fs) for f in files], promote_options="default")
    ids = table["request_id"].to_pylist()
    assert len(ids) == len(set(ids)), "a row is in the output twice"
    return dict(zip(ids, table["generated_text"].to_pylist(), strict=True))


@pytest.fixture(scope="module")
def local_texts(inputs, tmp_path_factory, shared_engines):
    """The same job run locally first (before any replica holds an engine)."""
    out = tmp_path_factory.mktemp("local") / "out"
    run = shared_engines.run(_spec(inputs, out), executor="local", progress_bars=False)
    assert run.exit_code == 0, run.log[-3000:]
    return _texts(out)


@pytest.fixture(scope="module")
def replicas(ray_cluster, local_texts, inputs, tmp_path_factory):
    """One executor (2 replicas of the tiny pair) every test below shares. The driver's VLLM_*
    settings reach the replicas: theirs run the engine in the replica's process (4 s to start,
    not 28; killing a replica kills its engine either way)."""
    from batchspec.run.executors.ray import RayExecutor

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        for name, value in INLINE_ENGINE.items():
            env.setenv(name, value)
        executor = RayExecutor(_spec(inputs, tmp_path_factory.mktemp("unused")))
        yield executor
        executor.shutdown()


@pytest.mark.engine
def test_ray_run_writes_what_a_local_run_writes(replicas, inputs, local_texts, tmp_path):
    out = tmp_path / "out"
    events = _Events()
    result = run_job(_spec(inputs, out), RunOptions(executor=replicas, events=events, progress_bars=False))
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
    again = run_job(_spec(inputs, out), RunOptions(executor=replicas, events=_Events(), progress_bars=False))
    assert again.summary["totals"]["rows"] == 0


@pytest.mark.engine
def test_killed_replica_loses_only_its_shard(replicas, inputs, local_texts, s3_server):
    """On S3: the killed replica's lease stays behind (as a replica on another node leaves it);
    another replica takes it over once its heartbeat has been still for lease_s and redoes the
    shard, every row exactly once (the driver used to re-queue it for ever)."""
    import ray

    killed: list[dict] = []
    problems: list[Exception] = []
    url, options = _s3_output(s3_server)
    lease_s = 4.0  # renewed every second by replicas that share 2 CPUs with their engines

    def kill_first_replica_on_a_shard(event, fields):
        if event == "shard_started" and not killed:
            victim = next(h for h in replicas.handles if h.index == fields["replica"])
            killed.append({"replica": victim.index, "shard": fields["shard"]})
            ray.kill(victim.actor)
            try:  # (the driver's poll would swallow an error here)
                _as_if_on_another_host(url, options, fields["shard"], victim.info["pid"])
            except Exception as exc:
                problems.append(exc)

    events = _Events(kill_first_replica_on_a_shard)
    with _deadline(400, "the run with a killed replica"):
        result = run_job(
            _spec(inputs, url, options, lease_s=lease_s),
            RunOptions(executor=replicas, events=events, progress_bars=False),
        )
    assert killed, "no shard started"
    assert not problems, problems
    deaths = result.summary["executor"]["replica_deaths"]
    # the kill landed while the replica was on that shard, which another replica then redid
    assert [(d["replica"], d["shard"]) for d in deaths] == [(killed[0]["replica"], killed[0]["shard"])], (
        deaths
    )
    assert deaths[0]["rows_done"] < ROWS
    assert [f["shard"] for e, f in events.seen if e == "replica_died"] == [killed[0]["shard"]]
    redone_by = [
        f["replica"] for e, f in events.seen if e == "shard_committed" and f["shard"] == killed[0]["shard"]
    ]
    assert len(redone_by) == 1 and redone_by[0] != killed[0]["replica"]
    # it was found held by the dead replica, waited for once, then taken over
    assert [f["shards"] for e, f in events.seen if e == "shards_waiting"] == [[killed[0]["shard"]]]
    assert _texts(url, options) == local_texts  # every row exactly once, the same text
    assert result.summary["status"] == "ok" and not result.summary["busy_shards"]


def _cli_job(path, inputs, out, **sections):
    """The module's job as a YAML file for `batchspec run` (one replica of one CPU)."""
    return write_job(
        path,
        **{
            "input": {"path": str(inputs / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
            "output": {"path": str(out)},
            "speculative": dict(DRAFT),
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            "executor": {"replicas": 1, "resources_per_replica": {"CPU": 1}},
            **sections,
        },
    )


def _json_events(stderr: str) -> list[dict]:
    """The events of a `--log-format json` run, from its stderr."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def poisoned_out(tmp_path_factory):
    """The output of the run with a poison shard, which the CLI test then finishes."""
    return tmp_path_factory.mktemp("poisoned") / "out"


@pytest.mark.engine
def test_shard_that_kills_every_replica_fails_after_bounded_tries(
    replicas, inputs, local_texts, poisoned_out, monkeypatch
):
    """s3, the last shard handed out, kills whichever replica runs it (the test-only hook exits
    the actor's process on its first result): after 2 tries it is failed, the run exits 1."""
    from batchspec.run.executors.ray import DIE_ON_SHARD_ENV

    monkeypatch.setenv(DIE_ON_SHARD_ENV, "s3")
    out = poisoned_out
    with pytest.raises(BatchspecError) as err:
        run_job(
            _spec(inputs, out, max_shard_attempts=2),
            RunOptions(executor=replicas, events=_Events(), progress_bars=False),
        )
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
    assert sorted(p.name for p in out.glob("*.parquet")) == ["s0.parquet", "s1.parquet", "s2.parquet"]
    assert not (out / "_batchspec" / "manifest" / "s3.json").exists()
    texts = _texts(out)
    assert texts == {k: v for k, v in local_texts.items() if k in texts}
    assert len(texts) == (SHARDS - 1) * ROWS


def _engine_cores(known: set[int]) -> list[psutil.Process]:
    """EngineCore processes below this one (Ray's workers are) that are not in ``known``."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in known and "EngineCore" in p.name():
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.engine
def test_cli_executor_ray_finishes_the_failed_run(
    replicas, ray_cluster, inputs, local_texts, poisoned_out, tmp_path
):
    """`batchspec run JOB --executor ray --ray-address ADDR`, as a scheduler's retry would: it
    joins the running cluster (its CPUs freed first: the shared replicas stop), redoes only the
    shard the failed run left, and the output is then what the local run wrote, every row once.
    Its replica's engine runs in processes of its own, and its EngineCore is killed (SIGKILL)
    once the replica is up: the replica starts its engine again in place and finishes the shard
    (batchspec/engine/supervise.py). `--ray-address` without Ray is a command-line error."""
    replicas.shutdown()
    address = ray_cluster.get_runtime_context().gcs_address
    job = _cli_job(tmp_path / "job.yaml", inputs, poisoned_out)
    bad = run_cli("run", str(job), "--ray-address", address, "--no-progress")
    assert bad.returncode == 2 and "--ray-address" in bad.stderr, bad.stderr
    before = {p.pid for p in _engine_cores(set())}
    run = Job(job, "--executor", "ray", "--ray-address", address, env=SEPARATE_ENGINE)
    # the CLI's import, a Ray worker's, and an engine in processes of its own (vLLM imported again):
    # past 300 s once on a loaded 2-core CI machine, so the wait only catches a hang
    assert run.wait_for("replicas_started", timeout=600) is not None, run.stderr[-3000:]
    cores = _engine_cores(before)
    assert len(cores) == 1, [p.name() for p in cores]
    cores[0].kill()
    assert run.wait(timeout=400) == 0, run.stderr[-3000:]
    events = run.records()
    assert [e["shard"] for e in events if e["event"] == "shard_started"] == ["s3"]
    assert sorted(e["shard"] for e in events if e["event"] == "shard_skipped") == ["s0", "s1", "s2"]
    (restarted,) = [e for e in events if e["event"] == "engine_restarted"]
    assert "killed by SIGKILL" in restarted["reason"] and restarted["replica"] is not None, restarted
    assert not [e for e in events if e["event"] == "replica_died"]  # restarted in place
    (finished,) = [e for e in events if e["event"] == "run_finished"]
    assert len(json.loads(open(finished["summary"]).read())["engine_restarts"]) == 1
    assert _texts(poisoned_out) == local_texts


@pytest.mark.engine
def test_replica_whose_engine_is_refused_ends_the_run_with_exit_2(replicas, ray_cluster, inputs, tmp_path):
    """A replica whose vLLM engine refuses the job's engine args (a context longer than the
    model's) ends the run as the local executor does: exit 2 naming vLLM's reason, nothing
    written, no lease held, a failed run summary, and no replica left holding the cluster."""
    replicas.shutdown()  # frees the cluster's CPUs (a no-op after the CLI test)
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "out"
    job = _cli_job(
        tmp_path / "job.yaml",
        inputs,
        out,
        model={"target": str(MODELS / "target"), "engine": {**ENGINE, "max_model_len": 100_000}},
    )
    run = run_cli(
        "run",
        str(job),
        "--executor",
        "ray",
        "--ray-address",
        address,
        "--no-progress",
        "--log-format",
        "json",
    )
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
