"""End to end through the CLI on the real vLLM engine and the tiny model pair.

Each module-scoped fixture runs one job (one engine start); the tests read what it wrote.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DRAFT, read_output, run_cli, write_job, write_parquet

from batchspec.columns import RESULT_FIELDS, SPEC_COLUMNS
from batchspec.sink import read_metadata

pytestmark = pytest.mark.engine

SHARDS, ROWS = 3, 24


def _bad_rows_shard(path):
    """A shard with every kind of bad row among good ones, and per-row overrides."""
    long_prompt = "def f(x):\n    return x\n" * 200  # far over max_model_len
    rows = [
        ("ok-0", "import os\nimport sys\n", None, None, None),
        ("null", None, None, None, None),
        ("empty", "", None, None, None),
        ("blank", "   \n\t ", None, None, None),
        ("too-long", long_prompt, None, None, None),
        ("bad-max-tokens", "x = 1\n", -5, None, None),
        ("bad-temperature", "x = 1\n", None, -1.0, None),
        ("short", "class A:\n    def __init__(self):\n", 3, None, None),
        ("sampled-a", "for i in range(10):\n", 24, 0.9, 7),
        ("sampled-b", "for i in range(10):\n", 24, 0.9, 7),
        ("ok-1", "def main():\n", None, None, None),
    ]
    write_parquet(path, {
        "id": [r[0] for r in rows],
        "prompt": pa.array([r[1] for r in rows], pa.string()),
        "max_tokens": pa.array([r[2] for r in rows], pa.int64()),
        "temperature": pa.array([r[3] for r in rows], pa.float64()),
        "seed": pa.array([r[4] for r in rows], pa.int64()),
    })
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
        table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens",
                                 table["max_tokens"].cast(pa.int64()))
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=10)
        ids += table["id"].to_pylist()
    ids += _bad_rows_shard(root / "odd.parquet")
    return root, ids


def _job(tmp_path_factory, inputs, name, speculative, *cli_args, **extra):
    root, _ = inputs
    work = tmp_path_factory.mktemp(name)
    out = work / "out"
    job = write_job(
        work / f"{name}.yaml",
        input={"path": str(root / "*.parquet"), "prompt_column": "prompt", "id_column": "id",
               "sampling_columns": {"max_tokens": "max_tokens", "temperature": "temperature",
                                    "seed": "seed"}},
        output={"path": str(out)},
        speculative=speculative,
        sampling={"temperature": 0.0, "max_tokens": 32},
        execution={"max_in_flight": 16},
        **extra,
    )
    result = run_cli("run", str(job), "--no-progress", *cli_args)
    return result, out


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory, inputs):
    return _job(tmp_path_factory, inputs, "spec", DRAFT)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, inputs):
    return _job(tmp_path_factory, inputs, "plain", None, "--log-format", "json",
                "--progress-interval", "0.2")


def test_run_succeeds_and_commits_one_file_per_shard(spec_run, inputs):
    result, out = spec_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.parquet")) == [
        "odd.parquet", "part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert not list((out / "_batchspec" / "tmp").glob("*")), "temporary files left behind"
    assert "ok: 4 shards committed" in result.stderr.splitlines()[-1]


def test_every_row_exactly_once(spec_run, inputs):
    _, ids = inputs
    table = read_output(spec_run[1])
    assert sorted(table["request_id"].to_pylist()) == sorted(ids)
    assert table.num_rows == len(ids)


def test_columns_and_types_match_the_contract(spec_run):
    for path in spec_run[1].glob("*.parquet"):
        schema = pq.read_schema(path)
        assert schema.field("request_id").type == pa.string()
        kept = [n for n in schema.names if n not in {"request_id", *[f.name for f in RESULT_FIELDS]}]
        # default keep_columns: every input column but the prompt
        assert kept == ["id", "topic", "max_tokens", "temperature", "seed"] or \
            kept == ["id", "max_tokens", "temperature", "seed"]
        for field in RESULT_FIELDS:
            assert schema.field(field.name).type == field.type, field.name
        assert schema.names[-len(RESULT_FIELDS):] == [f.name for f in RESULT_FIELDS]


def test_acceptance_invariants(spec_run):
    rows = [r for r in read_output(spec_run[1]).to_pylist() if r["error"] is None]
    assert rows
    drafted_total = 0
    for r in rows:
        steps, drafted, accepted = r["spec_num_steps"], r["spec_num_draft_tokens"], \
            r["spec_num_accepted_tokens"]
        assert 0 <= accepted <= drafted <= 4 * steps
        hist = r["spec_acceptance_histogram"]
        assert len(hist) == 5 and sum(hist) == steps
        assert sum(j * n for j, n in enumerate(hist)) == accepted
        if steps:
            assert r["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
        if drafted:
            assert r["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
        else:
            assert r["spec_acceptance_rate"] is None
        # every output token is the first (prefill) token, an accepted draft or a bonus token
        assert r["num_output_tokens"] <= 1 + accepted + steps
        drafted_total += drafted
    assert drafted_total > 0


def test_timings_are_consistent(spec_run):
    rows = [r for r in read_output(spec_run[1]).to_pylist() if r["error"] is None]
    for r in rows:
        for col in ("time_queued_s", "time_to_first_token_s", "time_decode_s", "time_e2e_s"):
            assert r[col] is not None and r[col] >= 0, (col, r)
        assert r["time_e2e_s"] >= r["time_to_first_token_s"]
        assert r["time_e2e_s"] == pytest.approx(r["time_to_first_token_s"] + r["time_decode_s"])
        if r["num_output_tokens"] > 1 and r["time_decode_s"] > 0:
            assert r["output_tokens_per_s"] == pytest.approx(
                (r["num_output_tokens"] - 1) / r["time_decode_s"])


def test_bad_rows_get_errors_and_the_rest_go_on(spec_run):
    rows = {r["request_id"]: r for r in read_output(spec_run[1]).to_pylist()}
    expected = {
        "null": "null prompt",
        "empty": "empty prompt",
        "blank": "empty prompt",
        "too-long": "prompt too long",
        "bad-max-tokens": "invalid per-row sampling override (max_tokens=-5)",
        "bad-temperature": "invalid per-row sampling override (temperature=-1.0)",
    }
    for rid, words in expected.items():
        r = rows[rid]
        assert r["finish_reason"] == "error" and r["generated_text"] is None, r
        assert words in r["error"], r["error"]
        assert all(r[c] is None for c in SPEC_COLUMNS)
    assert "max_model_len 512" in rows["too-long"]["error"]
    for rid in ("ok-0", "ok-1", "short"):
        assert rows[rid]["error"] is None and rows[rid]["finish_reason"] in ("stop", "length")


def test_per_row_overrides(spec_run, inputs):
    table = read_output(spec_run[1])
    rows = {r["request_id"]: r for r in table.to_pylist()}
    assert rows["short"]["num_output_tokens"] <= 3
    assert rows["ok-0"]["num_output_tokens"] <= 32  # the job's max_tokens
    for r in rows.values():
        if r["max_tokens"] is not None and r["error"] is None:
            assert r["num_output_tokens"] <= r["max_tokens"]
    # vLLM's CPU build corrupts sampled requests (and greedy ones batched with them) when
    # speculative decoding is on: batchspec refuses those rows instead of writing garbage.
    for rid in ("sampled-a", "sampled-b"):
        assert rows[rid]["finish_reason"] == "error"
        assert rows[rid]["error"].startswith("unsupported sampling: temperature > 0")


def test_seeded_sampling_overrides_without_speculation(plain_run):
    rows = {r["request_id"]: r for r in read_output(plain_run[1]).to_pylist()}
    a, b = rows["sampled-a"], rows["sampled-b"]
    assert a["error"] is None and a["num_output_tokens"] > 0
    # the same prompt, temperature and seed give the same sampled text
    assert a["generated_text"] == b["generated_text"]


def test_output_metadata_names_spec_models_and_versions(spec_run):
    import vllm

    import batchspec

    meta = read_metadata(str(spec_run[1] / "part-0.parquet"))
    assert meta["vllm_version"] == vllm.__version__
    assert meta["batchspec_version"] == batchspec.__version__
    assert meta["target_model"].endswith("target")
    assert meta["draft_model"].endswith("draft")
    assert meta["speculative_method"] == "draft_model"
    assert meta["spec"]["speculative"]["num_speculative_tokens"] == 4
    assert meta["run_id"] and meta["shard"] == "part-0"


def test_run_summary(spec_run, inputs):
    out = spec_run[1]
    runs = list((out / "_batchspec" / "runs").glob("*.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    table = read_output(out)
    totals = summary["totals"]
    assert summary["status"] == "ok"
    assert totals["rows"] == table.num_rows
    assert totals["errors"] == sum(e is not None for e in table["error"].to_pylist())
    assert totals["output_tokens"] == sum(table["num_output_tokens"].to_pylist())
    accepted = sum(x or 0 for x in table["spec_num_accepted_tokens"].to_pylist())
    drafted = sum(x or 0 for x in table["spec_num_draft_tokens"].to_pylist())
    assert totals["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert totals["wall_s"] > 0 and totals["output_tokens_per_s"] > 0
    assert set(summary["shards"]) == {"odd", "part-0", "part-1", "part-2"}
    assert summary["shards"]["odd"]["errors"] == 8
    per_pos = summary["acceptance_per_position"]
    assert len(per_pos["accepted"]) == 4
    assert sum(per_pos["accepted"]) == accepted
    assert per_pos["accepted"] == sorted(per_pos["accepted"], reverse=True)


def test_greedy_output_identical_with_and_without_speculation(spec_run, plain_run):
    assert plain_run[0].returncode == 0, plain_run[0].stderr[-3000:]
    spec_rows = {r["request_id"]: r for r in read_output(spec_run[1]).to_pylist()}
    plain_rows = {r["request_id"]: r for r in read_output(plain_run[1]).to_pylist()}
    assert spec_rows.keys() == plain_rows.keys()
    compared = 0
    for rid, r in spec_rows.items():
        if r["error"] is None and r["temperature"] is None:
            assert r["generated_text"] == plain_rows[rid]["generated_text"], rid
            assert r["num_output_tokens"] == plain_rows[rid]["num_output_tokens"], rid
            compared += 1
    assert compared >= SHARDS * ROWS


def test_speculation_with_sampling_temperature_exits_2(tmp_path, inputs):
    """On vLLM's CPU build a job-wide temperature > 0 with speculation is a spec error."""
    job = write_job(tmp_path / "hot.yaml",
                    input={"path": str(inputs[0] / "part-0.parquet"), "prompt_column": "prompt"},
                    output={"path": str(tmp_path / "out")}, speculative=DRAFT,
                    sampling={"max_tokens": 8})
    result = run_cli("run", str(job), "--no-progress")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "sampling.temperature" in result.stderr and "default temperature is 1.0" in result.stderr
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_speculation_off_leaves_spec_columns_null(plain_run):
    table = read_output(plain_run[1])
    for column in SPEC_COLUMNS:
        assert table[column].null_count == table.num_rows, column
    assert table["time_e2e_s"].null_count == sum(e is not None for e in table["error"].to_pylist())
    meta = read_metadata(str(plain_run[1] / "part-0.parquet"))
    assert meta["draft_model"] is None and meta["speculative_method"] is None


def test_rerun_skips_committed_shards(spec_run, inputs, tmp_path):
    """A second run of a finished job starts no engine and changes nothing."""
    _, out = spec_run
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    job = next(out.parent.glob("*.yaml"))
    result = run_cli("run", str(job), "--no-progress", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "0 of 4 shards to do" in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before
    status = run_cli("status", str(job), timeout=60)
    assert status.returncode == 0 and "4 committed, 0 partial, 0 pending" in status.stdout


def test_ngram_method(tmp_path_factory, inputs, plain_run):
    result, out = _job(tmp_path_factory, inputs, "ngram",
                       {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 4})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_output(out).to_pylist()
    plain = {r["request_id"]: r for r in read_output(plain_run[1]).to_pylist()}
    drafted = 0
    for r in rows:
        if r["error"] is None:
            assert len(r["spec_acceptance_histogram"]) == 4
            assert sum(r["spec_acceptance_histogram"]) == r["spec_num_steps"]
            assert r["spec_num_accepted_tokens"] <= r["spec_num_draft_tokens"]
            drafted += r["spec_num_draft_tokens"]
            if r["temperature"] is None:
                assert r["generated_text"] == plain[r["request_id"]]["generated_text"]
    assert drafted > 0, "n-gram lookup never proposed a token"
    assert read_metadata(str(out / "part-0.parquet"))["speculative_method"] == "ngram"


def test_chat_messages(tmp_path, models):
    messages_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    conversations = [
        [{"role": "system", "content": "You write Python."},
         {"role": "user", "content": "def add(a, b):"}],
        [{"role": "user", "content": "import os\nimport sys\n"}],
        [],
        [{"role": "user", "content": "  "}],
    ]
    write_parquet(tmp_path / "in" / "chat.parquet",
                  {"messages": pa.array(conversations, messages_type), "n": [1, 2, 3, 4]})
    job = write_job(tmp_path / "chat.yaml",
                    input={"path": str(tmp_path / "in"), "messages_column": "messages"},
                    output={"path": str(tmp_path / "out")},
                    speculative={"model": DRAFT["model"], "num_speculative_tokens": 2},
                    sampling={"temperature": 0.0, "max_tokens": 16})
    result = run_cli("run", str(job), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = pq.read_table(tmp_path / "out" / "chat.parquet").to_pylist()
    by_n = {r["n"]: r for r in rows}
    assert [r["request_id"] for r in sorted(rows, key=lambda r: r["n"])] == \
        ["chat/0", "chat/1", "chat/2", "chat/3"]
    assert "messages" not in rows[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models / "target"))
    for n in (1, 2):
        r = by_n[n]
        assert r["error"] is None and r["num_output_tokens"] > 0
        expected = tok.apply_chat_template(conversations[n - 1], tokenize=True,
                                           add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert r["num_prompt_tokens"] == len(expected)
        assert len(r["spec_acceptance_histogram"]) == 3  # shorthand -> draft_model, k=2
    assert by_n[3]["error"] == "empty messages" and by_n[4]["error"] == "empty messages"


def test_json_logs_one_object_per_line(plain_run):
    result, out = plain_run
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    for r in records:
        assert {"ts", "level", "event", "run_id"} <= r.keys()
    assert len({r["run_id"] for r in records}) == 1
    events = [r["event"] for r in records]
    assert events[0] == "engine_log" and events[1] == "run_started" and events[-1] == "run_finished"
    assert events.count("shard_started") == events.count("shard_committed") == 4
    assert "progress" in events  # not at a terminal: periodic progress lines instead of bars
    progress = next(r for r in records if r["event"] == "progress")
    assert {"rows", "total_rows", "output_tokens_per_s", "eta_s"} <= progress.keys()
    committed = {r["shard"]: r for r in records if r["event"] == "shard_committed"}
    table = pq.read_table(out / "part-1.parquet")
    assert committed["part-1"]["rows"] == table.num_rows
    assert committed["part-1"]["output_tokens"] == sum(table["num_output_tokens"].to_pylist())
    finished = records[-1]
    assert finished["status"] == "ok" and finished["rows"] == read_output(out).num_rows
    assert finished["message"].startswith("ok: 4 shards committed")


def test_report_on_real_output(spec_run, plain_run, tmp_path):
    result = run_cli("report", str(spec_run[1]), "--format", "json", "--html",
                     str(tmp_path / "r.html"), timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    table = read_output(spec_run[1])
    text = json.dumps(report)
    assert str(table.num_rows) in text
    assert (tmp_path / "r.html").read_text().count("<svg") >= 4
    compare = run_cli("report", str(plain_run[1]), str(spec_run[1]), timeout=120)
    assert compare.returncode == 0, compare.stderr
    assert "request_id" in compare.stdout or "matched" in compare.stdout
