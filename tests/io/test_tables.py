"""Delta Lake and Iceberg tables in and out (batchspec/io/tables.py, delta.py, iceberg.py) on
local disk, on the fake engine: every input row exactly once in the output table, after a
SIGKILL before or after a table commit and with two workers committing at once; the input
pinned at one version until the job is done with it; a filter, partitions, the schema check,
the keys refused; ``status`` and ``report`` on a table."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest
from helpers.fake_runs import run
from helpers.tables import (
    delta_prompts,
    expected_ids,
    iceberg_catalog,
    make_input,
    run_table_cli,
    table_cli,
    table_job,
    table_rows,
    write_job,
)

from batchspec.errors import InputDataError, Interrupted, SpecError
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

#: every run checks its spec against vLLM's classes, on the fake engine too
pytestmark = pytest.mark.vllm

FORMATS = ["delta", "iceberg"]


def _output_table(spec):
    from batchspec.io.output_dir import OutputDir

    return OutputDir.of(spec.output).table_state


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_table_in_and_out_holds_every_input_row_once(tmp_path, fmt):
    make_input(tmp_path, fmt, files=3)
    spec = build_spec(table_job(tmp_path, fmt, output={"commit_shards": 2}))
    result, events = run(spec)
    ids = expected_ids(spec)
    assert len(ids) == 15 and table_rows(spec) == ids
    pin = result.summary["input_pin"]
    assert pin["chosen"] == "latest" and pin["format"] == fmt
    # the lineage of each output file names the pin
    from batchspec.report.read import load_output

    output = load_output(spec.output.path, {}, spec.output)
    assert len(output.shards) == 3
    for meta in output.metadata.values():
        key = "version" if fmt == "delta" else "snapshot"
        assert meta["input_pin"][key] == pin[key]
    # status reads the table; a rerun does nothing and makes no table version
    status = job_status(spec)
    assert [s["state"] for s in status["shards"]] == ["committed"] * 3
    version = status["table"]["version"]
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 3
    assert _output_table(spec).version == version and table_rows(spec) == ids


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_are_committed_in_groups(tmp_path, fmt):
    make_input(tmp_path, fmt, files=5, rows=2)
    spec = build_spec(table_job(tmp_path, fmt, output={"commit_shards": 2}))
    run(spec)
    if fmt == "delta":
        from deltalake import DeltaTable

        operations = [h["operation"] for h in DeltaTable(spec.output.path).history()]
        assert operations.count("WRITE") == 3  # 2 + 2 + 1
    else:
        from batchspec.io.iceberg import load_catalog

        table = load_catalog(spec.output.catalog, "k").load_table("ns.results")
        shards = [
            json.loads(s.summary.additional_properties["batchspec.shards"]) for s in table.metadata.snapshots
        ]
        assert sorted(len(s) for s in shards) == [1, 2, 2]
    assert table_rows(spec) == expected_ids(spec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rerun_reads_the_pin_until_done_then_only_the_new_files(tmp_path, monkeypatch, fmt):
    """A run stopped after its first group commit; the table grows; the rerun reads the pin of
    the run it resumes (not the new file); the next run pins the latest and runs only the new
    file: a nightly job over a growing table."""
    from batchspec.io.output_formats import TableOutput

    make_input(tmp_path, fmt, files=3)
    spec = build_spec(table_job(tmp_path, fmt, output={"commit_shards": 1}))
    commit = TableOutput.commit_table
    calls = []

    def once(self, *args, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # stopped before its second commit
        return commit(self, *args, **kw)

    monkeypatch.setattr(TableOutput, "commit_table", once)
    with pytest.raises(Interrupted):
        run(spec)
    monkeypatch.undo()
    first = json.loads((tmp_path / "out" / "_batchspec" / "input_pin.json").read_text())
    assert len(table_rows(spec)) == 5
    make_input(tmp_path, fmt, files=1, first=3)  # the table grows
    result, _ = run(spec)
    key = "version" if fmt == "delta" else "snapshot"
    assert result.summary["input_pin"]["chosen"] == "resumed"
    assert result.summary["input_pin"][key] == first[key]
    assert len(table_rows(spec)) == 15
    result, events = run(spec)
    assert result.summary["input_pin"]["chosen"] == "latest"
    assert result.summary["input_pin"][key] != first[key]
    assert [e for e, _ in events].count("shard_committed") == 1
    assert table_rows(spec) == expected_ids(spec) and len(table_rows(spec)) == 20


def test_a_version_given_reads_that_version(tmp_path):
    delta_prompts(str(tmp_path / "in"), files=3)
    spec = build_spec(table_job(tmp_path, "delta", input={"version": 1}))
    result, _ = run(spec)
    assert result.summary["input_pin"] == {
        "format": "delta",
        "table": str(tmp_path / "in"),
        "version": 1,
        "chosen": "spec",
    }
    assert len(table_rows(spec)) == 10  # versions 0 and 1: two files


def test_a_version_given_is_recorded_as_the_pin(tmp_path):
    """``input.version`` is recorded in input_pin.json; a later run without it reads that
    version until it is done, then the latest."""
    delta_prompts(str(tmp_path / "in"), files=3)
    run(build_spec(table_job(tmp_path, "delta", input={"version": 1})))
    pin = json.loads((tmp_path / "out" / "_batchspec" / "input_pin.json").read_text())
    assert pin["version"] == 1 and pin["format"] == "delta"
    later = build_spec(table_job(tmp_path, "delta"))
    result, events = run(later)
    assert result.summary["input_pin"]["chosen"] == "latest" and result.summary["input_pin"]["version"] == 2
    assert [e for e, _ in events].count("shard_committed") == 1 and len(table_rows(later)) == 15


def test_a_delta_filter_prunes_files_and_rows_and_partitions_are_columns(tmp_path):
    from deltalake import write_deltalake

    for lang in ("en", "fr"):
        table = pa.table(
            {
                "prompt": [f"{lang} {j}" for j in range(4)],
                "k": pa.array(range(4), pa.int64()),
                "lang": [lang] * 4,
            }
        )
        write_deltalake(str(tmp_path / "in"), table, partition_by=["lang"], mode="append")
    spec = build_spec(table_job(tmp_path, "delta", input={"filter": "lang = 'en' AND k < 2"}))
    result, _ = run(spec)
    assert len(result.summary["shards"]) == 1  # the fr file pruned by its partition
    import polars as pl

    df = pl.read_delta(str(tmp_path / "out")).sort("k")
    assert df["lang"].to_list() == ["en", "en"] and df["k"].to_list() == [0, 1]
    assert df["generated_text"].to_list() == ["EN 0", "EN 1"]


def _same_name_in_two_partitions(url: str) -> None:
    """A Delta table partitioned by ``lang`` whose two files (en, fr) have one base name, as
    Spark's tables may."""
    import os
    import time

    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction

    schema = pa.schema([("prompt", pa.string()), ("k", pa.int64()), ("lang", pa.string())])
    table = DeltaTable.create(url, schema=schema, partition_by=["lang"])
    actions = []
    for lang in ("en", "fr"):
        os.makedirs(f"{url}/lang={lang}")
        path = f"{url}/lang={lang}/part-0.parquet"
        pq.write_table(
            pa.table({"prompt": [f"{lang} 0", f"{lang} 1"], "k": pa.array([0, 1], pa.int64())}), path
        )
        stats = json.dumps({"numRecords": 2})
        actions.append(
            AddAction(
                f"lang={lang}/part-0.parquet",
                os.path.getsize(path),
                {"lang": lang},
                int(time.time() * 1000),
                True,
                stats,
            )
        )
    table.create_write_transaction(actions, "append", table.schema(), partition_by=["lang"])


def test_delta_files_of_one_name_in_two_partitions_are_matched_by_their_path(tmp_path, monkeypatch):
    """Pruning and deletion vectors match a data file by its path in the table, not its name."""
    from batchspec.io.delta import DeltaInput
    from batchspec.run.stages import plan

    _same_name_in_two_partitions(str(tmp_path / "in"))
    spec = build_spec(table_job(tmp_path, "delta", input={"filter": "lang = 'fr'"}))
    assert [s.name for s in plan(spec).shards] == ["lang=fr/part-0"]
    monkeypatch.setattr(
        DeltaInput, "_deletion_vectors", staticmethod(lambda table: {"lang=fr/part-0.parquet"})
    )
    spec = build_spec(table_job(tmp_path, "delta"))
    shards = plan(spec).shards
    assert [(s.name, s.table.refused is not None) for s in shards] == [
        ("lang=en/part-0", False),
        ("lang=fr/part-0", True),
    ]


def test_a_delta_filter_prunes_and_filters_with_polars_alone(tmp_path):
    """One engine prunes the files and filters the rows: a predicate delta-rs cannot prune
    with (ILIKE) but polars reads runs; one polars cannot apply to the table's columns (a
    column compared with a value of another type, which delta-rs would coerce) is exit 2
    naming input.filter at planning, before any file is read."""
    from batchspec.run.stages import plan

    _same_name_in_two_partitions(str(tmp_path / "in"))
    spec = build_spec(table_job(tmp_path, "delta", input={"filter": "lang ILIKE 'EN' AND k > 0"}))
    assert [s.name for s in plan(spec).shards] == ["lang=en/part-0"]
    run(spec)
    import polars as pl

    assert pl.read_delta(str(tmp_path / "out"))["generated_text"].to_list() == ["EN 1"]
    for bad in ("k = '1'", "nope = 1"):
        spec = build_spec(table_job(tmp_path, "delta", input={"filter": bad}))
        with pytest.raises(SpecError) as info:
            plan(spec)
        assert info.value.key == "input.filter" and info.value.exit_code == 2


def test_an_iceberg_filter_is_pushed_down(tmp_path):
    make_input(tmp_path, "iceberg", files=2, rows=5)
    spec = build_spec(table_job(tmp_path, "iceberg", input={"filter": "k >= 3"}))
    run(spec)
    assert len(table_rows(spec)) == 4


def test_an_iceberg_table_is_read_as_its_snapshot_says_after_a_delete(tmp_path):
    """Rows deleted from the table (pyiceberg rewrites the file) are not read; the data files
    at the snapshot are the shards, read through pyiceberg (positional deletes applied)."""
    from pyiceberg.catalog import load_catalog

    catalog = iceberg_catalog(tmp_path)
    make_input(tmp_path, "iceberg", files=1, rows=6)
    load_catalog("default", **catalog).load_table("ns.prompts").delete("k = 2")
    spec = build_spec(table_job(tmp_path, "iceberg", out_fmt="parquet"))
    run(spec)
    import pyarrow.parquet as pq

    files = list((tmp_path / "out").rglob("*.parquet"))
    kept = pa.concat_tables([pq.read_table(f) for f in files])["generated_text"].to_pylist()
    assert sorted(kept) == sorted(f"PROMPT 0-{j}" for j in (0, 1, 3, 4, 5))


def test_an_iceberg_delete_added_after_a_shard_was_committed_leaves_it_committed(tmp_path, monkeypatch):
    """A positional delete file added later to a data file already answered: its shard stays
    committed (not stale), and a rerun skips it."""
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.table import DataScan, FileScanTask

    make_input(tmp_path, "iceberg", files=2)
    spec = build_spec(table_job(tmp_path, "iceberg"))
    run(spec)
    plan_files = DataScan.plan_files

    def with_deletes(self):
        def deletes(data):
            return DataFile.from_args(
                content=DataFileContent.POSITION_DELETES,
                file_path=data.file_path + ".deletes.parquet",
                file_format=FileFormat.PARQUET,
                record_count=1,
                file_size_in_bytes=100,
            )

        return [FileScanTask(t.file, {deletes(t.file)}, t.residual) for t in plan_files(self)]

    monkeypatch.setattr(DataScan, "plan_files", with_deletes)
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 2
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 2
    monkeypatch.undo()
    assert table_rows(spec) == expected_ids(spec)


def test_delta_deletion_vectors_are_refused_naming_the_feature(tmp_path, monkeypatch):
    from batchspec.io.delta import DeltaInput

    delta_prompts(str(tmp_path / "in"), files=1)
    monkeypatch.setattr(
        DeltaInput,
        "_deletion_vectors",
        staticmethod(lambda table: {p.rsplit("/", 1)[-1] for p in table.file_uris()}),  # at the root
    )
    spec = build_spec(table_job(tmp_path, "delta"))
    with pytest.raises(InputDataError, match="deletion vectors") as info:
        run(spec)
    assert info.value.exit_code == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_table_of_other_columns_is_exit_2_naming_the_column(tmp_path, fmt):
    """An output table another job made (other columns): exit 2 naming the column, before
    any row is generated."""
    make_input(tmp_path, fmt, files=1)
    spec = build_spec(table_job(tmp_path, fmt))
    other = pa.table({"request_id": ["x"], "score": [1.0]})
    if fmt == "delta":
        from deltalake import write_deltalake

        write_deltalake(spec.output.path, other)
    else:
        from batchspec.io.iceberg import load_catalog

        load_catalog(spec.output.catalog, "k").create_table(
            "ns.results", schema=other.schema, location=spec.output.path
        )
    with pytest.raises(SpecError, match="column 'k'") as info:
        run(spec)
    assert info.value.exit_code == 2 and info.value.key in ("output.path", "output.table")
    assert not list((tmp_path / "out").glob("data/*~*.parquet"))


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"input": {"path": "x/*.parquet", "prompt_column": "p", "version": 3}}, "input.version"),
        ({"input": {"path": "x", "format": "delta", "prompt_column": "p", "snapshot": 3}}, "input.snapshot"),
        ({"input": {"path": "x/*.parquet", "prompt_column": "p", "filter": "a = 1"}}, "input.filter"),
        ({"input": {"path": "x/*", "format": "delta", "prompt_column": "p"}}, "input.path"),
        ({"input": {"path": "x", "format": "iceberg", "prompt_column": "p"}}, "input.path"),
        (
            {"input": {"format": "iceberg", "prompt_column": "p", "table": "t", "catalog": {"type": "sql"}}},
            "input.table",
        ),
        ({"input": {"format": "iceberg", "prompt_column": "p", "table": "ns.t"}}, "input.catalog"),
        (
            {"input": {"path": "x", "format": "delta", "prompt_column": "p", "filter": "a = = 1"}},
            "input.filter",
        ),
        ({"output": {"path": "o", "table": "ns.t"}}, "output.table"),
        ({"output": {"path": "o", "format": "delta", "table": "ns.t"}}, "output.table"),
        ({"output": {"path": "o", "format": "delta", "catalog": {"type": "sql"}}}, "output.catalog"),
        ({"output": {"path": "o", "commit_shards": 4}}, "output.commit_shards"),
        ({"output": {"path": "o", "format": "iceberg"}}, "output.table"),
        ({"output": {"path": "o", "format": "delta", "commit_shards": 0}}, "output.commit_shards"),
        ({"output": {"path": "o", "format": "delta"}, "executor": {"kind": "ray"}}, "executor.kind"),
    ],
)
def test_a_key_no_table_reads_is_refused_naming_it(patch, key):
    raw = {
        "input": {"path": "x/*.parquet", "prompt_column": "p"},
        "output": {"path": "o"},
        "model": {"target": "m"},
        **patch,
    }
    with pytest.raises(SpecError) as info:
        build_spec(raw)
    assert info.value.key == key, info.value


def test_overwrite_of_a_table_is_refused_before_any_work(tmp_path):
    make_input(tmp_path, "delta", files=1)
    spec = build_spec(table_job(tmp_path, "delta"))
    with pytest.raises(SpecError) as info:
        run(spec, overwrite=True)
    assert info.value.key == "--overwrite"
    assert not (tmp_path / "out" / "_delta_log").exists()


def test_the_delta_checkpoint_interval_is_respected(tmp_path):
    from deltalake import DeltaTable

    make_input(tmp_path, "delta", files=1)
    spec = build_spec(table_job(tmp_path, "delta", output={"commit_shards": 1}))
    run(spec)
    DeltaTable(spec.output.path).alter.set_table_properties({"delta.checkpointInterval": "3"})
    make_input(tmp_path, "delta", files=4, first=1)
    run(spec)
    log = tmp_path / "out" / "_delta_log"
    assert list(log.glob("*.checkpoint.parquet")), sorted(p.name for p in log.iterdir())
    assert table_rows(spec) == expected_ids(spec)


def _jsonl_job(tmp_path, fmt, files: dict[str, list[dict]], **extra) -> dict:
    """A job over JSON-lines files (``name -> records``) into a table of format ``fmt``."""
    folder = tmp_path / "j"
    folder.mkdir(exist_ok=True)
    for name, records in files.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    raw = table_job(tmp_path, fmt, output={"commit_shards": 1}, **extra)
    raw["input"] = {"path": str(folder / "*.jsonl"), "prompt_column": "p", **extra.get("input", {})}
    return raw


@pytest.mark.parametrize("fmt", FORMATS)
def test_jsonl_shards_are_written_with_one_type_per_column(tmp_path, fmt):
    """Each JSON-lines shard infers its types from its own first records: a column null in one
    shard's first records (then numbers) and int in another's is written as the table's type by
    both, and a float shard widens an int column; every row in the table."""
    nulls = [{"p": f"b{j}", "score": None} for j in range(3)] + [{"p": "b3", "score": 7}]
    files = {
        "a.jsonl": [{"p": "a0", "score": 1}, {"p": "a1", "score": 2}],
        "b.jsonl": nulls,
        "c.jsonl": [{"p": "c0", "score": 0.5}],
    }
    spec = build_spec(_jsonl_job(tmp_path, fmt, files))
    run(spec)
    assert len(table_rows(spec)) == 7
    state = _output_table(spec)
    assert state.schema.field("score").type == pa.float64()


@pytest.mark.parametrize("skip", [False, True])
def test_a_jsonl_shard_of_another_type_is_a_bad_shard_before_any_commit(tmp_path, skip):
    """A kept column that is int in one JSON-lines shard and text in another: the second is a
    bad shard, found by the check stage before any shard is committed (exit 3 naming it and the
    column), or left out with ``on_bad_shard: skip``; never a failed group commit. The same
    once the table exists: its types are the ones a shard must have."""
    files = {
        "a.jsonl": [{"p": "a0", "score": 1}, {"p": "a1", "score": 2}],
        "b.jsonl": [{"p": "b0", "score": None}, {"p": "b1", "score": "x"}, {"p": "b2", "score": "y"}],
    }
    extra = {"input": {"on_bad_shard": "skip"}} if skip else {}
    spec = build_spec(_jsonl_job(tmp_path, "delta", files, **extra))
    if not skip:
        with pytest.raises(InputDataError, match="'score'") as info:
            run(spec)
        assert info.value.exit_code == 3 and "b.jsonl" in str(info.value)
        assert not _output_table(spec).exists
        return
    result, _ = run(spec)
    assert list(result.summary["bad_shards"]) == ["b"] and "'score'" in result.summary["bad_shards"]["b"]
    assert table_rows(spec) == ["a/0", "a/1"]
    # the table exists (score int64): a new shard of text is bad, the run goes on
    (tmp_path / "j" / "c.jsonl").write_text(json.dumps({"p": "c0", "score": "z"}) + "\n")
    (tmp_path / "j" / "d.jsonl").write_text(json.dumps({"p": "d0", "score": None}) + "\n")
    result, _ = run(spec)
    assert list(result.summary["bad_shards"]) == ["b", "c"]
    assert table_rows(spec) == ["a/0", "a/1", "d/0"]


# ------------------------------------------------------------------------ crash windows


def _cli_job(tmp_path, fmt, **extra):
    raw = table_job(tmp_path, fmt, **extra)
    return build_spec(raw), write_job(tmp_path / "job.yaml", raw)


@pytest.mark.parametrize("crash", ["before", "after"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sigkill_around_the_table_commit_leaves_every_row_once(tmp_path, fmt, crash):
    """SIGKILL after the shards' Parquet files are written but before the table commit
    (``before``), and after the table commit but before batchspec's manifests (``after``);
    then ``status`` and a rerun: every input row exactly once in the table."""
    make_input(tmp_path, fmt, files=3)
    spec, job = _cli_job(tmp_path, fmt, output={"commit_shards": 2})
    killed = run_table_cli("run", str(job), "--no-progress", crash=crash)
    assert killed.returncode == -9, killed.stderr
    ids = expected_ids(spec)
    states = [s["state"] for s in job_status(spec)["shards"]]
    if crash == "before":
        assert states == ["pending"] * 3
        data = list((tmp_path / "out" / "data").rglob("*.parquet"))
        assert len(data) == 2  # written, named by no commit: invisible
        assert not _output_table(spec).exists or table_rows(spec) == []
    else:
        assert sorted(states) == ["committed", "committed", "pending"]
        assert not list((tmp_path / "out" / "_batchspec" / "manifest").rglob("*.json"))
        assert len(table_rows(spec)) == 10
    rerun = run_table_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    assert table_rows(spec) == ids
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_workers_committing_at_once_leave_every_row_once(tmp_path, fmt):
    """Two workers of one job, each committing one shard a commit, at the same moments: the
    commits that lose the race are retried."""
    make_input(tmp_path, fmt, files=8, rows=3)
    spec, job = _cli_job(tmp_path, fmt, output={"commit_shards": 1})
    workers = [
        table_cli("run", str(job), "--no-progress", "--worker-index", str(i), "--num-workers", "2")
        for i in range(2)
    ]
    for w in workers:
        _, stderr = w.communicate(timeout=180)
        assert w.returncode == 0, stderr
    assert table_rows(spec) == expected_ids(spec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_commits_of_one_shard_from_one_table_version_commit_it_once(tmp_path, fmt, monkeypatch):
    """The race leases normally prevent: two writers read the same table state and commit the
    same shard's files (two attempts' files) at once. The table holds it once; the loser is
    told it was already committed."""
    import importlib

    from batchspec.io.output_dir import OutputDir
    from batchspec.io.records import ShardFile

    make_input(tmp_path, fmt, files=2, rows=3)
    spec = build_spec(table_job(tmp_path, fmt, output={"commit_shards": 1}))
    result, _ = run(spec)  # creates the table: one shard of it committed below twice
    out = OutputDir.of(spec.output)
    first = sorted((tmp_path / "out" / "data").rglob("*.parquet"))[0]
    copies = []
    for token in ("aaaa", "bbbb"):
        copy = first.with_name(first.name.split("~")[0] + f"-x~{token}.parquet")
        copy.write_bytes(first.read_bytes())
        copies.append(ShardFile("race", f"data/{copy.name}", str(copy), copy.stat().st_size, 3))
    module = importlib.import_module(out.format.module)
    barrier, waited = threading.Barrier(2), set()
    if fmt == "delta":
        original = module._open

        def opened(*args, **kw):
            table = original(*args, **kw)
            me = threading.current_thread()
            if me.name.startswith("race") and me.name not in waited:  # both read one state
                waited.add(me.name)
                barrier.wait(timeout=10)
            return table

        monkeypatch.setattr(module, "_open", opened)
    else:
        original = module._load_table

        def loaded(*args, **kw):
            table = original(*args, **kw)
            me = threading.current_thread()
            if me.name.startswith("race") and me.name not in waited:  # both read one state
                waited.add(me.name)
                barrier.wait(timeout=10)
            return table

        monkeypatch.setattr(module, "_load_table", loaded)
    results = []
    schema = pa.schema(_output_table(spec).schema)

    def commit(f):
        results.append(module.commit(out, [f], schema, {"run_id": "race"}))

    threads = [threading.Thread(target=commit, args=(f,), name=f"race-{i}") for i, f in enumerate(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(len(r.committed) for r in results) == [0, 1]
    assert sorted(len(r.already) for r in results) == [0, 1]
    assert len(table_rows(spec)) == 6 + 3  # the job's rows and the raced shard's once


def test_status_and_validate_do_not_pin_the_input(tmp_path):
    """Only a run records its pin: a ``status`` before it shows what a run would read now, and
    the run then reads the latest version when it starts."""
    make_input(tmp_path, "delta", files=1)
    spec = build_spec(table_job(tmp_path, "delta"))
    assert job_status(spec)["input_pin"]["version"] == 0
    assert not (tmp_path / "out" / "_batchspec" / "input_pin.json").exists()
    make_input(tmp_path, "delta", files=1, first=1)
    result, _ = run(spec)
    assert result.summary["input_pin"]["version"] == 1 and len(table_rows(spec)) == 10
