"""End to end on the real vLLM engine and the tiny model pair.

Each module-scoped fixture runs one job; the tests read what it wrote. The job with speculation
runs as `batchspec run` (JSON logs, a progress event every 0.2 s): one engine start-up. The same
job without speculation, with n-gram speculation and a chat job run through the library on the
session's shared engines (tests/helpers/shared_engines.py), as does the job whose temperature the
engine accepts with speculative decoding (not vLLM's CPU build without batchspec's plugin, where
it exits 2 before any engine).

Expected values come from docs/contract.md (written out below, not taken from batchspec.columns), from
the inputs the fixtures write, and from sources independent of the column under test: vLLM's
run-wide counters for acceptance, the test's own clock for timings, the tokenizer for lengths.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.jobs import (
    DRAFT,
    HEAD,
    MODELS,
    NGRAM,
    read_output,
    run_cli,
    run_cli_in_process,
    write_job,
    write_parquet,
)

from batchspec.io.writer import read_metadata
from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

SHARDS, ROWS = 3, 24
JOB_MAX_TOKENS = 32
MAX_IN_FLIGHT = 16
K = DRAFT["num_speculative_tokens"]

#: One candidate token in ``top_logprobs``: struct<token_id int32, token string, logprob
#: float64, rank int32>, as docs/contract.md has it.
TOKEN_LOGPROB = pa.struct(
    [("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float64()), ("rank", pa.int32())]
)
#: docs/contract.md "Output columns", after request_id and the kept input columns, in its order.
CONTRACT_RESULT_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("generated_text", pa.string()),
    ("finish_reason", pa.string()),
    ("num_prompt_tokens", pa.int32()),
    ("num_output_tokens", pa.int32()),
    ("spec_num_steps", pa.int32()),
    ("spec_num_draft_tokens", pa.int32()),
    ("spec_num_accepted_tokens", pa.int32()),
    ("spec_acceptance_rate", pa.float64()),
    ("spec_mean_acceptance_length", pa.float64()),
    ("spec_acceptance_histogram", pa.list_(pa.int32())),
    ("time_queued_s", pa.float64()),
    ("time_to_first_token_s", pa.float64()),
    ("time_decode_s", pa.float64()),
    ("time_e2e_s", pa.float64()),
    ("output_tokens_per_s", pa.float64()),
    # the request-feature columns: null where a row did not ask for the feature
    ("sample_index", pa.int32()),
    ("lora_adapter", pa.string()),
    ("structured_valid", pa.bool_()),
    ("structured_error", pa.string()),
    ("choice_probs", pa.list_(pa.struct([("choice", pa.string()), ("prob", pa.float64())]))),
    ("reasoning_text", pa.string()),
    ("num_reasoning_tokens", pa.int32()),
    ("num_answer_tokens", pa.int32()),
    ("spec_reasoning_num_draft_tokens", pa.int32()),
    ("spec_reasoning_num_accepted_tokens", pa.int32()),
    ("cumulative_logprob", pa.float64()),
    ("token_logprobs", pa.list_(pa.float64())),
    ("top_logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),
    ("prompt_token_logprobs", pa.list_(pa.float64())),
    ("prompt_top_logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),
    ("twin_of", pa.string()),
    ("error", pa.string()),
]
#: "With speculative decoding off the spec_* columns are null."
CONTRACT_SPEC_COLUMNS = [name for name, _ in CONTRACT_RESULT_COLUMNS if name.startswith("spec_")]
TIMING_COLUMNS = ["time_queued_s", "time_to_first_token_s", "time_decode_s", "time_e2e_s"]
LONG_PROMPT = "def f(x):\n    return x\n" * 200  # far over max_model_len


def _bad_rows_shard(path):
    """A shard with every kind of bad row among good ones, and per-row overrides."""
    rows = [
        ("ok-0", "import os\nimport sys\n", None, None, None),
        ("null", None, None, None, None),
        ("empty", "", None, None, None),
        ("blank", "   \n\t ", None, None, None),
        ("too-long", LONG_PROMPT, None, None, None),
        ("bad-max-tokens", "x = 1\n", -5, None, None),
        ("bad-temperature", "x = 1\n", None, -1.0, None),
        ("short", "class A:\n    def __init__(self):\n", 3, None, None),
        ("sampled-a", "for i in range(10):\n", 24, 0.9, 7),
        ("sampled-b", "for i in range(10):\n", 24, 0.9, 7),
        ("ok-1", "def main():\n", None, None, None),
    ]
    write_parquet(
        path,
        {
            "id": [r[0] for r in rows],
            "prompt": pa.array([r[1] for r in rows], pa.string()),
            "max_tokens": pa.array([r[2] for r in rows], pa.int64()),
            "temperature": pa.array([r[3] for r in rows], pa.float64()),
            "seed": pa.array([r[4] for r in rows], pa.int64()),
        },
    )
    return [r[0] for r in rows]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, models):
    """Three ordinary shards plus one full of bad rows and per-row overrides."""
    from demo_data import prompt_table

    root = tmp_path_factory.mktemp("inputs")
    ids = []
    for i in range(SHARDS):
        table = prompt_table(ROWS, seed=100 + i, first_id=i * ROWS, max_tokens=(4, 48))
        table = table.append_column("temperature", pa.nulls(ROWS, pa.float64()))
        table = table.append_column("seed", pa.nulls(ROWS, pa.int64()))
        table = table.set_column(
            table.schema.get_field_index("max_tokens"), "max_tokens", table["max_tokens"].cast(pa.int64())
        )
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=10)
        ids += table["id"].to_pylist()
    ids += _bad_rows_shard(root / "odd.parquet")
    return root, ids


@dataclass
class JobRun:
    """One run of a job (`batchspec run` or through the library), as the fixtures leave it."""

    exit_code: int
    #: What the run logged (the command's stderr; a library run's events).
    log: str
    out: Path
    job: Path
    #: The test's own clock around the whole run (for the command: process start to exit).
    elapsed_s: float

    @property
    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.splitlines() if line.startswith("{")]


def _write_job(
    tmp_path_factory, inputs, name, speculative, execution: dict | None = None, **extra
) -> tuple[Path, Path]:
    """A job over every shard of ``inputs``: (job file, output folder)."""
    root, _ = inputs
    work = tmp_path_factory.mktemp(name)
    out = work / "out"
    job = write_job(
        work / f"{name}.yaml",
        input={
            "path": str(root / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens", "temperature": "temperature", "seed": "seed"},
        },
        output={"path": str(out)},
        speculative=speculative,
        sampling={"temperature": 0.0, "max_tokens": JOB_MAX_TOKENS},
        execution={"max_in_flight": MAX_IN_FLIGHT, **(execution or {})},
        **extra,
    )
    return job, out


def _job(tmp_path_factory, inputs, name, speculative, *cli_args, **extra) -> JobRun:
    """`batchspec run` of the job."""
    job, out = _write_job(tmp_path_factory, inputs, name, speculative, **extra)
    started = time.monotonic()
    result = run_cli("run", str(job), "--no-progress", *cli_args)
    return JobRun(result.returncode, result.stderr, out, job, time.monotonic() - started)


def _library_job(tmp_path_factory, inputs, shared_engines, name, speculative, **extra) -> JobRun:
    """The job run through the library on the session's shared engine for it."""
    job, out = _write_job(tmp_path_factory, inputs, name, speculative, **extra)
    run = shared_engines.run(load_spec(job))
    return JobRun(run.exit_code, run.log, out, job, run.elapsed_s)


def run_summary(out: Path) -> dict:
    """The summary JSON of the run that wrote the output files (later reruns add their own)."""
    run_ids = {read_metadata(str(p))["run_id"] for p in out.glob("*.parquet")}
    assert len(run_ids) == 1, run_ids
    return json.loads((out / "_batchspec" / "runs" / f"{run_ids.pop()}.json").read_text())


def refuses_sampling(job: Path) -> bool:
    """Whether this engine build refuses random sampling with this job's speculation: vLLM's CPU
    build corrupts sampled requests there (see batchspec.engine.checks.CPU_SAMPLING_REFUSAL), its GPU
    build does not. Where it is not refused, test_greedy_output_identical_with_and_without_
    speculation checks that the greedy rows batched with sampled ones still come out right."""
    from batchspec.engine.checks import refuses_random_sampling
    from batchspec.spec.load import load_spec

    return refuses_random_sampling(load_spec(job))


def check_acceptance_against_engine_counters(
    rows: list[dict], summary: dict, k: int, full_drafts: bool
) -> None:
    """Per-request acceptance columns summed over rows against vLLM's run-wide counters
    (``LLM.get_metrics()``, kept in the summary's ``acceptance_per_position``): two sources that
    agree only if every request's metrics reached its own row."""
    spec_rows = [r for r in rows if r["spec_num_steps"] is not None]
    assert spec_rows
    per_pos = summary["acceptance_per_position"]
    assert len(per_pos["accepted"]) == k
    steps = sum(r["spec_num_steps"] for r in spec_rows)
    drafted = sum(r["spec_num_draft_tokens"] for r in spec_rows)
    accepted = sum(r["spec_num_accepted_tokens"] for r in spec_rows)
    assert drafted > 0 and accepted > 0, "nothing was drafted or accepted: nothing was compared"
    # every verification step of a request is one draft in the engine's counters
    assert per_pos["num_drafts"] == steps
    assert sum(per_pos["accepted"]) == accepted
    # draft position i was accepted in exactly the steps that accepted more than i tokens
    assert per_pos["accepted"] == [
        sum(sum(r["spec_acceptance_histogram"][i + 1 :]) for r in spec_rows) for i in range(k)
    ]
    if full_drafts:  # a draft model proposes k tokens at every step
        assert drafted == k * per_pos["num_drafts"]
    else:  # n-gram lookup proposes up to k
        assert drafted <= k * per_pos["num_drafts"]
    for r in spec_rows:
        assert len(r["spec_acceptance_histogram"]) == k + 1, r["request_id"]
        assert 0 <= r["spec_num_accepted_tokens"] <= r["spec_num_draft_tokens"]


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory, inputs) -> JobRun:
    return _job(tmp_path_factory, inputs, "spec", DRAFT, "--log-format", "json", "--progress-interval", "0.2")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, inputs, shared_engines) -> JobRun:
    # every row generated: the seeded pair shows vLLM's seed at work, not a twin's copy
    return _library_job(
        tmp_path_factory, inputs, shared_engines, "plain", None, execution={"dedupe_window": 0}
    )


# ---------------------------------------------------------------------------------- tests


def test_run_succeeds_and_commits_one_file_per_shard(spec_run, inputs):
    out = spec_run.out
    assert spec_run.exit_code == 0, spec_run.log[-3000:]
    assert sorted(p.name for p in out.glob("*.parquet")) == [
        "odd.parquet",
        "part-0.parquet",
        "part-1.parquet",
        "part-2.parquet",
    ]
    assert not list((out / "_batchspec" / "tmp").glob("*")), "temporary files left behind"
    # the last line carries the run's figures (as text: test_limits_e2e.py): check them against
    # the files
    table = read_output(out)
    last = spec_run.records[-1]
    m = re.match(
        r"ok: (\d+) shards committed, (\d+) rows, (\d+) errors, (\d+) output tokens", last["message"]
    )
    assert last["event"] == "run_finished" and m, last
    assert [int(g) for g in m.groups()] == [
        4,
        table.num_rows,
        len(table) - table["error"].null_count,
        sum(table["num_output_tokens"].to_pylist()),
    ]


def test_every_row_exactly_once(spec_run, inputs):
    _, ids = inputs
    table = read_output(spec_run.out)
    assert sorted(table["request_id"].to_pylist()) == sorted(ids)
    assert table.num_rows == len(ids)


def test_columns_and_types_match_the_contract(spec_run, inputs):
    root, _ = inputs
    for path in sorted(spec_run.out.glob("*.parquet")):
        schema = pq.read_schema(path)
        # default keep_columns: every input column but the prompt, in input order, same types
        source = pq.read_schema(root / path.name)
        kept = [(f.name, f.type) for f in source if f.name != "prompt"]
        assert [(f.name, f.type) for f in schema] == [
            ("request_id", pa.string()),
            *kept,
            *CONTRACT_RESULT_COLUMNS,
        ], path.name
    # the kept columns differ by shard: the ordinary shards have a topic, the odd one has none
    assert "topic" in pq.read_schema(spec_run.out / "part-0.parquet").names
    assert "topic" not in pq.read_schema(spec_run.out / "odd.parquet").names


def test_acceptance_columns_add_up_to_vllms_run_counters(spec_run):
    assert spec_run.exit_code == 0, spec_run.log[-3000:]
    rows = read_output(spec_run.out).to_pylist()
    check_acceptance_against_engine_counters(rows, run_summary(spec_run.out), K, full_drafts=True)
    for r in rows:
        if r["error"] is None and r["twin_of"] is None:  # a twin's figures are its twin's
            # output tokens (from the token ids) against the step counts: the prefill token,
            # then one bonus or correction token per step plus the accepted drafts
            assert r["num_output_tokens"] <= 1 + r["spec_num_steps"] + r["spec_num_accepted_tokens"]


def test_timings_fit_the_measured_wall_clock(spec_run):
    summary = run_summary(spec_run.out)
    totals = summary["totals"]
    gen_wall = totals["generation_wall_s"]
    assert 0 < gen_wall <= totals["wall_s"] <= spec_run.elapsed_s
    busy = 0.0
    for path in sorted(spec_run.out.glob("*.parquet")):
        shard_wall = summary["shards"][path.stem]["wall_s"]  # from shard start to its commit
        for r in pq.read_table(path).to_pylist():
            if r["error"] is not None or r["twin_of"] is not None:  # nothing ran for either
                assert all(r[c] is None for c in TIMING_COLUMNS), r
                continue
            queued, ttft, decode, e2e = (r[c] for c in TIMING_COLUMNS)
            assert all(v is not None and math.isfinite(v) and v >= 0 for v in (queued, ttft, decode, e2e)), r
            # queued, then first token, then finish: each span contains the one before
            assert queued <= ttft <= e2e, r
            assert decode <= e2e, r
            # a request lives within its shard's span, which lies within the run
            assert e2e <= shard_wall + 1e-3 and shard_wall <= gen_wall + 1e-3, r
            n, rate = r["num_output_tokens"], r["output_tokens_per_s"]
            if n > 1 and decode > 0:
                # the decode time this speed implies fits in the measured end-to-end time
                assert rate > 0 and (n - 1) / rate <= e2e * (1 + 1e-9), r
            else:
                assert rate is None, r
            busy += e2e
    # at most MAX_IN_FLIGHT requests are in the engine at once, and the engine is seldom idle:
    # the summed request lifetimes lie between half the generation time and 16 times it
    assert 0.5 * gen_wall <= busy <= MAX_IN_FLIGHT * gen_wall, (busy, gen_wall)


def test_bad_rows_get_errors_and_the_rest_go_on(spec_run):
    rows = {r["request_id"]: r for r in read_output(spec_run.out).to_pylist()}
    from transformers import AutoTokenizer

    long_tokens = len(AutoTokenizer.from_pretrained(str(MODELS / "target")).encode(LONG_PROMPT))
    expected = {
        "null": "null prompt",
        "empty": "empty prompt",
        "blank": "empty prompt",
    }
    for rid, message in expected.items():
        assert rows[rid]["error"] == message, rows[rid]
    # the too-long row names its own length (counted by the tokenizer here) and the limit
    too_long = rows["too-long"]
    assert too_long["error"].startswith(f"prompt too long: {long_tokens} prompt tokens"), too_long
    assert too_long["error"].endswith("max_model_len 512"), too_long
    assert too_long["num_prompt_tokens"] == long_tokens
    expected["too-long"] = too_long["error"]
    for rid, named in (
        ("bad-max-tokens", "'max_tokens' (max_tokens) = -5"),
        ("bad-temperature", "'temperature' (temperature) = -1.0"),
    ):
        message = rows[rid]["error"]
        assert message.startswith("invalid per-row sampling override: ") and named in message, message
    for rid in (*expected, "bad-max-tokens", "bad-temperature"):
        r = rows[rid]
        assert r["finish_reason"] == "error" and r["generated_text"] is None, r
        assert r["num_output_tokens"] == 0, r
        assert all(r[c] is None for c in CONTRACT_SPEC_COLUMNS), r
    for rid in ("ok-0", "ok-1", "short"):
        r = rows[rid]
        assert r["error"] is None and r["finish_reason"] in ("stop", "length"), r
        assert r["generated_text"] and r["num_output_tokens"] > 0, r


def test_per_row_overrides(spec_run):
    rows = read_output(spec_run.out).to_pylist()
    length_limited = set()
    for r in rows:
        if r["error"] is not None:
            continue
        limit = r["max_tokens"] if r["max_tokens"] is not None else JOB_MAX_TOKENS
        if r["finish_reason"] == "length":
            assert r["num_output_tokens"] == limit, r  # the row's own max_tokens reached vLLM
            length_limited.add(limit)
        else:
            assert r["num_output_tokens"] <= limit, r
    # many different per-row limits were hit exactly: the job-wide 32 alone would not do that
    assert len(length_limited) >= 5, length_limited
    by_id = {r["request_id"]: r for r in rows}
    assert by_id["short"]["num_output_tokens"] <= 3
    for rid in ("sampled-a", "sampled-b"):
        r = by_id[rid]
        if refuses_sampling(spec_run.job):
            # vLLM's CPU build corrupts sampled requests (and greedy ones batched with them)
            # with speculative decoding on: batchspec refuses those rows instead
            assert r["finish_reason"] == "error", r
            assert r["error"].startswith("unsupported sampling: temperature > 0"), r
        else:
            assert r["error"] is None and 0 < r["num_output_tokens"] <= 24, r


def test_a_seeded_repeat_is_written_from_its_twin(spec_run):
    """The same prompt, sampling and seed twice: generated once (batchspec/run/twins.py)."""
    rows = {r["request_id"]: r for r in read_output(spec_run.out).to_pylist()}
    a, b = rows["sampled-a"], rows["sampled-b"]
    assert b["twin_of"] == "sampled-a" and a["twin_of"] is None
    assert b["generated_text"] == a["generated_text"] and b["error"] == a["error"]
    assert b["spec_num_steps"] is None and b["time_e2e_s"] is None
    assert run_summary(spec_run.out)["shards"]["odd"]["rows_from_twin"] == 1


def test_seeded_sampling_overrides_without_speculation(plain_run):
    rows = {r["request_id"]: r for r in read_output(plain_run.out).to_pylist()}
    a, b = rows["sampled-a"], rows["sampled-b"]
    assert a["error"] is None and a["num_output_tokens"] > 0
    # the same prompt, temperature and seed give the same sampled text
    assert a["generated_text"] == b["generated_text"]


def test_output_metadata_names_spec_models_and_versions(spec_run):
    import vllm

    import batchspec

    meta = read_metadata(str(spec_run.out / "part-0.parquet"))
    assert meta["vllm_version"] == vllm.__version__
    assert meta["batchspec_version"] == batchspec.__version__
    assert meta["target_model"] == str(MODELS / "target")
    assert meta["draft_model"] == DRAFT["model"]
    assert meta["speculative_method"] == "draft_model"
    assert meta["spec"]["speculative"]["num_speculative_tokens"] == K
    assert meta["shard"] == "part-0"
    assert meta["run_id"] == run_summary(spec_run.out)["run_id"]


def test_run_summary(spec_run, inputs):
    out = spec_run.out
    summary = run_summary(out)
    table = read_output(out)
    totals = summary["totals"]
    assert summary["status"] == "ok"
    assert totals["rows"] == table.num_rows
    assert totals["errors"] == sum(e is not None for e in table["error"].to_pylist())
    assert totals["output_tokens"] == sum(table["num_output_tokens"].to_pylist())
    accepted = sum(x or 0 for x in table["spec_num_accepted_tokens"].to_pylist())
    drafted = sum(x or 0 for x in table["spec_num_draft_tokens"].to_pylist())
    assert totals["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert 0 < totals["wall_s"] <= spec_run.elapsed_s
    assert set(summary["shards"]) == {"odd", "part-0", "part-1", "part-2"}
    for name, shard in summary["shards"].items():  # the summary against each committed file
        t = pq.read_table(out / f"{name}.parquet")
        assert shard["rows"] == t.num_rows
        assert shard["errors"] == t.num_rows - t["error"].null_count
        assert shard["output_tokens"] == sum(t["num_output_tokens"].to_pylist())
    odd = {
        "empty prompt": 2,
        "null prompt": 1,
        "prompt too long": 1,
        "invalid per-row sampling override": 2,
    }
    if refuses_sampling(spec_run.job):
        odd["unsupported sampling"] = 2  # sampled-a, sampled-b
    assert summary["shards"]["odd"]["errors_by_reason"] == dict(sorted(odd.items()))
    assert summary["shards"]["odd"]["errors"] == sum(odd.values())


def test_greedy_output_identical_with_and_without_speculation(spec_run, plain_run):
    assert plain_run.exit_code == 0, plain_run.log[-3000:]
    spec_rows = {r["request_id"]: r for r in read_output(spec_run.out).to_pylist()}
    plain_rows = {r["request_id"]: r for r in read_output(plain_run.out).to_pylist()}
    assert spec_rows.keys() == plain_rows.keys()
    compared = 0
    for rid, r in spec_rows.items():
        if r["error"] is None and r["temperature"] is None:
            assert r["generated_text"] == plain_rows[rid]["generated_text"], rid
            assert r["num_output_tokens"] == plain_rows[rid]["num_output_tokens"], rid
            compared += 1
    assert compared >= SHARDS * ROWS


def test_speculation_with_sampling_temperature(tmp_path, inputs, monkeypatch):
    """A job-wide temperature > 0 (here vLLM's default, 1.0) with speculation where batchspec's
    vLLM plugin is off: a spec error (exit 2) before any engine where the engine build corrupts
    sampled requests (vLLM's CPU build), a normal run elsewhere. With the plugin on, such jobs
    run: test_cpu_sampling.py::test_job_with_sampling_and_speculation_runs."""
    monkeypatch.setenv("BATCHSPEC_DISABLE_VLLM_PLUGIN", "1")  # here and in the CLI it starts
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "hot.yaml",
        input={"path": str(inputs[0] / "part-0.parquet"), "prompt_column": "prompt"},
        output={"path": str(out)},
        speculative=DRAFT,
        sampling={"max_tokens": 8},
    )
    result = run_cli("run", str(job), "--no-progress")
    if refuses_sampling(job):
        assert "starting vLLM engine" not in result.stderr
        assert result.returncode == 2, result.stderr[-2000:]
        assert "sampling.temperature" in result.stderr
        assert "default temperature is 1.0" in result.stderr
        assert not list(out.glob("*.parquet"))
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        table = pq.read_table(out / "part-0.parquet")
        assert table.num_rows == ROWS and table["error"].null_count == ROWS
        assert max(table["num_output_tokens"].to_pylist()) <= 8


def test_speculation_off_leaves_spec_columns_null(plain_run):
    table = read_output(plain_run.out)
    for column in CONTRACT_SPEC_COLUMNS:
        assert table[column].null_count == table.num_rows, column
    assert table["time_e2e_s"].null_count == sum(e is not None for e in table["error"].to_pylist())
    meta = read_metadata(str(plain_run.out / "part-0.parquet"))
    assert meta["draft_model"] is None and meta["speculative_method"] is None
    assert "acceptance_per_position" not in run_summary(plain_run.out)


def test_validate_predicts_the_refusals_of_the_real_run(spec_run):
    """What `validate` says (tokenizer only, no engine) against what the engine then did."""
    result = run_cli_in_process("validate", str(spec_run.job))
    assert result.returncode == 0, result.stderr
    shards = run_summary(spec_run.out)["shards"]
    lines = {
        m["shard"]: m
        for m in (
            re.match(
                r"  (?P<shard>\S+): committed, (?P<rows>\d+) rows, longest prompt (?P<longest>\d+) tokens"
                r"(; rows to be refused: (?P<refused>.*))?$",
                line,
            )
            for line in result.stdout.splitlines()
        )
        if m
    }
    assert sorted(lines) == sorted(shards), result.stdout
    for name, m in lines.items():
        table = pq.read_table(spec_run.out / f"{name}.parquet")
        assert int(m["rows"]) == table.num_rows
        assert int(m["longest"]) == max(n for n in table["num_prompt_tokens"].to_pylist() if n)
        predicted = {}
        for item in (m["refused"] or "").split(", "):
            if item:
                count, reason = item.split(" ", 1)
                predicted[reason] = int(count)
        actual = shards[name]["errors_by_reason"]
        assert predicted == {reason: actual.get(reason) for reason in predicted}, name
    assert lines["odd"]["refused"] == "2 empty prompt, 1 null prompt, 1 prompt too long"


def test_rerun_skips_committed_shards(spec_run, inputs):
    """A second run of a finished job starts no engine and changes nothing."""
    root, _ = inputs
    out = spec_run.out
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    result = run_cli("run", str(spec_run.job), "--no-progress", "--log-format", "json", timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    events = [r["event"] for r in records]
    started = next(r for r in records if r["event"] == "run_started")
    assert (started["shards"], started["pending"]) == (4, 0)
    assert sorted(r["shard"] for r in records if r["event"] == "shard_skipped") == [
        "odd",
        "part-0",
        "part-1",
        "part-2",
    ]
    assert "engine_starting" not in events and "shard_started" not in events
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before
    status = run_cli_in_process("status", str(spec_run.job), "--format", "json")
    assert status.returncode == 0, status.stderr
    assert [{k: r[k] for k in ("shard", "state", "input", "output")} for r in json.loads(status.stdout)] == [
        {
            "shard": name,
            "state": "committed",
            "input": str(root / f"{name}.parquet"),
            "output": str(out / f"{name}.parquet"),
        }
        for name in ("odd", "part-0", "part-1", "part-2")
    ]


def test_ngram_method(tmp_path_factory, inputs, plain_run, shared_engines):
    run = _library_job(tmp_path_factory, inputs, shared_engines, "ngram", NGRAM)
    assert run.exit_code == 0, run.log[-3000:]
    rows = read_output(run.out).to_pylist()
    check_acceptance_against_engine_counters(
        rows, run_summary(run.out), NGRAM["num_speculative_tokens"], full_drafts=False
    )
    plain = {r["request_id"]: r for r in read_output(plain_run.out).to_pylist()}
    compared = 0
    for r in rows:
        if r["error"] is None and r["temperature"] is None:
            assert r["generated_text"] == plain[r["request_id"]]["generated_text"], r["request_id"]
            compared += 1
    assert compared >= SHARDS * ROWS
    assert read_metadata(str(run.out / "part-0.parquet"))["speculative_method"] == "ngram"


#: What every generated row of a speculative run has: acceptance and timing, per request (the
#: reasoning split's columns are a reasoning model's).
SPEC_AND_TIMING = [
    *(c for c in CONTRACT_SPEC_COLUMNS if not c.startswith("spec_reasoning_")),
    *TIMING_COLUMNS,
    "output_tokens_per_s",
]


def test_eagle3_head(tmp_path_factory, inputs, plain_run, shared_engines):
    """The EAGLE-3 head `make models` trained (batchspec distill --method eagle3): every
    acceptance and timing column per request, per position against vLLM's own counters (a head
    proposes k tokens at every step), greedy text equal to speculation off, and the method in
    the file's metadata."""
    run = _library_job(tmp_path_factory, inputs, shared_engines, "head", HEAD)
    assert run.exit_code == 0, run.log[-3000:]
    rows = read_output(run.out).to_pylist()
    k = HEAD["num_speculative_tokens"]
    check_acceptance_against_engine_counters(rows, run_summary(run.out), k, full_drafts=True)
    plain = {r["request_id"]: r for r in read_output(plain_run.out).to_pylist()}
    compared = accepted = 0
    for r in rows:
        if (
            r["error"] is None and r["twin_of"] is None and r["num_output_tokens"] > 1
        ):  # a twin's are its twin's
            assert all(r[c] is not None for c in SPEC_AND_TIMING), {c: r[c] for c in SPEC_AND_TIMING}
        if r["error"] is None and r["temperature"] is None:
            assert r["generated_text"] == plain[r["request_id"]]["generated_text"], r["request_id"]
            compared += 1
            accepted += r["spec_num_accepted_tokens"] or 0
    assert compared >= SHARDS * ROWS and accepted > 0
    assert read_metadata(str(run.out / "part-0.parquet"))["speculative_method"] == "eagle3"


def test_chat_messages(tmp_path, shared_engines):
    messages_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    conversations = [
        [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}],
        [{"role": "user", "content": "import os\nimport sys\n"}],
        [],
        [{"role": "user", "content": "  "}],
    ]
    write_parquet(
        tmp_path / "in" / "chat.parquet",
        {"messages": pa.array(conversations, messages_type), "n": [1, 2, 3, 4]},
    )
    job = write_job(
        tmp_path / "chat.yaml",
        input={"path": str(tmp_path / "in"), "messages_column": "messages"},
        output={"path": str(tmp_path / "out")},
        speculative={"model": DRAFT["model"], "num_speculative_tokens": K},
        sampling={"temperature": 0.0, "max_tokens": 16},
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log[-3000:]
    rows = pq.read_table(tmp_path / "out" / "chat.parquet").to_pylist()
    by_n = {r["n"]: r for r in rows}
    assert [r["request_id"] for r in sorted(rows, key=lambda r: r["n"])] == [
        "chat/0",
        "chat/1",
        "chat/2",
        "chat/3",
    ]
    assert "messages" not in rows[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    for n in (1, 2):
        r = by_n[n]
        assert r["error"] is None and r["num_output_tokens"] > 0
        expected = tok.apply_chat_template(conversations[n - 1], tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert r["num_prompt_tokens"] == len(expected)
        assert len(r["spec_acceptance_histogram"]) == K + 1  # shorthand -> draft_model
    assert by_n[3]["error"] == "empty messages" and by_n[4]["error"] == "empty messages"
    # the summary's counters are this run's engine's, on an engine shared in one process with
    # others (vLLM keeps its metrics process-wide)
    check_acceptance_against_engine_counters(rows, run_summary(tmp_path / "out"), K, full_drafts=True)


def test_json_logs_one_object_per_line(spec_run, inputs):
    out = spec_run.out
    lines = [line for line in spec_run.log.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    for r in records:
        assert {"ts", "level", "event", "run_id"} <= r.keys()
    assert len({r["run_id"] for r in records}) == 1
    events = [r["event"] for r in records]
    assert events[0] == "engine_log" and events[1] == "run_started" and events[-1] == "run_finished"
    assert events.count("shard_started") == events.count("shard_committed") == 4
    table = read_output(out)
    for name in ("odd", "part-0", "part-1", "part-2"):
        committed = next(r for r in records if r["event"] == "shard_committed" and r["shard"] == name)
        t = pq.read_table(out / f"{name}.parquet")
        assert committed["rows"] == t.num_rows
        assert committed["output_tokens"] == sum(t["num_output_tokens"].to_pylist())
        assert committed["errors"] == t.num_rows - t["error"].null_count
    finished = records[-1]
    assert finished["status"] == "ok" and finished["rows"] == table.num_rows
    assert finished["output_tokens"] == sum(table["num_output_tokens"].to_pylist())
    assert finished["errors"] == table.num_rows - table["error"].null_count


def test_progress_events_at_the_requested_interval(spec_run, inputs):
    """Not at a terminal: a `progress` event every --progress-interval (0.2 s) seconds."""
    _, ids = inputs
    records = [json.loads(line) for line in spec_run.log.splitlines() if line.strip()]
    progress = [r for r in records if r["event"] == "progress"]
    assert len(progress) >= 3, "the default interval (30 s) would give none in this short run"
    done = [r["rows"] for r in progress]
    assert done == sorted(done) and len(set(done)) == len(done)  # strictly growing
    assert all(r["total_rows"] == len(ids) for r in progress)
    assert all(0 < r["rows"] <= len(ids) and r["errors"] <= r["rows"] for r in progress)
    stamps = [dt.datetime.fromisoformat(r["ts"]).timestamp() for r in progress]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert min(gaps) >= 0.2 - 0.01, gaps  # never more often than asked (ms-rounded stamps)
    table = read_output(spec_run.out)
    assert progress[-1]["output_tokens"] <= sum(table["num_output_tokens"].to_pylist())


def test_report_on_real_output(spec_run, plain_run, tmp_path):
    result = run_cli(
        "report", str(spec_run.out), "--format", "json", "--html", str(tmp_path / "r.html"), timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    table = read_output(spec_run.out)
    rows = table.to_pylist()
    ok = [r for r in rows if r["error"] is None]
    generated = [r for r in ok if r["twin_of"] is None]  # a twin has no figures of its own
    overall = report["overall"]
    assert report["files"] == 4
    assert overall["rows"] == table.num_rows
    assert overall["errors"] == table.num_rows - len(ok)
    assert overall["output_tokens"] == sum(r["num_output_tokens"] for r in rows)
    accepted = sum(r["spec_num_accepted_tokens"] or 0 for r in rows)
    drafted = sum(r["spec_num_draft_tokens"] or 0 for r in rows)
    assert overall["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert overall["acceptance_histogram"] == [
        sum(r["spec_acceptance_histogram"][j] for r in generated) for j in range(K + 1)
    ]
    assert overall["rows_from_twin"] == len(ok) - len(generated) == 1  # the seeded pair
    e2e = [r["time_e2e_s"] for r in generated]
    assert overall["e2e_s"]["count"] == len(generated)
    assert (overall["e2e_s"]["min"], overall["e2e_s"]["max"]) == (min(e2e), max(e2e))
    summary = run_summary(spec_run.out)
    assert report["acceptance_per_position"]["accepted"] == summary["acceptance_per_position"]["accepted"]
    assert report["lineage"]["run_id"] == [summary["run_id"]]
    assert (tmp_path / "r.html").read_text().count("<svg") >= 4
    compare = run_cli_in_process("report", str(plain_run.out), str(spec_run.out), "--format", "json")
    assert compare.returncode == 0, compare.stderr
    matching = json.loads(compare.stdout)["matching"]
    plain = {r["request_id"]: r for r in read_output(plain_run.out).to_pylist()}
    both_ok = [r for r in ok if plain[r["request_id"]]["error"] is None]
    assert (matching["matched"], matching["only_in_a"], matching["only_in_b"]) == (len(rows), 0, 0)
    assert matching["both_ok"] == len(both_ok)
    assert matching["identical_text"] == sum(
        r["generated_text"] == plain[r["request_id"]]["generated_text"] for r in both_ok
    )
