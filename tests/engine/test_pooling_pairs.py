"""A ``score`` row's two sides through an engine death (batchspec/engine/pooling.py): the
supervisor (batchspec/engine/supervise.py) sends the sides the dead engine had in flight again,
as they are, and each pair is still yielded once, scored from its own two sides. With a
cross-encoder, a pair is one request of both texts, built by vLLM's own processor (its token type
ids compressed as vLLM does), and its score the model's one output. vLLM's engine and processor
are stood in for by stubs: what is under test is the pairing."""

from __future__ import annotations

import math

import pytest

from batchspec.engine.supervise import EngineDied
from batchspec.errors import SpecError
from batchspec.io.rows import Row
from batchspec.tasks import SCORE

pytestmark = pytest.mark.vllm

VECTORS = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0], "d": [1.0, 0.0]}


def _result(row: Row) -> list[dict]:
    return [{"embedding": VECTORS[row.prompt], "num_prompt_tokens": 1, "time_e2e_s": 0.1, "error": None}]


def test_sides_sent_again_after_a_death_make_each_pair_once(monkeypatch):
    from batchspec.engine import llm, pooling

    calls = []

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        rows = list(rows)  # what this engine was handed, in order
        calls.append(rows)
        if len(calls) == 1:  # the first side of the first pair answered, then the engine dies
            yield rows[0], _result(rows[0])
            raise EngineDied("died", "killed", in_flight=rows[1:3], unsent=rows[3:])
        for row in rows:
            yield row, _result(row)

    monkeypatch.setattr(llm.Engine, "stream", stream)
    engine = object.__new__(pooling.PoolingEngine)
    engine.task, engine._sides, engine._pair_results = SCORE, {}, {}
    pairs = [Row("s", 0, "p0", {}, prompt="a", pair="b"), Row("s", 1, "p1", {}, prompt="c", pair="d")]
    out = []
    with pytest.raises(EngineDied) as death:
        for item in engine.stream(iter(pairs), 8):
            out.append(item)
    assert out == []  # one side of p0 only: nothing to yield yet
    again = [*death.value.in_flight, *death.value.unsent]  # what the supervisor sends again
    assert [r.prompt for r in again] == ["b", "c", "d"] and all(r.pair is None for r in again)
    out = list(engine.stream(iter(again), 8))
    assert [row.request_id for row, _ in out] == ["p0", "p1"]
    scores = {row.request_id: results[0]["score"] for row, results in out}
    assert math.isclose(scores["p0"], 0.0) and math.isclose(scores["p1"], 1 / math.sqrt(2))
    assert calls[1] == again  # the sides went to the engine as they were, not split again
    assert engine._sides == {} and engine._pair_results == {}


class _Processor:
    """vLLM's cross-encoder processor, as far as batchspec asks it: the pair's tokens (and token
    type ids, as a tokenizer with segments gives them)."""

    def get_score_prompt(self, data_1, data_2, encode_kwargs, chat_template=None):
        assert encode_kwargs == {"add_special_tokens": True} and chat_template is None
        first, second = [1, *range(10, 10 + len(data_1))], [2, *range(50, 50 + len(data_2))]
        return None, {
            "prompt_token_ids": first + second,
            "token_type_ids": [0] * len(first) + [1] * len(second),
        }


def _cross_encoder():
    from types import SimpleNamespace

    from vllm import PoolingParams

    from batchspec.engine import pooling
    from batchspec.tasks import CROSS_ENCODE

    engine = object.__new__(pooling.PoolingEngine)
    engine.task, engine.max_model_len = CROSS_ENCODE, 16
    engine.pooling_params = PoolingParams(task="classify")
    engine.llm = SimpleNamespace(
        pooling_io_processors={"cross-encoder": _Processor()}, pooling_task="classify"
    )
    engine.engine = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(num_labels=1)),
        renderer=SimpleNamespace(default_cmpl_tok_params=SimpleNamespace(add_special_tokens=True)),
    )
    engine._launch_args = ("model", {})
    return engine


def test_a_cross_encoders_pair_is_one_request_of_both_texts_with_vllms_token_types():
    engine = _cross_encoder()
    assert not engine.split_pairs
    request, refused = engine._prepare(Row("s", 0, "p0", {}, prompt="abc", pair="de"))
    assert refused is None
    assert request.token_ids == [1, 10, 11, 12, 2, 50, 51]
    assert request.params.task == "classify"
    assert request.params.extra_kwargs == {"compressed_token_type_ids": 4}  # the document's first token
    assert engine.pooling_params.extra_kwargs is None  # the job's parameters are left as they were
    _, refused = engine._prepare(Row("s", 1, "p1", {}, prompt="a" * 10, pair="b" * 10))
    assert refused["error"] == "prompt too long: 22 prompt tokens, over max_model_len 16"
    engine.engine.model_config.hf_config.num_labels = 2
    with pytest.raises(SpecError) as err:  # vLLM serves it with two labels: the job's error, not the row's
        engine._prepare(Row("s", 2, "p2", {}, prompt="a", pair="b"))
    assert err.value.key == "task"


def test_a_cross_encoders_score_is_its_one_output():
    from types import SimpleNamespace

    import torch

    from batchspec.engine.pooling import cross_score_rows

    def output(values):
        return SimpleNamespace(outputs=SimpleNamespace(data=torch.tensor(values)), prompt_token_ids=[1, 2, 3])

    (row,) = cross_score_rows(output([0.75]), 0.5, None)
    assert row == {
        "score": 0.75,
        "num_prompt_tokens": 3,
        "time_e2e_s": 0.5,
        "finish_reason": "stop",
        "error": None,
    }
    (row,) = cross_score_rows(output([0.1, 0.9]), 0.5, None)
    assert row["error"] == "engine error: a cross-encoder's output of 2 values, expected one"
