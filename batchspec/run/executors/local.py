"""The local executor: one vLLM engine in this process runs the stages over every shard."""

from __future__ import annotations

import logging
import time

from batchspec.io.listing import Shard
from batchspec.leases.shard_leases import BusyRetry, ShardLeases
from batchspec.redact import sanitize_url
from batchspec.run.executors.base import RunContext
from batchspec.run.stages import ShardPipeline
from batchspec.stats import acceptance_per_position

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

    def start(self, ctx: RunContext) -> None:
        """One vLLM engine in this process, unless the caller gave one."""
        if self.engine is not None:
            self.engine.bind(ctx.spec)
            return
        from batchspec.engine.llm import Engine, child_pids, kill_new_children

        ctx.events.emit("engine_starting", f"starting vLLM engine for "
                        f"{sanitize_url(ctx.spec.model.target)}",
                        speculative=(ctx.spec.speculative or {}).get("method"))
        before = child_pids()
        ctx.stop.raise_now = True  # start-up cannot poll a flag: a signal ends it at once
        try:
            self.engine = Engine(ctx.spec)
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
        return vllm_version(), getattr(self.engine, "max_model_len", None)

    def generate(self, ctx: RunContext, shards: list[Shard], row_counts: dict[str, int],
                 spec_fingerprint: dict[str, str]) -> None:
        """Stages claim -> read prompts -> generate -> write and commit, in this process, holding
        each shard's lease. A shard whose holder went silent (it died on another host: object
        stores only) is retried once its lease has run out on this process's own clock, so a
        rerun never waits on a dead worker (:class:`BusyRetry`, the rule the Ray driver follows
        too)."""
        spec, events = ctx.spec, ctx.events
        progress = ctx.new_progress(sum(row_counts.values()), len(shards))
        self.leases = ShardLeases(ctx.out, ctx.owner, spec.execution.lease_s)
        self.pipeline = ShardPipeline(
            spec, ctx.run_id, ctx.out, self.leases, events, progress, ctx.summary,
            spec_fingerprint, ctx.summary["versions"].get("vllm"), ctx.overwrite,
            stop=lambda: bool(ctx.stop), grace_s=ctx.grace_s, bad_shard=ctx.bad_shard)
        fatal = self.pipeline.fatal
        by_name = {s.name: s for s in shards}
        try:
            with self.leases:
                self.pipeline.generate(self.engine, shards, row_counts)
                busy = ctx.summary["busy_shards"]
                rule = BusyRetry(spec.execution.lease_s)
                waits = {n: rule.after(n, self.leases.observation(n)) for n in busy}
                retry = sorted(n for n, w in waits.items() if w is not None)
                if not retry or ctx.stop or fatal:
                    return
                wait_s = max(waits[n] for n in retry)
                events.emit("shards_waiting", f"{len(retry)} shard(s) are held by runs that have "
                            f"not renewed their lease; taking them over in {wait_s:.0f}s unless "
                            "they do", shards=retry, wait_s=round(wait_s, 1))
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and not ctx.stop:
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                if ctx.stop:
                    return
                for n in retry:
                    del busy[n]
                    progress.rows_dropped(-row_counts[n])
                self.pipeline.generate(self.engine, [by_name[n] for n in retry], row_counts)
        finally:
            ctx.fatal.extend(fatal)

    def acceptance_per_position(self) -> dict | None:
        if self.engine is None:
            return None
        return acceptance_per_position(self.counters_before, self.engine.spec_counters())

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
