"""The output schema: every column batchspec writes, its type and (in its ``#:`` comment) its
meaning, in one place; the docs' column reference (docs/reference/columns.md) is generated from
it."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

#: The ``input.id_column`` value (an OpenAI Batch line's ``custom_id``), or
#: ``<shard name>/<row index>``.
REQUEST_ID = "request_id"
ERROR = "error"

#: One candidate token at one position: what ``top_logprobs``/``prompt_top_logprobs`` hold.
TOKEN_LOGPROB = pa.struct(
    [
        pa.field("token_id", pa.int32()),
        pa.field("token", pa.string()),
        pa.field("logprob", pa.float64()),
        pa.field("rank", pa.int32()),
    ]
)
#: One choice of a ``choice`` constraint and its probability.
CHOICE_PROB = pa.struct([pa.field("choice", pa.string()), pa.field("prob", pa.float64())])

#: The request-feature columns (samples, LoRA adapter, structured outputs, logprobs): null where the
#: row did not ask for the feature. Files written before they existed lack them; readers
#: (``batchspec report``) take a missing one as all null.
FEATURE_FIELDS: list[pa.Field] = [
    #: Which of the row's ``n`` samples this is (0 for ``n: 1``).
    pa.field("sample_index", pa.int32()),
    #: The LoRA adapter (a key of ``model.lora.adapters``) the row ran with; null: the base model.
    pa.field("lora_adapter", pa.string()),
    #: Null without a constraint; true when the row finished with ``stop`` and its text satisfies its own
    #: constraint (JSON parsed and validated against its schema, regex matched in full, one of the choices;
    #: a grammar is trusted to vLLM's backend); false otherwise, a row cut by ``max_tokens`` included.
    pa.field("structured_valid", pa.bool_()),
    #: Why ``structured_valid`` is false (``cut before the constraint was complete (finish_reason
    #: length)``, ``not JSON: ...``, ``schema: at PATH: ...``).
    pa.field("structured_error", pa.string()),
    #: ``choice`` rows: each choice's probability, in the order given; from the first output position,
    #: where the grammar leaves only tokens that start a choice: exact when each such token starts one
    #: choice, null when a token starts several (``yes``/``yes please``) or the top 20 logprobs hold less
    #: than 99.9% of the mass.
    pa.field("choice_probs", pa.list_(CHOICE_PROB)),
    #: Reasoning models (``model.reasoning_parser``): the thinking, its markers removed; null when the
    #: model did not think (``enable_thinking: false``). ``generated_text`` is then the answer alone.
    pa.field("reasoning_text", pa.string()),
    #: Reasoning models: output tokens spent thinking, its markers included (0 without thinking).
    pa.field("num_reasoning_tokens", pa.int32()),
    #: Reasoning models: output tokens of the answer (``num_output_tokens - num_reasoning_tokens``);
    #: 0 when the output never left the thinking.
    pa.field("num_answer_tokens", pa.int32()),
    #: Reasoning models with speculation: draft tokens proposed by the verify steps that began inside
    #: the thinking (the answer's are ``spec_num_draft_tokens`` minus these).
    pa.field("spec_reasoning_num_draft_tokens", pa.int32()),
    #: Reasoning models with speculation: draft tokens accepted in those steps.
    pa.field("spec_reasoning_num_accepted_tokens", pa.int32()),
    #: With ``logprobs``: the sum of ``token_logprobs``.
    pa.field("cumulative_logprob", pa.float64()),
    #: With ``logprobs``: the logprob of each generated token.
    pa.field("token_logprobs", pa.list_(pa.float64())),
    #: With ``logprobs: K``: the K most likely tokens at each position, most likely first.
    pa.field("top_logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),
    #: With ``prompt_logprobs``: each prompt token's logprob (null for the first).
    pa.field("prompt_token_logprobs", pa.list_(pa.float64())),
    #: With ``prompt_logprobs: K``: the K most likely tokens at each prompt position.
    pa.field("prompt_top_logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),
    #: The ``request_id`` of an identical request (same prompt or messages, adapter and per-row sampling;
    #: greedy or seeded) whose result this row was given instead of being generated again
    #: (``execution.dedupe_window``, batchspec/run/twins.py); its ``spec_*`` and ``time_*`` columns are
    #: then null.
    pa.field("twin_of", pa.string()),
]

#: The result columns, after ``request_id`` and the kept input columns.
RESULT_FIELDS: list[pa.Field] = [
    #: The generated text; null when the row failed.
    pa.field("generated_text", pa.string()),
    #: vLLM's own: ``stop``, ``length`` or ``abort``; ``error`` for an error row;
    #: ``length_in_reasoning`` for a reasoning model's output cut by ``max_tokens`` while it was still
    #: thinking (its ``generated_text`` is null: there is no answer).
    pa.field("finish_reason", pa.string()),
    #: Tokens in the prompt.
    pa.field("num_prompt_tokens", pa.int32()),
    #: Tokens generated (0 for an error row).
    pa.field("num_output_tokens", pa.int32()),
    #: Verification steps of the target model for this request.
    pa.field("spec_num_steps", pa.int32()),
    #: Draft tokens proposed.
    pa.field("spec_num_draft_tokens", pa.int32()),
    #: Draft tokens accepted.
    pa.field("spec_num_accepted_tokens", pa.int32()),
    #: Accepted / proposed; null when nothing was proposed.
    pa.field("spec_acceptance_rate", pa.float64()),
    #: Tokens per target step, bonus token included: 1 + accepted / steps.
    pa.field("spec_mean_acceptance_length", pa.float64()),
    #: Steps that accepted j = 0..k draft tokens.
    pa.field("spec_acceptance_histogram", pa.list_(pa.int32())),
    #: Waiting in the engine's queue.
    pa.field("time_queued_s", pa.float64()),
    #: Arrival to first output token.
    pa.field("time_to_first_token_s", pa.float64()),
    #: First to last output token.
    pa.field("time_decode_s", pa.float64()),
    #: Arrival to finish, measured by batchspec from handing the request to the engine to receiving its
    #: end.
    pa.field("time_e2e_s", pa.float64()),
    #: This request's decode speed.
    pa.field("output_tokens_per_s", pa.float64()),
    *FEATURE_FIELDS,
    #: Null when the row succeeded; otherwise why (``null prompt``, ``empty prompt``, ``prompt too long:
    #: 700 prompt tokens leave no room for output within max_model_len 512``, ``invalid per-row sampling
    #: override: ... (columns: 'max_tokens' (max_tokens) = -5)``, ``engine error: ...``).
    pa.field(ERROR, pa.string()),
]

#: The columns of a pooling task's output (``task: embed``, ``classify``, ``score``) that every
#: one of them has, after its own.
POOLING_FIELDS: list[pa.Field] = [
    #: Tokens in the prompt (for ``score``, the pair's: a cross-encoder's one request, or both
    #: sides').
    pa.field("num_prompt_tokens", pa.int32()),
    #: Arrival to finish, measured by batchspec from handing the request to the engine to receiving
    #: its end (``score`` with an embedding model: the later of its two sides).
    pa.field("time_e2e_s", pa.float64()),
    #: The ``request_id`` of an identical request whose result this row was given instead of being
    #: computed again (``execution.dedupe_window``); its ``time_*`` columns are then null.
    pa.field("twin_of", pa.string()),
    #: ``stop`` for a result; ``error`` for an error row.
    pa.field("finish_reason", pa.string()),
    #: Null when the row succeeded; otherwise why (``empty prompt``, ``prompt too long: ...``).
    pa.field(ERROR, pa.string()),
]

#: ``task: embed``: the result columns.
EMBED_FIELDS: list[pa.Field] = [
    #: The prompt's embedding, of the model's dimensions (``pooling.dimensions`` where given):
    #: ``fixed_size_list<float32>[N]`` in Parquet and Lance, which polars, DuckDB and Lance read as a
    #: vector; a list of float32 in Delta and Iceberg, which have no fixed-size list.
    pa.field("embedding", pa.list_(pa.float32())),
    *POOLING_FIELDS,
]

#: ``task: classify``: the result columns.
CLASSIFY_FIELDS: list[pa.Field] = [
    #: The most likely class: its name in the model's ``id2label``.
    pa.field("label", pa.string()),
    #: Each class's probability, in the order of the model's ``id2label``.
    pa.field("probs", pa.list_(pa.float32())),
    *POOLING_FIELDS,
]

#: ``task: score``: the result columns.
SCORE_FIELDS: list[pa.Field] = [
    #: The pair's score, as vLLM's ``LLM.score`` gives it: a cross-encoder's one output after
    #: vLLM's activation (a sigmoid: 0 to 1), or the cosine of the two texts' embeddings (an
    #: embedding model).
    pa.field("score", pa.float32()),
    *POOLING_FIELDS,
]

RESULT_NAMES = [f.name for f in RESULT_FIELDS]
FEATURE_NAMES = [f.name for f in FEATURE_FIELDS]
#: The columns every output file has had since the first release.
BASE_RESULT_NAMES = [name for name in RESULT_NAMES if name not in FEATURE_NAMES]
#: The columns every task's output files have (what a committed file is checked for).
COMMON_RESULT_NAMES = [name for name in BASE_RESULT_NAMES if name in {f.name for f in POOLING_FIELDS}]
SPEC_COLUMNS = [name for name in RESULT_NAMES if name.startswith("spec_")]
#: Names an input column kept in the output may not have (checked where kept columns are chosen).
OUTPUT_NAMES = frozenset({REQUEST_ID, *RESULT_NAMES})
#: The finish reason of a reasoning model's output cut by ``max_tokens`` while it was still thinking.
LENGTH_IN_REASONING = "length_in_reasoning"
FINISH_REASONS = ("stop", "length", "abort", "error", LENGTH_IN_REASONING)


def output_schema(kept: list[pa.Field], result_fields: Sequence[pa.Field] | None = None) -> pa.Schema:
    """The schema of an output shard: request_id, the kept input columns (chosen by
    :class:`batchspec.io.reader.ParquetReader`, never clashing with ``OUTPUT_NAMES``), the result
    columns: its task's (:attr:`batchspec.tasks.Task.result_fields`), generation's by default."""
    results = RESULT_FIELDS if result_fields is None else result_fields
    return pa.schema([pa.field(REQUEST_ID, pa.string()), *kept, *results])


def error_reason(message: str) -> str:
    """A short category for an error message (the part before the first colon)."""
    return message.split(":", 1)[0].strip()[:60] or "error"


def empty_result() -> dict:
    """A result row with every result column null."""
    return dict.fromkeys(RESULT_NAMES)


def error_result(message: str, num_prompt_tokens: int | None = None) -> dict:
    """A result row for a request that was refused or failed."""
    row = empty_result()
    row.update(finish_reason="error", error=message, num_prompt_tokens=num_prompt_tokens, num_output_tokens=0)
    return row
