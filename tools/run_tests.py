"""`make test`: the suite in pytest processes, three at a time on the machine, then what it cost.

The work, in the order it starts:

- **models** (``--models COMMAND``, `make test` passes ``make models``): builds the tiny models,
  or restores them from the model cache in seconds. On an empty cache the others start while it
  works, as soon as what they wait for is built (tests/helpers/lanes.py): the units that need no
  model once the first models are (the target and its draft, trained on both cores, so that they
  are not slowed by tests beside them), the ones that need models once all but the late ones are;
  a test that needs a late one waits for it (tests/conftest.py), last in its pytest process;
- **engines**: the tests on the session's shared engines, which run in the pytest process
  itself, one engine working at a time (tests/conftest.py marks them ``engine_group``);
- **rest**: every test that starts no engine and needs no model;
- **processes**: the engine tests whose engines live in other processes: ``batchspec``
  subprocesses (tune, distill, kills and restarts), Ray replicas and Airflow (marked
  ``own_processes``, by file or test function: tests/helpers/lanes.py), a pytest process
  each, the longest first, and **rest:models**, the tests that need the models but no engine,
  among the last two of them;
- whatever ``--also NAME=COMMAND`` adds (CI's Python 3.13 run, which needs no model), among
  those files (:data:`ALSO_AFTER`).

At most :data:`SLOTS` of them run at once: the first three that can start at the start, and each
time one ends the next in the list that can start (its models built), so the processes files go
one after another from early on and on two slots once the shorter of the other two has ended, and
the cores stay busy to the end instead of one long file running alone. More than three at once was
tried (two processes files beside the other lanes, torch's default of an OpenMP thread a core
then): four test processes' engines on 2 cores slowed each other so far that a 4-s lease was lost
and 48 requests did not finish within 120 s of grace. Every unit but the latency-bound ones
(tests/helpers/lanes.py: the Ray file, which mostly waits on the processes it starts) runs at a
lower CPU priority (:data:`NICE`), so that the Ray file is not the one left running at the end
(the figures: docs/development.md).

Each one's output is kept and printed whole when all have ended (and, as it comes, in the folder
the first line names), then, where ``BATCHSPEC_TEST_ENGINE_LOG`` names a file, the engine
start-ups by configuration across them, and last each one's wall time and CPU time (its own and
that of every process under it that was waited for: the engines' processes, `batchspec` runs)
and which failed.
Exits 0 only if every one passed. Extra arguments go to every pytest process.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.lanes import (  # noqa: E402  (the tests' own lists)
    FIRST_MODELS,
    LATE_MODELS,
    LATENCY_BOUND,
    MODEL_MARKERS,
    OWN_PROCESS_FILES,
)

#: How many run at once on the machine.
SLOTS = 3
#: The ``--also`` commands start after this many processes files: CI's Python 3.13 run (about 6
#: minutes beside the others) after the long files and before the short ones that fill the end.
ALSO_AFTER = 3
ENGINE_LOG_ENV = "BATCHSPEC_TEST_ENGINE_LOG"
#: How much lower the CPU priority of every unit but the latency-bound ones is (``nice``)
NICE = 4
#: pytest's exit code when nothing is selected (under ``-k``): a pass
NO_TESTS = 5
#: The name of the unit that builds the models.
MODELS = "models"
#: Where `make models` puts them (tests/helpers/jobs.py: MODELS)
MODELS_DIR = ROOT / ".models"
#: What a unit that needs models waits for while they are built: every one but the late ones
#: (tests/helpers/lanes.py; the tests that need those wait for them themselves)
MOST_MODELS = tuple(name for name in MODEL_MARKERS if name not in LATE_MODELS)
#: The variable that tells a unit started while the models are built the pid of the process
#: building them (tests/conftest.py waits for a model while it lives)
MODELS_PID_ENV = "BATCHSPEC_TEST_MODELS_PID"


@dataclasses.dataclass
class Unit:
    """One pytest process (or ``--also`` command): its name, command and what it showed."""

    name: str
    cmd: list[str]
    #: what to print of it: the marker expression or the command
    what: str
    #: whether it needs models (else it needs none but waits for the first ones to be built:
    #: tests/helpers/lanes.py's FIRST_MODELS)
    needs_models: bool = True
    #: whether it keeps the normal CPU priority (tests/helpers/lanes.py: LATENCY_BOUND)
    latency_bound: bool = False
    proc: subprocess.Popen | None = None
    started: float = 0.0
    status: int | None = None
    wall: float = 0.0
    #: CPU seconds (user and system) of it and of every process of its that it waited for
    cpu: float = 0.0
    out: object = None


def _pytest(
    name: str, marker: str, paths: list[str], durations: int, argv: list[str], needs_models: bool = True
) -> Unit:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", f"--durations={durations}", "-m", marker]
    return Unit(name, [*cmd, *paths, *argv], f"-m {marker!r} {' '.join(paths)}", needs_models)


def units(argv: list[str], also: list[str], models: str | None = None) -> list[Unit]:
    """The work in the order it starts (``also``: ``NAME=COMMAND`` each; ``models``: the command
    that builds the models, first)."""
    first = [Unit(MODELS, ["bash", "-c", models], models, needs_models=False)] if models else []
    work = [
        _pytest("engines", "engine_group and not own_processes", ["tests"], 25, argv),
        _pytest("rest", "not engine_group and not models", ["tests"], 10, argv, needs_models=False),
    ]
    also_at = len(work) + ALSO_AFTER
    for path in OWN_PROCESS_FILES:
        file, _, function = path.partition("::")
        name = "processes:" + Path(file).stem.removeprefix("test_") + (":" + function if function else "")
        work.append(_pytest(name, "engine_group and own_processes", [path], 10, argv))
        work[-1].latency_bound = path in LATENCY_BOUND
    # short and bound by CPU: among the last, to fill the cores at the end
    work.insert(len(work) - 2, _pytest("rest:models", "not engine_group and models", ["tests"], 5, argv))
    commands = []
    for value in also:
        name, sep, command = value.partition("=")
        if not sep or not name or not command:
            raise SystemExit(f"run_tests.py: --also takes NAME=COMMAND, not {value!r}")
        commands.append(Unit(name, ["bash", "-c", command], command, needs_models=False))
    work[also_at:also_at] = commands
    return first + work


def main(argv: list[str]) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--also", action="append", default=[])
    parser.add_argument("--models")
    known, pytest_args = parser.parse_known_args(argv)
    work = units(pytest_args, known.also, known.models)
    logs = Path(tempfile.mkdtemp(prefix="batchspec-lanes-"))
    print(
        f"make test: {len(work)} pytest processes and commands, {SLOTS} at a time; their output, "
        f"as it comes, in {logs}",
        flush=True,
    )
    waiting = list(work)
    running: list[Unit] = []
    models = next((u for u in work if u.name == MODELS), None)
    while waiting or running:
        if models is not None and models.status not in (None, 0):  # what needs them cannot run
            for unit in [u for u in waiting if u.needs_models]:
                waiting.remove(unit)
                unit.status, unit.what = 1, f"not run: the models were not built ({unit.what})"
                unit.out, unit.started = tempfile.TemporaryFile("w+"), time.monotonic()
        while len(running) < SLOTS and (ready := [u for u in waiting if _can_start(u, models, started)]):
            unit = ready[0]
            waiting.remove(unit)
            unit.out = (logs / f"{unit.name.replace(':', '-')[:80]}.log").open("w+")
            env = {**os.environ, "BATCHSPEC_TEST_LANE": unit.name}
            if models is not None and models.status is None and unit is not models:
                env[MODELS_PID_ENV] = str(models.proc.pid)
            unit.started = time.monotonic()
            unit.proc = subprocess.Popen(
                unit.cmd,
                stdout=unit.out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                preexec_fn=None if unit.latency_bound else _lower_priority,
            )
            running.append(unit)
        time.sleep(1)
        for unit in list(running):  # each one's own wall and CPU time, whichever ends first
            pid, wait_status, usage = os.wait4(unit.proc.pid, os.WNOHANG)
            if pid:
                unit.proc.returncode = status = os.waitstatus_to_exitcode(wait_status)
                unit.status = 0 if status == NO_TESTS else status
                unit.wall = time.monotonic() - unit.started
                unit.cpu = usage.ru_utime + usage.ru_stime
                running.remove(unit)
    for unit in work:
        unit.out.seek(0)
        print(f"\n======== {unit.name} (exit {unit.status}, {unit.wall:.0f} s)", flush=True)
        sys.stdout.write(unit.out.read())
    _startups(started)
    # last, so that the end of the output (all a CI log may keep) holds it
    print(
        f"\n======== make test: {SLOTS} at a time, each one's wall time from its start and its CPU "
        f"time ({os.cpu_count()} cores)"
    )
    for unit in work:
        offset = unit.started - work[0].started
        print(
            f"  {unit.name:<24} exit {unit.status}  {unit.wall:6.0f} s ({unit.wall / 60:4.1f} min)"
            f"  from {offset / 60:4.1f} min  CPU {unit.cpu / 60:4.1f} min  {unit.what}"
        )
    wall, cpu = time.time() - started, sum(unit.cpu for unit in work)
    print(f"  all                      {wall:6.0f} s ({wall / 60:.1f} min)  CPU {cpu / 60:.1f} min")
    failed = [unit.name for unit in work if unit.status != 0]
    print(f"make test: {'failed: ' + ', '.join(failed) if failed else 'all passed'}")
    return 0 if all(unit.status == 0 for unit in work) else 1


def _can_start(unit: Unit, models: Unit | None, since: float) -> bool:
    """Whether ``unit`` can start now: the models unit at once; the others once the models are
    built, or while they are, once those it waits for are built (:data:`MOST_MODELS` for a unit
    that needs models, the first ones for the others); the ones that need none also when the
    models failed."""
    if unit is models or models is None or models.status == 0:
        return True
    if models.status is not None:
        return not unit.needs_models
    return _built(MOST_MODELS if unit.needs_models else FIRST_MODELS, since)


def _built(names: tuple[str, ...], since: float) -> bool:
    """Whether each of these models was built or restored by this run: the file written last in
    it there, created since ``since`` (its inode's change time, which a restore's copy does not
    keep), for one from an earlier run may be one that `make models` is about to build again."""
    for name in names:
        try:
            # a second's slack: the file system's clock is coarser than time.time()
            if (MODELS_DIR / name / MODEL_MARKERS[name]).stat().st_ctime < since - 1:
                return False
        except FileNotFoundError:
            return False
    return True


def _lower_priority() -> None:
    """In the child, before its command: :data:`NICE` lower CPU priority, for it and every
    process it starts."""
    os.nice(NICE)


def _startups(since: float) -> None:
    """Engine start-ups of this suite's lanes by configuration, from the engine log."""
    path = os.environ.get(ENGINE_LOG_ENV)
    if not path or not Path(path).exists():
        return
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("time", 0) >= since - 1]
    by_config = collections.Counter(r.get("config", r.get("model")) for r in records)
    separate = sum(1 for r in records if r.get("separate", True))
    print(
        f"\n======== engine start-ups: {len(records)} in {len(by_config)} configurations "
        f"({separate} with vLLM's own processes); by configuration (model | speculation | "
        "other arguments' digest):"
    )
    for config, count in by_config.most_common():
        print(f"{count:4d}  {config}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
