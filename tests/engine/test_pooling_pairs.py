"""A ``score`` row's two sides through an engine death (batchspec/engine/pooling.py): the
supervisor (batchspec/engine/supervise.py) sends the sides the dead engine had in flight again,
as they are, and each pair is still yielded once, scored from its own two sides. vLLM's engine is
stood in for by a stub of :meth:`Engine.stream`: what is under test is the pairing."""

from __future__ import annotations

import math

import pytest

from batchspec.engine.supervise import EngineDied
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
