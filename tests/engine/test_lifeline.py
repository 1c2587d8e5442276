"""No engine process outlives batchspec (batchspec/engine/lifeline.py): an EngineCore dies with
the process that started it, a worker with its EngineCore. Without an engine (three processes in
a chain, each holding its lifeline as the plugin does), then once on vLLM: ``batchspec run``
killed with SIGKILL in the middle of a job leaves none of its engine's processes 10 s later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.jobs import SEPARATE_ENGINE, write_job, write_parquet

from batchspec.engine.lifeline import CORE_ENV, PARENT_ENV

#: A stand-in for the processes vLLM starts: a parent that starts a child with this same
#: script, down to ``depth`` 0, each child holding its lifeline as batchspec's plugin does.
CHAIN = """
import os, subprocess, sys, time
from batchspec.engine.lifeline import hold
depth = int(sys.argv[1])
if depth < 2:
    assert hold(), "no lifeline held"
if depth > 0:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth - 1), sys.argv[2]])
print(os.getpid(), flush=True)
time.sleep(120)
"""


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def _descendants(pid: int, wanted: int, timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        if len(found) >= wanted:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{pid} started {len(found)} processes, not {wanted}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_core_and_its_worker_die_with_the_process_that_armed_them():
    # the top process arms (as Engine does), its child holds as an EngineCore, that one's
    # child as a worker
    top = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            f"os.environ[{PARENT_ENV!r}] = str(os.getpid())\n"
            "subprocess.Popen([sys.executable, '-c', sys.argv[1], '1', sys.argv[1]])\n"
            "time.sleep(120)\n",
            CHAIN,
        ],
        env={k: v for k, v in os.environ.items() if k not in (PARENT_ENV, CORE_ENV)},
    )
    try:
        engine_processes = _descendants(top.pid, 2)
        top.send_signal(signal.SIGKILL)
        assert _gone(engine_processes, 5), "an engine process outlived its parent"
    finally:
        top.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_started_from_a_thread_outlives_the_thread_and_dies_with_the_process():
    """A Ray replica restarts its engine on a worker thread: the EngineCore must not die when
    that thread ends (a parent-death signal would), and must die when the process does."""
    top = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, threading, time\n"
            "from batchspec.engine.lifeline import arm\n"
            "def start():\n"
            "    arm()\n"
            "    subprocess.Popen([sys.executable, '-c', sys.argv[1], '1', sys.argv[1]])\n"
            "t = threading.Thread(target=start); t.start(); t.join()\n"
            "time.sleep(120)\n",
            CHAIN,
        ],
        env={k: v for k, v in os.environ.items() if k not in (PARENT_ENV, CORE_ENV)},
    )
    try:
        engine_processes = _descendants(top.pid, 2)
        assert not _gone(engine_processes, 1.5), "the engine died with the thread that started it"
        top.send_signal(signal.SIGKILL)
        assert _gone(engine_processes, 5), "an engine process outlived its parent"
    finally:
        top.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_that_did_not_arm_its_children_leaves_them_their_own():
    """The lifeline is batchspec's: a process vLLM starts for someone else keeps its life."""
    top = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\ntime.sleep(120)\n",
        ],
        env={k: v for k, v in os.environ.items() if k not in (PARENT_ENV, CORE_ENV)},
    )
    try:
        (child,) = _descendants(top.pid, 1)
        top.send_signal(signal.SIGKILL)
        top.wait()
        assert not _gone([child], 1.5)
    finally:
        top.kill()
        psutil.Process(child).kill()


@pytest.mark.engine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_killed_with_sigkill_leaves_no_engine_process(tmp_path, models):
    rows = 400
    write_parquet(tmp_path / "in" / "s0.parquet", {"prompt": [f"def f{i}(x):" for i in range(rows)]})
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0, "max_tokens": 64},
        execution={"max_in_flight": 4},
    )
    exe = Path(sys.executable).with_name("batchspec")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **SEPARATE_ENGINE}
    run = subprocess.Popen(
        [str(exe), "run", str(job), "--no-progress"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        engine = []
        while time.monotonic() < deadline and run.poll() is None:
            engine = [p for p in psutil.Process(run.pid).children(recursive=True) if "VLLM" in p.name()]
            # the engine is generating once the first shard's rows are in flight: its workers
            # exist and the run has said the shard started
            if len(engine) >= 2:
                break
            time.sleep(0.5)
        assert len(engine) >= 2, f"no engine processes seen: {[p.name() for p in engine]}"
        time.sleep(3)  # in the middle of the job
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        assert _gone([p.pid for p in engine], 10), [p.name() for p in engine if p.is_running()]
    finally:
        run.kill()
