"""Distill's data: a seeded sample of the job's prompts, split into training and held-out rows,
and the target's continuations of the training rows, generated through the engine and kept in
Parquet chunks so that a killed run restarts where it stopped.

Generated rows live in ``<work>/generated-<key>/part-NNNNN-<unique>.parquet`` (``<work>`` is the
private directory beside ``--out``, see :func:`batchspec.distill.outdir.work_dir`); ``key`` hashes what
the rows depend on (target, sampling, top-K, the sampled request ids), so a run with other
settings never mixes its rows with these. Each chunk is written under a temporary name of its
own, fsynced and renamed, so two writers never share a file; a chunk that cannot be read back
(a torn file) is deleted with a warning and its rows are generated again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.errors import SpecError
from batchspec.io import reader as prompts
from batchspec.io.output_dir import fsync_dir, replace_durably
from batchspec.io.reader import Row
from batchspec.spec.model import JobSpec

#: Generated rows committed per Parquet chunk: what a killed run can lose at most.
CHUNK_ROWS = 128


GENERATED_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        # per output token: the target's top-K token ids and log-probabilities (null without --logprobs)
        ("topk_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("finish_reason", pa.string()),
    ]
)


@dataclass
class Sample:
    """The seeded sample of a job's prompts: rows to train on, rows whose continuations judge
    the training as it goes (validation, never trained on) and rows held out for the acceptance
    evaluation."""

    train: list[Row]
    heldout: list[Row]
    #: Rows read from the job's input (the population the sample was drawn from).
    population: int
    validation: list[Row] = field(default_factory=list)


# --------------------------------------------------------------------------- how much data

#: Each training window is trained on at most this many times on average (epochs): more steps
#: than the data supports are cut (:func:`supported_steps`). Sixteen, not four: the validation
#: acceptance keeps the best weights and stops a run that overfits, and a small job's few
#: windows gained more from more passes than from longer continuations (BENCHMARKS.md).
MAX_EPOCHS = 16

#: At least one of the target's tokens per this many parameters of the model being trained.
PARAMS_PER_TOKEN = 32

#: A continuation is at most this many windows (of the job's ``max_tokens``) long: one, the
#: job's own length. Measured (BENCHMARKS.md, "Distill on a small job"): longer continuations
#: are another distribution (a code model's tail on prose repeats itself), and on the two
#: domains measured one window and more passes gained as much or more in less time.
MAX_WINDOWS = 1

#: The same for a new EAGLE-3 head (distill without ``--head``): eight. A head starts with
#: nothing learnt but its output layer, and on a small job one window a prompt left it short of
#: data and below the draft; eight bring it to about the draft's figure (benchmarks/head_job.py;
#: the figures are in BENCHMARKS.md, "A head on a small job").
NEW_HEAD_WINDOWS = 8

#: vLLM's ``max_tokens`` when the job sets none.
VLLM_DEFAULT_MAX_TOKENS = 16


def job_window(spec: JobSpec) -> int:
    """Target tokens per training window: the job's ``max_tokens`` (what a draft meets when the
    job runs), vLLM's default where the job sets none."""
    return max(1, int(spec.sampling.get("max_tokens") or VLLM_DEFAULT_MAX_TOKENS))


@dataclass
class DataPlan:
    """How long the target's continuations are, sized to the steps and the model trained."""

    #: Target tokens per training window (the job's max_tokens).
    window: int
    #: Windows generated per prompt (the continuation is ``window * windows`` tokens long).
    windows: int
    #: What the rule asks for: max(steps x batch x window / MAX_EPOCHS, parameters / PARAMS_PER_TOKEN).
    wanted_tokens: int
    #: The training prompts' tokens at ``windows`` windows each (before any continuation ends early).
    planned_tokens: int

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def plan_data(
    steps: int, batch_size: int, window: int, prompts: int, parameters: int, max_windows: int = MAX_WINDOWS
) -> DataPlan:
    """The sizing rule: the target's tokens to train on must be at least
    ``steps x batch_size x window / MAX_EPOCHS`` (no window trained on more than MAX_EPOCHS
    times on average) and at least ``parameters / PARAMS_PER_TOKEN``; continuations grow, a
    window of ``window`` tokens at a time, up to ``max_windows`` windows (the trainer's:
    :data:`MAX_WINDOWS`, :data:`NEW_HEAD_WINDOWS`), until the training prompts give that many."""
    wanted = max(
        math.ceil(steps * batch_size * window / MAX_EPOCHS), math.ceil(parameters / PARAMS_PER_TOKEN)
    )
    per_window = max(1, prompts) * window
    windows = min(max_windows, max(1, math.ceil(wanted / per_window)))
    return DataPlan(window=window, windows=windows, wanted_tokens=wanted, planned_tokens=per_window * windows)


def supported_steps(examples: int, batch_size: int, steps: int) -> int:
    """The steps ``examples`` training windows support: each trained on at most MAX_EPOCHS
    times on average (at least 1, at most ``steps``)."""
    return max(1, min(steps, examples * MAX_EPOCHS // max(1, batch_size)))


def validation_size(train: int) -> int:
    """Prompts of the training sample kept for validation: a tenth, at least 2, at most 200;
    none below 10 prompts (they would leave too few to train on)."""
    return 0 if train < 10 else min(200, max(2, train // 10))


def split_validation(sample: Sample, size: int) -> Sample:
    """Take ``size`` rows of the training rows for validation (the sample is already seeded
    and shuffled by its reservoir)."""
    size = max(0, min(size, len(sample.train) // 2))
    return dataclasses.replace(
        sample, train=sample.train[size:], validation=[*sample.validation, *sample.train[:size]]
    )


#: The held-out share of the sample when ``--holdout`` is not given, and its most prompts: a
#: small job keeps four fifths of its prompts to train on.
HELDOUT_SHARE, MAX_HELDOUT = 5, 200


def heldout_size(sample: int, asked: int | None) -> int:
    """Prompts held out of a sample of ``sample``: ``asked`` (``--holdout``), else a fifth of
    it, at most :data:`MAX_HELDOUT`; never more than half."""
    wanted = min(MAX_HELDOUT, sample // HELDOUT_SHARE) if asked is None else asked
    return max(0, min(wanted, sample // 2))


def draw_sample(spec: JobSpec, size: int, heldout: int | None, seed: int) -> Sample:
    """Draw ``size`` rows from the job's input (``prompts.sample_rows``: seeded, one pass, memory
    for ``size`` rows only), then hold out :func:`heldout_size` of them. Rows the runner would
    refuse (empty prompt, malformed messages) are left out."""
    reservoir, seen = prompts.sample_rows(spec, size, seed)
    if any(row.images for row in reservoir):  # image_url parts of chat messages
        raise SpecError(
            "input.messages_column",
            "rows with images (image_url parts): batchspec distill trains drafters on text and "
            "would never show them the images (docs/images.md)",
        )
    held = heldout_size(len(reservoir), heldout)
    return Sample(train=reservoir[held:], heldout=reservoir[:held], population=seen)


def generation_key(spec: JobSpec, rows: list[Row], logprobs: int, windows: int = 1) -> str:
    """A short hash of everything the generated rows depend on."""
    h = hashlib.sha256()
    key = {
        "target": spec.model.target,
        "engine": spec.model.engine,
        "sampling": spec.sampling,
        "logprobs": logprobs,
        "sampling_columns": spec.input.sampling_columns,
    }
    if windows != 1:
        key["windows"] = windows
    if spec.model.lora is not None:  # rows generated with an adapter are that adapter's text
        key["lora"] = [dataclasses.asdict(spec.model.lora), spec.input.lora_column]
    h.update(json.dumps(key, sort_keys=True, default=str).encode())
    for row in rows:
        h.update(row.request_id.encode() + b"\0")
    return h.hexdigest()[:16]


def _warn(msg: str) -> None:
    print(f"batchspec distill: {msg}", file=sys.stderr, flush=True)


def read_generated(directory: Path, warn: Callable[[str], None] | None = None) -> pa.Table | None:
    """All committed chunks of a generation folder as one table (None if there are none).

    A chunk that cannot be read back as generated rows (torn, truncated, another schema) is
    deleted with a warning: its rows are missing again and the next generation makes them.
    A request id found in two chunks counts once (the first chunk by name)."""
    warn = warn or _warn
    parts = sorted(directory.glob("part-*.parquet")) if directory.is_dir() else []
    tables = []
    for part in parts:
        try:
            tables.append(pq.read_table(part, schema=GENERATED_SCHEMA))
        except FileNotFoundError:
            continue
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a torn file
            warn(
                f"generated chunk {part} cannot be read ({type(exc).__name__}: {exc}): "
                "deleted, its rows will be generated again"
            )
            part.unlink(missing_ok=True)
    if not tables:
        return None
    table = pa.concat_tables(tables)
    ids = table.column("request_id").to_pylist()
    seen: set[str] = set()
    keep = [i for i, rid in enumerate(ids) if not (rid in seen or seen.add(rid))]
    if len(keep) < table.num_rows:
        table = table.take(pa.array(keep, pa.int64()))
    return table


def remove_temporary_files(directory: Path) -> int:
    """Delete chunk files that were never committed (a killed run's ``.part-*.tmp``). Only for
    the holder of the ``--out`` lock: nobody else writes there."""
    removed = 0
    if directory.is_dir():
        for tmp in directory.glob(".part-*.tmp"):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


def _write_chunk(directory: Path, rows: list[dict]) -> Path:
    """Commit one chunk: written under a temporary name no other writer uses, fsynced, renamed
    to a name no other writer uses, and the rename made durable (a reader never sees half, and
    two writers never write, rename or overwrite each other's file)."""
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(str(directory.parent))
    index = len(list(directory.glob("part-*.parquet")))  # for people: roughly in order
    path = directory / f"part-{index:05d}-{os.getpid()}-{os.urandom(6).hex()}.parquet"
    tmp = directory / f".{path.name}.tmp"
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), tmp)
        replace_durably(str(tmp), str(path))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@dataclass
class Generated:
    """The target's continuations of the training rows."""

    table: pa.Table
    #: Rows generated by this call (the rest were read back from an earlier run's chunks).
    generated_rows: int
    reused_rows: int
    failed_rows: int
    wall_s: float
    directory: Path


def generate(
    spec: JobSpec,
    rows: list[Row],
    directory: Path,
    logprobs: int,
    progress: Callable[[str], None] | None = None,
    interval_s: float = 10.0,
    chunk_rows: int = CHUNK_ROWS,
    windows: int = 1,
) -> Generated:
    """Generate the target's continuations of ``rows`` with speculation off and the job's
    sampling, through the same streaming engine loop as ``run``; rows already committed in
    ``directory`` are not generated again (a torn chunk's rows are). The caller holds the
    ``--out`` lock. The table comes back in the order of ``rows``, whatever the chunks'.
    ``windows``: continuations that many times the job's ``max_tokens`` long (:func:`plan_data`)."""
    say = progress or (lambda msg: None)
    remove_temporary_files(directory)
    done = read_generated(directory, warn=say)
    done_ids = set(done.column("request_id").to_pylist()) if done is not None else set()
    todo = [r for r in rows if r.request_id not in done_ids]
    started = time.monotonic()
    failed = 0
    if todo:
        say(
            f"generating the target's continuations of {len(todo)} prompts"
            + (f" ({len(done_ids)} already generated, reused)" if done_ids else "")
        )
        failed = _generate_missing(spec, todo, directory, logprobs, say, interval_s, chunk_rows, windows)
    else:
        say(f"all {len(done_ids)} continuations already generated in {directory}: reused")
    table = read_generated(directory, warn=say)
    if table is None:
        table = GENERATED_SCHEMA.empty_table()
    wanted = {r.request_id: i for i, r in enumerate(rows)}
    ids = table.column("request_id").to_pylist()
    keep = sorted((i for i, rid in enumerate(ids) if rid in wanted), key=lambda i: wanted[ids[i]])
    table = table.take(pa.array(keep, pa.int64()))
    return Generated(
        table=table,
        generated_rows=table.num_rows - len(done_ids & wanted.keys()),
        reused_rows=len(done_ids & wanted.keys()),
        failed_rows=failed,
        wall_s=time.monotonic() - started,
        directory=directory,
    )


#: Sampling fields a job may set that distill's generation replaces: one sample per prompt
#: (the target's distribution, which a draft learns), distill's own ``--logprobs``, no prompt
#: logprobs (never trained on).
DISTILL_REPLACES = ("n", "logprobs", "prompt_logprobs")


def generation_request(
    spec: JobSpec, rows: list[Row], logprobs: int, windows: int = 1
) -> tuple[JobSpec, list[Row]]:
    """The spec and rows distill generates the target's outputs with: the job's own sampling,
    structured outputs included (a draft for a JSON-extraction job learns its JSON), speculation
    off, one sample per prompt, top-``logprobs`` only when distill asks for them; the rows'
    own ``n``/``logprobs``/``prompt_logprobs`` columns give way the same way. With ``windows``
    above 1, ``max_tokens`` (the job's and each row's own) is that many times longer."""
    sampling = {k: v for k, v in spec.sampling.items() if k not in DISTILL_REPLACES}
    sampling["n"] = 1
    if logprobs:
        sampling["logprobs"] = logprobs
    if windows != 1:
        sampling["max_tokens"] = job_window(spec) * windows
    columns = {k: v for k, v in spec.input.sampling_columns.items() if k not in DISTILL_REPLACES}
    gen_spec = dataclasses.replace(
        spec,
        speculative=None,
        sampling=sampling,
        input=dataclasses.replace(spec.input, sampling_columns=columns),
    )
    rows = [_generation_row(row, windows) for row in rows]
    return gen_spec, rows


def _generation_row(row: Row, windows: int) -> Row:
    """A row's own sampling as distill generates it (see :func:`generation_request`)."""
    own_length = windows != 1 and isinstance(row.overrides.get("max_tokens"), int)
    if not own_length and not any(k in row.overrides for k in DISTILL_REPLACES):
        return row
    overrides = {k: v for k, v in row.overrides.items() if k not in DISTILL_REPLACES}
    if own_length:
        overrides["max_tokens"] = row.overrides["max_tokens"] * windows
    return dataclasses.replace(row, overrides=overrides)


def _generate_missing(
    spec: JobSpec,
    rows: list[Row],
    directory: Path,
    logprobs: int,
    say: Callable[[str], None],
    interval_s: float,
    chunk_rows: int,
    windows: int = 1,
) -> int:
    """Run the engine over ``rows``, committing a chunk every ``chunk_rows`` rows; returns
    how many rows failed (too long, refused): they are skipped, not trained on."""
    gen_spec, rows = generation_request(spec, rows, logprobs, windows)
    engine = TokenEngine(gen_spec)
    buffer: list[dict] = []
    failed = finished = tokens = 0
    started = last = time.monotonic()
    try:
        for row, results in engine.stream(iter(rows), spec.execution.max_in_flight):
            result = results[0]  # one sample: generation_request asks for n 1
            finished += 1
            if result.get("error") is not None or not result.get("output_token_ids"):
                failed += 1
                if failed <= 3:
                    print(
                        f"batchspec distill: row {row.request_id} skipped: {result.get('error')}",
                        file=sys.stderr,
                    )
                continue
            tokens += len(result["output_token_ids"])
            # the top K distill asked for, never more: a ``choice`` row's request asks the
            # engine for 20 (batchspec.engine.llm.CHOICE_LOGPROBS), and none without --logprobs
            topk_ids, topk_values = (
                (
                    [p[:logprobs] for p in result["topk_token_ids"]],
                    [p[:logprobs] for p in result["topk_logprobs"]],
                )
                if logprobs and result.get("topk_token_ids") is not None
                else (None, None)
            )
            buffer.append(
                {
                    "request_id": row.request_id,
                    "prompt_token_ids": result["prompt_token_ids"],
                    "output_token_ids": result["output_token_ids"],
                    "topk_token_ids": topk_ids,
                    "topk_logprobs": topk_values,
                    "finish_reason": result["finish_reason"],
                }
            )
            if len(buffer) >= chunk_rows:
                _write_chunk(directory, buffer)
                buffer = []
            now = time.monotonic()
            if now - last >= interval_s:
                last = now
                say(
                    f"generated {finished}/{len(rows)} rows, {tokens} tokens, "
                    f"{tokens / max(now - started, 1e-9):.0f} tok/s"
                )
        if buffer:
            _write_chunk(directory, buffer)
    finally:
        engine.shutdown()
    elapsed = time.monotonic() - started
    say(
        f"generated {finished} rows ({failed} skipped), {tokens} tokens in {elapsed:.1f}s "
        f"({tokens / max(elapsed, 1e-9):.0f} tok/s)"
    )
    return failed


def data_fingerprint(table: pa.Table) -> str:
    """sha256 over the training rows' ids and token ids, in request-id order."""
    ids = table.column("request_id").to_pylist()
    order = sorted(range(table.num_rows), key=ids.__getitem__)
    h = hashlib.sha256()
    prompts = table.column("prompt_token_ids").to_pylist()
    outputs = table.column("output_token_ids").to_pylist()
    for i in order:
        h.update(json.dumps([ids[i], prompts[i], outputs[i]]).encode())
    return "sha256:" + h.hexdigest()


def _engine_class():
    from batchspec.engine.llm import Engine

    return Engine


class _LazyTokenEngine:
    """Built on first use so that importing this module never imports vLLM."""

    _cls: Any = None

    def __call__(self, spec: JobSpec):
        if self._cls is None:
            base = _engine_class()

            class TokenEngineImpl(base):
                """The run engine, whose results also keep the prompt's and the output's token
                ids and, with ``logprobs`` in the sampling, the top-K log-probabilities."""

                def result(self, output, e2e_s=None, asked=None) -> list[dict]:
                    rows = super().result(output, e2e_s, asked)
                    for row, completion in zip(
                        rows, sorted(output.outputs, key=lambda c: c.index), strict=True
                    ):
                        row["prompt_token_ids"] = list(output.prompt_token_ids or ())
                        row["output_token_ids"] = list(completion.token_ids)
                        if completion.logprobs:
                            row["topk_token_ids"], row["topk_logprobs"] = topk_lists(completion.logprobs)
                    return rows

            type(self)._cls = TokenEngineImpl
        return self._cls(spec)


def topk_lists(logprobs: list[dict[int, Any]]) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM's per-token ``{token id: Logprob}`` dicts as two parallel lists of lists, most
    likely first (vLLM also adds the sampled token when it is outside the top K)."""
    ids, values = [], []
    for position in logprobs:
        items = sorted(position.items(), key=lambda kv: -kv[1].logprob)
        ids.append([int(t) for t, _ in items])
        values.append([float(lp.logprob) for _, lp in items])
    return ids, values


TokenEngine = _LazyTokenEngine()


def iter_examples(table: pa.Table) -> Iterator[dict]:
    """The generated rows as dicts (for training)."""
    yield from table.to_pylist()
