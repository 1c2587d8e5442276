"""vLLM's request outputs as result rows: text, tokens, finish reason, acceptance and timing
columns (batchspec.columns)."""

from __future__ import annotations

import logging

from batchspec.columns import FINISH_REASONS, empty_result
from batchspec.stats import acceptance_rate, mean_acceptance_length

log = logging.getLogger(__name__)




def result_row(output, e2e_s: float | None = None) -> dict:
    """A finished RequestOutput as a result row (the columns of docs/contract.md).

    vLLM's finish reason is kept as it is; ``error`` (the engine failed this request) becomes
    an error row (``generated_text`` null), so it is never mistaken for a success. ``e2e_s`` is
    batchspec's own measure from handing the request to the engine to receiving its end."""
    completion = output.outputs[0]
    row = empty_result()
    num_output = len(completion.token_ids)
    finish = completion.finish_reason or "abort"
    row.update(
        generated_text=completion.text,
        finish_reason=finish,
        num_prompt_tokens=len(output.prompt_token_ids or ()),
        num_output_tokens=num_output,
    )
    if finish == "error":
        row.update(generated_text=None,
                   error=f"engine error: vLLM failed this request after {num_output} output tokens"
                         + (f" ({completion.stop_reason})" if completion.stop_reason else ""))
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
    row.update(timing_columns(output.metrics, num_output, e2e_s))
    return row




def timing_columns(stats, num_output_tokens: int, e2e_s: float | None = None
                   ) -> dict[str, float | None]:
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
        if decode > 0 and num_output_tokens > 1 else None,
    }
