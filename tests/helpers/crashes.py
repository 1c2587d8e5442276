"""A shard's commit stopped between two of its steps, in this process (an exception no handler
of the run catches as a shard's failure) or for real (the process SIGKILLs itself): what the
output then holds, and what ``status`` and a rerun make of it.

The steps are the calls of :class:`batchspec.io.output_dir.OutputDir` that change what a reader
of the output sees: ``remove`` of a manifest, ``publish`` of a shard's file, ``write_json`` of a
manifest, in whatever order the commit makes them. ``after=k`` stops the process right after
the k-th (0: once the temporary files are complete, before the first); ``after="publish
s0.parquet"`` right after the step so named; ``after="writing"`` while the temporary files are
being written (after the shard's first line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from batchspec.columns import error_result
from helpers.fakes import FakeEngine

#: The environment of a process run with :data:`CRASHING_CLI`: where its commit stops, and the
#: request ids its engine fails.
CRASH_AFTER_ENV = "BATCHSPEC_TEST_CRASH_AFTER"
FAILING_ENV = "BATCHSPEC_TEST_FAILING_IDS"


class Crash(BaseException):
    """The process stops here (not an Exception: nothing on the run's path handles it as one
    shard's failure)."""


class SplitEngine(FakeEngine):
    """The fake engine, failing the requests whose id is in ``failing`` as the engine would
    (an ``engine error``, a line of the errors file): two runs with different ``failing`` put
    the same request in different files, with files of the same size."""

    def __init__(self, failing=(), **kw):
        super().__init__(**kw)
        self.failing = set(failing)

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        for row, results in super().stream(rows, max_in_flight, stop, grace_s, keep):
            if row.error is None and row.request_id in self.failing:
                results = [error_result(f"engine error: fake failure of {row.request_id}")]
            yield row, results


def stop_commit(setattr_, after, stop) -> list[str]:
    """Patch (with ``setattr_(owner, name, value)``, e.g. ``monkeypatch.setattr``) the output's
    steps so that ``stop(step)`` is called after the ``after``-th; returns the steps as they
    happen (``publish <name>``, ``remove <name>``, ``write_json <name>``)."""
    from batchspec.io.openai_results import OpenAIResultWriter
    from batchspec.io.output_dir import OutputDir
    from batchspec.io.writer import ParquetWriter

    steps: list[str] = []

    def step(what: str) -> None:
        steps.append(what)
        if after in (len(steps), what):
            stop(what)

    def manifest(path: str) -> bool:
        return "/_batchspec/manifest/" in path

    publish, remove, write_json = OutputDir.publish, OutputDir.remove, OutputDir.write_json

    def publishing(self, local_file, final):
        if after == 0 and not steps:
            stop("temporary files complete")
        publish(self, local_file, final)
        step(f"publish {os.path.basename(final)}")

    def removing(self, path):
        if manifest(path) and after == 0 and not steps:
            stop("temporary files complete")
        remove(self, path)
        if manifest(path):
            step(f"remove {os.path.basename(path)}")

    def writing_json(self, path, record):
        if manifest(path) and after == 0 and not steps:
            stop("temporary files complete")
        write_json(self, path, record)
        if manifest(path):
            step(f"write_json {os.path.basename(path)}")

    setattr_(OutputDir, "publish", publishing)
    setattr_(OutputDir, "remove", removing)
    setattr_(OutputDir, "write_json", writing_json)
    if after == "writing":
        for writer in (OpenAIResultWriter, ParquetWriter):
            add = writer.add_request

            def adding(self, row, results, add=add):
                add(self, row, results)
                self.flush()
                stop("writing the temporary files")

            setattr_(writer, "add_request", adding)
    return steps


def raise_crash(step: str) -> None:
    raise Crash(step)


def sigkill(step: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


#: ``batchspec`` in a new process with :class:`SplitEngine` (the ids of ``FAILING_ENV``, comma
#: separated) in place of vLLM, which SIGKILLs itself at ``CRASH_AFTER_ENV`` (see
#: :func:`stop_commit`). argv: the tests folder, then the command line.
CRASHING_CLI = """
import os, sys
sys.path.insert(0, sys.argv[1])
import batchspec.engine.llm
import batchspec.engine.checks
from helpers import crashes
failing = [x for x in os.environ.get(crashes.FAILING_ENV, "").split(",") if x]
batchspec.engine.llm.Engine = lambda spec: crashes.SplitEngine(failing)
batchspec.engine.checks.check_vllm_keys = lambda spec: None
batchspec.engine.checks.vllm_version = lambda: "none (fake engine)"
after = os.environ.get(crashes.CRASH_AFTER_ENV)
if after is not None:
    crashes.stop_commit(setattr, int(after) if after.isdigit() else after, crashes.sigkill)
from batchspec.cli import main
sys.argv = ["batchspec", *sys.argv[2:]]
main()
"""


def run_crashing_cli(*args: str, after, failing=(), timeout: float = 120) -> subprocess.CompletedProcess:
    """``batchspec ARGS`` in a process that kills itself with SIGKILL after the ``after``-th step
    of a commit (None: never), its engine failing the ids in ``failing``."""
    env = {**os.environ, FAILING_ENV: ",".join(failing)}
    env.pop(CRASH_AFTER_ENV, None)
    if after is not None:
        env[CRASH_AFTER_ENV] = str(after)
    tests = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-c", CRASHING_CLI, str(tests), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tests.parent,
    )
