"""Lance datasets in and out (batchspec/io/lance.py) on local disk and on the S3 server the
tests start (moto), on the fake engine: every input row exactly once in the output dataset,
after a SIGKILL before or after its commit and with a rival commit racing one; the input pinned
at one version; the schema check naming a column (a vector column accepted); a data file
outside the dataset refused."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest
from helpers.fake_runs import run, shards
from helpers.jobs import write_parquet
from helpers.tables import lance_prompts, lance_rows, prompts, run_table_cli, table_cli, write_job

from batchspec.errors import InputDataError, Interrupted, SpecError
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

#: every run checks its spec against vLLM's classes, on the fake engine too
pytestmark = pytest.mark.vllm


def _files_job(tmp_path, out: str | None = None, options=None, **output) -> dict:
    """Parquet files ``s0..`` (``tmp_path/in``) into a Lance dataset (``out``)."""
    return {
        "name": "lance",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {
            "path": out or str(tmp_path / "out.lance"),
            "format": "lance",
            **({"storage_options": options} if options else {}),
            **output,
        },
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 4, "read_batch_rows": 3},
    }


def _file_ids(n: int, rows: int) -> list[str]:
    return sorted(f"s{i}/{j}" for i in range(n) for j in range(rows))


def _dataset(spec):
    import lance

    from batchspec.io.lance import dataset_uri, storage_options

    out = spec.output
    return lance.dataset(
        dataset_uri(out.path, "output.path"), storage_options=storage_options(out.path, out.storage_options)
    )


@pytest.fixture
def bucket(s3_server):
    import s3fs

    endpoint, options = s3_server
    name = f"lance-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(name)
    return name, endpoint, options


# --------------------------------------------------------------------------------- output


def test_files_into_a_lance_dataset_every_row_once_and_a_rerun_does_nothing(tmp_path):
    shards(tmp_path, n=3, rows=5)
    spec = build_spec(_files_job(tmp_path, commit_shards=2))
    run(spec)
    assert lance_rows(spec) == _file_ids(3, 5)
    dataset = _dataset(spec)
    # two group commits, each naming its shards in its transaction; the files named after them
    recorded = [
        json.loads(t.transaction_properties["batchspec.shards"])
        for t in dataset.get_transactions(dataset.version)
        if t is not None and "batchspec.shards" in t.transaction_properties
    ]
    assert sorted(len(r) for r in recorded) == [1, 2]
    names = sorted(f.metadata.files[0].path.split("__")[0] for f in dataset.get_fragments())
    assert names == ["s0", "s1", "s2"]
    status = job_status(spec)
    assert [s["state"] for s in status["shards"]] == ["committed"] * 3
    assert status["table"] == {"format": "lance", "exists": True, "version": dataset.version}
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 3
    assert _dataset(spec).version == dataset.version and lance_rows(spec) == _file_ids(3, 5)


@pytest.mark.parametrize("crash", ["before", "after"])
def test_a_sigkill_around_a_lance_commit_leaves_every_row_once(tmp_path, crash):
    """Killed with the shards' fragments written and the commit not made (nothing visible), or
    with the commit made and batchspec's manifests not written (the dataset says committed)."""
    shards(tmp_path, n=3, rows=5)
    raw = _files_job(tmp_path, commit_shards=2)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    killed = run_table_cli("run", str(job), "--no-progress", crash=crash)
    assert killed.returncode == -9, killed.stderr
    states = sorted(s["state"] for s in job_status(spec)["shards"])
    if crash == "before":
        assert states == ["pending"] * 3
        # the fragments were written, and no version names them
        assert list((tmp_path / "out.lance" / "data").glob("*.lance")) and lance_rows(spec) == []
    else:
        assert states == ["committed", "committed", "pending"]
        assert not list((tmp_path / "out.lance" / "_batchspec" / "manifest").glob("*.json"))
    rerun = run_table_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    assert lance_rows(spec) == _file_ids(3, 5)
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3
    # the killed attempt's files, named by no version, went when the rerun committed their shards
    assert _data_files(tmp_path / "out.lance") == _named(spec)


def _data_files(root) -> list[str]:
    return sorted(p.name for p in (root / "data").iterdir())


def _named(spec) -> list[str]:
    """The data files the dataset's versions name, every version's."""
    dataset = _dataset(spec)
    return sorted(
        {
            data.path
            for version in dataset.versions()
            for fragment in dataset.checkout_version(version["version"]).get_fragments()
            for data in fragment.metadata.files
        }
    )


def test_a_shard_named_with_many_non_ascii_characters_into_a_lance_dataset(tmp_path):
    """30 CJK characters (90 bytes; 270 escaped, each byte as _XX): its data file is named by
    the escaped name's start and a hash of the name, under 255 bytes; status and a rerun find
    the shard committed by it, and a report names it."""
    from batchspec.report.read import load_output

    name = "中" * 30
    write_parquet(tmp_path / "in" / f"{name}.parquet", {"prompt": ["p0", "p1"], "k": [0, 1]})
    shards(tmp_path, n=1, rows=2)
    spec = build_spec(_files_job(tmp_path))
    run(spec)
    assert lance_rows(spec) == sorted([f"{name}/0", f"{name}/1", "s0/0", "s0/1"])
    assert max(len(f.encode()) for f in _data_files(tmp_path / "out.lance")) < 255
    assert {s["shard"]: s["state"] for s in job_status(spec)["shards"]} == {
        name: "committed",
        "s0": "committed",
    }
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 2
    assert lance_rows(spec) == sorted([f"{name}/0", f"{name}/1", "s0/0", "s0/1"])
    assert sorted(load_output(spec.output.path, {}, None).shards) == sorted([name, "s0"])


def test_two_workers_committing_at_once_to_a_lance_dataset(tmp_path):
    shards(tmp_path, n=6, rows=2)
    raw = _files_job(tmp_path, commit_shards=1)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    workers = [
        table_cli("run", str(job), "--no-progress", "--worker-index", str(i), "--num-workers", "2")
        for i in range(2)
    ]
    for w in workers:
        _, stderr = w.communicate(timeout=180)
        assert w.returncode == 0, stderr
    assert lance_rows(spec) == _file_ids(6, 2)


def _written(out, name: str, rows: int):
    """A shard's fragments written to ``out`` (a LanceShardFile), not committed."""
    from batchspec.io.lance import LanceFragmentWriter
    from batchspec.io.records import FileFormat, Shard

    shard = Shard(url=name, path=name, name=name, fs=None, fingerprint={}, format=FileFormat("parquet"))
    writer = LanceFragmentWriter(out, shard, [], {"run_id": "test"})
    for j in range(rows):
        writer.add({"request_id": f"{name}/{j}", "generated_text": "x", "finish_reason": "stop"})
    return writer.commit()["table_file"], writer.schema.remove_metadata()


def test_a_commit_that_loses_a_race_looks_again_and_leaves_the_shard_out(tmp_path, monkeypatch):
    """Another run commits the same shard between this commit's look and its commit: Lance
    refuses this one (a Merge on a stale version), and the look again finds the shard there."""
    import lance
    from lance.commit import CommitConflictError

    from batchspec.io import lance as lance_io
    from batchspec.io.output_dir import OutputDir

    out = OutputDir(str(tmp_path / "out.lance"), {}, "lance")
    mine, schema = _written(out, "s0", 3)
    rival, _ = _written(out, "s0", 3)
    real = lance.LanceDataset.commit
    calls = []

    def racing(*args, **kw):
        calls.append(1)
        if len(calls) == 1:  # the rival's commit lands first, on the version this one read
            monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(real))
            assert lance_io.commit(out, [rival], schema, {"run_id": "rival"}).committed == ["s0"]
            monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(racing))
        try:
            return real(*args, **kw)
        except CommitConflictError:
            calls.append("conflict")
            raise

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(racing))
    result = lance_io.commit(out, [mine], schema, {"run_id": "mine"})
    assert result.committed == [] and result.already == ["s0"] and calls == [1, "conflict"]
    dataset = lance.dataset(str(tmp_path / "out.lance"))
    assert sorted(dataset.to_table()["request_id"].to_pylist()) == ["s0/0", "s0/1", "s0/2"]


def test_a_shard_is_committed_after_its_version_is_cleaned_up(tmp_path):
    """The transactions that named the shards are gone with their versions: the current
    fragments' data files still name them."""
    import datetime as dt

    shards(tmp_path, n=2, rows=2)
    spec = build_spec(_files_job(tmp_path, commit_shards=1))
    run(spec)
    dataset = _dataset(spec)
    dataset.cleanup_old_versions(older_than=dt.timedelta(0), delete_unverified=True)
    from batchspec.io import lance as lance_io

    lance_io._RECORDED.clear()  # a new process: what the transactions still there say
    assert set(lance_io.recorded(_dataset(spec))) < {"s0", "s1"}
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 2
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 2
    assert lance_rows(spec) == _file_ids(2, 2)


def test_the_schema_check_names_the_column(tmp_path):
    import lance

    from batchspec.columns import output_schema

    shards(tmp_path, n=1, rows=2)
    theirs = output_schema([pa.field("k", pa.int64()), pa.field("other", pa.string())])
    lance.write_dataset(theirs.empty_table(), str(tmp_path / "out.lance"))
    with pytest.raises(SpecError, match="'other'") as caught:
        run(build_spec(_files_job(tmp_path)))
    assert caught.value.exit_code == 2


_VECTOR = pa.list_(pa.field("v", pa.float32(), nullable=False), 4)


def _vector_input(tmp_path, i: int) -> str:
    write_parquet(
        tmp_path / f"in{i}" / f"e{i}.parquet",
        {"prompt": ["a", "b"], "emb": [[1.0, 2.0, 3.0, 4.0], [0.5] * 4]},
        schema=pa.schema([pa.field("prompt", pa.string()), pa.field("emb", _VECTOR)]),
    )
    return str(tmp_path / f"in{i}" / "*.parquet")


def test_a_vector_column_passes_the_schema_check(tmp_path):
    """An embedding's fixed-size list of float32: Lance names its item ``item``, nullable,
    whatever the writer's was; the check compares the vectors' type and size."""
    from batchspec.columns import output_schema
    from batchspec.io.lance import check_schema
    from batchspec.io.output_dir import OutputDir

    raw = _files_job(tmp_path)
    raw["input"]["path"] = _vector_input(tmp_path, 0)
    spec = build_spec(raw)
    run(spec)
    dataset = _dataset(spec)
    assert pa.types.is_fixed_size_list(dataset.schema.field("emb").type) and dataset.count_rows() == 2
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"]
    out = OutputDir(str(tmp_path / "out.lance"), {}, "lance")
    check_schema(out, output_schema([pa.field("emb", _VECTOR)]))
    with pytest.raises(SpecError, match="'emb'") as caught:
        check_schema(out, output_schema([pa.field("emb", pa.list_(pa.float32(), 8))]))
    assert caught.value.exit_code == 2


def test_a_second_job_keeping_a_vector_column_appends_to_the_dataset(tmp_path):
    for i in range(2):
        raw = _files_job(tmp_path)
        raw["input"]["path"] = _vector_input(tmp_path, i)
        run(build_spec(raw))
    assert _dataset(build_spec(raw)).count_rows() == 4


def test_output_compression_is_refused_for_lance(tmp_path):
    with pytest.raises(SpecError, match="output.compression"):
        build_spec(_files_job(tmp_path, compression="zstd"))


# ---------------------------------------------------------------------------------- input


def _lance_job(tmp_path, url: str | None = None, options=None, out_fmt: str = "lance", **output) -> dict:
    """The Lance dataset of prompts (``tmp_path/in.lance``) into ``out_fmt`` at ``tmp_path/out``."""
    inp = {"path": url or str(tmp_path / "in.lance"), "format": "lance", "prompt_column": "prompt"}
    if options:
        inp["storage_options"] = options
    return {
        "name": "lance-in",
        "input": inp,
        "output": {"path": str(tmp_path / "out"), "format": out_fmt, **output},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 4, "read_batch_rows": 3},
    }


def _ids(spec) -> list[str]:
    """The request id every input row gets (``<shard>/<row>``), from the input's fragments."""
    from batchspec.run.stages import plan

    return sorted(f"{s.name}/{j}" for s in plan(spec).shards for j in range(s.table.rows))


def test_a_lance_dataset_in_and_out_holds_every_input_row_once(tmp_path):
    lance_prompts(str(tmp_path / "in.lance"), files=3, rows=5)
    spec = build_spec(_lance_job(tmp_path, commit_shards=2))
    result, _ = run(spec)
    ids = _ids(spec)
    assert len(ids) == 15 and lance_rows(spec) == ids
    assert [i.split("/")[0] for i in ids[::5]] == ["fragment-000000", "fragment-000001", "fragment-000002"]
    pin = result.summary["input_pin"]
    assert pin["chosen"] == "latest" and pin["format"] == "lance" and pin["version"] == 3
    # the kept column is in, typed as the input has it
    table = _dataset(spec).to_table()
    assert table.schema.field("k").type == pa.int64() and sorted(table["k"].to_pylist()) == sorted(
        list(range(5)) * 3
    )
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 3
    assert lance_rows(spec) == ids


def test_a_lance_outputs_shards_read_back_with_their_lineage(tmp_path):
    """What ``batchspec report`` asks of a table output: its shards, each one's rows and
    lineage (here the Lance input's pin)."""
    from batchspec.io.output_dir import OutputDir

    lance_prompts(str(tmp_path / "in.lance"), files=2, rows=3)
    spec = build_spec(_lance_job(tmp_path))
    run(spec)
    out = OutputDir.of(spec.output)
    names = out.format.report_names(out)
    assert names == ["fragment-000000", "fragment-000001"]
    shard = out.format.open_shard(out, names[1])
    pin = {"format": "lance", "table": str(tmp_path / "in.lance"), "version": 2}
    assert shard.metadata["input_pin"] == pin
    rows = out.format.scan(out, shard).collect()
    assert sorted(rows["request_id"].to_list()) == [f"fragment-000001/{j}" for j in range(3)]
    # and `batchspec report URL` finds the dataset by its URL alone
    from batchspec.report.read import load_output

    loaded = load_output(spec.output.path, {}, None)
    assert sorted(loaded.shards) == names


def test_a_lance_input_into_parquet_files(tmp_path):
    from helpers.fake_runs import outputs

    lance_prompts(str(tmp_path / "in.lance"), files=2, rows=3)
    spec = build_spec(_lance_job(tmp_path, out_fmt="parquet"))
    run(spec)
    got = outputs(tmp_path)
    assert sorted(got) == ["fragment-000000", "fragment-000001"]
    assert sorted(r for t in got.values() for r in t["request_id"].to_pylist()) == _ids(spec)


def test_a_rerun_reads_the_pin_until_done_then_only_the_new_fragments(tmp_path, monkeypatch):
    """Stopped after its first group commit; the dataset grows; the rerun reads the version the
    run it resumes read; the next run pins the latest and answers only the new fragment."""
    from batchspec.io.output_formats import TableOutput

    lance_prompts(str(tmp_path / "in.lance"), files=3, rows=5)
    spec = build_spec(_lance_job(tmp_path, commit_shards=1))
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
    assert len(lance_rows(spec)) == 5
    lance_prompts(str(tmp_path / "in.lance"), files=1, rows=5, first=3)  # the dataset grows
    result, _ = run(spec)
    assert result.summary["input_pin"] | {"pinned_at": None} == result.summary["input_pin"] | {
        "pinned_at": None,
        "chosen": "resumed",
        "version": 3,
    }
    assert len(lance_rows(spec)) == 15
    result, events = run(spec)
    assert result.summary["input_pin"]["chosen"] == "latest" and result.summary["input_pin"]["version"] == 4
    assert [e for e, _ in events if e == "shard_committed"] == ["shard_committed"]
    assert len(lance_rows(spec)) == 20


@pytest.mark.parametrize("crash", ["before", "after"])
def test_a_sigkill_around_a_commit_from_a_lance_input_leaves_every_row_once(tmp_path, crash):
    lance_prompts(str(tmp_path / "in.lance"), files=3, rows=5)
    raw = _lance_job(tmp_path, commit_shards=2)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    killed = run_table_cli("run", str(job), "--no-progress", crash=crash)
    assert killed.returncode == -9, killed.stderr
    states = sorted(s["state"] for s in job_status(spec)["shards"])
    assert states == (["pending"] * 3 if crash == "before" else ["committed", "committed", "pending"])
    rerun = run_table_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    assert lance_rows(spec) == _ids(spec) and len(lance_rows(spec)) == 15


def test_input_version_pins_the_dataset(tmp_path):
    from helpers.fake_runs import outputs

    lance_prompts(str(tmp_path / "in.lance"), files=3, rows=2)
    raw = _lance_job(tmp_path, out_fmt="parquet")
    raw["input"]["version"] = 2
    spec = build_spec(raw)
    result, _ = run(spec)
    assert result.summary["input_pin"]["version"] == 2 and result.summary["input_pin"]["chosen"] == "spec"
    assert sorted(outputs(tmp_path)) == ["fragment-000000", "fragment-000001"]
    raw["input"]["version"] = 9
    with pytest.raises(InputDataError, match="version 9") as caught:
        run(build_spec(raw))
    assert caught.value.exit_code == 3


def test_a_fragment_with_deleted_rows_is_read_without_them_and_a_filter_applies(tmp_path):
    import lance

    lance_prompts(str(tmp_path / "in.lance"), files=2, rows=4)
    lance.dataset(str(tmp_path / "in.lance")).delete("k = 0")
    raw = _lance_job(tmp_path)
    raw["input"]["filter"] = "k < 3"
    spec = build_spec(raw)
    run(spec)
    table = _dataset(spec).to_table()
    assert sorted(table["k"].to_pylist()) == [1, 1, 2, 2]


def test_a_fragment_outside_the_dataset_is_exit_3(tmp_path):
    """A dataset may keep data files in other bases (another folder, another bucket): batchspec
    reads a dataset's files only below its root."""
    import lance
    from lance import DatasetBasePath

    victim = tmp_path / "victim"
    lance.write_dataset(
        prompts(0, 3),
        str(tmp_path / "in.lance"),
        initial_bases=[DatasetBasePath(path=str(victim), name="elsewhere")],
        target_bases=["elsewhere"],
    )
    before = sorted(p.name for p in victim.iterdir())
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(build_spec(_lance_job(tmp_path)))
    assert caught.value.exit_code == 3 and str(tmp_path / "in.lance") in str(caught.value)
    assert sorted(p.name for p in victim.iterdir()) == before
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.lance"))


def test_no_dataset_is_exit_3_and_allow_empty_runs_nothing(tmp_path):
    with pytest.raises(InputDataError, match="no Lance dataset") as caught:
        run(build_spec(_lance_job(tmp_path)))
    assert caught.value.exit_code == 3
    raw = _lance_job(tmp_path)
    raw["input"]["allow_empty"] = True
    result, _ = run(build_spec(raw))
    assert result.summary["input_pin"]["version"] is None


def test_lance_keys_are_checked(tmp_path):
    raw = _lance_job(tmp_path)
    raw["input"]["snapshot"] = 3
    with pytest.raises(SpecError, match="input.snapshot"):
        build_spec(raw)
    raw = _lance_job(tmp_path)
    raw["input"]["path"] = [str(tmp_path / "a.lance"), str(tmp_path / "b.lance")]
    with pytest.raises(SpecError, match="reads one table"):
        build_spec(raw)


# ------------------------------------------------------------------------------------ S3


def test_a_lance_dataset_on_s3_as_output(tmp_path, bucket):
    name, _, options = bucket
    shards(tmp_path, n=3, rows=4)
    spec = build_spec(_files_job(tmp_path, f"s3://{name}/out.lance", options, commit_shards=2))
    run(spec)
    assert lance_rows(spec) == _file_ids(3, 4)
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3
    _, events = run(spec)
    assert [e for e, _ in events if e.startswith("shard_")] == ["shard_skipped"] * 3


@pytest.mark.parametrize("crash", ["before", "after"])
def test_a_sigkill_around_a_lance_commit_on_s3_leaves_every_row_once(tmp_path, bucket, crash):
    name, _, options = bucket
    shards(tmp_path, n=3, rows=4)
    raw = _files_job(tmp_path, f"s3://{name}/out.lance", options, commit_shards=2)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    killed = run_table_cli("run", str(job), "--no-progress", crash=crash)
    assert killed.returncode == -9, killed.stderr
    states = sorted(s["state"] for s in job_status(spec)["shards"])
    assert states == (["pending"] * 3 if crash == "before" else ["committed", "committed", "pending"])
    rerun = run_table_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    assert lance_rows(spec) == _file_ids(3, 4)


def test_a_lance_dataset_on_s3_in_and_out(tmp_path, bucket):
    from batchspec.io.lance import storage_options

    name, _, options = bucket
    url = f"s3://{name}/in.lance"
    lance_prompts(url, files=3, rows=4, storage_options=storage_options(url, options))
    raw = _lance_job(tmp_path, url, options, commit_shards=2)
    raw["output"].update(path=f"s3://{name}/out.lance", storage_options=options)
    spec = build_spec(raw)
    result, _ = run(spec)
    assert result.summary["input_pin"]["version"] == 3
    assert lance_rows(spec) == _ids(spec) and len(lance_rows(spec)) == 12
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 3


def test_two_workers_committing_at_once_to_a_lance_dataset_on_s3(tmp_path, bucket):
    """Lance's commit on S3 is a conditional put of the next manifest, which moto honours: two
    processes' commits never overwrite each other."""
    name, _, options = bucket
    shards(tmp_path, n=6, rows=2)
    raw = _files_job(tmp_path, f"s3://{name}/out.lance", options, commit_shards=1)
    spec = build_spec(raw)
    job = write_job(tmp_path / "job.yaml", raw)
    workers = [
        table_cli("run", str(job), "--no-progress", "--worker-index", str(i), "--num-workers", "2")
        for i in range(2)
    ]
    for w in workers:
        _, stderr = w.communicate(timeout=180)
        assert w.returncode == 0, stderr
    assert lance_rows(spec) == _file_ids(6, 2)
    assert [s["state"] for s in job_status(spec)["shards"]] == ["committed"] * 6
