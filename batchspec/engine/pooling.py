"""The pooling tasks (``task: embed``, ``classify``, ``score``): vLLM's pooling runner behind the
same request stream as generation (:class:`batchspec.engine.llm.Engine`), so that shards,
leases, exactly-once commits, resume, per-row errors, duplicates once and Ray work as they do
for text. What differs is here: the engine's arguments (``runner="pooling"``, and ``convert``
where the checkpoint is a causal LM), a row's request (:class:`vllm.PoolingParams`, no
sampling) and its result columns (:mod:`batchspec.columns`: ``EMBED_FIELDS`` and the others).

A ``score`` row is a pair of texts, scored as vLLM's ``LLM.score`` scores it for the model:

- a cross-encoder (a sequence classifier of one label, ``spec.cross_encoder``): both texts in
  one request, built by vLLM's own cross-encoder processor (``LLM.score``'s: the tokenizer's
  pair encoding, or the model's score template, and its token type ids), run with
  ``PoolingParams(task="classify")``; the score is the classifier's one output after vLLM's
  activation (a sigmoid, unless ``pooling.use_activation: false``);
- an embedding model: each side embedded as a request of its own, the score the cosine of the
  two embeddings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from batchspec.columns import error_result
from batchspec.engine.llm import _STATS_ON, ENGINE_DEFAULTS, Engine, Prepared
from batchspec.engine.rows import NOTHING
from batchspec.engine.tokens import prompt_token_ids
from batchspec.errors import SpecError
from batchspec.io.rows import Row
from batchspec.spec.checkpoints import read_config
from batchspec.spec.model import JobSpec
from batchspec.tasks import CROSS_ENCODE, task_for


def _causal(target: str) -> bool:
    """Whether the checkpoint is a causal LM (``*ForCausalLM``): an embedding job converts it."""
    config = read_config(target) or {}
    return any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or ())


class PoolingEngine(Engine):
    """One vLLM engine on the pooling runner, for the job's pooling task."""

    def __init__(self, spec: JobSpec):
        self.task = task_for(spec.task, spec.cross_encoder)
        self.dimensions = spec.dimensions
        #: ``score``: id(side row) -> (its pair's row, which side, the side row); id(pair's row)
        #: -> each side's result, until both are in
        self._sides: dict[int, tuple[Row, int, Row]] = {}
        self._pair_results: dict[int, list[dict | None]] = {}
        super().__init__(spec)
        config = self.engine.model_config.hf_config
        id2label = getattr(config, "id2label", None) or {}
        #: ``classify``: each class's name, in the order of the model's outputs
        self.labels = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(len(id2label))]

    @property
    def split_pairs(self) -> bool:
        """``score`` with an embedding model: each side of a pair a request of its own."""
        return self.task.pairs and self.task is not CROSS_ENCODE

    def _llm_kwargs(self, spec: JobSpec) -> dict[str, Any]:
        kwargs = {**ENGINE_DEFAULTS, **spec.model.engine, **_STATS_ON, "runner": "pooling"}
        if self.task.convert is not None and _causal(spec.model.target):
            kwargs.setdefault("convert", self.task.convert)
        return kwargs

    def _use(self, spec: JobSpec) -> None:
        super()._use(spec)
        from vllm import PoolingParams

        params = PoolingParams(task=self.task.pooling_task, **spec.pooling)
        try:
            params.verify(self.engine.model_config)
        except ValueError as exc:  # dimensions the model cannot give, say
            raise SpecError("pooling", f"vLLM refused the pooling parameters: {exc}") from exc
        self.pooling_params = params
        if self.task is CROSS_ENCODE:
            self._cross_encoder()  # vLLM serves the model as one, or the job is refused here

    def _cross_encoder(self):
        """vLLM's cross-encoder processor for this engine (what ``LLM.score`` builds a pair's
        request with); SpecError naming ``task`` where vLLM does not serve the model as a
        cross-encoder of one label."""
        from vllm.tasks import SCORE_TYPE_MAP

        config = self.engine.model_config.hf_config
        processor = (getattr(self.llm, "pooling_io_processors", None) or {}).get("cross-encoder")
        kind = SCORE_TYPE_MAP.get(getattr(self.llm, "pooling_task", None))
        if kind != "cross-encoder" or processor is None or getattr(config, "num_labels", 0) != 1:
            raise SpecError(
                "task",
                f"vLLM does not serve {self._launch_args[0]} as a cross-encoder of one label "
                f"(its scoring: {kind}, num_labels {getattr(config, 'num_labels', None)}): task score "
                "takes a sequence classifier of one label, or an embedding model",
            )
        return processor

    def _prepare(self, row: Row) -> tuple[Prepared | None, dict | None]:
        if self.task is CROSS_ENCODE:
            return self._prepare_pair(row)
        try:
            ids = prompt_token_ids(self.tokenizer, row, self.base_template_kwargs)
        except Exception as exc:  # a template or tokenizer failure belongs to this row only
            return None, error_result(f"cannot render prompt: {exc}")
        return self._request(ids, self.pooling_params)

    def _request(self, ids: list[int], params) -> tuple[Prepared | None, dict | None]:
        """The request of these prompt tokens, or the row's error: no tokens, or more than
        ``max_model_len`` (a pooling request has no output to leave room for)."""
        if not ids:
            return None, error_result("empty prompt: no tokens", num_prompt_tokens=0)
        if len(ids) > self.max_model_len:
            return None, error_result(
                f"prompt too long: {len(ids)} prompt tokens, over max_model_len {self.max_model_len}",
                num_prompt_tokens=len(ids),
            )
        return Prepared(ids, params, NOTHING, None), None

    def _prepare_pair(self, row: Row) -> tuple[Prepared | None, dict | None]:
        """A pair's one request to a cross-encoder, as ``LLM.score`` builds it: vLLM's processor
        renders the two texts (the tokenizer's pair encoding with its special tokens, or the
        model's score template), and token type ids, where the tokenizer gives them, go with
        the request's parameters as vLLM compresses them. Not truncated: a pair over
        ``max_model_len`` is the row's error, as a prompt is."""
        from vllm.entrypoints.pooling.scoring.utils import compress_token_type_ids

        try:
            processor = self._cross_encoder()
            tok_params = self.engine.renderer.default_cmpl_tok_params
            _, prompt = processor.get_score_prompt(
                data_1=row.prompt,
                data_2=row.pair,
                encode_kwargs={"add_special_tokens": tok_params.add_special_tokens},
                chat_template=None,
            )
            ids = list(prompt["prompt_token_ids"])
            token_types = prompt.get("token_type_ids")
            params = self.pooling_params
            if token_types:
                params = params.clone()
                params.extra_kwargs = {
                    **(params.extra_kwargs or {}),
                    "compressed_token_type_ids": compress_token_type_ids(list(token_types)),
                }
        except SpecError:
            raise
        except Exception as exc:  # a tokenizer or template failure belongs to this row only
            return None, error_result(f"cannot render pair: {exc}")
        return self._request(ids, params)

    def result(self, output, e2e_s: float | None = None, asked=None) -> list[dict]:
        return self._task_rows(output, e2e_s, self)

    def stream(
        self,
        rows: Iterator[Row],
        max_in_flight: int,
        stop: Callable[[], bool] | None = None,
        grace_s: float = 0.0,
        keep: Callable[[Row], bool] | None = None,
    ) -> Iterator[tuple[Row, list[dict]]]:
        """:meth:`Engine.stream`; a ``score`` row's two sides run as two requests, and the row is
        yielded once both have finished, with its score."""
        if not self.split_pairs:  # one request a row (a cross-encoder's reads both texts)
            yield from super().stream(rows, max_in_flight, stop, grace_s, keep)
            return
        # kept across calls: after an engine death the supervisor (engine/supervise.py) sends the
        # sides it had in flight again, as they are
        sides, done = self._sides, self._pair_results

        def halves(rows: Iterator[Row]) -> Iterator[Row]:
            for row in rows:
                known = sides.get(id(row))
                if row.error is not None or (known is not None and known[2] is row):
                    yield row  # an error row, or a side sent again
                    continue
                first = dataclasses.replace(row, pair=None)
                second = dataclasses.replace(row, prompt=row.pair, messages=None, pair=None)
                sides[id(first)], sides[id(second)] = (row, 0, first), (row, 1, second)
                done[id(row)] = [None, None]
                yield first
                yield second

        for side, results in super().stream(halves(rows), max_in_flight, stop, grace_s, keep):
            entry = sides.get(id(side))
            if entry is None or entry[2] is not side:  # refused before the engine: as it is
                yield side, results
                continue
            del sides[id(side)]
            row, which, _ = entry
            both = done[id(row)]
            both[which] = results[0]
            if both[1 - which] is not None:
                del done[id(row)]
                yield row, [score_row(both[0], both[1])]


def _vector(output) -> list[float]:
    return [float(x) for x in output.outputs.data.float().tolist()]


def _pooled(output, e2e_s: float | None) -> dict:
    """What every pooling result row has."""
    return {
        "num_prompt_tokens": len(output.prompt_token_ids or ()),
        "time_e2e_s": e2e_s,
        "finish_reason": "stop",
        "error": None,
    }


def embed_rows(output, e2e_s: float | None, engine: PoolingEngine) -> list[dict]:
    """A finished embedding request as its one result row: the vector, of the job's size."""
    vector = _vector(output)
    if engine.dimensions is not None and len(vector) != engine.dimensions:
        return [
            error_result(
                f"engine error: an embedding of {len(vector)} dimensions, expected {engine.dimensions}",
                num_prompt_tokens=len(output.prompt_token_ids or ()),
            )
        ]
    return [{"embedding": vector, **_pooled(output, e2e_s)}]


def classify_rows(output, e2e_s: float | None, engine: PoolingEngine) -> list[dict]:
    """A finished classification as its one result row: the likeliest label, every probability."""
    probs = _vector(output)
    best = max(range(len(probs)), key=probs.__getitem__)
    label = engine.labels[best] if best < len(engine.labels) else str(best)
    return [{"label": label, "probs": probs, **_pooled(output, e2e_s)}]


def cross_score_rows(output, e2e_s: float | None, engine: PoolingEngine) -> list[dict]:
    """A cross-encoder's finished pair as its one result row: the classifier's one output,
    after vLLM's activation (what ``LLM.score`` gives)."""
    data = output.outputs.data.float().squeeze()
    if data.ndim != 0:
        return [
            error_result(
                f"engine error: a cross-encoder's output of {data.numel()} values, expected one",
                num_prompt_tokens=len(output.prompt_token_ids or ()),
            )
        ]
    return [{"score": float(data.item()), **_pooled(output, e2e_s)}]


def score_row(first: dict, second: dict) -> dict:
    """A pair's result row from its two sides' embedding rows: the cosine of the embeddings."""
    tokens = (first.get("num_prompt_tokens") or 0) + (second.get("num_prompt_tokens") or 0)
    for side in (first, second):
        if side.get("error") is not None:
            return error_result(side["error"], num_prompt_tokens=tokens)
    a, b = first["embedding"], second["embedding"]
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    score = sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
    times = [t for t in (first.get("time_e2e_s"), second.get("time_e2e_s")) if t is not None]
    return {
        "score": score,
        "num_prompt_tokens": tokens,
        "time_e2e_s": max(times) if times else None,
        "finish_reason": "stop",
        "error": None,
    }
