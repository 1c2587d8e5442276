"""The output schema: every column batchspec writes, its type, in one place."""

from __future__ import annotations

import pyarrow as pa

REQUEST_ID = "request_id"
ERROR = "error"

#: The result columns of docs/contract.md, after ``request_id`` and the kept input columns.
#: One candidate token at one position: what ``top_logprobs``/``prompt_top_logprobs`` hold.
TOKEN_LOGPROB = pa.struct([
    pa.field("token_id", pa.int32()),
    pa.field("token", pa.string()),
    pa.field("logprob", pa.float64()),
    pa.field("rank", pa.int32()),
])
#: One choice of a ``choice`` constraint and its probability.
CHOICE_PROB = pa.struct([pa.field("choice", pa.string()), pa.field("prob", pa.float64())])

#: The request-feature columns (samples, LoRA adapter, structured outputs, logprobs): null where the
#: row did not ask for the feature. Files written before they existed lack them; readers
#: (``batchspec report``) take a missing one as all null.
FEATURE_FIELDS: list[pa.Field] = [
    pa.field("sample_index", pa.int32()),
    pa.field("lora_adapter", pa.string()),
    pa.field("structured_valid", pa.bool_()),
    pa.field("structured_error", pa.string()),
    pa.field("choice_probs", pa.list_(CHOICE_PROB)),
    pa.field("cumulative_logprob", pa.float64()),
    pa.field("token_logprobs", pa.list_(pa.float64())),
    pa.field("top_logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),
    pa.field("prompt_token_logprobs", pa.list_(pa.float64())),
    pa.field("prompt_top_logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),
    # the request id of the identical request generated for this row (batchspec/run/twins.py)
    pa.field("twin_of", pa.string()),
]

RESULT_FIELDS: list[pa.Field] = [
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_output_tokens", pa.int32()),
    pa.field("spec_num_steps", pa.int32()),
    pa.field("spec_num_draft_tokens", pa.int32()),
    pa.field("spec_num_accepted_tokens", pa.int32()),
    pa.field("spec_acceptance_rate", pa.float64()),
    pa.field("spec_mean_acceptance_length", pa.float64()),
    pa.field("spec_acceptance_histogram", pa.list_(pa.int32())),
    pa.field("time_queued_s", pa.float64()),
    pa.field("time_to_first_token_s", pa.float64()),
    pa.field("time_decode_s", pa.float64()),
    pa.field("time_e2e_s", pa.float64()),
    pa.field("output_tokens_per_s", pa.float64()),
    *FEATURE_FIELDS,
    pa.field(ERROR, pa.string()),
]

RESULT_NAMES = [f.name for f in RESULT_FIELDS]
FEATURE_NAMES = [f.name for f in FEATURE_FIELDS]
#: The columns every output file has had since the first release.
BASE_RESULT_NAMES = [name for name in RESULT_NAMES if name not in FEATURE_NAMES]
SPEC_COLUMNS = [name for name in RESULT_NAMES if name.startswith("spec_")]
#: Names an input column kept in the output may not have (checked where kept columns are chosen).
OUTPUT_NAMES = frozenset({REQUEST_ID, *RESULT_NAMES})
FINISH_REASONS = ("stop", "length", "abort", "error")


def output_schema(kept: list[pa.Field]) -> pa.Schema:
    """The schema of an output shard: request_id, the kept input columns (chosen by
    :class:`batchspec.io.reader.ShardReader`, never clashing with ``OUTPUT_NAMES``), the result
    columns."""
    return pa.schema([pa.field(REQUEST_ID, pa.string()), *kept, *RESULT_FIELDS])


def error_reason(message: str) -> str:
    """A short category for an error message (the part before the first colon)."""
    return message.split(":", 1)[0].strip()[:60] or "error"


def empty_result() -> dict:
    """A result row with every result column null."""
    return dict.fromkeys(RESULT_NAMES)


def error_result(message: str, num_prompt_tokens: int | None = None) -> dict:
    """A result row for a request that was refused or failed."""
    row = empty_result()
    row.update(finish_reason="error", error=message, num_prompt_tokens=num_prompt_tokens,
               num_output_tokens=0)
    return row
