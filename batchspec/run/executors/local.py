"""The local executor: one vLLM engine in this process runs the stages over every shard."""

from __future__ import annotations

import contextlib
import logging

from batchspec.io.records import Shard
from batchspec.leases.shard_leases import ShardLeases
from batchspec.redact import sanitize_url
from batchspec.run.executors.base import RunContext
from batchspec.run.lease_wait import LeaseWait
from batchspec.run.outcome import SupervisionLog
from batchspec.run.stages import ShardPipeline
from batchspec.stats import acceptance_per_position, prefix_cache

log = logging.getLogger(__name__)


class LocalExecutor:
    """One engine in this process; ``engine`` reuses a caller's started engine (then the caller
    shuts it down)."""

    def __init__(self, engine=None):
        self.engine = engine
        self.owns_engine = engine is None
        self.leases: ShardLeases | None = None
        self.pipeline: ShardPipeline | None = None
        self.counters_before: dict = {}
        self.vllm_version: str | None = None

    def start(self, ctx: RunContext) -> None:
        """One vLLM engine in this process, unless the caller gave one."""
        if self.engine is not None:
            self.engine.bind(ctx.spec)
            return
        from batchspec.engine.llm import child_pids, engine_for, kill_new_children

        ctx.events.emit(
            "engine_starting",
            f"starting vLLM engine for {sanitize_url(ctx.spec.model.target)}",
            speculative=(ctx.spec.speculative or {}).get("method"),
        )
        before = child_pids()
        ctx.stop.raise_now = True  # start-up cannot poll a flag: a signal ends it at once
        try:
            self.engine = engine_for(ctx.spec)
        except BaseException:
            kill_new_children(before)  # engine processes a half-built engine left behind
            raise
        finally:
            ctx.stop.raise_now = False

    def engine_info(self) -> tuple[str, int | None] | None:
        if self.engine is None:
            return None
        from batchspec.engine.checks import vllm_version

        self.counters_before = self.engine.spec_counters()
        self.vllm_version = vllm_version()
        return self.vllm_version, getattr(self.engine, "max_model_len", None)

    def generate(
        self,
        ctx: RunContext,
        shards: list[Shard],
        row_counts: dict[str, int],
        spec_fingerprint: dict[str, str],
    ) -> None:
        """Stages claim -> read prompts -> generate -> write and commit, in this process, holding
        each shard's lease. A shard whose holder went silent (it died on another host: object
        stores only) is retried once its lease has run out on this process's own clock, so a
        rerun never waits on a dead worker (:class:`LeaseWait`, as the Ray driver does)."""
        spec = ctx.spec
        progress = ctx.new_progress(sum(row_counts.values()), len(shards))
        self.leases = ShardLeases(ctx.out, ctx.owner, spec.execution.lease_s)
        self.pipeline = ShardPipeline(
            spec,
            ctx.run_id,
            ctx.out,
            self.leases,
            ctx.events,
            progress,
            ctx.outcome,
            spec_fingerprint,
            self.vllm_version,
            ctx.overwrite,
            stop=lambda: bool(ctx.stop),
            grace_s=ctx.grace_s,
            bad_shard=ctx.bad_shard,
            supervisor=self.supervisor(ctx),
        )
        lease_wait = LeaseWait(spec.execution.lease_s, ctx.outcome, ctx.events, progress, row_counts)
        by_name = {s.name: s for s in shards}
        try:
            with self.leases:
                self.pipeline.generate(self.engine, shards, row_counts)
                retry = lease_wait.schedule_retries(
                    dict(ctx.outcome.busy),
                    self.leases.observation,
                    stopping=bool(ctx.stop or self.pipeline.fatal),
                )
                if not retry or not lease_wait.sleep_until_due(retry, lambda: bool(ctx.stop)):
                    return
                for name in retry:
                    lease_wait.leave(name)
                self.pipeline.generate(self.engine, [by_name[n] for n in retry], row_counts)
        finally:
            ctx.fatal.extend(self.pipeline.fatal)

    def supervisor(self, ctx: RunContext):
        """The run's engine supervisor (batchspec/engine/supervise.py): a dead engine is started
        again, ``execution.engine_restarts`` times, a signal ending a start at once as at the first."""
        from batchspec.engine.supervise import supervise

        @contextlib.contextmanager
        def starting():
            ctx.stop.raise_now = True
            try:
                yield
            finally:
                ctx.stop.raise_now = False

        return supervise(
            self.engine, ctx.spec.execution.engine_restarts, SupervisionLog(ctx.events, ctx.outcome), starting
        )

    def acceptance_per_position(self) -> dict | None:
        if self.engine is None:
            return None
        return acceptance_per_position(self.counters_before, self.engine.spec_counters())

    def prefix_cache(self) -> dict | None:
        if self.engine is None:
            return None
        return prefix_cache(self.counters_before, self.engine.spec_counters())

    def abort(self) -> None:
        if self.pipeline is not None:
            self.pipeline.discard_uncommitted()
        if self.leases is not None:
            try:
                self.leases.release_all()
            except Exception:
                log.debug("releasing leases", exc_info=True)

    def shutdown(self) -> None:
        if self.owns_engine and self.engine is not None:
            self.engine.shutdown()
