"""`make test`: the suite in pytest processes side by side (lanes), then what it cost.

- **engines**: the tests on the session's shared engines, which run in the pytest process
  itself, one engine working at a time (tests/conftest.py marks them ``engine_group``);
- **processes**: the engine tests whose engines live in other processes: ``batchspec``
  subprocesses (tune, distill, kills and restarts), Ray replicas and Airflow (marked
  ``own_processes``, by file: tests/helpers/lanes.py). One pytest process a file, longest first,
  on :data:`PROCESS_WORKERS` worker(s) that each take the next file;
- **rest**: every test that starts no engine.

Each lane's output is kept and printed whole when all have ended, then each lane's wall time (and
each file of the processes lane) and, where ``BATCHSPEC_TEST_ENGINE_LOG`` names a file, the engine
start-ups by configuration across the lanes. Exits 0 only if every pytest process passed. Extra
arguments go to every pytest process.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.lanes import OWN_PROCESS_FILES  # noqa: E402  (the tests' own list)

#: (name, marker expression, how many slowest tests to print)
LANES = (
    ("engines", "engine_group and not own_processes", 25),
    ("rest", "not engine_group", 10),
)
PROCESSES_MARKER = "engine_group and own_processes"
#: Workers of the processes lane, each running one file at a time. Two were tried: with the
#: other lanes beside them, four test processes' engines on 2 cores (vLLM binds each engine's
#: OpenMP threads to every core) slowed each other so far that a 4-s lease was lost and 48
#: requests did not finish within 120 s of grace, and the whole took no less time.
PROCESS_WORKERS = 1
ENGINE_LOG_ENV = "BATCHSPEC_TEST_ENGINE_LOG"
#: pytest's exit code when nothing is selected (a file of the processes lane under ``-k``): a pass
NO_TESTS = 5


def _pytest(lane: str, marker: str, durations: int, paths: list[str], argv: list[str], out) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", f"--durations={durations}", "-m", marker]
    env = {**os.environ, "BATCHSPEC_TEST_LANE": lane}
    return subprocess.call([*cmd, *paths, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def main(argv: list[str]) -> int:
    started = time.time()
    logs = Path(tempfile.mkdtemp(prefix="batchspec-lanes-"))
    print(f"make test: lanes side by side; their output, as it comes, in {logs}", flush=True)
    results: dict[str, tuple[int, float]] = {}

    def lane(name: str, marker: str, durations: int) -> None:
        t0 = time.monotonic()
        with (logs / f"{name}.log").open("w") as out:
            status = _pytest(name, marker, durations, ["tests"], argv, out)
        results[name] = (0 if status == NO_TESTS else status, time.monotonic() - t0)

    queue = collections.deque(OWN_PROCESS_FILES)
    lock = threading.Lock()

    def worker(index: int) -> None:
        name = f"processes-{index}"
        while True:
            with lock:
                if not queue:
                    return
                path = queue.popleft()
            t0 = time.monotonic()
            with (logs / f"{name}.log").open("a") as out:
                out.write(f"\n======== {path}\n")
                out.flush()
                status = _pytest(name, PROCESSES_MARKER, 5, [path], argv, out)
            results[path] = (0 if status == NO_TESTS else status, time.monotonic() - t0)

    threads = [threading.Thread(target=lane, args=spec) for spec in LANES]
    threads += [threading.Thread(target=worker, args=(i + 1,)) for i in range(PROCESS_WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    for log in sorted(logs.glob("*.log")):
        print(f"\n======== {log.stem}", flush=True)
        sys.stdout.write(log.read_text())
    print("\n======== make test: the lanes, side by side (wall time)")
    for name, marker, _ in LANES:
        status, wall = results[name]
        print(f"  {name:<38} exit {status}  {wall:6.0f} s ({wall / 60:.1f} min)  -m {marker!r}")
    print(f"  processes ({PROCESS_WORKERS} workers, one file each at a time; -m {PROCESSES_MARKER!r}):")
    for path in OWN_PROCESS_FILES:
        status, wall = results[path]
        print(f"    {path:<36} exit {status}  {wall:6.0f} s")
    total = time.time() - started
    print(f"  all {' ' * 34} {total:6.0f} s ({total / 60:.1f} min)")
    _startups(started)
    return 0 if all(status == 0 for status, _ in results.values()) else 1


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
