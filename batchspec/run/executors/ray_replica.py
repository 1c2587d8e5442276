"""A Ray replica's side of :mod:`batchspec.run.executors.ray`: :class:`Replica`, the actor that
holds one vLLM engine and runs the per-shard stages for each shard the driver hands it, what it
keeps for the driver's polls, and its errors, which cross Ray's boundary as plain data
(:func:`error_record`) and are raised again in the driver (:func:`rebuild_error`)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
from typing import Any

from batchspec.errors import (
    EXIT_BAD_INPUT,
    EXIT_BAD_SPEC,
    EXIT_RUNTIME_FAILURE,
    BatchspecError,
    InputDataError,
    RuntimeFailure,
    SpecError,
)
from batchspec.io.output_dir import OutputDir
from batchspec.io.records import Shard
from batchspec.run.outcome import RunOutcome, SupervisionLog
from batchspec.run.stages import ShardPipeline
from batchspec.spec.model import JobSpec

log = logging.getLogger(__name__)


def error_record(exc: BaseException) -> dict[str, Any]:
    """An exception as plain data (batchspec's errors do not all pickle by their arguments)."""
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "exit_code": getattr(exc, "exit_code", EXIT_RUNTIME_FAILURE),
        "shard": getattr(exc, "shard", None),
        "column": getattr(exc, "column", None),
    }


def rebuild_error(record: dict[str, Any]) -> BatchspecError:
    """The driver's exception for a replica's error record, with the same exit code."""
    if record["exit_code"] == EXIT_BAD_INPUT:
        exc: BatchspecError = InputDataError("", "", record.get("column"))
        exc.shard = record.get("shard")
        exc.args = (record["message"],)
        return exc
    if record["exit_code"] == EXIT_BAD_SPEC:
        return SpecError(None, record["message"])
    if record["type"] == "RuntimeFailure":
        return RuntimeFailure(record["message"])
    return RuntimeFailure(f"unexpected {record['type']} in a Ray replica: {record['message']}")


class _ReplicaOutbox:
    """What a replica's stages report, kept until the driver polls: events and result rows."""

    def __init__(self, die_on: str | None, shard: str):
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.results: list[dict] = []
        self.dropped = 0
        self._die_on = die_on == shard

    # EventLog's emit, for the pipeline
    def emit(self, event: str, message: str = "", level: str = "info", **fields: Any) -> None:
        with self.lock:
            self.events.append((event, message, level, fields))

    # Progress's interface, for the pipeline
    def row_done(self, result: dict) -> None:
        if self._die_on:
            os._exit(1)  # the test-only crash: mid-shard, lease held, temporary file open
        keep = (
            "error",
            "num_output_tokens",
            "spec_num_draft_tokens",
            "spec_num_accepted_tokens",
            "spec_num_steps",
        )
        with self.lock:
            self.results.append({k: result.get(k) for k in keep})

    def rows_dropped(self, count: int) -> None:
        with self.lock:
            self.dropped += count

    def shard_done(self) -> None:
        pass  # the driver counts committed shards from the replica's outcome

    def drain(self) -> dict[str, Any]:
        with self.lock:
            out = {"events": self.events, "results": self.results, "dropped": self.dropped}
            self.events, self.results, self.dropped = [], [], 0
        return out


class Replica:
    """One Ray actor's work: one vLLM engine, and the per-shard stages for each shard the
    driver hands it (one at a time). Errors come back as data, never as a dead actor."""

    def __init__(self, spec: JobSpec, index: int, engine_factory=None, secrets: dict[str, str] | None = None):
        # the driver's credential variables, before anything reads the environment
        os.environ.update(secrets or {})
        self.index = index
        self.error: dict | None = None
        self.engine = None
        self.buffer: _ReplicaOutbox | None = None
        self._stop = threading.Event()
        self.counters_before: dict = {}
        #: the engine's supervisor for the run it works for (execution.engine_restarts a run)
        self.supervisor, self._supervised_run = None, None
        try:
            from batchspec.engine.checks import vllm_version
            from batchspec.engine.llm import engine_for

            self.engine = (engine_factory or engine_for)(spec)
            self.vllm_version = vllm_version() if engine_factory is None else None
            self.counters_before = self.engine.spec_counters()
        except BaseException as exc:  # reported by ready(), so the driver can exit 1 or 2
            log.error("replica %d could not start its engine", index, exc_info=True)
            self.error = error_record(exc)

    def ready(self) -> dict[str, Any]:
        """How the replica started: its error, or its engine's version, context length, counters."""
        from batchspec.io.host import this_host

        if self.error is not None:
            return {"error": self.error}
        return {
            "error": None,
            "vllm_version": self.vllm_version,
            "host": this_host(),
            "pid": os.getpid(),
            "max_model_len": getattr(self.engine, "max_model_len", None),
            "counters": self.counters_before,
        }

    def process(self, task: dict[str, Any]) -> dict[str, Any]:
        """Claim, read, generate, write and commit one shard; returns what happened to it. An
        unreadable shard is not judged here: it goes back as ``bad`` for the driver's
        :meth:`RunContext.bad_shard`, the one place a run decides to skip it or end."""
        from batchspec.io.host import this_host
        from batchspec.leases.shard_leases import ShardLeases

        spec: JobSpec = task["spec"]
        shard: Shard = task["shard"]
        self._stop.clear()
        buffer = self.buffer = _ReplicaOutbox(task.get("die_on"), shard.name)
        out = OutputDir.of(spec.output)
        owner = {
            "run_id": task["run_id"],
            "host": this_host(),
            "pid": os.getpid(),
            "started_at": dt.datetime.now(dt.UTC).isoformat(),
            "replica": self.index,
        }
        outcome = RunOutcome()
        if self._supervised_run != task["run_id"]:
            from batchspec.engine.supervise import supervise

            self.supervisor = supervise(self.engine, spec.execution.engine_restarts)
            self._supervised_run = task["run_id"]
        if self.supervisor is not None:  # this shard's outcome and events hear of its restarts
            self.supervisor.report = SupervisionLog(buffer, outcome)
        bad: list[tuple[str, dict]] = []
        leases = ShardLeases(out, owner, spec.execution.lease_s)
        for name, observation in (task.get("seen") or {}).items():
            leases.note_observation(name, observation)  # the driver's watch of a silent holder
        pipeline = ShardPipeline(
            spec,
            task["run_id"],
            out,
            leases,
            buffer,
            buffer,
            outcome,
            task["spec_fingerprint"],
            self.vllm_version,
            task["overwrite"],
            stop=self._stop.is_set,
            grace_s=task["grace_s"],
            bad_shard=lambda s, exc: bad.append((s.name, error_record(exc))),
            supervisor=self.supervisor,
        )
        error = None
        with leases:
            try:
                pipeline.generate(self.engine, [shard], {shard.name: task["rows"]})
            except BaseException as exc:
                error = error_record(exc)
            finally:
                pipeline.discard_uncommitted()
                leases.release_all()
        result = buffer.drain()
        # what this replica saw of each busy shard's holder, for the driver's lease wait
        observed = {name: leases.observation(name) for name in outcome.busy}
        result.update(
            outcome=outcome, error=error, observed=observed, bad=bad, counters=self.engine.spec_counters()
        )
        return result

    def poll(self) -> dict[str, Any]:
        """Events and result rows since the last poll (runs beside ``process``)."""
        buffer = self.buffer
        return buffer.drain() if buffer is not None else {"events": [], "results": [], "dropped": 0}

    def stop(self) -> None:
        """Stop taking rows; the shard's fully read rows may finish for the grace period."""
        self._stop.set()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
