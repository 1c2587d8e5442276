"""The runner's I/O logic with a fake engine: commits, reruns, bad input, engine failure.

The fake engine echoes prompts and finishes requests out of order; it proves nothing about vLLM.
These behaviours also run end to end on the real engine: every row once in one file per shard,
bad rows and rerunning a finished job in test_e2e.py; changed input with --overwrite, the
zero-row shard, duplicate ids, a missing column and a corrupt row group exiting 3,
``on_bad_shard: skip``, explicit keep_columns and progress bars in test_cli_e2e.py; engine death
in test_recovery.py. Checked with the fake engine only: the output's row-group size, the
max_in_flight bound, and storage_options redacted in the output metadata.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import make_spec, outputs, run, shards
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.columns import RESULT_NAMES
from batchspec.errors import InputDataError, RuntimeFailure, SpecError
from batchspec.run.events import EventLog
from batchspec.run.job import RunOptions, run_job
from batchspec.spec.build import build_spec


@pytest.mark.vllm
def test_every_row_once_in_one_file_per_shard(tmp_path):
    shards(tmp_path)
    engine = FakeEngine()
    result, events = run(make_spec(tmp_path), engine)
    out = outputs(tmp_path)
    assert sorted(out) == ["s0", "s1", "s2"]
    for i, table in out.items():
        assert sorted(table["k"].to_pylist()) == list(range(10))
        assert table.column_names == ["request_id", "k", *RESULT_NAMES]
        assert sorted(table["request_id"].to_pylist()) == sorted(f"{i}/{j}" for j in range(10))
        assert pq.ParquetFile(tmp_path / "out" / f"{i}.parquet").num_row_groups == 3  # 4+4+2
    assert engine.max_seen_in_flight <= 5
    assert result.summary["totals"]["rows"] == 30
    assert [e for e, _ in events].count("shard_committed") == 3
    manifest = json.loads((tmp_path / "out" / "_batchspec" / "manifest" / "s1.json").read_text())
    assert manifest["rows"] == 10 and manifest["run_id"] == result.run_id


@pytest.mark.vllm
def test_rerun_skips_committed_and_redoes_changed_input(tmp_path):
    shards(tmp_path)
    run(make_spec(tmp_path))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.parquet")}
    result, events = run(make_spec(tmp_path))
    assert [f["shard"] for e, f in events if e == "shard_skipped"] == ["s0", "s1", "s2"]
    assert result.summary["totals"]["rows"] == 0
    write_parquet(tmp_path / "in" / "s1.parquet", {"prompt": ["changed"], "k": [7]})
    result, _ = run(make_spec(tmp_path))
    assert list(result.summary["shards"]) == ["s1"]
    assert outputs(tmp_path)["s1"]["k"].to_pylist() == [7]
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.parquet")}
    assert after["s0.parquet"] == before["s0.parquet"]
    result, _ = run(make_spec(tmp_path), overwrite=True)
    assert sorted(result.summary["shards"]) == ["s0", "s1", "s2"]


@pytest.mark.vllm
def test_zero_row_shard_commits_an_empty_file_with_the_full_schema(tmp_path):
    write_parquet(tmp_path / "in" / "empty.parquet", {"prompt": pa.array([], pa.string())})
    run(make_spec(tmp_path))
    table = pq.read_table(tmp_path / "out" / "empty.parquet")
    assert table.num_rows == 0 and table.column_names == ["request_id", *RESULT_NAMES]


@pytest.mark.vllm
def test_duplicate_ids_are_processed_and_counted(tmp_path):
    write_parquet(tmp_path / "in" / "d.parquet", {"id": ["a", "b", "a", "a"], "prompt": ["x"] * 4})
    result, _ = run(make_spec(tmp_path, id_column="id"))
    assert outputs(tmp_path)["d"].num_rows == 4
    assert result.summary["shards"]["d"]["duplicate_ids"] == 2
    assert result.summary["totals"]["duplicate_ids"] == 2


@pytest.mark.vllm
@pytest.mark.parametrize(
    "columns, extra, words",
    [
        ({"text": ["a"]}, {}, "missing prompt column 'prompt'"),
        ({"prompt": [1, 2]}, {}, "has type int64, expected text"),
        ({"prompt": ["a"]}, {"id_column": "uid"}, "missing id column 'uid'"),
        (
            {"prompt": ["a"]},
            {"sampling_columns": {"max_tokens": "mt"}},
            "missing sampling_columns.max_tokens column",
        ),
    ],
)
def test_bad_columns_exit_3_naming_shard_and_column(tmp_path, columns, extra, words):
    write_parquet(tmp_path / "in" / "good.parquet", {"prompt": ["a"], "uid": ["u"], "mt": [3]})
    write_parquet(tmp_path / "in" / "zz-bad.parquet", columns)
    with pytest.raises(InputDataError) as info:
        run(make_spec(tmp_path, **extra))
    assert info.value.exit_code == 3
    assert "zz-bad.parquet" in str(info.value) and words in str(info.value)


@pytest.mark.vllm
def test_corrupt_shard_exits_3_and_loses_nothing_already_done(tmp_path):
    shards(tmp_path, n=2)
    run(make_spec(tmp_path))
    shards(tmp_path, n=3)  # rewrites s0..s2: s0, s1 change, s2 is new
    (tmp_path / "in" / "s1.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputDataError, match=r"s1\.parquet: not a readable Parquet file"):
        run(make_spec(tmp_path))
    # the earlier committed outputs are untouched
    assert sorted(outputs(tmp_path)) == ["s0", "s1"]


@pytest.mark.vllm
def test_corrupt_shard_skip_records_it_and_goes_on(tmp_path):
    shards(tmp_path, n=3)
    (tmp_path / "in" / "s1.parquet").write_bytes(b"garbage")
    result, events = run(make_spec(tmp_path, on_bad_shard="skip"))
    assert sorted(outputs(tmp_path)) == ["s0", "s2"]
    assert "s1" in result.summary["bad_shards"]
    assert any(e == "shard_failed" and f["shard"] == "s1" for e, f in events)


@pytest.mark.vllm
def test_corrupt_row_group_midway_commits_nothing_partial(tmp_path):
    shards(tmp_path, n=1)
    path = tmp_path / "in" / "s5.parquet"
    pq.write_table(
        pa.table({"prompt": [f"p{i}" for i in range(40)], "k": list(range(40))}), path, row_group_size=10
    )
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    start = meta.row_group(2).column(0).data_page_offset
    data[start : start + 40] = b"\xff" * 40  # garble the third row group's page
    path.write_bytes(bytes(data))
    with pytest.raises(InputDataError, match="s5.parquet"):
        run(make_spec(tmp_path))
    assert sorted(outputs(tmp_path)) == ["s0"]  # the good shard committed, nothing of s5
    assert not list((tmp_path / "out" / "_batchspec" / "tmp").glob("*"))


@pytest.mark.vllm
def test_engine_failure_commits_nothing_partial_and_rerun_finishes(tmp_path):
    shards(tmp_path, n=3)
    with pytest.raises(RuntimeFailure, match="EngineDeadError"):
        run(make_spec(tmp_path), FakeEngine(fail_after=15))
    done = outputs(tmp_path)
    for table in done.values():
        assert table.num_rows == 10  # whatever was committed is complete
    assert not list((tmp_path / "out" / "_batchspec" / "tmp").glob("*"))
    summary = json.loads(next((tmp_path / "out" / "_batchspec" / "runs").glob("*.json")).read_text())
    assert summary["status"] == "failed" and "EngineDeadError" in summary["error"]
    run(make_spec(tmp_path))
    assert sorted(outputs(tmp_path)) == ["s0", "s1", "s2"]
    assert all(t.num_rows == 10 for t in outputs(tmp_path).values())


@pytest.mark.vllm
def test_bad_rows_become_error_rows(tmp_path):
    write_parquet(tmp_path / "in" / "b.parquet", {"prompt": pa.array(["ok", None, "", "  \n"], pa.string())})
    run(make_spec(tmp_path))
    rows = {r["request_id"]: r for r in outputs(tmp_path)["b"].to_pylist()}
    assert rows["b/0"]["error"] is None and rows["b/0"]["generated_text"] == "OK"
    assert rows["b/1"]["error"] == "null prompt"
    assert rows["b/2"]["error"] == rows["b/3"]["error"] == "empty prompt"
    assert all(rows[k]["finish_reason"] == "error" for k in ("b/1", "b/2", "b/3"))


@pytest.mark.vllm
def test_keep_columns_and_metadata(tmp_path):
    write_parquet(
        tmp_path / "in" / "m.parquet",
        {"prompt": ["a"], "keep": [1.5], "drop": ["x"], "when": pa.array([0], pa.timestamp("ms"))},
    )
    spec = build_spec(
        {
            **make_spec(tmp_path).raw,
            "output": {
                "path": str(tmp_path / "out"),
                "keep_columns": ["keep", "when"],
                "storage_options": {"secret": "hunter2"},
            },
        }
    )
    run(spec)
    table = outputs(tmp_path)["m"]
    assert table.column_names[:3] == ["request_id", "keep", "when"]
    assert table.schema.field("when").type == pa.timestamp("ms")
    from batchspec.io.writer import read_metadata

    meta = read_metadata(str(tmp_path / "out" / "m.parquet"))
    assert meta["spec"]["output"]["storage_options"] == {"secret": "***"}
    assert "hunter2" not in (tmp_path / "out" / "m.parquet").read_bytes().decode("latin-1")


@pytest.mark.vllm
def test_progress_bars_show_throughput(tmp_path, capsys):
    shards(tmp_path, n=2)
    run_job(
        make_spec(tmp_path), RunOptions(engine=FakeEngine(), events=EventLog("t", "text"), progress_bars=True)
    )
    err = capsys.readouterr().err
    assert "shards" in err and "rows" in err and "tok/s" in err
    assert "20/20" in err and "2/2" in err


def test_sample_rows_is_seeded_uniform_over_shards_and_skips_rows_a_run_would_refuse(tmp_path):
    """The sample tune and distill draw (prompts.sample_rows): every shard contributes, rows
    that would be error rows are never drawn, the same seed gives the same rows in the same
    order, another seed another sample."""
    from batchspec.io.reader import sample_rows

    for i in range(3):
        write_parquet(
            tmp_path / "in" / f"s{i}.parquet", {"prompt": ["", None] + [f"p{i}-{j}" for j in range(20)]}
        )
    spec = make_spec(tmp_path)
    rows, seen = sample_rows(spec, 12, seed=7)
    again, _ = sample_rows(spec, 12, seed=7)
    other, _ = sample_rows(spec, 12, seed=8)
    assert seen == 60 and len(rows) == 12
    prompts = [r.prompt for r in rows]
    assert prompts == [r.prompt for r in again]
    assert prompts != [r.prompt for r in other]
    assert all(p and p.startswith("p") for p in prompts)
    assert len({p.split("-")[0] for p in prompts}) == 3  # drawn from every shard
    everything, _ = sample_rows(spec, 100, seed=7)
    assert len(everything) == 60 and len({r.request_id for r in everything}) == 60


@pytest.mark.vllm
def test_a_reused_engine_generates_with_each_jobs_sampling_and_refuses_another_model(tmp_path):
    """run_job(spec, RunOptions(engine=...)) reuses a started engine across jobs: each job's own sampling is
    what it generates with (it used to keep the first spec's), and a job for another model,
    engine arguments or speculative config is a spec error naming the key, before any row."""
    from batchspec.engine.llm import Engine

    engine = FakeEngine()
    shards(tmp_path / "a", n=1)
    shards(tmp_path / "b", n=1)
    first, second = make_spec(tmp_path / "a"), make_spec(tmp_path / "b")
    run_job(first, RunOptions(engine=engine, events=EventLog("t", "text"), progress_bars=False))
    run_job(second, RunOptions(engine=engine, events=EventLog("t", "text"), progress_bars=False))
    assert [s.output.path for s in engine.bound] == [first.output.path, second.output.path]

    real = Engine.__new__(Engine)  # bind's bookkeeping alone, no vLLM
    # no speculation, no LoRA, no reasoning parser; the task
    real.serves = (first.model.target, dict(first.model.engine), None, None, None, "generate")
    warm = build_spec({**first.raw, "sampling": {"temperature": 0.7, "max_tokens": 9}})
    real.bind(warm)
    assert real.base_sampling == {"temperature": 0.7, "max_tokens": 9}
    for key, change in [
        ("model.target", {"model": {**first.raw["model"], "target": "other"}}),
        ("model.engine", {"model": {**first.raw["model"], "engine": {"dtype": "half"}}}),
        ("speculative", {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}),
        ("model.lora", {"model": {**first.raw["model"], "lora": {"adapters": {"a": "org/a"}}}}),
        ("model.reasoning_parser", {"model": {**first.raw["model"], "reasoning_parser": "qwen3"}}),
    ]:
        with pytest.raises(SpecError, match=key.replace(".", r"\.")):
            real.bind(build_spec({**first.raw, **change}))
    assert real.base_sampling == {"temperature": 0.7, "max_tokens": 9}
