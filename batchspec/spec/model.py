"""The job spec as typed objects: one dataclass per section, each field with its default and
meaning. Every default lives here (spec/build.py reads them from these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from batchspec.redact import public_spec
from batchspec.redact import secret_values as _secret_values
from batchspec.tasks import TaskName

# Every choice a key offers is a Literal type on its field: spec/build.py checks each value
# against its field's type, in one place.

#: Input formats (``input.format``): files (``parquet``, ``jsonl``; ``openai``: OpenAI Batch
#: request files) or tables (``delta``, ``iceberg``, ``lance``). Each one is a class in
#: batchspec/io/input_formats.py.
InputFormatName = Literal["parquet", "jsonl", "openai", "delta", "iceberg", "lance"]
INPUT_FORMATS: tuple[InputFormatName, ...] = get_args(InputFormatName)
#: Output formats (``output.format``): ``parquet`` (the contract's columns, one file a
#: shard), ``openai`` (OpenAI Batch result and error files, batchspec/io/openai_results.py),
#: ``delta`` or ``iceberg`` (the Parquet files appended to a table, batchspec/io/tables.py).
#: ``lance`` (Lance fragments appended to a dataset, batchspec/io/lance.py).
#: Each one is a class in batchspec/io/output_formats.py.
OutputFormatName = Literal["parquet", "openai", "delta", "iceberg", "lance"]
OUTPUT_FORMATS: tuple[OutputFormatName, ...] = get_args(OutputFormatName)
#: What a run does with an unreadable shard (``input.on_bad_shard``).
OnBadShard = Literal["fail", "skip"]
#: Where a job's shards run (``executor.kind``): ``local`` (this process's one engine) or
#: ``ray`` (replicas).
ExecutorKind = Literal["local", "ray"]
EXECUTOR_KINDS: tuple[ExecutorKind, ...] = get_args(ExecutorKind)

#: SamplingParams fields a row may override from its own column (``input.sampling_columns``).
ROW_OVERRIDABLE = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "n",
    "logprobs",
    "prompt_logprobs",
    # reasoning models (model.reasoning_parser): the thinking's token budget, and the keyword
    # arguments of the chat template (JSON text or a struct), such as ``enable_thinking``
    "thinking_token_budget",
    "chat_template_kwargs",
    # a row's structured-outputs constraint: the whole mapping (JSON text or a struct), or one
    # field of it (batchspec.engine.structured)
    "structured_outputs",
    "structured_outputs.json",
    "structured_outputs.regex",
    "structured_outputs.choice",
    "structured_outputs.grammar",
)


@dataclass(frozen=True)
class InputSpec:
    """Where the prompts are and how to read them."""

    #: fsspec URLs of the input shards: one path or glob (local, s3://, gs://, az://, memory://),
    #: or a list of them. Listing never picks up files under ``output.path``. With ``format:
    #: delta``: the table's root, one URL without wildcards; with ``format: iceberg``: none (the
    #: catalog knows where the table is).
    paths: tuple[str, ...]
    #: ``parquet``, ``jsonl`` (JSON lines, plain or .gz/.zst) or ``openai`` (OpenAI Batch request
    #: files, whose lines name their prompt, id and sampling); ``delta`` (a Delta Lake table at
    #: ``path``, read with delta-rs) or ``iceberg`` (the Iceberg table ``table`` of ``catalog``,
    #: read with pyiceberg): each data file of the table is a shard. None: each file's name
    #: says: ``*.jsonl`` and ``*.ndjson`` (plain, ``.gz`` or ``.zst``) are JSON lines, a
    #: ``.json`` file needs ``jsonl`` (it may be one JSON document), any other name is Parquet,
    #: and a compressed one is refused naming this key.
    format: InputFormatName | None = None
    #: ``format: iceberg``: the table, ``NAMESPACE.TABLE`` (a nested namespace's parts dotted).
    table: str | None = None
    #: ``format: iceberg``: the catalog's properties as pyiceberg takes them (``type: sql``,
    #: ``uri: sqlite:///...``, ``warehouse``; ``type: rest`` or ``glue`` and their keys, the
    #: FileIO's ``s3.*`` keys); credential-like keys are ``***`` wherever batchspec writes.
    catalog: dict[str, Any] = field(default_factory=dict)
    #: ``format: delta``: the table version to read. None: the version this job pinned when it
    #: first planned, until every data file of it is committed; then the latest when a run
    #: starts (docs/tables.md).
    version: int | None = None
    #: ``format: iceberg``: the snapshot id to read; None: pinned as ``version`` is.
    snapshot: int | None = None
    #: Tables only: one row predicate in the table library's own syntax, pushed down: a SQL
    #: predicate for ``delta`` (polars' SQL: files pruned on their partition values, rows
    #: filtered as they are read, both by polars); a pyiceberg ``row_filter``
    #: string for ``iceberg`` (``lang == 'en' and len > 3``). None: every row.
    filter: str | None = None
    #: Column holding the text prompt (exclusive with ``messages_column``; give exactly one of
    #: the two, and neither with ``format: openai``).
    prompt_column: str | None = None
    #: Column holding chat messages (list of {role, content}), rendered by the chat template.
    messages_column: str | None = None
    #: A Jinja2 template over the row's columns that renders its text prompt (``Classify:
    #: {{ subject }} / {{ body }}``), in a sandbox (batchspec/io/templates.py). Give exactly one
    #: of this, ``messages_template``, ``prompt_column`` and ``messages_column``; refused with
    #: ``format: openai``. A column it names that the input lacks exits 2; a null cell is an error
    #: row naming the column unless the template gives a default (``{{ x | default('n/a') }}``).
    prompt_template: str | None = None
    #: Chat messages from templates: a list of ``{role, content}``, each ``content`` a Jinja2
    #: template over the row's columns as ``prompt_template`` (``role`` as written), rendered by
    #: the target's chat template.
    messages_template: tuple[dict[str, str], ...] | None = None
    #: Column holding a row's id; default id is ``<shard name>/<row index>``.
    id_column: str | None = None
    #: Column naming the LoRA adapter (a key of ``model.lora.adapters``) a row runs with; null
    #: keeps ``model.lora.adapter`` (the base model when that is unset too).
    lora_column: str | None = None
    #: SamplingParams field -> input column that overrides it per row (null keeps the job value).
    sampling_columns: dict[str, str] = field(default_factory=dict)
    #: Handed to fsspec as is (endpoint, credentials, ...); every value is ``***`` wherever
    #: batchspec writes.
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: ``fail``: an unreadable shard exits 3; ``skip``: it is recorded in the run summary.
    on_bad_shard: OnBadShard = "fail"
    #: An input path or glob that matches no file is fine: the run exits 0 with a summary
    #: (for scheduled jobs whose input may be empty some days). False: it is bad input data.
    allow_empty: bool = False
    #: Bytes a line of a JSON-lines or OpenAI Batch file may have (its line end not counted): a
    #: longer line is one error row, read past in constant memory (batchspec/io/jsonl.py).
    max_line_bytes: int = 64 * 2**20
    #: ``task: score``: the two text columns of each pair, ``[query, document]`` (instead of
    #: ``prompt_column``); a null or empty side is that row's error.
    pair_columns: tuple[str, str] | None = None
    #: ``task: score``: each side of a pair rendered from the row's columns, ``[query template,
    #: document template]``, two Jinja2 templates as ``prompt_template`` (the same sandbox and
    #: rules); give this or ``pair_columns``, not both. A column a template reads unguarded that
    #: the input lacks exits 2; a null cell, or a side that renders empty, is that row's error.
    pair_templates: tuple[str, str] | None = None
    #: Columns holding each row's images, put before its prompt text in one user message (the
    #: first user message of chat messages) and rendered by the target's chat template: a cell
    #: is the image's bytes (Parquet ``binary``), a URL (a local path, ``s3://``, ``gs://``,
    #: ``az://``, ``memory://`` under ``image_roots``, or a ``data:`` URL), or a list of them.
    #: Needs a vision-language target (docs/images.md); a bad image is that row's error.
    image_columns: tuple[str, ...] = ()
    #: Locations an image URL may name (a row's ``image_columns`` cell or an ``image_url``
    #: part of its messages), read with ``storage_options``, never written; none of them may
    #: overlap ``output.path``. An image URL outside all of them, or of another scheme
    #: (``http://`` is never fetched), is that row's error.
    image_roots: tuple[str, ...] = ()
    #: Bytes an image may have (encoded, as stored); a larger one is that row's error.
    max_image_bytes: int = 20 * 2**20
    #: Pixels an image may have (width times height, read from its header before it is
    #: decoded: a small file that decodes to gigabytes is refused unread).
    max_image_pixels: int = 2**25

    @property
    def text_column(self) -> str | None:
        """The column the prompt comes from, whichever kind it is (None with a template)."""
        return self.prompt_column or self.messages_column

    @property
    def templated(self) -> bool:
        """Whether prompts are rendered from a template over the row's columns."""
        return (
            self.prompt_template is not None
            or self.messages_template is not None
            or self.pair_templates is not None
        )


@dataclass(frozen=True)
class OutputSpec:
    """Where results go."""

    #: Directory URL; may be on another filesystem than the input, but never equal to, inside
    #: or containing an input location (exit 2).
    path: str
    #: Input columns copied to the output; None keeps all but the prompt/messages column. JSON
    #: lines: typed from the first ``execution.read_batch_rows`` records; OpenAI Batch files: each
    #: line's ``url`` and ``model``.
    keep_columns: tuple[str, ...] | None = None
    #: Handed to fsspec as is; every value is ``***`` wherever batchspec writes.
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: Rows per Parquet row group; results are written as they complete, in groups this size.
    row_group_rows: int = 1024
    #: Parquet compression codec.
    compression: str = "zstd"
    #: ``parquet`` (the contract's columns) or ``openai`` (OpenAI Batch result and error files
    #: per input file, for ``input.format: openai``; batchspec/io/openai_results.py). ``openai``
    #: needs ``input.format: openai`` and refuses ``keep_columns``, ``row_group_rows`` and
    #: ``compression``. ``delta`` appends to the Delta Lake table at ``path``; ``iceberg`` to
    #: the Iceberg table ``table`` of ``catalog``, located at ``path`` (docs/tables.md).
    format: OutputFormatName = "parquet"
    #: ``format: iceberg``: the table, ``NAMESPACE.TABLE``; created (at ``path``) on first write.
    table: str | None = None
    #: ``format: iceberg``: the catalog's properties as pyiceberg takes them (see
    #: ``input.catalog``).
    catalog: dict[str, Any] = field(default_factory=dict)
    #: Tables only: shards committed to the table together, so that a job of many shards makes
    #: one table version per this many (fewer at the end of a run, or once the first of them
    #: has waited ``commit_interval_s``).
    commit_shards: int = 16
    #: Tables only: seconds a finished shard may wait for others before its group is committed.
    commit_interval_s: float = 60.0
    #: Write each structured answer as a typed column ``answer``: with a JSON schema in
    #: ``sampling.structured_outputs.json``, an Arrow struct (or the type) derived from the schema;
    #: with ``choice``, the chosen label as text; with per-row constraints
    #: (``input.sampling_columns``), JSON text. Null where ``structured_valid`` is not true. It
    #: makes JSON compact (``model.engine.structured_outputs_config.disable_any_whitespace``)
    #: unless the job sets that key. Needs a ``json`` or ``choice`` constraint; refused with
    #: ``format: openai`` (its body's content is the JSON already). docs/templates.md.
    parse_json: bool = False


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of the target (``model.lora``): vLLM loads each on first use, and each
    request runs with the adapter its row names, or the base model."""

    #: Adapter name -> local directory in PEFT's format, or a model id (as ``LoRARequest`` takes).
    adapters: dict[str, str]
    #: The adapter every row runs with unless its ``input.lora_column`` names another; None:
    #: the base model.
    adapter: str | None = None
    #: vLLM's ``max_loras``: adapters in one batch. None: as many as there are adapters.
    max_loras: int | None = None
    #: vLLM's ``max_lora_rank``. None: the smallest rank vLLM offers that fits the largest
    #: ``r`` of the local adapters (16 where none is local).
    max_lora_rank: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """The target model and how vLLM runs it."""

    #: Local path or model id, as ``vllm.LLM(model=...)`` takes it.
    target: str
    #: ``vllm.LLM`` keyword arguments (max_model_len, dtype, tensor_parallel_size, ...), checked
    #: against vLLM's ``EngineArgs`` before any weights load. ``model``, ``speculative_config``,
    #: ``enable_lora``, ``max_loras`` and ``max_lora_rank`` come from other keys (``model.target``,
    #: ``speculative``, ``model.lora``).
    engine: dict[str, Any] = field(default_factory=dict)
    #: LoRA adapters rows may run with; None: LoRA off.
    lora: LoraSpec | None = None
    #: A reasoning model's parser, by vLLM's name for it (``qwen3``, ``deepseek_r1``,
    #: ``openai_gptoss``, ...; checked against vLLM's registry and the tokenizer before any weights
    #: load). Each output is split into ``reasoning_text`` and the answer (``generated_text``), a
    #: structured-outputs constraint applies to the answer only, and ``thinking_token_budget`` may be
    #: set. See [Reasoning models](../reasoning.md).
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class ExecutionSpec:
    """How the runner feeds the engine."""

    #: Sequences handed to the engine at once (a row asking for ``n`` samples counts ``n``);
    #: refilled as requests finish. A row with more samples than this runs alone.
    max_in_flight: int = 512
    #: The most samples (``n``) one row may ask for, job-wide or per row; more is refused (exit 2
    #: for ``sampling.n``, an error row for a per-row ``n``). 128 is OpenAI's own limit.
    max_n: int = 128
    #: Rows per record batch read from a shard.
    read_batch_rows: int = 1024
    #: Seconds between progress log lines when not at a terminal (``--progress-interval``).
    progress_interval_s: float = 30.0
    #: Seconds a run stopped by SIGTERM may spend finishing its in-flight requests (and
    #: committing the shards they complete) before it aborts them; 0 aborts at once
    #: (``--grace-seconds``).
    grace_s: float = 30.0
    #: Seconds after which a shard lease that was not renewed counts as abandoned and another
    #: process may take the shard over.
    lease_s: float = 120.0
    #: Identical requests (same prompt or messages, adapter and per-row sampling; greedy or
    #: seeded) within this many are generated once, the result written to each (``twin_of``);
    #: 0 generates every row (batchspec/run/twins.py).
    dedupe_window: int = 10000
    #: Bytes (estimated) the results kept for later identical requests may hold; the least
    #: recently used go first, and a later twin of one is generated again. 64 MiB keeps the
    #: whole default window of single-sample results of a thousand characters (about 2 KB
    #: each with the row's other columns; 20 MB for 10,000) and bounds what large ``n`` or
    #: long outputs would keep (about 500 results at n = 64), small beside the engine's own
    #: memory. 0 keeps no finished result (twins of a request in flight are still served).
    dedupe_max_bytes: int = 64 * 2**20
    #: Rows of a shard sent this many at a time, each window sorted by LoRA adapter and prompt
    #: text, so rows sharing a prefix go to the engine together and its prefix cache serves
    #: them; the engine holds a request whose first cache block another request is computing
    #: until that one's prefill ran. 0: file order, no holding (batchspec/run/prefixes.py).
    prefix_window: int = 1024
    #: Times the engine may be started again in one run (per Ray replica) after it died (a
    #: process killed, a fault in vLLM): the requests it had are sent again to the new one, and
    #: a request that kills it twice is found and written as an error row (quarantine searches
    #: cost restarts beyond these: [What is guaranteed](../guarantees.md#an-engine-that-dies-is-restarted)).
    #: One death more ends the run (exit 1); 0: the first death does.
    engine_restarts: int = 3


@dataclass(frozen=True)
class AutoSpeculation:
    """``speculative: auto`` / ``speculative: {method: auto, drafts: [...]}``: the run measures
    speculation off and these candidates on a seeded sample of its pending rows before the first
    shard, runs with the fastest, and keeps the choice under the output's ``_batchspec/auto/``
    for the next run (batchspec/tune/auto.py)."""

    #: Draft models and EAGLE heads to try, each at every k in ``k`` (each with the method its
    #: checkpoint's ``config.json`` calls for: ``draft_model``, ``eagle3`` or ``eagle``).
    drafts: tuple[str, ...] = ()
    #: num_speculative_tokens tried for each draft (its largest, smallest and, of four or more,
    #: middle measured, the rest predicted from those; the best predicted one measured too).
    k: tuple[int, ...] = (1, 2, 3, 4)
    #: Try n-gram (prompt lookup) speculation, which needs no draft model, with k 2 and 4.
    ngram: bool = True
    #: Rows in the seeded sample of the pending rows the candidates are timed on.
    sample: int = 64
    #: Seed of the sample.
    seed: int = 0
    #: Requests in flight to measure at; None: the job's own (``model.engine.max_num_seqs``,
    #: else ``execution.max_in_flight``). Several levels give vLLM a per-batch-size k where one
    #: draft wins at every level.
    concurrency: tuple[int, ...] | None = None
    #: Minutes the measuring may take before the run goes on with the best measured so far.
    max_minutes: float = 10.0
    #: Measure again even where a stored choice matches (``batchspec run --remeasure`` too).
    remeasure: bool = False
    #: After the drafters, measure ``model.engine.max_num_seqs`` (with
    #: ``execution.max_in_flight``) and ``max_num_batched_tokens`` for the choice, around the
    #: job's values (up to three more engines), and run with those that beat the noise;
    #: ``false`` runs with the job's own.
    batch_knobs: bool = True


@dataclass(frozen=True)
class ExecutorSpec:
    """Where the shards run (``executor:``); never part of the output's fingerprint: a job run
    locally and on Ray writes the same files, and either may resume the other."""

    #: ``local``: one engine in this process; ``ray``: ``replicas`` Ray actors, one engine each
    #: (``--executor``).
    kind: ExecutorKind = "local"
    #: Ray actors, each holding one vLLM engine (tensor/pipeline parallel stay engine args).
    replicas: int = 1
    #: Ray resources each replica reserves: ``CPU``, ``GPU``, or custom resource names.
    resources_per_replica: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    #: The Ray cluster to join (``ray://host:10001``, ``auto``); unset starts a local one
    #: (``--ray-address``).
    ray_address: str | None = None
    #: Tries a shard gets when the replica running it dies, before it is reported failed.
    max_shard_attempts: int = 3


#: The job's name where the spec gives none.
DEFAULT_JOB_NAME = "batchspec"


@dataclass(frozen=True)
class JobSpec:
    """A whole job, validated. ``raw`` is the resolved YAML mapping it was built from."""

    #: The job's name, in its events, run summaries, output metadata and reports.
    name: str
    input: InputSpec
    output: OutputSpec
    model: ModelSpec
    #: vLLM ``speculative_config``, passed through and checked against vLLM's
    #: ``SpeculativeConfig`` before any weights load; None turns speculative decoding off. A
    #: ``model`` with no ``method`` gets the method its checkpoint's ``config.json`` calls for
    #: (``eagle3`` or ``eagle`` for a head, else ``draft_model``); ``auto`` (or ``method: auto``)
    #: lets the run choose (``speculative: auto`` below).
    speculative: dict[str, Any] | None
    #: ``vllm.SamplingParams`` keyword arguments, job-wide, checked against vLLM's
    #: ``SamplingParams`` before any weights load.
    sampling: dict[str, Any]
    execution: ExecutionSpec
    raw: dict[str, Any] = field(repr=False, compare=False)
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)
    #: ``speculative: auto``: what the run chooses ``speculative`` from (then None until chosen;
    #: the chosen spec keeps this, so the run knows the choice was automatic).
    speculative_auto: AutoSpeculation | None = None
    #: What the job does with each row: ``generate`` text; or, with vLLM's pooling runner,
    #: ``embed`` (a vector a row), ``classify`` (a sequence classifier's label and probabilities)
    #: or ``score`` (each pair of texts scored: by a cross-encoder, a sequence classifier of one
    #: label, or by the cosine of the two texts' embeddings).
    #: A pooling task has no decoding: ``speculative`` and ``sampling`` are refused with it
    #: (docs/pooling.md).
    task: TaskName = "generate"
    #: A pooling task's ``vllm.PoolingParams`` keyword arguments, job-wide (``dimensions``,
    #: ``use_activation``), checked against vLLM's ``PoolingParams`` before any weights load.
    pooling: dict[str, Any] = field(default_factory=dict)
    #: ``task: embed`` and ``score``: the embedding's size, from ``pooling.dimensions`` or the
    #: model's ``config.json`` (``hidden_size``); None for the other tasks.
    dimensions: int | None = None
    #: ``task: score``: whether the model is a cross-encoder (a ``*ForSequenceClassification`` of
    #: one label in its ``config.json``), which reads both texts in one request; else each text is
    #: embedded. Found when the spec is built, never given.
    cross_encoder: bool = False

    def public(self) -> dict[str, Any]:
        """The resolved spec as it may be persisted or logged (:func:`batchspec.redact.public_spec`):
        no storage options, credentials, URL userinfo or query strings."""
        return public_spec(self.raw)

    def secret_values(self) -> set[str]:
        """The values :meth:`public` hides, for :func:`batchspec.redact.scrub_text`."""
        return _secret_values(self.raw)
