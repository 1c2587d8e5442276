"""Transient storage errors are retried; leases keep two processes off one shard.

The flaky filesystem is a real fsspec filesystem (memory-backed) that fails each operation the
first time it sees it, so every storage call on the run's path must survive one failure.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from helpers.fake_runs import run
from helpers.fakes import FakeEngine

from batchspec.errors import RuntimeFailure, SpecError
from batchspec.io import host as host_mod
from batchspec.io import retry as storage
from batchspec.io.output_dir import OutputDir
from batchspec.spec.build import build_spec

FAILED: set = set()


class FlakyFile(io.BytesIO):
    def __init__(self, data: bytes, key: str):
        super().__init__(data)
        self.key = key
        self.reads = 0

    def read(self, *args):
        self.reads += 1
        if self.reads == 3 and ("read", self.key) not in FAILED:
            FAILED.add(("read", self.key))
            raise ConnectionError(f"connection reset while reading {self.key}")
        return super().read(*args)


class FlakyFileSystem(MemoryFileSystem):
    """Memory filesystem whose operations each fail once, like a throttled object store."""

    protocol = "flaky"
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        if path.startswith("flaky://"):
            path = path[len("flaky://") :]
        return MemoryFileSystem._strip_protocol(path)

    def _fail_once(self, op, path):
        if (op, path) not in FAILED:
            FAILED.add((op, path))
            raise ConnectionError(f"503 Slow Down: {op} {path}")

    def info(self, path, **kw):
        self._fail_once("info", path)
        return super().info(path, **kw)

    def pipe_file(self, path, value, **kw):
        self._fail_once("pipe", path)
        return super().pipe_file(path, value, **kw)

    def put_file(self, lpath, rpath, **kw):
        self._fail_once("put", rpath)
        return super().put_file(lpath, rpath, **kw)

    def _open(self, path, mode="rb", **kw):
        if "r" in mode:
            self._fail_once("open", path)
            return FlakyFile(self.cat_file(path), path)
        return super()._open(path, mode, **kw)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    FAILED.clear()
    monkeypatch.setattr(storage, "BACKOFF_S", 0.001)
    import fsspec

    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    yield
    FlakyFileSystem.store.clear()
    FlakyFileSystem.pseudo_dirs.clear()
    FlakyFileSystem.pseudo_dirs.append("")


def test_retry_gives_up_with_a_clear_message():
    calls = []

    def always_down():
        calls.append(1)
        raise ConnectionError("connection refused")

    with pytest.raises(RuntimeFailure, match="storage failed after 3 attempts: listing s3://b"):
        storage.retry(always_down, "listing s3://b", attempts=3)
    assert len(calls) == 3
    with pytest.raises(FileNotFoundError):  # not transient: no retry
        storage.retry(lambda: (_ for _ in ()).throw(FileNotFoundError("x")), "x")


@pytest.mark.vllm
def test_a_job_survives_a_transient_failure_of_every_storage_call(tmp_path):
    for i in range(2):
        buf = io.BytesIO()
        pq.write_table(pa.table({"prompt": [f"p{i}-{j}" for j in range(30)]}), buf, row_group_size=7)
        with MemoryFileSystem().open(f"/in/s{i}.parquet", "wb") as f:
            f.write(buf.getvalue())
    spec = build_spec(
        {
            "input": {"path": "flaky:///in/*.parquet", "prompt_column": "prompt"},
            "output": {"path": "flaky:///out", "row_group_rows": 8},
            "model": {"target": "unused"},
            "sampling": {"temperature": 0.0},
            "execution": {"max_in_flight": 4, "read_batch_rows": 5},
        }
    )
    result, _ = run(spec, FakeEngine())
    assert result.summary["totals"]["rows"] == 60
    for i in range(2):
        table = pq.read_table(io.BytesIO(MemoryFileSystem().cat(f"/out/s{i}.parquet")))
        assert sorted(table["request_id"].to_pylist()) == sorted(f"s{i}/{j}" for j in range(30))
    kinds = {op for op, _ in FAILED}
    assert {"info", "open", "read", "pipe", "put"} <= kinds, kinds


@pytest.mark.vllm
def test_a_live_lease_keeps_a_second_process_off_the_shard(tmp_path):
    from helpers.fake_runs import make_spec, outputs, shards
    from helpers.jobs import write_parquet
    from helpers.leases import kill_a_holder

    from batchspec.leases.shard_leases import ShardLeases

    shards(tmp_path, n=3)
    out_url = str(tmp_path / "out")
    holder = ShardLeases(
        OutputDir(out_url, {}),
        {"run_id": "other-run", "host": host_mod.this_host(), "pid": os.getpid(), "started_at": "now"},
    )
    assert holder.acquire("s1") is None
    with pytest.raises(
        RuntimeFailure,
        match=r"1 shards are being processed by another run.*s1 "
        r"\(run other-run",
    ):
        run(make_spec(tmp_path))
    assert sorted(outputs(tmp_path)) == ["s0", "s2"]
    holder.release("s1")
    # a lease whose process is killed is taken over at once
    child = kill_a_holder(out_url, {}, "s1", host_mod.this_host())
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    result, _ = run(make_spec(tmp_path))
    assert list(result.summary["shards"]) == ["s1"]
    # a lock file nobody holds is no lease, whatever its record says (another host, a heartbeat
    # that looks fresh): on local disk only a live process's lock counts
    write_parquet(tmp_path / "in" / "s1.parquet", {"prompt": ["changed"], "k": [1]})
    lock = tmp_path / "out" / "_batchspec" / "locks" / "s1.json"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(
        json.dumps(
            {
                "run_id": "gone",
                "host": "elsewhere",
                "pid": 1,
                "token": "t",
                "heartbeat": time.time(),
                "lease_s": 120,
            }
        )
    )
    result, _ = run(make_spec(tmp_path))
    assert list(result.summary["shards"]) == ["s1"]
    assert not list((tmp_path / "out" / "_batchspec" / "locks").glob("*.json"))


def test_orphan_temp_files_of_dead_processes_are_removed(tmp_path):
    from batchspec.io.output_dir import remove_orphan_tmp_files, tmp_file_name

    mine = tmp_file_name("a")
    dead = f"b~{host_mod.this_host()}~{2**22 + 99}~abcdef.parquet.tmp"
    other_host = "c~some-other-host~1~abcdef.parquet.tmp"
    for name in (mine, dead, other_host):
        (tmp_path / name).write_bytes(b"x")
    assert remove_orphan_tmp_files(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, other_host])


# ---------------------------------------------------------------- settings from the environment


BAD_SETTINGS = [
    ("BATCHSPEC_STORAGE_TIMEOUT_S", "abc"),
    ("BATCHSPEC_STORAGE_TIMEOUT_S", ""),
    ("BATCHSPEC_STORAGE_TIMEOUT_S", "-1"),
    ("BATCHSPEC_STORAGE_TIMEOUT_S", "nan"),
    ("BATCHSPEC_STORAGE_TIMEOUT_S", "inf"),
    ("BATCHSPEC_STORAGE_ATTEMPTS", "x"),
    ("BATCHSPEC_STORAGE_ATTEMPTS", "0"),
    ("BATCHSPEC_STORAGE_ATTEMPTS", "2.5"),
    ("BATCHSPEC_STORAGE_BACKOFF_S", "-5"),
]


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_a_bad_setting_in_the_environment_is_exit_2_naming_it(tmp_path, name, value):
    """Every command checks the BATCHSPEC_* numbers first: exit 2 naming the variable, never a
    traceback, a silent default or a timeout on every request."""
    from click.testing import CliRunner

    from batchspec.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "env", "input": {"path": str(tmp_path / "in")}}))
    for command in ("validate", "status"):
        result = CliRunner().invoke(main, [command, str(job)], env={name: value})
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(f"batchspec: bad job spec: {name}: expected a "), result.stderr
        assert f"got {value!r}" in result.stderr and "Traceback" not in result.output


def test_a_bad_setting_is_exit_2_when_the_command_line_starts(tmp_path):
    """Read when used, never at import: a process given one does not die importing batchspec."""
    from helpers.jobs import run_cli

    result = run_cli("status", str(tmp_path / "job.yaml"), env={"BATCHSPEC_STORAGE_TIMEOUT_S": "abc"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "BATCHSPEC_STORAGE_TIMEOUT_S: expected a positive number, got 'abc'" in result.stderr


def test_settings_are_read_at_each_use(monkeypatch):
    monkeypatch.setenv("BATCHSPEC_STORAGE_ATTEMPTS", "7")
    monkeypatch.setenv("BATCHSPEC_STORAGE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("BATCHSPEC_STORAGE_BACKOFF_S", "0")
    assert (storage.max_attempts(), storage.request_timeout_s()) == (7, 2.5)
    monkeypatch.setattr(storage, "BACKOFF_S", None)  # fast_backoff's, here the environment's
    assert storage.backoff_s(3) == 0 and storage.budget_s() == 7 * 2.5
    monkeypatch.setenv("BATCHSPEC_STORAGE_ATTEMPTS", "x")
    with pytest.raises(SpecError) as err:
        storage.retry(lambda: 1, "x")
    assert err.value.key == "BATCHSPEC_STORAGE_ATTEMPTS" and err.value.exit_code == 2
