"""A shard's commit stopped between any two of its steps (tests/helpers/crashes.py), on a first
run and on an ``--overwrite`` retry over a committed output: ``status`` never says
``committed`` with a request missing or answered twice, nor with files the manifest was not
written for, and a plain rerun leaves every ``custom_id`` on exactly one line of the two files
(batchspec/io/output_dir.py, batchspec/io/openai_results.py). In this process, for real
(SIGKILL), on local disk and on the S3 server; the Parquet output's one file too."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from helpers.crashes import SplitEngine, raise_crash, run_crashing_cli, stop_commit
from helpers.emulators import (  # noqa: F401  (session fixtures)
    azure_fs,
    azure_server,
    gcs_cas_server,
    gcs_fs,
)
from helpers.fake_runs import run
from helpers.openai_format import read_openai_output

from batchspec.errors import RuntimeFailure
from batchspec.io.writer import read_metadata
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

#: every run checks its spec against vLLM's classes, on the fake engine too
pytestmark = pytest.mark.vllm

MODEL = "tiny-target"
CHAT = "/v1/chat/completions"
IDS = ["r1", "r2"]
#: The crash points of an OpenAI shard's commit: while its temporary files are written, then
#: after each of its steps (0: before the first; 4 steps: the old manifest invalidated, the
#: errors file, the results file, the new manifest).
POINTS = ["writing", 0, 1, 2, 3, 4]


def _raw(inputs: dict, out: str, output_format: str = "openai") -> dict:
    return {
        "name": "crashes",
        "input": inputs,
        "output": {"path": out, "format": output_format},
        "model": {"target": "unused", "engine": {"served_model_name": MODEL}},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 4, "read_batch_rows": 3},
    }


def _openai_job(tmp_path: Path, out: str | None = None, storage_options: dict | None = None) -> dict:
    (tmp_path / "in").mkdir(exist_ok=True)
    (tmp_path / "in" / "batch.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": cid,
                    "method": "POST",
                    "url": CHAT,
                    "body": {"model": MODEL, "messages": [{"role": "user", "content": f"question {cid}"}]},
                }
            )
            + "\n"
            for cid in IDS
        )
    )
    raw = _raw({"path": str(tmp_path / "in" / "*.jsonl"), "format": "openai"}, out or str(tmp_path / "out"))
    if storage_options is not None:
        raw["output"]["storage_options"] = storage_options
    return raw


def _answered(spec, fs=None) -> list[str]:
    """The custom_id of every line of the shard's two files (each line checked as OpenAI's)."""
    results, errors = read_openai_output(spec.output.path.split("://")[-1], "batch", fs)
    return sorted([line["custom_id"] for line in results] + [line["custom_id"] for line in errors])


def _state(spec) -> str:
    [shard] = job_status(spec)["shards"]
    return shard["state"]


def _crash(monkeypatch, after, *args, **kw) -> list[str]:
    """A run stopped (in this process) after the ``after``-th step of its commit."""
    steps = stop_commit(monkeypatch.setattr, after, raise_crash)
    try:
        run(*args, **kw)
    except RuntimeFailure as exc:
        assert "Crash" in str(exc), exc
    monkeypatch.undo()
    return steps


def _check_after_crash(spec, failing: set[str], fs=None) -> None:
    """``status`` says committed only where each request is on exactly one line; a plain rerun
    leaves it so (redoing the shard where it was not), and its result is committed."""
    state = _state(spec)
    if state == "committed":
        assert _answered(spec, fs) == IDS, "committed with a request missing or answered twice"
    elif state == "pending":  # nothing of the shard visible
        assert not list(Path(spec.output.path).glob("batch.*"))
    run(spec, engine=SplitEngine(failing))
    assert _answered(spec, fs) == IDS
    assert _state(spec) == "committed"


@pytest.mark.parametrize("after", POINTS)
@pytest.mark.parametrize("retry", [False, True], ids=["first-run", "overwrite-retry"])
def test_a_commit_stopped_between_any_two_steps_never_commits_a_request_missing_or_twice(
    tmp_path, monkeypatch, retry, after
):
    spec = build_spec(_openai_job(tmp_path))
    if retry:  # r1 answered, r2 failed; the retry fails r1: files of the same sizes
        run(spec, engine=SplitEngine({"r2"}))
        assert _answered(spec) == IDS and _state(spec) == "committed"
    _crash(monkeypatch, after, spec, engine=SplitEngine({"r1"}), overwrite=retry)
    _check_after_crash(spec, {"r1"})


def test_an_overwrite_stopped_after_the_errors_file_leaves_the_shard_partial(tmp_path, monkeypatch):
    """The issue's case: the new errors file beside the old results file, the old manifest
    matching both by size. Not committed; a plain rerun redoes the shard."""
    spec = build_spec(_openai_job(tmp_path))
    run(spec, engine=SplitEngine({"r2"}))
    _crash(monkeypatch, "publish batch.errors.jsonl", spec, engine=SplitEngine({"r1"}), overwrite=True)
    assert _state(spec) == "partial"
    _, events = run(spec, engine=SplitEngine({"r1"}))
    assert [f["shard"] for e, f in events if e == "shard_committed"] == ["batch"]
    results, errors = read_openai_output(tmp_path / "out", "batch")
    assert [x["custom_id"] for x in results] == ["r2"]
    assert [x["custom_id"] for x in errors] == ["r1"]


def test_the_commit_invalidates_the_old_manifest_before_its_first_publish(tmp_path, monkeypatch):
    """The steps the crash points above cover, in order."""
    spec = build_spec(_openai_job(tmp_path))
    run(spec, engine=SplitEngine({"r2"}))
    steps = _crash(monkeypatch, None, spec, engine=SplitEngine({"r1"}), overwrite=True)
    assert steps == [
        "remove batch.json",
        "publish batch.errors.jsonl",
        "publish batch.output.jsonl",
        "write_json batch.json",
    ]
    assert len(steps) == POINTS[-1]


@pytest.mark.parametrize("after", POINTS)
def test_an_overwrite_killed_for_real_at_any_step_of_its_commit(tmp_path, after):
    """The same with a real process SIGKILLed at each point (batchspec's command line, the
    split engine in place of vLLM)."""
    raw = _openai_job(tmp_path)
    spec = build_spec(raw)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    cli = ("run", str(job), "--log-format", "json", "--no-progress")
    first = run_crashing_cli(*cli, after=None, failing=["r2"])
    assert first.returncode == 0, first.stderr
    killed = run_crashing_cli(*cli, "--overwrite", after=after, failing=["r1"])
    # (a commit of fewer steps than the points ends before the last)
    assert killed.returncode in ((-9, 0) if after == POINTS[-1] else (-9,)), killed.stderr
    _check_after_crash(spec, {"r1"})


def _object_store(request, name: str) -> tuple[str, dict, object]:
    """A store's scheme, storage options and a fresh client (the emulators on 127.0.0.1)."""
    if name == "s3":
        import s3fs

        _, options = request.getfixturevalue("s3_server")
        return "s3", options, s3fs.S3FileSystem(**options, skip_instance_cache=True)
    if name == "gcs":
        emulator = request.getfixturevalue("gcs_cas_server")
        return "gs", emulator.storage_options, gcs_fs(emulator)
    emulator = request.getfixturevalue("azure_server")
    return "az", emulator.storage_options, azure_fs(emulator)


@pytest.mark.parametrize("after", [0, "publish batch.errors.jsonl", "publish batch.output.jsonl"])
@pytest.mark.parametrize("store", ["s3", "gcs", "azure"])
def test_an_overwrite_stopped_on_an_object_store_leaves_the_shard_partial(
    tmp_path, monkeypatch, request, store, after
):
    """On S3, GCS and Azure (their emulators): the old manifest goes before the first put, and
    the new one binds each file by its ETag or generation."""
    import uuid

    scheme, options, fs = _object_store(request, store)
    bucket = f"crashes-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    spec = build_spec(_openai_job(tmp_path, f"{scheme}://{bucket}/out", options))
    run(spec, engine=SplitEngine({"r2"}))  # a first commit: no earlier manifest to remove
    record = json.loads(fs.cat(f"{bucket}/out/_batchspec/manifest/batch.json"))
    assert {"etag", "generation"} & set(record["output_info"]) & set(record["errors_info"])
    _crash(monkeypatch, after, spec, engine=SplitEngine({"r1"}), overwrite=True)
    fs.invalidate_cache()
    assert _state(spec) == ("committed" if after == 0 else "partial")
    if after == 0:
        assert _answered(spec, fs) == IDS
    run(spec, engine=SplitEngine({"r1"}))
    fs.invalidate_cache()
    assert _answered(spec, fs) == IDS and _state(spec) == "committed"


def test_a_parquet_shard_rewritten_by_a_stopped_overwrite_is_not_committed(tmp_path, monkeypatch):
    """A Parquet shard rewritten under another spec (the same size, on local disk) whose commit
    stopped before its manifest: neither spec sees it committed (or stale) with the old
    manifest; a plain rerun commits it under the new spec."""
    from helpers.fake_runs import shards

    shards(tmp_path, n=1)
    raw = _raw(
        {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        str(tmp_path / "out"),
        "parquet",
    )
    old = build_spec(raw)
    new = build_spec({**raw, "sampling": {**raw["sampling"], "max_tokens": 9}})
    run(old)
    size = (tmp_path / "out" / "s0.parquet").stat().st_size
    _crash(monkeypatch, "publish s0.parquet", new, overwrite=True)
    path = tmp_path / "out" / "s0.parquet"
    assert path.stat().st_size == size  # what a size-only check cannot tell apart
    manifest = tmp_path / "out" / "_batchspec" / "manifest" / "s0.json"
    written = read_metadata(str(path))["run_id"]
    for spec in (old, new):
        state = _state(spec)
        assert state not in ("committed", "stale") or json.loads(manifest.read_text())["run_id"] == written, (
            state
        )
    run(new)
    assert _state(new) == "committed"
    assert json.loads(manifest.read_text())["run_id"] == read_metadata(str(path))["run_id"]
    assert sorted(pq.read_table(path)["request_id"].to_pylist()) == sorted(f"s0/{i}" for i in range(10))


def test_a_manifest_of_the_previous_version_is_judged_by_size_as_before(tmp_path):
    """A manifest without the files' identity (written before it was recorded) still reads:
    committed where the sizes agree, partial where one differs."""
    spec = build_spec(_openai_job(tmp_path))
    run(spec, engine=SplitEngine({"r2"}))
    manifest = tmp_path / "out" / "_batchspec" / "manifest" / "batch.json"
    record = json.loads(manifest.read_text())
    for key in ("output_info", "errors_info"):
        record[key] = {"size": record[key]["size"]}
    manifest.write_text(json.dumps(record))
    errors = tmp_path / "out" / "batch.errors.jsonl"
    errors.write_bytes(errors.read_bytes())  # a new mtime, the same bytes
    assert _state(spec) == "committed"
    errors.write_bytes(errors.read_bytes() + b"\n")
    assert _state(spec) == "partial"


def test_a_committed_file_rewritten_with_as_many_bytes_makes_its_shard_partial(tmp_path):
    """On local disk the manifest binds each file by inode and mtime_ns besides its size: the
    errors file rewritten in place with other bytes of the same size is no longer the one
    committed."""
    spec = build_spec(_openai_job(tmp_path))
    run(spec, engine=SplitEngine({"r2"}))
    errors = tmp_path / "out" / "batch.errors.jsonl"
    errors.write_bytes(errors.read_bytes().replace(b'"r2"', b'"r1"'))
    assert _state(spec) == "partial"
    run(spec, engine=SplitEngine({"r2"}))
    assert _answered(spec) == IDS and _state(spec) == "committed"
