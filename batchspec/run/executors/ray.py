"""``executor: {kind: ray}`` / ``batchspec run JOB --executor ray``: one job across a Ray cluster.

Each replica is a Ray actor holding one vLLM engine. The driver (the ``batchspec run`` process)
plans the shards and checks their inputs as a local run does, then hands shards out one at a
time as replicas free up. A replica runs the same per-shard stages as a local run
(:class:`batchspec.run.stages.ShardPipeline`: claim the lease, read prompts, generate, write and
commit with the manifest), so the output is the files a local run writes, and ``status``,
``report`` and reruns work unchanged. Replicas must reach the input and output at the same URLs:
on more than one machine, that means object storage (or a shared filesystem).

Progress and events stream back to the driver (it polls each busy replica), which keeps the one
progress bar and writes the one run summary.

A replica whose engine dies starts it again in place and goes on with its shard, as a local run
does (batchspec/engine/supervise.py: ``execution.engine_restarts`` per replica and run). A
replica that dies (actor killed, node lost, its engine dead past those restarts) loses only its
in-flight shard: its uncommitted temporary file is never committed, and the shard goes back to
the front of the queue for another replica; a replacement replica is started while work
remains. A shard whose replica died on each of ``executor.max_shard_attempts`` tries is reported
failed (exit 1).

A shard a replica finds held by another process (on object stores: a replica of this run that
died holding it, a crashed earlier run, or a live other run) waits as in a local run
(:class:`batchspec.run.lease_wait.LeaseWait`): the driver keeps what the replica saw of the
holder, waits until its heartbeat could have been still for ``execution.lease_s``, and hands the
shard out once more with that observation, so whichever replica gets it takes a dead holder's
lease over; a shard still held then is busy (exit 1 naming its holder). No shard waits for ever.

Environment: the driver's settings (``VLLM_*``, ``HF_HOME``, thread counts, ...) go to the
replicas in Ray's ``runtime_env``, which Ray records in its job and actor metadata and shows on
its dashboard; credential variables (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, any name
:func:`batchspec.redact.is_secret_key` calls a credential) never do: they are a constructor
argument of each replica, set in its process's environment before its engine starts.

This module is the driver; the replica's side is :mod:`batchspec.run.executors.ray_replica`."""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from batchspec.errors import EXIT_RUNTIME_FAILURE, InputDataError, RuntimeFailure, SpecError
from batchspec.io.records import Shard
from batchspec.redact import is_secret_key, sanitize_url
from batchspec.run.executors.base import RunContext
from batchspec.run.executors.ray_replica import Replica, rebuild_error
from batchspec.run.lease_wait import LeaseWait
from batchspec.run.outcome import RunOutcome
from batchspec.spec.model import JobSpec
from batchspec.stats import acceptance_per_position, prefix_cache, prefix_cache_figures

log = logging.getLogger(__name__)


#: Environment the engine and storage need, passed to every replica (the driver's values):
#: vLLM and Hugging Face settings, thread counts, cloud settings and credentials read from the
#: environment (credentials never through Ray's runtime_env: see :func:`replica_secrets`).
ENV_PREFIXES = (
    "VLLM_",
    "BATCHSPEC_",
    "HF_",
    "HUGGING_FACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "OMP_",
    "MKL_",
    "AWS_",
    "GOOGLE_",
    "AZURE_",
    "FSSPEC_",
)


#: Test-only: a replica given this shard name exits (like a crash) on the shard's first result.
DIE_ON_SHARD_ENV = "BATCHSPEC_TEST_RAY_DIE_ON_SHARD"


#: Seconds between the driver's progress polls of busy replicas.
POLL_S = 0.25


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise SpecError("executor.kind", "ray is not installed: pip install 'batchspec[ray]'") from exc
    return ray


def _wanted_env(environ: dict[str, str] | None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES)}


def replica_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's environment variables a replica needs (see :data:`ENV_PREFIXES`) that are no
    credentials: these go in Ray's ``runtime_env``, which Ray records and shows."""
    return {k: v for k, v in _wanted_env(environ).items() if not is_secret_key(k)}


def replica_secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The credential variables among them (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, ...): passed
    to each replica's constructor, kept in memory, never in a ``runtime_env``."""
    return {k: v for k, v in _wanted_env(environ).items() if is_secret_key(k)}


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options for ``executor.resources_per_replica`` (``CPU``, ``GPU``, custom)."""
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0)}
    if resources.get("GPU"):
        options["num_gpus"] = resources["GPU"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options


# ---------------------------------------------------------------------------- the driver


@dataclass
class _ReplicaHandle:
    index: int
    actor: Any
    ready_ref: Any = None
    info: dict = field(default_factory=dict)
    shard: Shard | None = None
    rows_done: int = 0


class RayExecutor:
    """Runs a job's shards on Ray replicas. :func:`batchspec.run.job.run_job` makes one for
    ``executor.kind: ray``; a caller may make one and pass it to several runs (of jobs with the
    same model and engine settings) to keep its replicas, and then shuts it down itself."""

    def __init__(
        self, spec: JobSpec, ray_address: str | None = None, replicas: int | None = None, engine_factory=None
    ):
        self.spec = spec
        #: builds each replica's engine from the spec (default: batchspec.engine.llm.Engine); tests
        #: pass a fake one to check the scheduling without vLLM
        self.engine_factory = engine_factory
        self.ray = _import_ray()
        self.address = ray_address
        self.replicas = replicas or spec.executor.replicas
        self.handles: list[_ReplicaHandle] = []
        self.vllm_version: str | None = None
        self.max_model_len: int | None = None
        self._counters: dict[int, list[dict]] = {}
        self._next_index = 0
        self._started_ray = False
        self._actor_class = None

    # --- start

    def start(self, ctx: RunContext) -> None:
        """Connect to Ray (or start a local cluster) and make sure ``replicas`` replicas are
        up, each with its engine started; a replica that cannot start ends the run."""
        ray = self.ray
        if not ray.is_initialized():
            # no address: ray.init() starts a local cluster, as `ray start --head` would
            # no credentials here: Ray records a job's runtime_env (replica_secrets go to each
            # replica's constructor instead)
            ray.init(address=self.address, runtime_env={"env_vars": replica_env()}, log_to_driver=True)
            self._started_ray = True
        self.handles = [h for h in self.handles if self._alive(h)]
        missing = self.replicas - len(self.handles)
        if missing <= 0:
            return
        ctx.events.emit(
            "replicas_starting",
            f"starting {missing} Ray replica(s), one vLLM engine "
            f"each, for {sanitize_url(self.spec.model.target)}",
            replicas=missing,
            resources=self.spec.executor.resources_per_replica,
            address=sanitize_url(self.address) if self.address else "local",
        )
        ctx.stop.raise_now = True  # start-up waits on Ray: a signal ends it at once
        try:
            new = [self._launch() for _ in range(missing)]
            for h in new:
                self._await_ready(h)
        finally:
            ctx.stop.raise_now = False
        self.handles.extend(new)
        ctx.events.emit(
            "replicas_started",
            f"{len(self.handles)} Ray replica(s) ready",
            replicas=len(self.handles),
            hosts=sorted({h.info.get("host") for h in self.handles}),
        )

    def _launch(self) -> _ReplicaHandle:
        ray = self.ray
        if self._actor_class is None:
            self._actor_class = ray.remote(Replica)
        index = self._next_index
        self._next_index += 1
        actor = self._actor_class.options(
            max_concurrency=2,  # process() and the driver's poll() at once
            max_restarts=0,
            max_task_retries=0,  # the driver redoes lost shards itself
            runtime_env={"env_vars": replica_env()},  # recorded and shown by Ray: no secrets
            name=f"batchspec-replica-{os.getpid()}-{index}",
            **actor_options(self.spec.executor.resources_per_replica),
        ).remote(self.spec, index, self.engine_factory, replica_secrets())
        return _ReplicaHandle(index, actor, ready_ref=actor.ready.remote())

    def _await_ready(self, h: _ReplicaHandle) -> None:
        try:
            info = self.ray.get(h.ready_ref)
        except self.ray.exceptions.RayError as exc:
            raise RuntimeFailure(f"Ray replica {h.index} died while starting its engine: {exc}") from exc
        self._accept(h, info)

    def _accept(self, h: _ReplicaHandle, info: dict) -> None:
        if info["error"] is not None:
            self._kill(h)
            raise rebuild_error(info["error"])
        h.info, h.ready_ref = info, None
        self.vllm_version = self.vllm_version or info["vllm_version"]
        self.max_model_len = self.max_model_len or info["max_model_len"]
        self._counters[h.index] = [info["counters"], info["counters"]]

    def _alive(self, h: _ReplicaHandle) -> bool:
        try:
            self.ray.get(h.actor.poll.remote(), timeout=30)
            return True
        except Exception:
            return False

    def _kill(self, h: _ReplicaHandle) -> None:
        try:
            self.ray.kill(h.actor)
        except Exception:
            log.debug("killing a replica", exc_info=True)

    # --- generate

    def generate(
        self,
        ctx: RunContext,
        shards: list[Shard],
        row_counts: dict[str, int],
        spec_fingerprint: dict[str, str],
    ) -> None:
        """Hand shards to replicas as they free up until every shard is committed, skipped or
        failed; merge what each replica did into the run's outcome."""
        _Dispatch(self, ctx, shards, row_counts, spec_fingerprint).run()

    # --- summarise

    def engine_info(self) -> tuple[str, int | None] | None:
        """(vLLM version, max_model_len) of the replicas; None when none started."""
        if self.vllm_version is None:
            return None
        return self.vllm_version, self.max_model_len

    def abort(self) -> None:
        """Nothing to do here: each replica drops its uncommitted files and gives its leases
        back when its shard ends."""

    def prefix_cache(self) -> dict | None:
        """Prefix-cache lookups and hits over every replica's engine during this run."""
        parts = [
            p for before, after in self._counters.values() if (p := prefix_cache(before, after)) is not None
        ]
        if not parts:
            return None
        return prefix_cache_figures(sum(p["queries"] for p in parts), sum(p["hits"] for p in parts))

    def acceptance_per_position(self) -> dict | None:
        """Per-position acceptance over every replica's engine during this run."""
        total: dict | None = None
        for before, after in self._counters.values():
            p = acceptance_per_position(before, after)
            if p is None:
                continue
            if total is None:
                total = {"num_drafts": 0, "accepted": [0] * len(p["accepted"])}
            total["num_drafts"] += p["num_drafts"]
            for i, a in enumerate(p["accepted"]):
                if i < len(total["accepted"]):
                    total["accepted"][i] += a
        if total is None:
            return None
        from batchspec.stats import acceptance_rate

        total["rate"] = [acceptance_rate(a, total["num_drafts"]) for a in total["accepted"]]
        return total

    def shutdown(self) -> None:
        """Stop every replica (and the local Ray cluster, if this executor started it)."""
        for h in self.handles:
            try:
                self.ray.get(h.actor.shutdown.remote(), timeout=30)
            except Exception:
                log.debug("replica shutdown", exc_info=True)
            self._kill(h)
        self.handles = []
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False


class _Dispatch:
    """One run's shards handed out to a :class:`RayExecutor`'s replicas: a queue, the replicas
    idle, running a shard or starting, and what each replica's task returns merged into the
    run's outcome (:meth:`RayExecutor.generate`)."""

    def __init__(
        self,
        executor: RayExecutor,
        ctx: RunContext,
        shards: list[Shard],
        row_counts: dict[str, int],
        spec_fingerprint: dict[str, str],
    ):
        self.executor, self.ray, self.ctx = executor, executor.ray, ctx
        self.row_counts, self.spec_fingerprint = row_counts, spec_fingerprint
        self.outcome, self.events = ctx.outcome, ctx.events
        self.progress = ctx.new_progress(sum(row_counts.values()), len(shards))
        self.outcome.executor = {
            "kind": "ray",
            "replicas": executor.replicas,
            "resources_per_replica": ctx.spec.executor.resources_per_replica,
            "replica_deaths": [],
        }
        self.by_name = {s.name: s for s in shards}
        self.lease_wait = LeaseWait(
            ctx.spec.execution.lease_s, self.outcome, self.events, self.progress, row_counts
        )
        self.queue = collections.deque(shards)
        self.attempts: collections.Counter = collections.Counter()
        self.idle = list(executor.handles)
        self.running: dict[Any, _ReplicaHandle] = {}
        self.starting: dict[Any, _ReplicaHandle] = {}
        self.stopping = False
        self.start_failures = 0
        self.die_on = os.environ.get(DIE_ON_SHARD_ENV)

    def run(self) -> None:
        while self.queue or self.running:
            self.check_stop()
            self.replace_dead()
            self.hand_out()
            if not self.running and not self.starting:
                if self.queue and not self.stopping and self.idle and self.waiting_only():
                    time.sleep(POLL_S)  # a replica is free once a retry is due
                    continue
                self.fail_queue("no Ray replica left to run it")
                break
            done, _ = self.ray.wait(list(self.running) + list(self.starting), num_returns=1, timeout=POLL_S)
            for ref in done:
                if ref in self.starting:
                    self.started(self.starting.pop(ref), ref)
                else:
                    self.returned(self.running.pop(ref), ref)
            self.poll_running()
        for h in self.starting.values():
            self.executor._kill(h)

    # --- the loop's steps

    def check_stop(self) -> None:
        """A signal stops the running replicas too; an error ending the run lets the shards in
        flight finish and commit. Either way no shard is handed out any more."""
        if self.stopping or not (self.ctx.stop or self.ctx.fatal):
            return
        self.stopping = True
        self.queue.clear()
        if self.ctx.stop:
            for h in self.running.values():
                h.actor.stop.remote()

    def replace_dead(self) -> None:
        """Start a replacement for a replica that died, while there is work for it."""
        live = len(self.idle) + len(self.running) + len(self.starting)
        if (
            self.queue
            and not self.stopping
            and live < self.executor.replicas
            and self.start_failures < self.executor.replicas
        ):
            h = self.executor._launch()
            self.starting[h.ready_ref] = h
            self.events.emit(
                "replica_starting", f"starting replacement Ray replica {h.index}", replica=h.index
            )

    def hand_out(self) -> None:
        """Give each idle replica the next shard whose retry (if it waits for one) is due."""
        while self.idle and self.queue and not self.stopping:
            if self.lease_wait.due_in(self.queue[0].name) > 0:
                if self.waiting_only():
                    return
                self.queue.rotate(-1)
                continue
            shard = self.queue.popleft()
            self.lease_wait.leave(shard.name)
            h = self.idle.pop(0)
            self.attempts[shard.name] += 1
            h.shard, h.rows_done = shard, 0
            self.running[h.actor.process.remote(self.task(shard))] = h

    def waiting_only(self) -> bool:
        """Every shard in the queue waits for its retry."""
        return all(self.lease_wait.due_in(s.name) > 0 for s in self.queue)

    def task(self, shard: Shard) -> dict[str, Any]:
        """What a replica's :meth:`Replica.process` gets for one shard."""
        ctx, seen = self.ctx, self.lease_wait.observation(shard.name)
        return {
            "spec": ctx.spec,
            "shard": shard,
            "run_id": ctx.run_id,
            "spec_fingerprint": self.spec_fingerprint,
            "overwrite": ctx.overwrite,
            "grace_s": ctx.grace_s,
            "rows": self.row_counts[shard.name],
            "die_on": self.die_on,
            "seen": {shard.name: seen} if seen is not None else {},
        }

    def fail_queue(self, why: str) -> None:
        """The shards still queued when nothing can run them any more."""
        if self.stopping:
            return
        for s in self.queue:
            self.lease_wait.leave(s.name)
            self.outcome.failed[s.name] = why
            self.progress.rows_dropped(self.row_counts[s.name])
        self.queue.clear()

    def poll_running(self) -> None:
        """Progress and events from the replicas on a shard."""
        busy = list(self.running.values())
        polls = [h.actor.poll.remote() for h in busy]
        for h, ref in zip(busy, polls, strict=True):
            try:
                self.apply(h, self.ray.get(ref, timeout=30))
            except Exception:
                pass  # a dead replica shows when its process() call fails

    # --- what replicas report

    def started(self, h: _ReplicaHandle, ref) -> None:
        """A replacement replica is up (or could not start: it is not tried again)."""
        try:
            self.executor._accept(h, self.ray.get(ref))
        except Exception as exc:
            self.events.emit(
                "replica_failed",
                f"replacement Ray replica {h.index} could not start: {exc}",
                level="warning",
                replica=h.index,
            )
            self.executor._kill(h)
            self.start_failures += 1
            return
        self.executor.handles.append(h)
        self.idle.append(h)

    def returned(self, h: _ReplicaHandle, ref) -> None:
        """A replica's task ended: merge what it did, wait for its busy shard's holder if that
        may be dead, judge its bad shard, and take its errors; an engine failure is a death."""
        try:
            data = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self.died(h, type(exc).__name__)
            return
        self.apply(h, data)
        self.executor._counters[h.index][1] = data["counters"]
        outcome: RunOutcome = data["outcome"]
        self.outcome.merge_settled(outcome)
        for _ in outcome.committed:
            self.progress.shard_done()
        for name in self.lease_wait.schedule_retries(
            outcome.busy, data["observed"].get, stopping=self.stopping, replica=h.index
        ):
            self.attempts[name] -= 1  # not a try: nothing of it ran
            self.queue.append(self.by_name[name])
        for name, record in data["bad"]:
            try:
                self.ctx.bad_shard(self.by_name[name], rebuild_error(record))
            except InputDataError as exc:
                self.ctx.fatal.append(exc)
        err = data["error"]
        if err is not None and err["exit_code"] == EXIT_RUNTIME_FAILURE and not self.stopping:
            self.died(h, err["message"])  # its engine failed: the shard goes to another one
            return
        if err is not None:
            self.ctx.fatal.append(rebuild_error(err))
        h.shard = None
        self.idle.append(h)

    def apply(self, h: _ReplicaHandle, data: dict) -> None:
        """A replica's events and finished rows, into the run's events and progress."""
        for event, message, level, fields in data["events"]:
            self.events.emit(event, message, level=level, replica=h.index, **fields)
        for result in data["results"]:
            h.rows_done += 1
            self.progress.row_done(result)
        if data["dropped"]:
            self.progress.rows_dropped(data["dropped"])

    def died(self, h: _ReplicaHandle, why: str) -> None:
        """A replica is gone: its shard goes back to the front of the queue, or fails after
        ``executor.max_shard_attempts`` tries."""
        self.executor.handles = [x for x in self.executor.handles if x is not h]
        self.executor._kill(h)
        if h.shard is None:
            return
        name, attempt = h.shard.name, self.attempts[h.shard.name]
        self.outcome.executor["replica_deaths"].append(
            {"replica": h.index, "shard": name, "attempt": attempt, "rows_done": h.rows_done, "why": why}
        )
        self.progress.rows_restored(h.rows_done)  # they will be done again
        if attempt >= self.ctx.spec.executor.max_shard_attempts:
            self.outcome.failed[name] = (
                f"its replica died on each of {attempt} tries (executor.max_shard_attempts); last: {why}"
            )
            self.progress.rows_dropped(self.row_counts[name])
            self.events.emit(
                "shard_failed",
                f"shard {name} failed: {self.outcome.failed[name]}",
                level="error",
                shard=name,
                attempts=attempt,
            )
            return
        self.lease_wait.rearm(name)  # on object stores its lease stays: a new holder to wait for
        self.queue.appendleft(h.shard)
        self.events.emit(
            "replica_died",
            f"Ray replica {h.index} died while on shard {name} "
            f"({why}); the shard is handed to another replica",
            level="warning",
            replica=h.index,
            shard=name,
            attempt=attempt,
        )
