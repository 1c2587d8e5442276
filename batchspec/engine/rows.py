"""vLLM's request outputs as result rows: text, tokens, finish reason, acceptance and timing
columns, and what a row asked for beyond text (samples, logprobs, structured outputs); the
columns are :mod:`batchspec.columns`."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchspec.columns import FINISH_REASONS, empty_result
from batchspec.engine.reasoning import LENGTH_IN_REASONING, Splitter, split_acceptance
from batchspec.engine.structured import check_answer
from batchspec.stats import acceptance_rate, mean_acceptance_length

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Asked:
    """What a request asked for beyond text, as the result columns need it."""

    #: The row's structured-output constraint (normalised mapping), if any.
    constraint: Mapping[str, Any] | None = None
    #: Top logprobs per generated token the row asked for (None: no logprob columns).
    logprobs: int | None = None
    #: Top logprobs per prompt token the row asked for (None: no prompt logprob columns).
    prompt_logprobs: int | None = None
    #: The LoRA adapter the request ran with (None: the base model).
    lora: str | None = None
    #: A reasoning model's chat template ended the thinking in the prompt (``enable_thinking:
    #: false``): all of the output is the answer (``Splitter.prompt_ends_thinking``).
    thinking_ended: bool = False


NOTHING = Asked()

#: The share of the first position's probability mass the top logprobs must hold for
#: ``choice_probs`` to be given: each probability is then within 0.1 percentage points.
CHOICE_MASS_SEEN = 0.999


def result_rows(
    output, e2e_s: float | None = None, asked: Asked = NOTHING, reasoning: Splitter | None = None
) -> list[dict]:
    """A finished RequestOutput as result rows, one per sample (``n``), in sample order.

    vLLM's finish reason is kept as it is; ``error`` (the engine failed this request) becomes
    an error row (``generated_text`` null), so it is never mistaken for a success. ``e2e_s`` is
    batchspec's own measure from handing the request to the engine to receiving its end. With a
    reasoning model's ``reasoning`` splitter, each sample's thinking is split from its answer."""
    num_prompt = len(output.prompt_token_ids or ())
    prompt_columns = _prompt_logprob_columns(output, asked.prompt_logprobs)
    rows = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        row = _sample_row(completion, num_prompt, asked, reasoning)
        row.update(prompt_columns)
        row.update(timing_columns(output.metrics, row["num_output_tokens"], e2e_s))
        rows.append(row)
    return rows


def _sample_row(completion, num_prompt: int, asked: Asked, reasoning: Splitter | None = None) -> dict:
    row = empty_result()
    num_output = len(completion.token_ids)
    finish = completion.finish_reason or "abort"
    row.update(
        sample_index=completion.index,
        generated_text=completion.text,
        finish_reason=finish,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        lora_adapter=asked.lora,
    )
    split = None
    if reasoning is not None and finish != "error":
        split = reasoning.split(asked.thinking_ended, completion.token_ids, completion.text)
        row.update(
            generated_text=split.answer,
            reasoning_text=split.reasoning,
            num_reasoning_tokens=split.reasoning_tokens,
            num_answer_tokens=num_output - split.reasoning_tokens,
        )
        if not split.ended and finish == "length":
            row["finish_reason"] = finish = LENGTH_IN_REASONING
    if finish == "error":
        row.update(
            generated_text=None,
            error=f"engine error: vLLM failed this request after {num_output} output tokens"
            + (f" ({completion.stop_reason})" if completion.stop_reason else ""),
        )
    elif finish not in FINISH_REASONS:
        log.warning("unknown finish reason from vLLM: %r (kept as is)", finish)
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is not None:
        m = metrics.to_dict()
        steps, drafted = m["num_spec_steps"], m["num_draft_tokens"]
        accepted = m["num_accepted_draft_tokens"]
        row.update(
            spec_num_steps=steps,
            spec_num_draft_tokens=drafted,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_rate=acceptance_rate(accepted, drafted),
            spec_mean_acceptance_length=mean_acceptance_length(accepted, steps),
            spec_acceptance_histogram=list(m["acceptance_histogram"]),
        )
        if split is not None and "per_step_accepted" in m:
            drafted, accepted = split_acceptance(
                m["per_step_accepted"], m["per_step_drafted"], split.reasoning_tokens
            )
            row.update(spec_reasoning_num_draft_tokens=drafted, spec_reasoning_num_accepted_tokens=accepted)
    if asked.constraint is not None:
        valid, why, answer = check_answer(asked.constraint, row["generated_text"], finish)
        # the parsed answer, for output.parse_json's column (batchspec/io/answers.py; not a column)
        row.update(structured_valid=valid, structured_error=why, _answer=answer)
        if "choice" in asked.constraint and completion.logprobs:
            row["choice_probs"] = choice_probs(asked.constraint["choice"], completion.logprobs[0])
    if asked.logprobs is not None and completion.logprobs is not None:
        row.update(
            cumulative_logprob=_finite(completion.cumulative_logprob),
            token_logprobs=[
                _chosen(entry, token)
                for entry, token in zip(completion.logprobs, completion.token_ids, strict=False)
            ],
            top_logprobs=[_top(entry, asked.logprobs) for entry in completion.logprobs],
            # each generated token as text, for OpenAI-format output (not a Parquet column)
            _token_texts=[
                entry[token].decoded_token if entry and token in entry else None
                for entry, token in zip(completion.logprobs, completion.token_ids, strict=False)
            ],
        )
    return row


def _prompt_logprob_columns(output, k: int | None) -> dict:
    entries = getattr(output, "prompt_logprobs", None)
    if k is None or entries is None:
        return {}
    ids = output.prompt_token_ids or ()
    return {
        # vLLM has no logprob for the first prompt token (nothing precedes it): null there
        "prompt_token_logprobs": [
            None if e is None else _chosen(e, t) for e, t in zip(entries, ids, strict=False)
        ],
        "prompt_top_logprobs": [None if e is None else _top(e, k) for e in entries],
    }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _chosen(entry: Mapping[int, Any] | None, token_id: int) -> float | None:
    """The logprob of the token that was generated (or given) at one position."""
    if not entry or token_id not in entry:
        return None
    return _finite(entry[token_id].logprob)


def _top(entry: Mapping[int, Any] | None, k: int) -> list[dict] | None:
    """The ``k`` most likely tokens at one position, most likely first (vLLM adds the sampled
    token to its top k when it is not among them; it is left out here: see token_logprobs)."""
    if entry is None:
        return None
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank or 0, -item[1].logprob))
    return [
        {"token_id": token_id, "token": lp.decoded_token, "logprob": _finite(lp.logprob), "rank": lp.rank}
        for token_id, lp in ranked[:k]
        if lp.rank is not None and lp.rank <= k
    ]


def choice_probs(choices: Sequence[str], first: Mapping[int, Any] | None) -> list[dict] | None:
    """Each choice's probability, from the first generated position's logprobs.

    The grammar masks every token that starts no choice, so vLLM's logprobs at the first
    position are the constrained distribution, and a token that starts exactly one choice
    commits the output to it. A choice's probability is the mass of the tokens that start only
    it, over the mass of all tokens seen (the top logprobs batchspec asked for). None when a
    token with any mass starts several choices (``yes`` and ``yes please``: the first position
    cannot tell them apart), or when the tokens seen hold less than ``CHOICE_MASS_SEEN`` of the
    mass (the rest could belong to any choice)."""
    if not first:
        return None
    mass = dict.fromkeys(choices, 0.0)
    seen = 0.0
    for lp in first.values():
        p = math.exp(lp.logprob) if lp.logprob is not None and math.isfinite(lp.logprob) else 0.0
        if p <= 0.0:
            continue
        text = lp.decoded_token or ""
        starts = [c for c in choices if text and c.startswith(text)]
        if len(starts) > 1:
            return None
        if starts:
            mass[starts[0]] += p
            seen += p
    if seen < CHOICE_MASS_SEEN:
        return None
    return [{"choice": c, "prob": mass[c] / seen} for c in choices]


def timing_columns(stats, num_output_tokens: int, e2e_s: float | None = None) -> dict[str, float | None]:
    """Per-request timings: queueing, first token and decode from vLLM's RequestStateStats
    (engine clock); end to end from ``e2e_s`` when measured, else first token + decode."""
    if stats is None or not getattr(stats, "first_token_ts", 0):
        return {}
    queued = max(0.0, stats.scheduled_ts - stats.queued_ts) if stats.scheduled_ts else None
    ttft = max(0.0, stats.first_token_latency)
    decode = max(0.0, stats.last_token_ts - stats.first_token_ts)
    return {
        "time_queued_s": queued,
        "time_to_first_token_s": ttft,
        "time_decode_s": decode,
        "time_e2e_s": e2e_s if e2e_s is not None else ttft + decode,
        "output_tokens_per_s": (num_output_tokens - 1) / decode
        if decode > 0 and num_output_tokens > 1
        else None,
    }


def result_row(output, e2e_s: float | None = None, asked: Asked = NOTHING) -> dict:
    """The first sample's row (what a request with ``n: 1`` gives)."""
    return result_rows(output, e2e_s, asked)[0]
