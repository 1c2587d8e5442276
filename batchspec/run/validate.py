"""``batchspec validate``: check a job without loading model weights.

Checks the spec's keys against vLLM's own config classes, lists the shards and their state,
checks each shard's columns, and tokenizes every prompt with the target's tokenizer to count
the rows vLLM would refuse (empty, or too long to leave room for one output token within the
``max_model_len`` vLLM itself would use)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchspec.columns import error_reason
from batchspec.engine.checks import max_model_len
from batchspec.engine.images import RowImageError, read_row_images, takes_images
from batchspec.engine.tokens import length_error, prompt_token_ids
from batchspec.errors import EXIT_BAD_INPUT, InputDataError, SpecError
from batchspec.io.images import ImageLimits
from batchspec.io.locations import check_job_locations
from batchspec.io.reader import open_reader
from batchspec.io.states import ShardState
from batchspec.redact import sanitize_url
from batchspec.run.stages import plan
from batchspec.spec.model import JobSpec


@dataclass
class ShardCheck:
    name: str
    url: str
    state: ShardState
    rows: int = 0
    bad_rows: dict[str, int] = field(default_factory=dict)
    max_prompt_tokens: int = 0
    problem: str | None = None


@dataclass
class ValidationReport:
    job: str
    max_model_len: int
    shards: list[ShardCheck]
    exit_code: int = 0

    def render(self) -> str:
        lines = [f"job {self.job!r}: spec OK; max_model_len {self.max_model_len}"]
        for s in self.shards:
            if s.problem:
                lines.append(f"  {s.name}: BAD: {s.problem}")
                continue
            bad = ", ".join(f"{n} {reason}" for reason, n in sorted(s.bad_rows.items()))
            lines.append(
                f"  {s.name}: {s.state}, {s.rows} rows, longest prompt "
                f"{s.max_prompt_tokens} tokens" + (f"; rows to be refused: {bad}" if bad else "")
            )
        rows = sum(s.rows for s in self.shards)
        refused = sum(sum(s.bad_rows.values()) for s in self.shards)
        lines.append(f"{len(self.shards)} shards, {rows} rows, {refused} rows would get an error")
        return "\n".join(lines)


def validate_job(spec: JobSpec, worker_index: int = 0, num_workers: int = 1) -> ValidationReport:
    """Check everything a run would check before generating, without loading weights."""
    from transformers import AutoTokenizer

    from batchspec.engine.checks import (
        TEMPLATE_KWARGS,
        check_row,
        check_vllm_keys,
        override_error,
        override_sources,
        row_template_kwargs,
        template_kwargs,
    )
    from batchspec.engine.lora import unknown_adapter
    from batchspec.engine.structured import normalise

    # as a run does: overlapping locations first, then the keys vLLM takes (both exit 2)
    check_job_locations(spec)
    check_vllm_keys(spec)
    if spec.speculative_auto is not None:
        from batchspec.tune.auto import check_auto

        check_auto(spec)
    adapters = tuple(spec.model.lora.adapters) if spec.model.lora is not None else ()
    constraint = spec.sampling.get("structured_outputs")
    base = normalise(constraint) if constraint is not None else None
    max_logprobs = spec.model.engine.get("max_logprobs", 20)
    sources = override_sources(spec)
    given = spec.sampling.get(TEMPLATE_KWARGS)
    base_kwargs = template_kwargs(given) if given is not None else {}
    p = plan(spec, worker_index, num_workers)
    shards, states = p.shards, p.states
    # code shipped with a model runs only when the spec asks for it, as vLLM does
    tokenizer = AutoTokenizer.from_pretrained(
        spec.model.engine.get("tokenizer") or spec.model.target,
        trust_remote_code=spec.model.engine.get("trust_remote_code") is True,
    )
    max_len = max_model_len(spec)
    images = _ImageCheck(spec)
    report = ValidationReport(spec.name, max_len, [])
    for shard in shards:
        check = ShardCheck(shard.name, shard.url, states[shard.name])
        report.shards.append(check)
        unnamable = p.out.unnamable(shard) if states[shard.name] is not ShardState.COMMITTED else None
        if unnamable is not None:  # what a run's input check says of it
            check.problem = str(InputDataError(sanitize_url(shard.url), unnamable))
            report.exit_code = EXIT_BAD_INPUT
            continue
        try:
            reader = open_reader(shard, spec)
        except InputDataError as exc:
            check.problem = str(exc)
            report.exit_code = EXIT_BAD_INPUT
            continue
        try:
            for row in reader.rows():
                check.rows += 1
                reason = row.error
                if reason is None and row.lora is not None and row.lora not in adapters:
                    reason = unknown_adapter(row.lora, spec.input.lora_column, adapters)
                if reason is None and row.overrides:
                    try:
                        check_row(base, row.overrides, max_logprobs, spec.execution.max_n)
                    except Exception as exc:  # noqa: BLE001 (what a run makes an error row)
                        reason = override_error(row.overrides, sources, exc)
                if reason is None:
                    try:
                        kwargs = row_template_kwargs(base_kwargs, row)
                    except ValueError as exc:
                        kwargs, reason = None, override_error(row.overrides, sources, exc)
                if reason is None and row.images:
                    reason = images.check(row)
                if reason is None:
                    ids = prompt_token_ids(tokenizer, row, kwargs)
                    check.max_prompt_tokens = max(check.max_prompt_tokens, len(ids))
                    reason = length_error(len(ids), max_len)
                if reason is not None:
                    key = error_reason(reason)
                    check.bad_rows[key] = check.bad_rows.get(key, 0) + 1
        except InputDataError as exc:
            check.problem = str(exc)
            report.exit_code = EXIT_BAD_INPUT
        finally:
            reader.close()
    return report


class _ImageCheck:
    """A row's images as a run reads them (every one fetched and decoded within the job's
    limits, then dropped); a text-only target given rows with images is exit 2, naming the
    first such row. The text of an image row is counted; its image tokens are counted when it
    runs (``num_prompt_tokens``)."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.limits = ImageLimits.of(spec.input)
        self.takes = None if not spec.input.image_columns else True  # checked by check_vllm_keys

    def check(self, row) -> str | None:
        if self.takes is None:
            self.takes = takes_images(self.spec.model.target)
        if self.takes is False:
            raise SpecError(
                "model.target",
                f"row {row.request_id!r} of shard {row.shard!r} has images, but the target "
                f"{self.spec.model.target!r} is a text-only model: vLLM takes no images for it",
            )
        try:
            read_row_images(row.images, self.limits)
        except RowImageError as exc:
            return str(exc)
        return None
