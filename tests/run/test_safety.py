"""Safe by construction, tried as a careless user or an attacker would (fast: no engine).

Overlapping input and output, a spec that changed under an output directory, a truncated
output, private temp files, planning errors with their exit codes, and the runner's
bookkeeping of duplicate ids, skipped shards and empty inputs. The same paths run on the real
engine in test_safety_e2e.py where the engine changes anything.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import outputs, run, shards
from helpers.fakes import FakeEngine
from helpers.jobs import run_cli, run_cli_in_process, write_job, write_parquet

from batchspec import redact as redact_mod
from batchspec.errors import InputDataError, RuntimeFailure, SpecError
from batchspec.io import output_dir as shards_mod
from batchspec.io.listing import discover_shards
from batchspec.io.locations import check_no_overlap
from batchspec.run.stages import plan
from batchspec.spec.build import build_spec


def spec_with(tmp_path, **changes):
    raw = {
        "name": "unit",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out"), "row_group_rows": 4},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 5, "read_batch_rows": 3},
    }
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            raw[section][name] = value
        else:
            raw[section] = value
    return build_spec(raw)


# ---------------------------------------------------------------- 1. inputs are never outputs


@pytest.mark.parametrize(
    "inp, out",
    [
        ("data/*.parquet", "data"),  # output is the input directory
        ("data/*.parquet", "data/"),
        ("data/*.parquet", "data/out"),  # output nested under the input
        ("data/day=1/*.parquet", "data"),  # output contains the input
        ("data", "data/results"),  # a directory input, output inside it
        ("data/p0.parquet", "data"),  # a single file inside the output
    ],
)
def test_output_overlapping_input_is_a_spec_error(tmp_path, inp, out):
    write_parquet(tmp_path / "data" / "p0.parquet", {"prompt": ["a"]})
    with pytest.raises(SpecError) as err:
        check_no_overlap([str(tmp_path / inp)], {}, str(tmp_path / out), {})
    assert err.value.key == "output.path" and err.value.exit_code == 2


def test_overlap_through_a_symlink_is_caught(tmp_path):
    write_parquet(tmp_path / "data" / "p0.parquet", {"prompt": ["a"]})
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(SpecError):
        check_no_overlap([str(tmp_path / "data" / "*.parquet")], {}, str(tmp_path / "link" / "o"), {})


def test_separate_locations_and_other_stores_are_fine(tmp_path):
    check_no_overlap([str(tmp_path / "in" / "*.parquet")], {}, str(tmp_path / "out"), {})
    check_no_overlap([str(tmp_path / "data2" / "*.parquet")], {}, str(tmp_path / "data"), {})
    check_no_overlap(["memory://bucket/data/*.parquet"], {}, str(tmp_path / "bucket" / "data"), {})


#: An S3-compatible server's endpoint (nothing listens there: no check opens a connection).
EP = "http://127.0.0.1:9000"
AZ_KEY = "a2V5LW5vdC1hLXNlY3JldA=="


def s3(endpoint=None, where="endpoint_url", **options):
    """S3 storage options naming ``endpoint`` the way ``where`` says."""
    if endpoint is None:
        return dict(options)
    if where == "client_kwargs":
        return {**options, "client_kwargs": {"endpoint_url": endpoint}}
    return {**options, "endpoint_url": endpoint}


GS = {"token": "anon"}
AZ_CONN = (
    f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={AZ_KEY};EndpointSuffix=core.windows.net"
)


@pytest.mark.parametrize(
    "inp, in_opts, out, out_opts",
    [
        # the attack: the same server spelled with and without a trailing slash
        ("s3://b/data", s3(f"{EP}/"), "s3://b/data", s3(EP)),
        ("s3://b/data/*.parquet", s3(f"{EP}/", "client_kwargs"), "s3://b/data", s3(EP)),
        ("s3://b/data", s3("HTTP://127.0.0.1:9000"), "s3://b/data/out", s3(EP, "client_kwargs")),
        ("s3://b/data", s3("http://Minio.Example.COM./"), "s3://b/data", s3("http://minio.example.com:80")),
        ("s3://b/data", s3("https://minio.example.com:443/"), "s3://b/data", s3("https://minio.example.com")),
        ("s3://b/data", s3(f"{EP}/some/path/"), "s3://b/data", s3(EP)),  # the endpoint's path
        # an explicit default AWS endpoint on one side only; regional and global endpoints
        ("s3://b/data", s3("https://s3.amazonaws.com"), "s3://b/data", s3()),
        ("s3://b/data", s3(), "s3://b/data/out", s3("https://s3.eu-west-1.amazonaws.com/")),
        (
            "s3://b/data",
            s3("https://s3.us-east-2.amazonaws.com"),
            "s3://b/data",
            s3("https://s3.amazonaws.com"),
        ),
        # one name for one scheme family, and bucket and key paths normalised
        ("s3://b/data", s3(EP), "s3a://b/data", s3(EP)),
        ("s3://b/data/", s3(EP), "s3://b//data//", s3(EP)),
        ("s3://b/data", s3(EP), "s3://B/data", s3(EP)),
        ("s3://b/x/../data", s3(EP), "s3://b/data", s3(EP)),
        ("s3://b/x/../data", s3(EP), "s3://b/x", s3(EP)),  # or, kept literally, a key under x/
        ("gs://b/data", GS, "gcs://b/data", GS),
        ("gs://b/data", GS, "gs://b/data/out", {**GS, "endpoint_url": "https://storage.googleapis.com/"}),
        ("az://c/data", {"account_name": "acct"}, "abfs://c/data", {"account_name": "acct"}),
        ("abfss://c@acct.dfs.core.windows.net/data", {}, "az://c/data", {"connection_string": AZ_CONN}),
        (
            "az://c/data",
            {"account_name": "acct"},
            "az://c/data",
            {"account_name": "acct", "account_host": "ACCT.blob.core.windows.net."},
        ),
        # could be one: a named server against none, an IP against a host name on one port,
        # two spellings of the endpoint that disagree
        ("s3://b/data", s3(EP), "s3://b/data", s3()),
        ("s3://b/data", s3("http://localhost:9000"), "s3://b/data", s3(EP)),
        (
            "s3://b/data",
            {"endpoint_url": EP, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9001"}},
            "s3://b/data",
            s3("http://127.0.0.1:9001"),
        ),
        ("s3://b/data", s3("https://s3.amazonaws.com"), "s3://b/data", s3("https://s3.example.com")),
        # an https URL to an object of the output's bucket
        ("https://b.s3.amazonaws.com/data/p0.parquet?X-Amz-Signature=SIG", {}, "s3://b/data", s3()),
        (f"{EP}/b/data/p0.parquet", {}, "s3://b/data", s3(EP)),
        # local paths: ./ and duplicate slashes
        ("{tmp}/./data//*.parquet", {}, "{tmp}/data/", {}),
        ("file://{tmp}/data", {}, "local://{tmp}/data/out", {}),
    ],
)
def test_one_store_spelled_two_ways_is_refused(tmp_path, inp, in_opts, out, out_opts):
    inp, out = inp.format(tmp=tmp_path), out.format(tmp=tmp_path)
    with pytest.raises(SpecError) as err:
        check_no_overlap([inp], in_opts, out, out_opts)
    message = str(err.value)
    assert err.value.key == "output.path" and err.value.exit_code == 2
    assert redact_mod.sanitize_url(out) in message and redact_mod.sanitize_url(inp) in message
    assert "separate directory or bucket prefix" in message
    assert "SIG" not in message and AZ_KEY not in message
    # listing agrees: the output's store is the input's, so its files are skipped
    from batchspec.io.locations import same_store
    from batchspec.io.output_dir import OutputDir

    assert same_store([inp], in_opts, OutputDir(out, out_opts))


@pytest.mark.parametrize(
    "inp, in_opts, out, out_opts",
    [
        ("s3://b/data", s3(EP), "s3://c/data", s3(EP)),  # another bucket
        ("s3://b/data", s3(EP), "s3://b/data2", s3(EP)),  # a sibling prefix
        ("s3://b/data", s3(EP), "s3://b/data", s3("http://127.0.0.1:9001")),  # another server
        ("s3://b/data", s3(EP), "s3://b/data", s3("https://s3.amazonaws.com")),
        ("s3://b/data", s3(EP), "{tmp}/b/data", {}),  # local against s3
        ("{tmp}/b/data", {}, "s3://b/data/out", s3(EP)),
        ("az://c/data", {"account_name": "acct"}, "az://c/data", {"account_name": "other"}),
        ("gs://b/data", GS, "s3://b/data", s3("https://s3.amazonaws.com")),  # two clouds
    ],
)
def test_separate_stores_pass(tmp_path, inp, in_opts, out, out_opts):
    check_no_overlap([inp.format(tmp=tmp_path)], in_opts, out.format(tmp=tmp_path), out_opts)


def test_an_unresolvable_store_is_refused_with_how_to_tell_them_apart():
    with pytest.raises(SpecError) as err:
        check_no_overlap(
            ["s3://b/data/*.parquet"], s3("http://user:PASSWORD@127.0.0.1:9000/"), "s3://b/data", s3()
        )
    message = str(err.value)
    assert "PASSWORD" not in message and "cannot be told apart" in message
    assert "127.0.0.1:9000" in message and "endpoint_url" in message


@pytest.mark.vllm
def test_cli_refuses_overlap_before_writing_anything(tmp_path):
    write_parquet(tmp_path / "data" / "p0.parquet", {"prompt": ["a", "b"]})
    before = sorted(p.name for p in (tmp_path / "data").iterdir())
    for out, commands in (
        (tmp_path / "data", ("run", "validate", "status")),
        (tmp_path / "data" / "out", ("run",)),
    ):
        job = write_job(
            tmp_path / "job.yaml",
            input={"path": str(tmp_path / "data" / "*.parquet"), "prompt_column": "prompt"},
            output={"path": str(out)},
            sampling={"temperature": 0.0, "max_tokens": 4},
        )
        for command in commands:
            result = run_cli_in_process(command, str(job))
            assert result.returncode == 2, (command, result.stderr)
            assert "output.path" in result.stderr and "input location" in result.stderr
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == before
    assert pq.read_table(tmp_path / "data" / "p0.parquet").column_names == ["prompt"]


def test_listing_never_picks_up_files_under_the_output_path(tmp_path):
    write_parquet(tmp_path / "d" / "p0.parquet", {"prompt": ["a"]})
    write_parquet(tmp_path / "d" / "out" / "p0.parquet", {"prompt": ["a"]})
    names = [s.name for s in discover_shards([str(tmp_path / "d")], {}, exclude=str(tmp_path / "d" / "out"))]
    assert names == ["p0"]


# ---------------------------------------------------------------- 3. one spec per output


@pytest.mark.vllm
def test_rerun_with_a_different_spec_exits_2_naming_what_changed(tmp_path):
    shards(tmp_path, n=2, rows=4)
    run(spec_with(tmp_path))
    changed = spec_with(
        tmp_path, sampling={"temperature": 0.0, "max_tokens": 9}, model={"target": "other-model"}
    )
    with pytest.raises(SpecError) as err:
        run(changed)
    message = str(err.value)
    assert err.value.exit_code == 2 and "sampling" in message and "model.target" in message
    assert "--overwrite" in message
    p = plan(changed)
    assert p.states == {"s0": "stale", "s1": "stale"}
    assert set(p.stale["s0"]) == {"sampling", "model.target"}
    # nothing was touched by the refused run; --overwrite redoes every shard under the new spec
    result, _ = run(changed, overwrite=True)
    assert set(result.summary["shards"]) == {"s0", "s1"}
    assert plan(changed).states == {"s0": "committed", "s1": "committed"}
    # a change that does not shape the output (throughput knobs) is not a different spec
    faster = spec_with(
        tmp_path,
        sampling={"temperature": 0.0, "max_tokens": 9},
        model={"target": "other-model", "engine": {"max_num_seqs": 7}},
        execution={"max_in_flight": 2},
    )
    assert plan(faster).states == {"s0": "committed", "s1": "committed"}


@pytest.mark.vllm
def test_status_shows_stale_shards_and_orphan_outputs(tmp_path):
    shards(tmp_path, n=2, rows=4)
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        model={"target": "unused"},
        sampling={"temperature": 0.0, "max_tokens": 8},
    )
    run(spec_with(tmp_path))
    (tmp_path / "in" / "s1.parquet").rename(tmp_path / "in" / "s9.parquet")
    result = run_cli_in_process("status", str(job), "--set", "sampling.max_tokens=3", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = {r["shard"]: r for r in json.loads(result.stdout)}
    assert rows["s0"]["state"] == "stale" and rows["s0"]["changed"] == ["sampling"]
    assert rows["s9"]["state"] == "pending"
    assert rows["s1"]["state"] == "orphan" and rows["s1"]["input"] is None
    text = run_cli_in_process("status", str(job)).stdout
    assert "s1" in text and "orphan" in text and "1 orphan outputs" in text


# ---------------------------------------------------------------- 7. durability, checked


@pytest.mark.vllm
def test_a_truncated_output_is_not_committed(tmp_path):
    shards(tmp_path, n=2, rows=10)
    spec = spec_with(tmp_path)
    run(spec)
    manifest = json.loads((tmp_path / "out" / "_batchspec" / "manifest" / "s0.json").read_text())
    size = (tmp_path / "out" / "s0.parquet").stat().st_size
    assert manifest["output_info"]["size"] == size
    with open(tmp_path / "out" / "s0.parquet", "r+b") as f:
        f.truncate(size - 10)
    assert plan(spec).states == {"s0": "partial", "s1": "committed"}
    result, _ = run(spec)
    assert set(result.summary["shards"]) == {"s0"}
    assert outputs(tmp_path)["s0"].num_rows == 10


@pytest.mark.vllm
def test_commit_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    shards(tmp_path, n=1, rows=3)
    run(spec_with(tmp_path))
    out = str(tmp_path / "out")
    assert any(p.endswith(".parquet.tmp") for p in synced)  # the shard's bytes
    assert out in synced  # its rename
    assert str(tmp_path / "out" / "_batchspec" / "manifest") in synced  # the manifest's rename


# ---------------------------------------------------------------- 6. private files


def test_spool_is_private_per_process_and_dead_spools_go(tmp_path, monkeypatch):
    monkeypatch.setattr(shards_mod.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shards_mod, "_spool", None)
    (tmp_path / "batchspec-spool").mkdir(mode=0o777)  # the old fixed name: never used
    dead = tmp_path / "batchspec-spool-999999999-abc"
    dead.mkdir()
    mine = shards_mod.spool_dir()
    assert os.path.dirname(mine) == str(tmp_path) and os.path.basename(mine) != "batchspec-spool"
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    assert not dead.exists()
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "from batchspec.io.output_dir import spool_dir; "
            "import tempfile,sys; tempfile.tempdir=sys.argv[1]; print(spool_dir())",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert other != mine


def test_engine_log_is_private_and_never_follows_a_planted_link(tmp_path):
    code = (
        "import os, sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
        "from batchspec.cli.common import engine_log_file\n"
        "stream, path = engine_log_file('r1')\n"
        "stream.write(path + '\\n')\n"
    )
    planted = tmp_path / "victim.txt"
    planted.write_text("keep")
    for name in ("batchspec-r1.engine.log",):
        (tmp_path / name).symlink_to(planted)
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    path = result.stderr.strip().splitlines()[-1]
    assert os.path.dirname(path) == str(tmp_path) and not os.path.islink(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert planted.read_text() == "keep"


# ---------------------------------------------------------------- 9. every error has its code


@pytest.mark.parametrize(
    "path, code, words",
    [
        ("sftp://host/in/*.parquet", 2, "input.path"),  # a backend that is not installed
        ("nosuchproto://bucket/*.parquet", 2, "input.path"),  # not a protocol at all
        # planned after the spec is checked against vLLM's classes
        pytest.param(
            "{tmp}/in/a**/*.parquet",
            2,
            "input.path",  # a glob fsspec cannot compile
            marks=pytest.mark.vllm,
        ),
        pytest.param("{tmp}/nothing/*.parquet", 3, "no input shards", marks=pytest.mark.vllm),
    ],
)
def test_planning_errors_exit_with_their_code_and_a_json_error(models, tmp_path, path, code, words):
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": path.format(tmp=tmp_path), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0},
    )
    result = run_cli_in_process("run", str(job), "--log-format", "json")
    assert result.returncode == code, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert "Traceback" not in result.stderr
    errors = [e for e in events if e["event"] == "error"]
    assert len(errors) == 1 and errors[0]["exit_code"] == code and words in errors[0]["message"]
    assert events[-1]["event"] == "run_finished" and events[-1]["exit_code"] == code


@pytest.mark.vllm
def test_an_unexpected_error_exits_1_with_summary(tmp_path):
    class Broken(FakeEngine):
        def stream(self, rows, max_in_flight, **kw):
            next(rows)
            raise ZeroDivisionError("a bug")
            yield

    shards(tmp_path, n=1, rows=3)
    with pytest.raises(RuntimeFailure, match="ZeroDivisionError"):
        run(spec_with(tmp_path), Broken())
    summary = json.loads(next((tmp_path / "out" / "_batchspec" / "runs").glob("*.json")).read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert "ZeroDivisionError" in summary["error"]


@pytest.mark.vllm
def test_engine_that_fails_to_start_still_writes_summary_and_run_finished(tmp_path):
    shards(tmp_path, n=1, rows=3)
    (tmp_path / "no-such-model").mkdir()  # a directory with no model in it (no path is refused first)
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        model={"target": str(tmp_path / "no-such-model")},
        sampling={"temperature": 0.0, "max_tokens": 4},
    )
    result = run_cli("run", str(job), "--log-format", "json", timeout=300)
    assert result.returncode in (1, 2), result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    finished = [e for e in events if e["event"] == "run_finished"]
    assert len(finished) == 1 and finished[0]["status"] == "failed"
    summary = json.loads(open(finished[0]["summary"]).read())
    assert summary["status"] == "failed" and summary["exit_code"] == result.returncode
    assert "no-such-model" in summary["error"]


# ---------------------------------------------------------------- bookkeeping


@pytest.mark.vllm
def test_duplicate_ids_are_counted_across_shards(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["p", "q", "r"], "id": ["1", "2", "2"]})
    write_parquet(tmp_path / "in" / "b.parquet", {"prompt": ["s", "t"], "id": ["1", "3"]})
    result, _ = run(spec_with(tmp_path, input__id_column="id"))
    assert result.summary["shards"]["a"]["duplicate_ids"] == 1
    assert result.summary["shards"]["b"]["duplicate_ids"] == 1
    assert result.summary["totals"]["duplicate_ids"] == 2
    assert sum(t.num_rows for t in outputs(tmp_path).values()) == 5  # every row still written


@pytest.mark.vllm
def test_a_shard_skipped_mid_read_gives_its_lease_back(tmp_path):
    shards(tmp_path, n=2, rows=10)
    path = tmp_path / "in" / "s1.parquet"
    table = pq.read_table(path)
    pq.write_table(table, path, row_group_size=3)
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    start = meta.row_group(2).column(0).data_page_offset
    data[start : start + 40] = b"\xff" * 40  # the third row group is garbage, the footer fine
    path.write_bytes(bytes(data))
    result, _ = run(spec_with(tmp_path, input__on_bad_shard="skip"))
    assert set(result.summary["bad_shards"]) == {"s1"} and set(result.summary["shards"]) == {"s0"}
    locks = tmp_path / "out" / "_batchspec" / "locks"
    held = [p for p in locks.rglob("*") if p.is_file() and p.read_text().strip()] if locks.exists() else []
    from batchspec.io.output_dir import OutputDir
    from batchspec.leases.shard_leases import ShardLeases

    other = ShardLeases(
        OutputDir(str(tmp_path / "out"), {}),
        {"run_id": "other", "host": "h", "pid": 1, "started_at": "x"},
        60,
    )
    assert other.acquire("s1") is None, f"s1's lease is still held: {held}"
    other.release_all()


@pytest.mark.vllm
def test_a_shard_lost_to_a_run_that_committed_it_names_its_holder_in_words(tmp_path, monkeypatch):
    """A split-brain loser: before this run's commit, another run took the shard over,
    committed it and gave its lease back. The exit-1 message said the holder was "run None on
    None pid None"; it says in words that it is unknown."""
    from batchspec.leases.shard_leases import ShardLeases

    shards(tmp_path, n=2, rows=3)
    confirm = ShardLeases.confirm

    def taken_and_given_back(self, shard_name):
        if shard_name == "s1":
            os.unlink(self.out.lock_path(shard_name))  # the other run's release, on local disk
        return confirm(self, shard_name)

    monkeypatch.setattr(ShardLeases, "confirm", taken_and_given_back)
    with pytest.raises(RuntimeFailure, match="lost their lease") as caught:
        run(spec_with(tmp_path))
    message = str(caught.value)
    assert "s1 (taken over by another run before commit: holder unknown: no lease names one now)" in message
    assert "None" not in message


@pytest.mark.vllm
def test_empty_input_is_fine_when_allowed(models, tmp_path):
    (tmp_path / "in").mkdir()
    with pytest.raises(InputDataError):
        run(spec_with(tmp_path))
    result, _ = run(spec_with(tmp_path, input__allow_empty=True))
    assert result.summary["status"] == "ok" and result.summary["totals"]["rows"] == 0
    assert result.summary_path and os.path.exists(result.summary_path)
    # as a nightly job sees it: no engine is needed when there is nothing to do
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "cli-out")},
        sampling={"temperature": 0.0},
    )
    assert run_cli("run", str(job), timeout=120).returncode == 3
    cli = run_cli_in_process("run", str(job), "--set", "input.allow_empty=true")
    assert cli.returncode == 0, cli.stderr
    assert "ok: 0 shards committed, 0 rows" in cli.stderr
    assert len(list((tmp_path / "cli-out" / "_batchspec" / "runs").glob("*.json"))) == 2


def test_unknown_and_error_finish_reasons_are_kept(tmp_path):
    """vLLM's `error` finish reason once became a `stop` row with no error. A stub output is
    enough here: the real engine cannot be made to fail one request on demand."""
    from batchspec.engine.rows import result_row

    def output(reason):
        completion = SimpleNamespace(
            index=0,
            token_ids=[1, 2],
            text="ab",
            finish_reason=reason,
            stop_reason=None,
            spec_decode_metrics=None,
            logprobs=None,
        )
        return SimpleNamespace(outputs=[completion], prompt_token_ids=[5], metrics=None)

    row = result_row(output("error"))
    assert row["finish_reason"] == "error" and row["error"].startswith("engine error")
    assert row["generated_text"] is None
    assert result_row(output("length"))["error"] is None
    assert result_row(output("repetition"))["finish_reason"] == "repetition"


@pytest.mark.vllm
def test_sigterm_drains_only_shards_that_can_commit(tmp_path):
    """After a stop the runner takes no new row and commits nothing partial (fake engine; the
    real engine's drain and grace period are tested in test_recovery.py)."""
    shards(tmp_path, n=3, rows=6)
    spec = spec_with(tmp_path)

    class StopAfter(FakeEngine):
        def stream(self, rows, max_in_flight, stop=None, **kw):
            import signal

            for i, item in enumerate(super().stream(rows, max_in_flight, stop=stop, **kw)):
                if i == 8:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield item

    from batchspec.errors import Interrupted

    with pytest.raises(Interrupted) as err:
        run(spec, StopAfter())
    assert err.value.exit_code == 143
    for name, table in outputs(tmp_path).items():
        assert table.num_rows == 6, f"{name} committed partially"
    assert len(outputs(tmp_path)) < 3


@pytest.mark.vllm
def test_nested_shards_mirror_their_directories_and_are_reported(tmp_path):
    for day in (1, 2):
        write_parquet(tmp_path / "in" / f"day={day}" / "part-0.parquet", {"prompt": ["a", "b"]})
    spec = spec_with(tmp_path, input__path=str(tmp_path / "in" / "*" / "*.parquet"))
    result, _ = run(spec)
    assert sorted(result.summary["shards"]) == ["day=1/part-0", "day=2/part-0"]
    assert pq.read_table(tmp_path / "out" / "day=2" / "part-0.parquet").num_rows == 2
    from batchspec.report.metrics import build_report

    report = build_report(str(tmp_path / "out"))
    assert sorted(report["shards"]) == ["day=1/part-0", "day=2/part-0"]
    assert report["overall"]["rows"] == 4
    assert plan(spec).states == {"day=1/part-0": "committed", "day=2/part-0": "committed"}


@pytest.mark.vllm
def test_a_shard_held_by_a_silent_worker_on_object_storage_is_taken_over(tmp_path, s3_server):
    """A worker that died on another host leaves its lease behind on S3; the next run waits
    out the lease on its own clock and takes the shard over instead of exiting 1."""
    import s3fs

    from batchspec.io.output_dir import OutputDir
    from batchspec.leases.shard_leases import ShardLeases

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("takeover")
    shards(tmp_path, n=2, rows=4)
    spec = spec_with(
        tmp_path,
        output={"path": "s3://takeover/out", "storage_options": options},
        execution={"lease_s": 2.0, "max_in_flight": 5},
    )
    dead = ShardLeases(
        OutputDir("s3://takeover/out", options),
        {"run_id": "dead-run", "host": "another-host", "pid": 4242, "started_at": "x"},
        2.0,
    )
    assert dead.acquire("s1") is None  # taken, and never renewed: its keeper never starts
    result, events = run(spec)
    assert set(result.summary["shards"]) == {"s0", "s1"} and not result.summary["busy_shards"]
    names = [e for e, _ in events]
    assert names.count("shards_waiting") == 1 and "shard_busy" in names


@pytest.mark.vllm
def test_s3_overlap_spelled_with_another_endpoint_is_refused_before_any_work(tmp_path, s3_server):
    """The attack that replaced an input object: the input's endpoint with a trailing slash, the
    output's without, output.path the input directory. `validate` and `run` exit 2 naming
    output.path before anything is listed, read or written, and no engine is started (the model
    does not even exist: an engine start-up could not get past it)."""
    import s3fs

    endpoint, options = s3_server
    creds = {"key": options["key"], "secret": options["secret"]}
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.mkdir("overlap-attack")
    write_parquet(tmp_path / "p0.parquet", {"prompt": ["a", "b"]})
    fs.put_file(str(tmp_path / "p0.parquet"), "overlap-attack/data/p0.parquet")
    before = fs.cat_file("overlap-attack/data/p0.parquet")
    keys_before = fs.find("overlap-attack")
    job = write_job(
        tmp_path / "job.yaml",
        input={
            "path": "s3://overlap-attack/data",
            "prompt_column": "prompt",
            "storage_options": {**creds, "endpoint_url": f"{endpoint}/"},
        },
        output={"path": "s3://overlap-attack/data", "storage_options": {**creds, "endpoint_url": endpoint}},
        model={"target": str(tmp_path / "no-such-model")},
        sampling={"temperature": 0.0, "max_tokens": 4},
    )
    checked = run_cli_in_process("validate", str(job))
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "output.path" in checked.stderr and "input location" in checked.stderr
    assert options["secret"] not in checked.stderr
    result = run_cli_in_process("run", str(job), "--log-format", "json")
    assert result.returncode == 2, result.stderr
    assert options["secret"] not in result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "engine_starting" not in names and "run_started" not in names, names
    errors = [e for e in events if e["event"] == "error"]
    assert len(errors) == 1 and errors[0]["exit_code"] == 2
    assert "output.path" in errors[0]["message"] and "input location" in errors[0]["message"]
    fs.invalidate_cache()
    assert fs.find("overlap-attack") == keys_before  # no summary, no lock, no output
    assert fs.cat_file("overlap-attack/data/p0.parquet") == before
