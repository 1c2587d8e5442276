"""Real vLLM engines shared by a test session, and jobs run through the library on them.

An engine start-up costs about 28 s on the tiny models with vLLM's engine and worker processes
(4 s where they run in this process, as shared engines do), and most end-to-end
tests need "a run of job X on the real engine", not a process of their own. So one
:class:`batchspec.engine.llm.Engine` per (target model, engine arguments, speculative config) is
started the first time a test asks for it and reused, as ``run_job(spec, RunOptions(engine=...))``
allows, by every later job with that key; the ``shared_engines`` fixture (conftest.py) holds them
for the session. Tests of what a process does (exit codes, signals, kills, the CLI's flags and
output) keep running ``batchspec`` as a subprocess.

vLLM keeps its metrics (``LLM.get_metrics()``, which batchspec reads for a run's per-position
acceptance) in prometheus_client's process-wide registry, and each new engine takes the registry
over: so the engine a run uses gets the registry back first (:func:`_own_metrics`).
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from batchspec.errors import BatchspecError
from batchspec.run.events import EventLog
from batchspec.run.job import RunResult
from batchspec.spec.model import JobSpec
from helpers.jobs import INLINE_ENGINE, SEPARATE_ENGINE

#: Environment that turns batchspec's vLLM plugin off. A shared engine's processes get it as it
#: was when the session started (so BATCHSPEC_DISABLE_VLLM_PLUGIN=1 pytest ... turns the plugin
#: off everywhere), never as a test set it for itself, which would change later tests' engine.
PLUGIN_ENV = ("BATCHSPEC_DISABLE_VLLM_PLUGIN", "VLLM_PLUGINS")


@dataclass
class LibraryRun:
    """One ``run_job`` call, with what ``batchspec run`` would have logged and exited with."""

    spec: JobSpec
    run_id: str
    result: RunResult | None
    error: BatchspecError | None
    #: The run's events, as the CLI would print them (``fmt``: json or text).
    log: str
    elapsed_s: float

    @property
    def exit_code(self) -> int:
        return 0 if self.error is None else self.error.exit_code

    @property
    def records(self) -> list[dict]:
        """The JSON events (a json-format run)."""
        return [json.loads(line) for line in self.log.splitlines() if line.startswith("{")]

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records if r["event"] == name]

    @property
    def summary(self) -> dict:
        """The summary the run wrote (a failed run's too)."""
        if self.result is not None:
            return self.result.summary
        from batchspec.io.output_dir import OutputDir

        out = OutputDir(self.spec.output.path, self.spec.output.storage_options, self.spec.output.format)
        return out.read_json(out.run_summary_path(self.run_id))


def run_library(
    spec: JobSpec, engine, *, fmt: str = "json", progress_bars: bool = False, **options
) -> LibraryRun:
    """``run_job(spec, RunOptions(engine=engine, ...))`` with its events captured (``options``:
    more :class:`RunOptions` fields); a failed run is returned, not raised (its ``error``
    carries the exit code the CLI would exit with)."""
    from batchspec.run.job import RunOptions, new_run_id, run_job

    run_id = new_run_id()
    stream = io.StringIO()
    started = time.monotonic()
    result = error = None
    try:
        result = run_job(
            spec,
            RunOptions(
                engine=engine,
                events=EventLog(run_id, fmt, stream),
                progress_bars=progress_bars,
                run_id=run_id,
                **options,
            ),
        )
    except BatchspecError as exc:
        error = exc
    return LibraryRun(spec, run_id, result, error, stream.getvalue(), time.monotonic() - started)


class NoEngine:
    """An engine for runs that must end before any row is generated (bad input is found
    first): handing it a row fails the test."""

    max_model_len = None

    def stream(self, *args, **kwargs):
        raise AssertionError("a row reached the engine: the run should have ended before")

    def spec_counters(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


#: Memory (bytes) to leave free when another engine starts: below it, the least recently used
#: engines are shut down first. An in-process engine of the tiny models holds about 1.5 GiB (its
#: 1-GiB KV cache and vLLM's own state); the two other pytest processes `make test` runs, their
#: `batchspec` subprocesses and Ray replicas need room beside them. 6 GiB was too little once:
#: this process held 14 GiB of engines while a Ray run started its replicas, and Ray's memory
#: monitor (which kills a worker once the machine is 95% used) killed a replica.
KEEP_FREE = 10 << 30


class SharedEngines:
    """Started engines by (target, engine arguments, speculative config, LoRA adapters); at most ``keep``
    stay up at once, and fewer where memory is short (the least recently used is shut down first):
    each engine is started once a session where memory allows."""

    def __init__(self, keep: int = 12, plugin_env: dict[str, str | None] | None = None):
        self.keep = keep
        #: PLUGIN_ENV for the engines' processes (None: unset)
        self.plugin_env = plugin_env or {}
        self._engines: OrderedDict[str, object] = OrderedDict()
        #: How many engines this object started (each one is a start-up the suite paid for).
        self.started = 0

    @staticmethod
    def key(spec: JobSpec) -> str:
        lora = spec.model.lora  # the adapters an engine serves; the job-wide one is per request
        # the names a job answers to are the job's, not the engine's (engine/llm.py _serves)
        engine = {k: v for k, v in spec.model.engine.items() if k != "served_model_name"}
        return json.dumps(
            [
                spec.model.target,
                engine,
                spec.speculative,
                lora and [lora.adapters, lora.max_loras, lora.max_lora_rank],
                spec.model.reasoning_parser,
                spec.task,
            ],
            sort_keys=True,
            default=str,
        )

    def engine(self, spec: JobSpec):
        """The started engine for ``spec``'s model, engine arguments and speculation, ready to
        generate with ``spec``'s sampling."""
        key = self.key(spec)
        _log_use(key, started=key not in self._engines)
        if key in self._engines:
            self._engines.move_to_end(key)
        else:
            while self._engines and (len(self._engines) >= self.keep or _available() < KEEP_FREE):
                self._stop(next(iter(self._engines)))
            self._engines[key] = self._start(spec)
        engine = self._engines[key]
        _own_metrics(engine)
        return engine  # run_job(spec, RunOptions(engine=...)) binds it to each job's sampling

    @staticmethod
    def probe_spec(target, engine_args: dict, speculative: dict | None = None) -> JobSpec:
        """A spec that names only an engine: for probes that call ``vllm.LLM`` directly
        (``engine(spec).llm``: built as batchspec builds it, with seed 0, log stats on and, with
        speculation, per-request acceptance)."""
        from batchspec.spec.build import build_spec

        return build_spec(
            {
                "name": "probe",
                "input": {"path": "unused/*.parquet", "prompt_column": "prompt"},
                "output": {"path": "unused-output"},
                "model": {"target": str(target), "engine": dict(engine_args)},
                "speculative": speculative,
                "sampling": {"temperature": 0.0},
            }
        )

    def run(self, spec: JobSpec, **kwargs) -> LibraryRun:
        """Run ``spec`` on its shared engine (see :func:`run_library`)."""
        run = run_library(spec, self.engine(spec), **kwargs)
        if run.error is not None and "the vLLM engine failed" in str(run.error):
            self._stop(self.key(spec))  # a dead engine serves no later test
        return run

    def release(self, spec: JobSpec) -> None:
        """Shut ``spec``'s engine down now (one no later test needs)."""
        if self.key(spec) in self._engines:
            self._stop(self.key(spec))

    def close(self) -> None:
        for key in list(self._engines):
            self._stop(key)

    def _start(self, spec: JobSpec):
        import psutil

        from batchspec.engine.cpu_plugin import active as plugin_active
        from batchspec.engine.llm import child_pids, engine_for, kill_new_children

        before = child_pids()
        wanted = {k: self.plugin_env.get(k) for k in PLUGIN_ENV}
        wanted["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB, as run_cli gives a `batchspec` process
        wanted.update(INLINE_ENGINE)
        saved = {k: os.environ.get(k) for k in wanted}
        _set_env(wanted)
        if not plugin_active():
            # the engine in this process (4 s instead of 28) needs the plugin's fix 4 to start
            # after an n-gram engine did: without the plugin, vLLM's processes
            _set_env(SEPARATE_ENGINE)
        # the engine's watchdog watches this process's children as it finds them at start-up:
        # show it only the engine's own, not a test's subprocesses that end before the engine
        children = psutil.Process.children
        psutil.Process.children = lambda proc, recursive=False: [
            p for p in children(proc, recursive) if p.pid not in before
        ]
        try:
            engine = engine_for(spec)
        except BaseException:
            kill_new_children(before)
            raise
        finally:
            psutil.Process.children = children
            _set_env(saved)
        engine._shared_pids = child_pids() - before
        engine._shared_metrics = _vllm_collectors()  # the ones its start-up registered
        self.started += 1
        return engine

    def _stop(self, key: str) -> None:
        import psutil

        engine = self._engines.pop(key)
        engine.shutdown()
        procs = []
        for pid in engine._shared_pids:  # whatever the shutdown left behind
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)


def _log_use(key: str, started: bool) -> None:
    """With the suite's engine log on (tests/helpers/engine_counter), each request for a shared
    engine is a line of ``LOG.shared``: the order of engine configurations the tests ask for, from
    which the start-ups of another keep policy can be counted."""
    import hashlib

    path = os.environ.get("BATCHSPEC_TEST_ENGINE_LOG")
    if not path:
        return
    line = json.dumps(
        {
            "key": hashlib.sha256(key.encode()).hexdigest()[:10],
            "started": started,
            "test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
            "time": round(time.time(), 1),
        }
    )
    with open(f"{path}.shared", "a") as fh:
        fh.write(line + "\n")


def _available() -> int:
    import psutil

    return psutil.virtual_memory().available


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _vllm_collectors() -> list:
    from prometheus_client import REGISTRY

    return [c for c in list(REGISTRY._collector_to_names) if getattr(c, "_name", "").startswith("vllm:")]


def _own_metrics(engine) -> None:
    """Put ``engine``'s metrics in the registry ``get_metrics()`` reads, in place of those of the
    engine started last (vLLM unregisters every earlier engine's when it starts one)."""
    from prometheus_client import REGISTRY

    current = _vllm_collectors()
    if {id(c) for c in current} == {id(c) for c in engine._shared_metrics}:
        return
    for collector in current:
        REGISTRY.unregister(collector)
    for collector in engine._shared_metrics:
        REGISTRY.register(collector)
