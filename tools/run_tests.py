"""`make test`: the suite in three pytest processes side by side (lanes), then what it cost.

- **engines**: the tests on the session's shared engines, which run in the pytest process
  itself, one engine working at a time (tests/conftest.py marks them ``engine_group``);
- **processes**: the engine tests whose engines live in other processes: ``batchspec``
  subprocesses (tune, distill, kills and restarts), Ray replicas and Airflow (marked
  ``own_processes``, by file: tests/helpers/lanes.py), one at a time, the files longest first;
- **rest**: every test that starts no engine.

Each lane's output is kept and printed whole when all have ended, then each lane's wall time and,
where ``BATCHSPEC_TEST_ENGINE_LOG`` names a file, the engine start-ups by configuration across
the lanes. Exits 0 only if every lane passed. Extra arguments go to every pytest process.

One pytest process for the processes lane: two side by side were tried, and with the other lanes
beside them four test processes' engines on 2 cores (vLLM binds each engine's OpenMP threads to
every core) slowed each other so far that a 4-s lease was lost and 48 requests did not finish
within 120 s of grace; one pytest process a file, one after another, paid a collection a file.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.lanes import OWN_PROCESS_FILES  # noqa: E402  (the tests' own list)

#: (name, marker expression, the paths to collect, how many slowest tests to print)
LANES = (
    ("engines", "engine_group and not own_processes", ["tests"], 25),
    ("processes", "engine_group and own_processes", list(OWN_PROCESS_FILES), 25),
    ("rest", "not engine_group", ["tests"], 10),
)
ENGINE_LOG_ENV = "BATCHSPEC_TEST_ENGINE_LOG"
#: pytest's exit code when nothing is selected (under ``-k``): a pass
NO_TESTS = 5


def main(argv: list[str]) -> int:
    started = time.time()
    logs = Path(tempfile.mkdtemp(prefix="batchspec-lanes-"))
    print(f"make test: {len(LANES)} lanes side by side; their output, as it comes, in {logs}", flush=True)
    procs = []
    for name, marker, paths, durations in LANES:
        out = (logs / f"{name}.log").open("w+")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", f"--durations={durations}", "-m", marker]
        env = {**os.environ, "BATCHSPEC_TEST_LANE": name}
        proc = subprocess.Popen(
            [*cmd, *paths, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
        procs.append((name, out, time.monotonic(), proc))
    ended: dict[str, tuple[int, float]] = {}
    while len(ended) < len(procs):  # each lane's own wall time, whichever ends first
        for name, _, lane_started, proc in procs:
            status = proc.poll()
            if status is not None and name not in ended:
                ended[name] = (0 if status == NO_TESTS else status, time.monotonic() - lane_started)
        time.sleep(1)
    results = [(name, *ended[name]) for name, _, _, _ in procs]
    for (name, out, _, _), (_, status, wall) in zip(procs, results, strict=True):
        out.seek(0)
        print(f"\n======== lane {name} (exit {status}, {wall:.0f} s)", flush=True)
        sys.stdout.write(out.read())
    print("\n======== make test: the lanes, side by side")
    for name, status, wall in results:
        marker = next(m for n, m, _, _ in LANES if n == name)
        print(f"  {name:<10} exit {status}  {wall:6.0f} s ({wall / 60:.1f} min)  -m {marker!r}")
    print(f"  all        {time.time() - started:6.0f} s ({(time.time() - started) / 60:.1f} min)")
    _startups(started)
    return 0 if all(status == 0 for _, status, _ in results) else 1


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
