"""The only module that imports vLLM: build the engine, keep it fed, turn its outputs into
result rows.

Requests go in through ``llm_engine.add_request`` and come out of ``llm_engine.step()`` with a
bounded number in flight, refilled as requests finish, so that there is no stall at batch or
shard boundaries: one slow request never holds back the next batch."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from batchspec.columns import error_result
from batchspec.engine import structured
from batchspec.engine.checks import (
    CPU_SAMPLING_REFUSAL,
    TEMPLATE_KWARGS,
    _bad_value_errors,
    _seeded_chunks_crash,
    check_row,
    check_vllm_keys,
    override_error,
    override_sources,
    refuses_random_sampling,
    row_template_kwargs,
    template_kwargs,
)
from batchspec.engine.images import ImagePrompts, RowImageError
from batchspec.engine.lifeline import arm
from batchspec.engine.lora import Adapters, check_lora
from batchspec.engine.pacing import PrefixPacer
from batchspec.engine.reasoning import Splitter
from batchspec.engine.rows import Asked
from batchspec.engine.supervise import EngineDied, add_counters, death_note
from batchspec.engine.tokens import length_error, prompt_token_ids
from batchspec.errors import Interrupted, RuntimeFailure, SpecError, interrupted_within
from batchspec.io.images import text_only
from batchspec.io.reader import Row
from batchspec.spec.methods import vllm_speculative
from batchspec.spec.model import JobSpec
from batchspec.tasks import GENERATE, TASKS

log = logging.getLogger(__name__)


#: Top logprobs batchspec asks for at a ``choice`` row's first position (capped by the engine's
#: ``max_logprobs``), so that ``choice_probs`` sees the whole constrained distribution.
CHOICE_LOGPROBS = 20

#: Engine arguments batchspec sets unless the job spec says otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {"seed": 0}


#: Engine arguments batchspec needs and always sets: per-request timing and acceptance.
_STATS_ON = {"disable_log_stats": False}


#: Engine arguments that change nothing an offline engine generates (only the names a job
#: answers to: batchspec/io/openai_batch.py), so an engine serves jobs that differ in them.
_NAMING_ONLY = ("served_model_name",)


def _serves(spec: JobSpec) -> tuple:
    """What an engine is built from: the target, the engine arguments (but their names), the
    speculative config, the LoRA adapters."""
    engine = {k: v for k, v in spec.model.engine.items() if k not in _NAMING_ONLY}
    return (
        spec.model.target,
        engine,
        dict(spec.speculative) if spec.speculative is not None else None,
        _lora_engine(spec),
        spec.model.reasoning_parser,
        spec.task,
    )


def _lora_engine(spec: JobSpec) -> tuple | None:
    """What of ``model.lora`` an engine is started with (the job-wide adapter is per request)."""
    lora = spec.model.lora
    return None if lora is None else (dict(lora.adapters), lora.max_loras, lora.max_lora_rank)


class Prepared(NamedTuple):
    """A row made ready for the engine: what :meth:`Engine.stream` hands to ``add_request``."""

    token_ids: list[int]
    params: Any  # vllm.SamplingParams
    asked: Asked
    lora_request: Any  # vllm.lora.request.LoRARequest or None
    #: a row with images: vLLM's engine input (its images processed); None: ``token_ids``
    prompt: Any = None

    @property
    def sequences(self) -> int:
        """Sequences the engine runs for it: its ``n`` samples."""
        return max(1, int(getattr(self.params, "n", 1)))  # PoolingParams: one


@dataclasses.dataclass
class Held:
    """A prepared request waiting to be sent: for its prefix to be cached (``until``, an engine
    step), or for room among the sequences in flight."""

    until: int
    row: Row
    request: Prepared


#: vLLM's prefix-cache counters (prompt tokens looked up, and found) a run's summary reports.
_PREFIX_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")


def _start_with_the_heap_frozen(start):
    """``start()`` (vLLM's ``LLM(...)``) with the objects alive now set aside from the garbage
    collector: vLLM collects garbage several times while it loads weights, and each collection
    then walks only what the start-up makes, not torch's and vLLM's modules (most of the heap):
    about 2 s less of an in-process start of the tiny pair. vLLM freezes its start-up heap itself
    once the engine is up (and thaws it at shutdown); a start that fails thaws it here."""
    gc.collect()
    gc.freeze()
    try:
        return start()
    except BaseException:
        gc.unfreeze()
        raise


class Engine:
    """One vLLM engine, reused for every shard of the process."""

    #: What the job asks of each row (generation today): the rows of its outputs come from it.
    task = GENERATE

    @functools.cached_property
    def _task_rows(self):
        return self.task.row_maker()

    def __init__(self, spec: JobSpec):
        check_vllm_keys(spec)
        self.refuse_random_sampling = refuses_random_sampling(spec)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._SamplingParams = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.spec_enabled = spec.speculative is not None
        #: what :meth:`restart` starts again: the model and vLLM's arguments
        self._launch_args = (spec.model.target, self._llm_kwargs(spec))
        #: counters of the engines this one replaced (:meth:`restart`)
        self._carried: dict[str, Any] = {}
        self.llm = self._launch()
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.engine.model_config.max_model_len
        self.serves = _serves(spec)
        self.max_logprobs = self.engine.model_config.max_logprobs
        config = getattr(self.engine, "vllm_config", None)
        #: the prefix cache's block, in tokens (None: prefix caching off), and the prompt tokens a
        #: step may prefill: what :class:`PrefixPacer` needs
        self.prefix_block = (
            config.cache_config.block_size
            if config is not None and config.cache_config.enable_prefix_caching
            else None
        )
        self.tokens_per_step = (
            config.scheduler_config.max_num_batched_tokens if config is not None else self.max_model_len
        )
        self._use(spec)
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._start_watchdog()

    def _launch(self):
        """vLLM's ``LLM``, started as :attr:`_launch_args` say; keeps the processes it started
        (:attr:`processes`, with their names) for the watchdog and :meth:`restart`."""
        from vllm import LLM

        model, kwargs = self._launch_args
        arm()  # the engine's processes die with this one (batchspec/engine/lifeline.py)
        before = child_pids()
        try:
            llm = _start_with_the_heap_frozen(lambda: LLM(model=model, **kwargs))
        except _bad_value_errors() as exc:
            # vLLM validates its configs here: a bad engine or speculative value is a spec error.
            raise SpecError("model", f"vLLM refused the engine configuration: {exc}") from exc
        except Exception as exc:
            stop = interrupted_within(exc)
            if stop is not None:  # a signal during start-up: a stop, not an engine that failed
                raise stop from exc
            raise RuntimeFailure(f"could not start the vLLM engine: {exc}") from exc
        self.processes = _engine_processes(before)
        return llm

    def restart(self) -> None:
        """A new vLLM engine in place of this one's, which died, with the same configuration
        (batchspec/engine/supervise.py). What is left of the old one is shut down and its
        processes killed first; its counters carry over (:meth:`spec_counters`). RuntimeFailure
        where the new one cannot start (what it started is killed too)."""
        if self.llm is not None:  # (None: after a restart whose start failed)
            self._carried = self.spec_counters()
            self.shutdown()
            self.llm = None
        _kill([p for p, _ in self.processes])
        before = child_pids()
        try:
            self.llm = self._launch()
        except BaseException:
            kill_new_children(before)
            raise
        self.engine = self.llm.llm_engine
        self._closed = threading.Event()
        self._start_watchdog()

    def _llm_kwargs(self, spec: JobSpec) -> dict[str, Any]:
        """vLLM's ``LLM`` arguments for this job's engine (a pooling task's engine has its own)."""
        kwargs = {**ENGINE_DEFAULTS, **spec.model.engine, **check_lora(spec), **_STATS_ON}
        if spec.model.reasoning_parser is not None:
            # the answer is constrained, and the thinking budget counted, by vLLM's parser
            kwargs["reasoning_parser"] = spec.model.reasoning_parser
        if self.spec_enabled:
            kwargs["speculative_config"] = vllm_speculative(spec.speculative)
            # each verify step's acceptance, to split a reasoning output's between its parts
            detail = "detailed" if spec.model.reasoning_parser is not None else "summary"
            kwargs.setdefault("per_request_spec_decode_metrics", detail)
        if _seeded_chunks_crash(spec):
            # a seeded request whose prompt is split across steps kills this engine (see
            # batchspec.engine.cpu_plugin); without the plugin's fix, prompts are prefilled whole
            kwargs.setdefault("enable_chunked_prefill", False)
        return kwargs

    def bind(self, spec: JobSpec) -> None:
        """Generate for ``spec`` from now on (``run_job(spec, engine=...)`` reuses an engine across
        jobs): its sampling and refusals. A spec for another model, engine arguments or
        speculative config is a spec error: this engine cannot run it."""
        wanted = _serves(spec)
        for key, (have, want) in zip(
            ("model.target", "model.engine", "speculative", "model.lora", "model.reasoning_parser", "task"),
            zip(self.serves, wanted, strict=True),
            strict=True,
        ):
            if have != want:
                raise SpecError(
                    key,
                    "the engine given to run_job was started for another "
                    f"{key}; start one for this job (or pass none)",
                )
        self._use(spec)

    def _use(self, spec: JobSpec) -> None:
        sampling = dict(spec.sampling)
        constraint = sampling.pop("structured_outputs", None)
        kwargs = sampling.pop(TEMPLATE_KWARGS, None)
        #: the chat template's variables for every row (checked before the engine started)
        self.base_template_kwargs = template_kwargs(kwargs) if kwargs is not None else {}
        self.base_sampling = sampling
        #: splits a reasoning model's outputs into thinking and answer (None: not one)
        self.reasoning = (
            Splitter(spec.model.reasoning_parser, self.tokenizer)
            if spec.model.reasoning_parser is not None
            else None
        )
        # checked by check_vllm_keys before the engine started: a bad one never reaches here
        self.base_constraint = structured.normalise(constraint) if constraint is not None else None
        self.override_sources = override_sources(spec)
        self.refuse_random_sampling = refuses_random_sampling(spec)
        self.adapters = Adapters(spec)
        #: hold a request whose prefix another is computing (``execution.prefix_window`` > 0)
        self.pace_prefixes = spec.execution.prefix_window > 0
        self.max_n = spec.execution.max_n
        #: rows with images: read, checked and rendered by vLLM's chat renderer
        self.images = ImagePrompts(spec)

    # ------------------------------------------------------------------ requests

    def sampling_params(self, overrides: dict[str, Any]):
        """The job's SamplingParams with a row's overrides, and what the row asked for beyond
        text (:class:`Asked`); ValueError/TypeError if invalid (a bad per-row constraint is a
        :class:`~batchspec.engine.structured.ConstraintError`, a ValueError)."""
        plain, constraint = check_row(self.base_constraint, overrides, self.max_logprobs, self.max_n)
        params = {**self.base_sampling, **plain, "output_kind": self._final_only}
        logprobs = params.get("logprobs")
        if constraint is not None:
            params["structured_outputs"] = structured.vllm_params(constraint)
            if "choice" in constraint:  # choice_probs needs the first position's distribution
                wanted = max(logprobs or 0, CHOICE_LOGPROBS)
                params["logprobs"] = wanted if self.max_logprobs < 0 else min(wanted, self.max_logprobs)
        asked = Asked(constraint=constraint, logprobs=logprobs, prompt_logprobs=params.get("prompt_logprobs"))
        return self._SamplingParams(**params), asked

    def _prepare(self, row: Row) -> tuple[Prepared | None, dict | None]:
        """The row's :class:`Prepared` request, or its error result row. Nothing one row holds
        raises out of here: whatever vLLM or a check raises is that row's error."""
        try:
            lora, lora_request = self.adapters.pick(row.lora)
        except ValueError as exc:
            return None, error_result(str(exc))
        try:
            params, asked = self.sampling_params(row.overrides)
        except Exception as exc:  # noqa: BLE001 (vLLM asserts on some values: AssertionError)
            return None, error_result(override_error(row.overrides, self.override_sources, exc))
        asked = dataclasses.replace(asked, lora=lora)
        try:
            kwargs = row_template_kwargs(self.base_template_kwargs, row)
        except ValueError as exc:
            return None, error_result(override_error(row.overrides, self.override_sources, exc))
        try:
            if row.images:
                prompt = self.images.prepare(self.llm, row, kwargs)
                ids = list(prompt["prompt_token_ids"])
            else:
                prompt, ids = None, prompt_token_ids(self.tokenizer, row, kwargs)
        except RowImageError as exc:
            return None, error_result(str(exc))
        except RuntimeFailure:
            raise  # an image's store failed past its retries: the run's failure (exit 1)
        except Exception as exc:  # a template or tokenizer failure belongs to this row only
            return None, error_result(f"cannot render prompt: {exc}")
        if self.refuse_random_sampling and params.temperature > 0:
            return None, error_result(f"unsupported sampling: {CPU_SAMPLING_REFUSAL}")
        too_long = length_error(len(ids), self.max_model_len)
        if too_long is not None:
            return None, error_result(too_long, num_prompt_tokens=len(ids))
        if self.reasoning is not None:
            messages = text_only(row.messages) if row.images else row.messages
            ended = self.reasoning.prompt_ends_thinking(messages, kwargs)
            asked = dataclasses.replace(asked, thinking_ended=ended)
        return Prepared(ids, params, asked, lora_request, prompt), None

    def stream(
        self,
        rows: Iterator[Row],
        max_in_flight: int,
        stop: Callable[[], bool] | None = None,
        grace_s: float = 0.0,
        keep: Callable[[Row], bool] | None = None,
    ) -> Iterator[tuple[Row, list[dict]]]:
        """Feed rows to the engine, at most ``max_in_flight`` sequences at a time (a row asking
        for ``n`` samples counts ``n``; one with more than ``max_in_flight`` runs alone), and
        yield each row with its result rows as it finishes (errors included): one per sample
        (``n``), in sample order; a row refused before the engine has one error row. Order is
        completion order.

        ``stop`` is polled between engine steps. Once it is true no new row is taken; requests
        that ``keep`` rejects (their shard can no longer be committed) are aborted at once, the
        rest may finish for ``grace_s`` seconds, then whatever is left is aborted."""
        from vllm.inputs import TokensPrompt

        # engine request id -> the row, its request, when it was handed over (batchspec's own
        # clock: e2e is measured, not summed)
        in_flight: dict[str, tuple[Row, Prepared, float]] = {}
        pacer = (
            PrefixPacer(self.prefix_block, self.tokens_per_step)
            if self.pace_prefixes and self.prefix_block
            else None
        )
        held: list[Held] = []  # oldest first
        sequences = {"in_flight": 0, "held": 0}
        sent_since_step: list[Row] = []  # what the engine got since its last step
        steps = 0
        exhausted = False
        deadline: float | None = None

        def fits(request: Prepared) -> bool:
            return not in_flight or sequences["in_flight"] + request.sequences <= max_in_flight

        def admit(row: Row, request: Prepared) -> list[dict] | None:
            """Hand a prepared request to the engine; the error result where vLLM refuses it."""
            request_id = str(next(self._ids))
            started = time.monotonic()  # before add_request, where vLLM's arrival is
            try:
                self.engine.add_request(
                    request_id,
                    request.prompt
                    if request.prompt is not None
                    else TokensPrompt(prompt_token_ids=request.token_ids),
                    request.params,
                    lora_request=request.lora_request,
                )
            except Exception as exc:  # refused: empty, too long, a bad grammar, a bad value...
                if _engine_dead(exc):
                    raise died(exc, [*sent_since_step, row], [row, *(h.row for h in held)]) from exc
                return [
                    error_result(str(exc) or type(exc).__name__, num_prompt_tokens=len(request.token_ids))
                ]
            in_flight[request_id] = (row, request, started)
            sequences["in_flight"] += request.sequences
            sent_since_step.append(row)
            return None

        def died(exc: Exception, suspects: list[Row], unsent: list[Row]) -> EngineDied:
            """The engine is dead: the rows it had and those taken but not sent go with the
            error (batchspec/engine/supervise.py sends them again)."""
            # which process died, and how, says more than vLLM's "EngineCore encountered an issue"
            note = death_note(getattr(self.engine, "engine_core", None), getattr(self, "processes", ()))
            reason = f"{type(exc).__name__}: {note or exc}"
            in_engine = [row for row, _, _ in in_flight.values()]
            return EngineDied(
                f"the vLLM engine failed: {reason}{_suspects(suspects)}", reason, in_engine, unsent
            )

        def forget(request_id: str) -> tuple[Row, Prepared, float] | None:
            entry = in_flight.pop(request_id, None)
            if entry is not None:
                sequences["in_flight"] -= entry[1].sequences
            return entry

        try:
            while True:
                if deadline is None and stop is not None and stop():
                    deadline = time.monotonic() + max(0.0, grace_s)
                    exhausted = True
                    dropped = [rid for rid, (row, _, _) in in_flight.items() if keep is None or not keep(row)]
                    for rid in dropped:
                        forget(rid)
                    if dropped:
                        self._abort_quietly(dropped)
                    held = [h for h in held if keep is not None and keep(h.row)]
                    sequences["held"] = sum(h.request.sequences for h in held)
                if deadline is not None and (not (in_flight or held) or time.monotonic() >= deadline):
                    return
                # held requests whose prefix is cached now (all of them once nothing is in
                # flight: whatever they waited for has run), while there is room
                while held:
                    ready = next((i for i, h in enumerate(held) if h.until <= steps or not in_flight), None)
                    if ready is None or not fits(held[ready].request):
                        break
                    waiting = held.pop(ready)
                    sequences["held"] -= waiting.request.sequences
                    refused = admit(waiting.row, waiting.request)
                    if refused is not None:
                        yield waiting.row, refused
                while not exhausted and sequences["in_flight"] + sequences["held"] < max_in_flight:
                    row = next(rows, None)
                    if row is None:
                        exhausted = True
                        break
                    if row.error is not None:
                        yield row, [error_result(row.error)]
                        continue
                    request, refused = self._prepare(row)
                    if refused is not None:
                        yield row, [refused]
                        continue
                    # an image row's placeholders are alike whatever its images: no prefix to share
                    paced = pacer is not None and request.prompt is None
                    until = pacer.hold_until(request.token_ids, steps) if paced else None
                    if until is None and not fits(request):
                        until = steps  # ready now; waits for room among the sequences
                    if until is not None:
                        held.append(Held(until, row, request))
                        sequences["held"] += request.sequences
                        continue
                    refused = admit(row, request)
                    if refused is not None:
                        yield row, refused
                if not in_flight:
                    if exhausted and not held:
                        return
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    raise died(exc, sent_since_step, [h.row for h in held]) from exc
                steps += 1
                sent_since_step.clear()
                for output in outputs:
                    if output.finished:
                        entry = forget(output.request_id)
                        if entry is not None:
                            row, request, started = entry
                            yield row, self._results(output, time.monotonic() - started, request)
        finally:
            if in_flight:
                self.abort(list(in_flight))

    def _results(self, output, e2e_s: float, request: Prepared) -> list[dict]:
        """:meth:`result`, or one error row per sample where reading the output fails: one
        output never ends the run."""
        try:
            return self.result(output, e2e_s, request.asked)
        except Interrupted:
            raise  # a signal while this output was read: the run's stop, not the row's error
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot read the output of request %s", output.request_id, exc_info=True)
            why = f"cannot read the engine's output: {type(exc).__name__}: {exc}"
            return [
                {**error_result(why, num_prompt_tokens=len(request.token_ids)), "sample_index": i}
                for i in range(request.sequences)
            ]

    def _abort_quietly(self, request_ids: list[str]) -> None:
        """Abort some requests and leave the rest running."""
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            log.debug("abort", exc_info=True)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests still in the engine (on shutdown or a failed shard)."""
        try:
            self.engine.abort_request(request_ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except Exception:  # the engine may already be dead; nothing more to clean up
            log.debug("abort after engine failure", exc_info=True)

    # ------------------------------------------------------------------ results

    def result(self, output, e2e_s: float | None = None, asked: Asked | None = None) -> list[dict]:
        """A finished RequestOutput as result rows, made by the job's task (generation's:
        :func:`~batchspec.engine.rows.result_rows`); what :meth:`stream` yields, so a subclass
        can add what it needs from the output (distill keeps token ids)."""
        return self._task_rows(output, e2e_s, asked or Asked(), self.reasoning)

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (nothing may be in flight): the next requests prefill their
        prompts in full. False where vLLM could not (it then leaves the cache as it was)."""
        try:
            return bool(self.llm.reset_prefix_cache())
        except Exception:  # a timing without the reset is still a timing
            return False

    def batch_config(self) -> dict[str, Any]:
        """The batch sizes vLLM resolved for this engine (its ``scheduler_config``: the job's
        values where it set them, vLLM's defaults for this platform and usage otherwise):
        ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``; empty where
        vLLM exposes none."""
        config = getattr(self.engine, "vllm_config", None)
        scheduler = getattr(config, "scheduler_config", None)
        if scheduler is None:
            return {}
        keys = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill")
        return {k: getattr(scheduler, k) for k in keys if getattr(scheduler, k, None) is not None}

    def spec_counters(self) -> dict[str, Any]:
        """Engine-lifetime speculative-decoding and prefix-cache totals from vLLM's own metrics
        (``spec_decode_*``, ``prefix_cache_queries`` and ``prefix_cache_hits``), the engines it
        replaced (:meth:`restart`) counted in."""
        return add_counters(self._carried, self._own_counters())

    def _own_counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            metrics = self.llm.get_metrics()
        except Exception:
            return out
        for metric in metrics:
            name = metric.name.removeprefix("vllm:")
            if not name.startswith("spec_decode") and name not in _PREFIX_COUNTERS:
                continue
            if hasattr(metric, "values"):
                out[name] = list(metric.values)
            elif hasattr(metric, "value"):
                out[name] = metric.value
        return out

    def _start_watchdog(self) -> None:
        """Turn a dead engine process into an error instead of a hang.

        vLLM's synchronous client notices a dead EngineCore process but then blocks for ever in
        ``step()`` (nothing is put on its output queue). This thread watches the engine's
        processes and, when one dies, puts EngineDeadError on that queue so ``step()`` raises.
        """
        import psutil

        core = self.engine.engine_core
        outputs = getattr(core, "outputs_queue", None)
        if outputs is None:
            return  # in-process engine: a crash raises directly
        watched, closed = self.processes, self._closed

        def alive(p) -> bool:
            try:
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False

        def watch() -> None:
            while not closed.wait(0.5):
                resources = getattr(core, "resources", None)
                if getattr(resources, "engine_dead", False) or not all(alive(p) for p, _ in watched):
                    if closed.is_set():
                        return
                    from vllm.v1.engine.exceptions import EngineDeadError

                    note = death_note(core, watched) or "an engine process died"
                    outputs.put_nowait(EngineDeadError(note))
                    return

        threading.Thread(target=watch, name="batchspec-engine-watchdog", daemon=True).start()

    def shutdown(self) -> None:
        """Stop the engine's worker processes."""
        self._closed.set()
        engine_core = getattr(self.engine, "engine_core", None)
        if engine_core is not None:
            try:
                engine_core.shutdown()
            except Exception:
                log.debug("engine shutdown", exc_info=True)


def _engine_dead(exc: BaseException) -> bool:
    """True for vLLM's errors that mean the engine itself is gone, not one request refused."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


def _suspects(rows: list[Row]) -> str:
    """The rows the engine got since its last good step (one of them may have killed it), for
    the run's error message."""
    if not rows:
        return ""
    shown = ", ".join(f"{r.request_id!r} (shard {r.shard})" for r in rows[:10])
    more = f" and {len(rows) - 10} more" if len(rows) > 10 else ""
    return f"; the requests sent to it since its last step: {shown}{more}"


def child_pids() -> set[int]:
    """This process's descendants now (to tell, later, which processes an engine started)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _engine_processes(before: set[int]) -> list[tuple[Any, str]]:
    """The engine processes (EngineCore, workers) started since ``before``, with their names."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            name = p.name()
        except psutil.Error:
            continue
        if p.pid not in before and ("EngineCore" in name or "Worker" in name):
            found.append((p, name))
    return found


def _kill(procs: list) -> None:
    """SIGKILL these processes (psutil's: a pid reused since is left alone) and reap them."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def kill_new_children(before: set[int]) -> None:
    """Kill processes started since ``before``: what an engine left behind after its shutdown
    or a failed or interrupted start-up, so that the next engine has the machine to itself."""
    import psutil

    _kill([p for p in psutil.Process().children(recursive=True) if p.pid not in before])


def engine_for(spec: JobSpec) -> Engine:
    """A started engine for the job's task: :class:`Engine` for generation, the class the task
    names for another (``batchspec.engine.pooling.PoolingEngine``)."""
    cls = TASKS[spec.task].engine_class()
    return Engine(spec) if cls is None else cls(spec)
