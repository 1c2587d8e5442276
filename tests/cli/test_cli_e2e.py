"""The runner's behaviours from test_runner.py (fake engine), once more on the real vLLM engine,
and the command line that reaches them.

The features job runs three times through the library on the session's shared engine
(tests/helpers/shared_engines.py): as written, failing with exit 3, and again with changed input and
overwrite; the three runs build on each other, in this order, through their fixtures, and each
fixture keeps what its run left behind. Two workers share a job: worker 0 is `batchspec run
--worker-index 0 --num-workers 2 --set ... --progress` (this file's one engine start-up), worker 1
runs through the library. The missing-column run exits 3 before starting an engine, and
`--overwrite` is checked with the fake engine (tests/helpers/fakes.py).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.fakes import run_fake_cli
from helpers.jobs import DRAFT, read_output, run_cli, run_cli_in_process, write_job

from batchspec.io.writer import read_metadata
from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

#: docs/contract.md "Output columns" after request_id and the kept input columns, in its order.
CONTRACT_RESULT_NAMES = [
    "generated_text",
    "finish_reason",
    "num_prompt_tokens",
    "num_output_tokens",
    "spec_num_steps",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_acceptance_rate",
    "spec_mean_acceptance_length",
    "spec_acceptance_histogram",
    "time_queued_s",
    "time_to_first_token_s",
    "time_decode_s",
    "time_e2e_s",
    "output_tokens_per_s",
    "sample_index",
    "lora_adapter",
    "structured_valid",
    "structured_error",
    "choice_probs",
    "reasoning_text",
    "num_reasoning_tokens",
    "num_answer_tokens",
    "spec_reasoning_num_draft_tokens",
    "spec_reasoning_num_accepted_tokens",
    "cumulative_logprob",
    "token_logprobs",
    "top_logprobs",
    "prompt_token_logprobs",
    "prompt_top_logprobs",
    "twin_of",
    "error",
]
#: The features job keeps these input columns, in this order (not the input's order).
KEEP = ["topic", "id"]
#: The features run's progress interval, in seconds.
PROGRESS_S = 0.03
#: The ids of the features job's good shards: "a1" twice in a, "a0" in a and in b.
IDS = {
    "a": ["a0", "a1", "a2", "a1", "a3", "a4"],
    "b": ["b0", "b1", "a0", "b2", "b3"],
    "empty": [],
    "z": [f"z{i}" for i in range(8)],
}
MIDBAD_ROWS, MIDBAD_GROUP_ROWS = 30, 10


def _prompts(count: int, seed: int) -> list[str]:
    from demo_data import prompt_table

    return prompt_table(count, seed=seed)["prompt"].to_pylist()


def _shard(path: Path, ids: list[str], seed: int, **kwargs) -> Path:
    """A shard with an id, a prompt, a topic and a column the job does not keep."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "prompt": pa.array(_prompts(len(ids), seed) if ids else [], pa.string()),
            "topic": pa.array([f"topic-{i % 3}" for i in range(len(ids))], pa.string()),
            "extra": pa.array(list(range(len(ids))), pa.int64()),
        }
    )
    pq.write_table(table, path, **kwargs)
    return path


def _garble_row_group(path: Path, group: int) -> None:
    """Overwrite the start of one row group's first data page: the footer stays readable, so the
    shard passes the up-front schema check and fails only when that row group is read."""
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(group).column(0).data_page_offset
    data[start : start + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))


@dataclass
class Run:
    """One run of a job (`batchspec run` or through the library), with what it left behind read
    at once (later runs change it)."""

    exit_code: int
    #: The command's stderr; a library run's events.
    log: str
    records: list[dict] = field(default_factory=list)
    summary: dict | None = None
    tables: dict[str, pa.Table] = field(default_factory=dict)
    mtimes: dict[str, int] = field(default_factory=dict)


def _collect(exit_code: int, log: str, out: Path, run_id: str | None = None) -> Run:
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    run_id = run_id or next((r["run_id"] for r in records), None)
    if run_id is None:  # text logs: the run that wrote the newest output file
        newest = max(out.glob("*.parquet"), key=lambda p: p.stat().st_mtime_ns, default=None)
        run_id = newest and read_metadata(str(newest))["run_id"]
    summary_path = out / "_batchspec" / "runs" / f"{run_id}.json"
    return Run(
        exit_code,
        log,
        records,
        json.loads(summary_path.read_text()) if summary_path.exists() else None,
        {p.stem: pq.read_table(p) for p in sorted(out.glob("*.parquet"))},
        {p.stem: p.stat().st_mtime_ns for p in sorted(out.glob("*.parquet"))},
    )


def _run(job: Path, out: Path, *args: str) -> Run:
    """`batchspec run JOB ARGS`."""
    result = run_cli("run", str(job), *args)
    return _collect(result.returncode, result.stderr, out)


def _library_run(shared_engines, job: Path, out: Path, *overrides: str, **kwargs) -> Run:
    """The job (with ``--set``-style overrides) through the library, JSON events."""
    run = shared_engines.run(load_spec(job, overrides), **kwargs)
    return _collect(run.exit_code, run.log, out, run.run_id)


@dataclass
class Features:
    inputs: Path
    out: Path
    job: Path


@pytest.fixture(scope="module")
def features(tmp_path_factory, models) -> Features:
    root = tmp_path_factory.mktemp("features")
    inputs = root / "in"
    for seed, (name, ids) in enumerate(IDS.items()):
        _shard(inputs / f"{name}.parquet", ids, seed=300 + seed)
    (inputs / "garbage.parquet").write_bytes(b"this is not a Parquet file")
    midbad = _shard(
        inputs / "midbad.parquet",
        [f"m{i}" for i in range(MIDBAD_ROWS)],
        seed=310,
        row_group_size=MIDBAD_GROUP_ROWS,
    )
    _garble_row_group(midbad, 2)
    job = write_job(
        root / "features.yaml",
        input={
            "path": str(inputs / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "on_bad_shard": "skip",
        },
        output={"path": str(root / "out"), "keep_columns": KEEP},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 24},
        execution={"max_in_flight": 8, "read_batch_rows": 4},
    )
    return Features(inputs, root / "out", job)


@pytest.fixture(scope="module")
def first_run(features, shared_engines) -> Run:
    """The features job: duplicate ids, a zero-row shard, two bad shards skipped, keep_columns,
    a progress event every 0.03 s (the run can end within 0.3 s on a warm shared engine: at 0.1 s
    it gave two events once, too few to see the interval)."""
    return _library_run(
        shared_engines, features.job, features.out, f"execution.progress_interval_s={PROGRESS_S}"
    )


@pytest.fixture(scope="module")
def failing_run(features, first_run, shared_engines) -> Run:
    """The same job with `input.on_bad_shard=fail`: only the shard with the corrupt row group
    is still to do (the unreadable one is removed, so that it gets that far)."""
    (features.inputs / "garbage.parquet").unlink()
    return _library_run(shared_engines, features.job, features.out, "input.on_bad_shard=fail")


@pytest.fixture(scope="module")
def overwrite_run(features, failing_run, shared_engines) -> Run:
    """The same job once more after shard b changed, with overwrite."""
    (features.inputs / "midbad.parquet").unlink()
    _shard(features.inputs / "b.parquet", ["b10", "b11", "b12", "b13"], seed=320)
    return _library_run(shared_engines, features.job, features.out, overwrite=True)


# ------------------------------------------------------------------------ the features job


def test_bad_shards_are_skipped_and_the_rest_committed(features, first_run):
    assert first_run.exit_code == 0, first_run.log[-3000:]
    assert sorted(first_run.tables) == ["a", "b", "empty", "z"]
    bad = first_run.summary["bad_shards"]
    assert sorted(bad) == ["garbage", "midbad"]
    assert bad["garbage"].startswith(f"{features.inputs / 'garbage.parquet'}: not a readable Parquet")
    # the corrupt row group is found mid-file, after two row groups went to the engine
    assert bad["midbad"].startswith(
        f"{features.inputs / 'midbad.parquet'}: cannot read row group 2 (after row {2 * MIDBAD_GROUP_ROWS})"
    ), bad["midbad"]
    failed = {r["shard"]: r for r in first_run.records if r["event"] == "shard_failed"}
    assert sorted(failed) == ["garbage", "midbad"]
    assert all(r["level"] == "warning" for r in failed.values())
    # nothing of the failed shard is visible or left behind
    assert not (features.out / "midbad.parquet").exists()
    assert not (features.out / "_batchspec" / "manifest" / "midbad.json").exists()
    assert not list((features.out / "_batchspec" / "tmp").glob("*"))
    assert not list((features.out / "_batchspec" / "locks").glob("*.json"))
    assert first_run.summary["status"] == "ok"
    assert sorted(first_run.summary["shards"]) == ["a", "b", "empty", "z"]


def test_every_row_once_with_duplicate_ids_kept(first_run):
    for name, ids in IDS.items():
        table = first_run.tables[name]
        assert sorted(table["request_id"].to_pylist()) == sorted(ids), name
        assert table["error"].null_count == len(ids), name  # every row generated
    assert first_run.summary["totals"]["rows"] == sum(len(ids) for ids in IDS.values())
    # "a1" twice within shard a
    assert first_run.summary["shards"]["a"]["duplicate_ids"] == 1


def test_duplicate_ids_across_shards_are_counted(first_run):
    # "a1" twice within a, and "a0" in a and again in b
    assert first_run.summary["totals"]["duplicate_ids"] == 2


def test_explicit_keep_columns(features, first_run):
    for name, table in first_run.tables.items():
        assert table.schema.names == ["request_id", *KEEP, *CONTRACT_RESULT_NAMES], name
        assert table.schema.field("topic").type == pa.string()
        source = pq.read_table(features.inputs / f"{name}.parquet")
        # the kept values travel with their own row (matched here by id and topic together)
        assert sorted(zip(table["id"].to_pylist(), table["topic"].to_pylist(), strict=True)) == sorted(
            zip(source["id"].to_pylist(), source["topic"].to_pylist(), strict=True)
        ), name
        assert table["request_id"].to_pylist() == table["id"].to_pylist()


def test_zero_row_shard_commits_an_empty_file_with_the_full_schema(features, first_run):
    table = first_run.tables["empty"]
    assert table.num_rows == 0
    assert table.schema.names == ["request_id", *KEEP, *CONTRACT_RESULT_NAMES]
    manifest = json.loads((features.out / "_batchspec" / "manifest" / "empty.json").read_text())
    assert manifest["rows"] == 0 and manifest["run_id"] == first_run.summary["run_id"]
    assert first_run.summary["shards"]["empty"]["rows"] == 0


def test_progress_events_every_interval(first_run):
    progress = [r for r in first_run.records if r["event"] == "progress"]
    assert len(progress) >= 3, "the default interval (30 s) would give none in this short run"
    done = [r["rows"] for r in progress]
    assert done == sorted(done) and len(set(done)) == len(done)  # strictly growing
    totals = [r["total_rows"] for r in progress]
    # the total starts with every readable shard's rows and drops the failed shard's unread ones
    full = sum(len(ids) for ids in IDS.values()) + MIDBAD_ROWS
    assert totals == sorted(totals, reverse=True) and totals[0] <= full
    assert totals[-1] >= sum(len(ids) for ids in IDS.values())
    assert all(r["rows"] <= r["total_rows"] for r in progress)
    stamps = [dt.datetime.fromisoformat(r["ts"]).timestamp() for r in progress]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert min(gaps) >= PROGRESS_S - 0.005, gaps  # never more often than asked (ms-rounded stamps)
    finished = first_run.records[-1]
    assert finished["event"] == "run_finished"
    assert finished["rows"] == sum(t.num_rows for t in first_run.tables.values())


# ------------------------------------------------------------------------ exit 3


def test_corrupt_row_group_with_on_bad_shard_fail_exits_3(features, first_run, failing_run):
    assert failing_run.exit_code == 3, failing_run.log[-3000:]
    # the failure came mid-run, not from the up-front check
    assert [r["shard"] for r in failing_run.records if r["event"] == "shard_started"] == ["midbad"]
    error = next(r for r in failing_run.records if r["event"] == "error")
    assert error["exit_code"] == 3
    assert error["message"].startswith(
        f"bad input data: {features.inputs / 'midbad.parquet'}: cannot read row group 2 (after row "
        f"{2 * MIDBAD_GROUP_ROWS})"
    ), error["message"]
    assert failing_run.summary["status"] == "failed"
    # the committed shards stay as they were; nothing of the failed one is visible or left over
    assert failing_run.mtimes == first_run.mtimes
    assert not list((features.out / "_batchspec" / "tmp").glob("*"))
    assert not list((features.out / "_batchspec" / "locks").glob("*.json"))


def test_missing_column_exits_3_before_the_engine_starts(tmp_path, models):
    _shard(tmp_path / "in" / "good.parquet", ["g0"], seed=330)
    bad = tmp_path / "in" / "zz-bad.parquet"
    pq.write_table(pa.table({"id": ["x"], "text": ["def f():\n"]}), bad)
    job = write_job(
        tmp_path / "bad.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 8},
    )
    result = run_cli("run", str(job), "--no-progress", "--log-format", "json", timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    error = next(r for r in records if r["event"] == "error")
    assert error["exit_code"] == 3
    assert error["message"] == f"bad input data: {bad}: missing prompt column 'prompt' (columns: id, text)"
    assert "engine_starting" not in [r["event"] for r in records]  # schemas are checked first
    assert not list((tmp_path / "out").glob("*.parquet"))


# ------------------------------------------------------------------------ overwrite


def test_overwrite_redoes_every_shard_after_input_changed(features, first_run, overwrite_run):
    assert overwrite_run.exit_code == 0, overwrite_run.log[-3000:]
    summary = overwrite_run.summary
    # without --overwrite only the changed shard b would be redone
    assert sorted(summary["shards"]) == ["a", "b", "empty", "z"]
    for name in summary["shards"]:
        path = features.out / f"{name}.parquet"
        assert read_metadata(str(path))["run_id"] == summary["run_id"], name
        assert overwrite_run.mtimes[name] > first_run.mtimes[name], name
    assert sorted(overwrite_run.tables["b"]["request_id"].to_pylist()) == ["b10", "b11", "b12", "b13"]
    # an unchanged shard redone gives the same greedy text
    before = dict(
        zip(
            first_run.tables["z"]["request_id"].to_pylist(),
            first_run.tables["z"]["generated_text"].to_pylist(),
            strict=True,
        )
    )
    after = dict(
        zip(
            overwrite_run.tables["z"]["request_id"].to_pylist(),
            overwrite_run.tables["z"]["generated_text"].to_pylist(),
            strict=True,
        )
    )
    assert after == before


def test_overwrite_flag_redoes_committed_shards(tmp_path):
    """`run --overwrite` reaches the run: a committed shard is redone (with the fake engine; what
    overwriting does on the real engine: the test above)."""
    _shard(tmp_path / "in" / "a.parquet", ["a0", "a1"], seed=340)
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "again.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(out)},
        sampling={"temperature": 0.0, "max_tokens": 8},
    )
    first = run_fake_cli("run", str(job), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    before = read_metadata(str(out / "a.parquet"))["run_id"]
    again = run_fake_cli("run", str(job), "--no-progress", "--log-format", "json", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    records = [json.loads(line) for line in again.stderr.splitlines() if line.startswith("{")]
    assert [r["shard"] for r in records if r["event"] == "shard_committed"] == ["a"]
    assert read_metadata(str(out / "a.parquet"))["run_id"] == records[0]["run_id"] != before


# ------------------------------------------------------------------------ two workers, --set, bars


WORKER_SHARDS = [f"w{i}" for i in range(6)]


@dataclass
class Workers:
    inputs: Path
    out: Path
    job: Path
    status_before: list[dict]
    status_worker0: list[dict]
    runs: list[Run]
    status_between: list[dict]
    status_after: list[dict]


def _status(job: Path, *args: str) -> list[dict]:
    """`status --format json`: the fields docs/contract.md's status reports, for each shard."""
    result = run_cli_in_process("status", str(job), "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    return [{k: r[k] for k in ("shard", "state", "input", "output")} for r in json.loads(result.stdout)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory, shared_engines) -> Workers:
    """Two workers of one job, one after the other, with `--set sampling.max_tokens=5`: worker 0
    a `batchspec run` with progress bars, worker 1 through the library."""
    root = tmp_path_factory.mktemp("workers")
    for i, name in enumerate(WORKER_SHARDS):
        _shard(root / "in" / f"{name}.parquet", [f"{name}-{j}" for j in range(3)], seed=400 + i)
    job = write_job(
        root / "workers.yaml",
        input={"path": str(root / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(root / "out")},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 32},
    )
    out = root / "out"
    # status gets the same --set as the runs: a shard written with another spec is not committed
    same = ("--set", "sampling.max_tokens=5")
    before = _status(job, *same)
    worker0 = _status(job, *same, "--worker-index", "0", "--num-workers", "2")
    runs = [_run(job, out, "--progress", "--worker-index", "0", "--num-workers", "2", *same)]
    between = _status(job, *same)
    runs.append(_library_run(shared_engines, job, out, same[1], worker_index=1, num_workers=2))
    return Workers(root / "in", out, job, before, worker0, runs, between, _status(job, *same))


def test_two_workers_do_every_shard_exactly_once(workers):
    for run in workers.runs:
        assert run.exit_code == 0, run.log[-3000:]
    done = [sorted(run.summary["shards"]) for run in workers.runs]
    assert done[0] and done[1], f"a worker had nothing to do: {done}"
    assert not set(done[0]) & set(done[1])
    assert sorted(done[0] + done[1]) == WORKER_SHARDS
    for i, run in enumerate(workers.runs):
        assert run.summary["worker"] == {"index": i, "count": 2}
    # worker 1 left worker 0's files alone
    assert {k: v for k, v in workers.runs[1].mtimes.items() if k in done[0]} == workers.runs[0].mtimes
    table = read_output(workers.out)
    assert sorted(table["request_id"].to_pylist()) == sorted(
        f"{name}-{j}" for name in WORKER_SHARDS for j in range(3)
    )


def test_set_overrides_the_yaml(workers):
    table = read_output(workers.out)
    assert table["error"].null_count == table.num_rows
    counts = table["num_output_tokens"].to_pylist()
    assert max(counts) == 5, counts  # the YAML says 32
    assert all(
        r == "length" for r, n in zip(table["finish_reason"].to_pylist(), counts, strict=True) if n == 5
    )
    for path in workers.out.glob("*.parquet"):
        assert read_metadata(str(path))["spec"]["sampling"]["max_tokens"] == 5


def test_status_json_rows(workers):
    def row(name, state):
        return {
            "shard": name,
            "state": state,
            "input": str(workers.inputs / f"{name}.parquet"),
            "output": str(workers.out / f"{name}.parquet") if state == "committed" else None,
        }

    done0 = set(workers.runs[0].summary["shards"])
    assert workers.status_before == [row(n, "pending") for n in WORKER_SHARDS]
    assert workers.status_worker0 == [row(n, "pending") for n in WORKER_SHARDS if n in done0]
    assert workers.status_between == [row(n, "committed" if n in done0 else "pending") for n in WORKER_SHARDS]
    assert workers.status_after == [row(n, "committed") for n in WORKER_SHARDS]


def test_progress_bars_with_progress_flag(workers):
    """`--progress` draws tqdm bars even when stderr is no terminal; their last state carries the
    run's figures, and no progress event is logged beside them."""
    run = workers.runs[0]
    segments = re.split(r"[\r\n]", run.log)
    shard_bars = [s for s in segments if s.startswith("shards:")]
    row_bars = [s for s in segments if s.startswith("rows:")]
    assert shard_bars and row_bars, run.log[-2000:]
    shards, rows = len(run.tables), sum(t.num_rows for t in run.tables.values())
    assert re.search(rf"\| {shards}/{shards} \[", shard_bars[-1]), shard_bars[-1]
    assert re.search(rf"\| {rows}/{rows} \[.*tok/s", row_bars[-1]), row_bars[-1]
    assert not re.search(r"\[batchspec\] progress \d+/\d+ rows", run.log), run.log[-2000:]
