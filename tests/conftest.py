"""Shared fixtures: the tiny model pair, prompt shards, job files, and a CLI runner."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

#: One OpenMP thread a process, unbound: `make test` runs three pytest processes at once on a
#: 2-core machine, each with engines (in its process, in `batchspec` subprocesses, in vLLM's own
#: processes). With torch's default of a thread a core, the threads of one parallel region wait
#: spinning for a peer the other processes hold off the core: three runs of one job side by side
#: took 84 s with the default and 47 s with one thread each, their generating 37 s and 6 s (one
#: alone: 28 and 31 s). vLLM's own engine processes bind their threads to core 0 unless told
#: not to, so that all of them would share one core. Set before torch is imported anywhere in the
#: run, and inherited by every process the tests start. Not a setting batchspec makes for users.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
from helpers.jobs import MODELS, ROOT, S3_KEY, S3_SECRET, free_port  # noqa: E402
from helpers.lanes import LATE_MODELS, MODEL_MARKERS, OWN_PROCESS_FILES  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))

#: Whether vLLM is installed (looked up, not imported: importing it takes seconds). Where it is
#: not, as in `make test-py313` (Python 3.13, batchspec without the engine extra), every test marked
#: ``vllm`` is skipped: those that start an engine or need the built models, marked here, and those
#: marked by hand that reach vLLM's own classes, torch or transformers (a run checks its spec against
#: vLLM's classes, on the fake engine too). Every other test must pass without vLLM.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

#: Tune's and auto's timed levels last half a second in the tests (4 s for users): the tests
#: check what tune does with its measurements; the speed-ups themselves are `make bench`'s. Set
#: before batchspec.tune is imported, and inherited by the `batchspec` subprocesses.
os.environ.setdefault("BATCHSPEC_TEST_TUNE_LEVEL_S", "0.5")
_NEEDS_VLLM = "needs vLLM installed (marker vllm)"


#: The fixtures whose tests are in the engine group (below): a session's shared engines live in
#: one process, and a Ray cluster is started once a module.
_ENGINE_GROUP_FIXTURES = frozenset({"shared_engines", "ray_cluster"})

#: The engine tests whose engines live in processes of their own, by file (tests/helpers/lanes.py):
#: marked ``own_processes``, `make test` runs them beside the tests on the shared engines.
_OWN_PROCESS_FILES = frozenset(OWN_PROCESS_FILES)


def _has_own_processes(nodeid: str) -> bool:
    """Whether ``OWN_PROCESS_FILES`` names the test's file or its test function (every
    parameter of it)."""
    return nodeid.split("::")[0] in _OWN_PROCESS_FILES or nodeid.split("[")[0] in _OWN_PROCESS_FILES


def pytest_collection_modifyitems(items):
    """Mark every test that needs the built models, so `make test-fast` (no models, no engine)
    can leave them out on a fresh clone; mark the engine and models tests as needing vLLM, and
    skip what needs vLLM where it is not installed.

    Every test that starts a vLLM engine, runs on a shared one or on the Ray cluster is also
    marked ``engine_group``, and those ``OWN_PROCESS_FILES`` names (a file, or one test function
    of a file) ``own_processes``:
    `make test` runs each group in pytest processes of its own, side by side
    (tools/run_tests.py)."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "models" in fixtures:
            item.add_marker(pytest.mark.models)
        if item.get_closest_marker("engine") or item.get_closest_marker("models"):
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("engine") or _ENGINE_GROUP_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.engine_group)
            if _has_own_processes(item.nodeid):
                item.add_marker(pytest.mark.own_processes)
        if not HAVE_VLLM and item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.skip(reason=_NEEDS_VLLM))
    # last, in their order: on an empty model cache their models are built last (tests/helpers/lanes.py)
    items.sort(key=lambda item: item.get_closest_marker("reasoner") is not None)


@pytest.fixture(scope="session")
def models() -> Path:
    """The tiny models `make models` builds (make test does so first): every one but the late ones
    (tests/helpers/lanes.py), which a test marked ``reasoner`` waits for itself."""
    _wait_for_models(tuple(name for name in MODEL_MARKERS if name not in LATE_MODELS))
    return MODELS


#: The pid of the process building the models, where `make test` started this pytest process
#: while it works (tools/run_tests.py)
_MODELS_PID_ENV = "BATCHSPEC_TEST_MODELS_PID"


def _wait_for_models(names: tuple[str, ...]) -> None:
    """Fail unless each of these models is built, waiting for it while the process building the
    models, if any, lives."""
    pid = int(os.environ.get(_MODELS_PID_ENV) or 0)
    for name in names:
        marker = MODELS / name / MODEL_MARKERS[name]
        while not marker.exists() and pid and _alive(pid):
            _time.sleep(2)
        if not marker.exists():
            pytest.fail(f"{MODELS / name} is not built: run `make models` first")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pytest_runtest_setup(item):
    """A test marked ``reasoner`` needs the late models (tests/helpers/lanes.py): built last."""
    if item.get_closest_marker("reasoner"):
        _wait_for_models(LATE_MODELS)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 (moto's server mode, as s3fs's own tests use).

    Yields ``(endpoint_url, storage_options)``; each test makes its own buckets."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint, {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint}}
    server.stop()


@pytest.fixture(scope="session")
def shared_engines(models):
    """Real engines shared by the session's tests, one per (target, engine arguments, speculative
    config), each started the first time a test needs it (see tests/helpers/shared_engines.py):
    ``shared_engines.run(spec)`` runs a job on one through the library."""
    from helpers.shared_engines import SharedEngines

    engines = SharedEngines(plugin_env=_PLUGIN_ENV_AT_START)
    yield engines
    engines.close()


# ---------------------------------------------------------------------- engine start-ups

#: With this variable naming a file, every vLLM engine the tests build, in this process or in a
#: subprocess, appends a line to it (tests/helpers/engine_counter), and pytest prints the start-ups per
#: test file at the end: `BATCHSPEC_TEST_ENGINE_LOG=$PWD/engines.jsonl make test`.
ENGINE_LOG_ENV = "BATCHSPEC_TEST_ENGINE_LOG"
import time as _time  # noqa: E402

_SESSION_STARTED = _time.time()
#: batchspec's vLLM plugin switches as the session found them (before any test set its own)
_PLUGIN_ENV_AT_START = {k: os.environ.get(k) for k in ("BATCHSPEC_DISABLE_VLLM_PLUGIN", "VLLM_PLUGINS")}
if os.environ.get(ENGINE_LOG_ENV):
    import importlib.util as _importlib_util

    _COUNTER_DIR = Path(__file__).resolve().parent / "helpers" / "engine_counter"
    os.environ[ENGINE_LOG_ENV] = str(Path(os.environ[ENGINE_LOG_ENV]).resolve())
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_COUNTER_DIR), os.environ.get("PYTHONPATH")) if p
    )
    _counter_spec = _importlib_util.spec_from_file_location(
        "batchspec_engine_counter", _COUNTER_DIR / "sitecustomize.py"
    )
    _counter = _importlib_util.module_from_spec(_counter_spec)
    _counter_spec.loader.exec_module(_counter)
    _counter.install()


#: CPU seconds (user and system) each test file cost: this process's and that of every process it
#: started and waited for (``batchspec`` subprocesses, vLLM's own processes), read around each
#: test; a shared engine's start-up counts for the test that started it. What a lane costs
#: whatever else the cores were doing (wall times depend on the other lanes).
_CPU_BY_FILE: dict[str, float] = {}


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_seconds()
    try:
        return (yield)
    finally:
        name = item.nodeid.split("::")[0]
        _CPU_BY_FILE[name] = _CPU_BY_FILE.get(name, 0.0) + _cpu_seconds() - before


def _write_cpu_summary(terminalreporter, shown: int = 25) -> None:
    if not _CPU_BY_FILE:
        return
    total = sum(_CPU_BY_FILE.values())
    terminalreporter.section(f"CPU: {total / 60:.1f} min in {len(_CPU_BY_FILE)} test files")
    for name, seconds in sorted(_CPU_BY_FILE.items(), key=lambda kv: -kv[1])[:shown]:
        terminalreporter.write_line(f"{seconds:8.0f} s  {name}")


def pytest_terminal_summary(terminalreporter):
    """Without vLLM, how many tests that need it were skipped; engine start-ups per test file
    and per test, when they were counted."""
    import collections
    import json

    if not HAVE_VLLM:
        skipped = sum(
            1
            for r in terminalreporter.stats.get("skipped", ())
            if isinstance(r.longrepr, tuple) and _NEEDS_VLLM in r.longrepr[2]
        )
        terminalreporter.write_line(
            f"vLLM is not installed: {skipped} tests that need it were skipped (marker vllm)"
        )
    _write_cpu_summary(terminalreporter)
    path = os.environ.get(ENGINE_LOG_ENV)
    if not path or not Path(path).exists():
        return
    lane = os.environ.get("BATCHSPEC_TEST_LANE")  # make test's lanes share one log
    records = [
        r
        for r in map(json.loads, Path(path).read_text().splitlines())
        if r["time"] >= _SESSION_STARTED - 1 and r.get("lane") == lane
    ]
    by_file = collections.Counter(r["test"].split("::")[0] for r in records)
    by_test = collections.Counter(r["test"] for r in records)
    separate = collections.Counter(r["test"].split("::")[0] for r in records if r.get("separate", True))
    terminalreporter.section(
        f"engine start-ups: {len(records)} ({sum(separate.values())} with vLLM's own processes)"
    )
    by_config = collections.Counter(r.get("config", r["model"]) for r in records)
    terminalreporter.write_line(
        f"by configuration: {len(by_config)} configurations (model | speculation | other arguments' digest)"
    )
    for name, count in by_config.most_common():
        terminalreporter.write_line(f"{count:4d}  {name}")
    terminalreporter.write_line("by test file:")
    for name, count in sorted(by_file.items()):
        terminalreporter.write_line(f"{count:4d}  {name}  ({separate[name]} with vLLM's own processes)")
    for name, count in sorted(by_test.items()):
        terminalreporter.write_line(f"{count:4d}    {name}")
