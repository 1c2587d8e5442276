"""Helpers for tests that start, kill and rerun real batchspec processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

from helpers.fakes import fake_cli_command
from helpers.jobs import ROOT


class Job:
    """A `batchspec run` process in its own process group, with its JSON log lines readable
    while it runs; with ``fake_engine`` its engine is tests/helpers/fakes.py's (no vLLM start-up)."""

    def __init__(self, job: Path, *extra: str, env: dict | None = None, fake_engine: bool = False):
        args = ["run", str(job), "--log-format", "json", "--no-progress", *extra]
        command = (
            fake_cli_command(*args)
            if fake_engine
            else [str(Path(sys.executable).with_name("batchspec")), *args]
        )
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self.events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("{"):
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    pass
        self.events.put(None)

    def wait_for(self, event: str, timeout: float = 240) -> dict | None:
        """The first log record of this event, or None if the process ended first. Past
        ``timeout`` the run is killed (never left running behind a failed test) and the error
        holds the end of what it logged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                record = self.events.get(timeout=1)
            except queue.Empty:
                continue
            if record is None:
                return None
            if record.get("event") == event:
                return record
        self.kill_group()
        raise TimeoutError(f"no {event} event in {timeout}s; the run's log ends:\n{self.stderr[-3000:]}")

    def kill_group(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()  # never leave a hung run (and its engine) behind a failed test
            raise
        self._reader.join(timeout=10)
        return rc

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def records(self) -> list[dict]:
        return [json.loads(x) for x in self.lines if x.startswith("{")]

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def input_ids(in_dir: Path) -> dict[str, list[str]]:
    """Shard name -> the request ids it holds."""
    return {
        p.stem: pq.read_table(p, columns=["id"])["id"].to_pylist() for p in sorted(in_dir.glob("*.parquet"))
    }


def check_output(
    out_dir: Path, expected: dict[str, list[str]], reference: dict | None = None
) -> dict[str, int]:
    """Check what is visible in the output after a crash: only complete shards, each row once,
    no stray files. Returns {shard: rows} of what is committed."""
    visible = {}
    for entry in out_dir.iterdir() if out_dir.exists() else ():
        if entry.name == "_batchspec":
            continue
        assert entry.suffix == ".parquet" and entry.stem in expected, f"stray file {entry}"
        table = pq.read_table(entry)
        ids = table["request_id"].to_pylist()
        assert sorted(ids) == sorted(expected[entry.stem]), f"{entry.name} is not complete"
        assert len(set(ids)) == len(ids)
        if reference is not None:
            for rid, text in zip(ids, table["generated_text"].to_pylist(), strict=True):
                assert text == reference[rid], rid
        visible[entry.stem] = len(ids)
    return visible
