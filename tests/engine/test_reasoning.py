"""Reasoning models without an engine: the spec's refusals, the parser checked against vLLM's
registry and the model's vocabulary, each output split as vLLM's server splits it, the verify
steps attributed to the thinking or the answer, and the chat template's arguments checked."""

from __future__ import annotations

import json

import pytest
from helpers.jobs import MODELS

from batchspec.columns import LENGTH_IN_REASONING
from batchspec.engine.checks import row_template_kwargs, template_kwargs
from batchspec.engine.reasoning import split_acceptance
from batchspec.errors import SpecError
from batchspec.io.rows import Row
from batchspec.spec.build import build_spec


def spec(**sections):
    raw = {
        "name": "r",
        "input": {"path": "memory://in/*.parquet", "messages_column": "m"},
        "output": {"path": "memory://out"},
        "model": {"target": str(MODELS / "reasoner"), "reasoning_parser": "qwen3"},
        "sampling": {"temperature": 0.0},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return build_spec(raw)


# ---------------------------------------------------------------------------- spec (no vLLM)


def test_a_thinking_budget_needs_a_reasoning_parser():
    with pytest.raises(SpecError) as info:
        spec(model={"reasoning_parser": None}, sampling={"thinking_token_budget": 8})
    assert info.value.key == "sampling.thinking_token_budget"
    assert "model.reasoning_parser" in str(info.value)
    with pytest.raises(SpecError) as info:
        spec(model={"reasoning_parser": None}, input={"sampling_columns": {"thinking_token_budget": "b"}})
    assert info.value.key == "input.sampling_columns.thinking_token_budget"


def test_template_arguments_need_a_chat_prompt():
    text = {"messages_column": None, "prompt_column": "p"}
    with pytest.raises(SpecError) as info:
        spec(input=text, sampling={"chat_template_kwargs": {"enable_thinking": False}})
    assert info.value.key == "sampling.chat_template_kwargs"
    with pytest.raises(SpecError) as info:
        spec(input={**text, "sampling_columns": {"chat_template_kwargs": "k"}})
    assert info.value.key == "input.sampling_columns.chat_template_kwargs"
    with pytest.raises(SpecError) as info:  # a text prompt from a template is text too
        spec(
            input={"messages_column": None, "prompt_template": "{{ p }}"},
            sampling={"chat_template_kwargs": {"enable_thinking": False}},
        )
    assert info.value.key == "sampling.chat_template_kwargs"
    with pytest.raises(SpecError) as info:
        spec(sampling={"chat_template_kwargs": ["enable_thinking"]})
    assert info.value.key == "sampling.chat_template_kwargs"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"tokenize": True}, "chat_template_kwargs.tokenize: set by batchspec"),
        ({"messages": []}, "chat_template_kwargs.messages: set by batchspec"),
        ({"a b": 1}, "is not a template variable name"),
        ({"x": {"deep": [1]}}, "chat_template_kwargs.x: expected a string, number or true/false"),
        ({"x": float("nan")}, "chat_template_kwargs.x: expected"),
        ({"x": "y" * 5000}, "5000 characters; at most 4096"),
        ({"x": list(range(65))}, "a list of 65; at most 64"),
        ({f"k{i}": 1 for i in range(33)}, "33 arguments; at most 32"),
        ("[1, 2]", "expected a mapping"),
        ("{not json", "not a JSON object"),
        ("[" * 10000 + "]" * 10000, "not a JSON object"),  # too deep for json: a row's error
        (b"\x00", "expected a mapping"),
        (7, "expected a mapping"),
    ],
)
def test_template_arguments_of_the_wrong_shape_are_refused(value, why):
    with pytest.raises(ValueError, match=None) as info:
        template_kwargs(value)
    assert why in str(info.value)


def test_template_arguments_merge_per_row_and_null_fields_keep_the_jobs():
    assert template_kwargs(json.dumps({"enable_thinking": False, "effort": "low"})) == {
        "enable_thinking": False,
        "effort": "low",
    }
    base = {"enable_thinking": True, "effort": "high"}
    chat = Row(shard="s", index=0, request_id="r", kept={}, messages=[{"role": "user", "content": "x"}])
    chat.overrides = {"chat_template_kwargs": {"enable_thinking": False, "effort": None}}
    assert row_template_kwargs(base, chat) == {"enable_thinking": False, "effort": "high"}
    text = Row(shard="s", index=0, request_id="r", kept={}, prompt="x")
    text.overrides = {"chat_template_kwargs": "{}"}
    with pytest.raises(ValueError, match="a text prompt is not rendered with a chat template"):
        row_template_kwargs(base, text)
    # an OpenAI Batch /v1/completions line of a job with chat_template_kwargs: the job's too
    text.overrides = {}
    with pytest.raises(ValueError, match="a text prompt is not rendered with a chat template"):
        row_template_kwargs(base, text)
    assert row_template_kwargs({}, text) == {}


def test_verify_steps_are_the_thinkings_until_one_begins_past_its_end():
    # token 0 from the prefill; steps emit accepted + 1 tokens: positions 1-4, 5, 6-8, 9-13
    accepted, drafted = [3, 0, 2, 4], [4, 4, 4, 4]
    assert split_acceptance(accepted, drafted, reasoning_tokens=0) == (0, 0)
    assert split_acceptance(accepted, drafted, reasoning_tokens=5) == (4, 3)
    assert split_acceptance(accepted, drafted, reasoning_tokens=6) == (8, 3)  # step 2 begins at 5
    assert split_acceptance(accepted, drafted, reasoning_tokens=100) == (16, 9)


# ---------------------------------------------------------------------------- with vLLM's parsers


@pytest.mark.vllm
@pytest.mark.models
def test_the_parser_is_checked_against_vllms_registry_and_the_vocabulary():
    from batchspec.engine.checks import check_vllm_keys

    check_vllm_keys(spec())  # the reasoner has <think> and </think>
    with pytest.raises(SpecError) as info:
        check_vllm_keys(spec(model={"reasoning_parser": "qwen4"}))
    assert info.value.key == "model.reasoning_parser"
    assert "no reasoning parser 'qwen4'" in str(info.value) and "deepseek_r1" in str(info.value)
    with pytest.raises(SpecError) as info:  # a model of another family
        check_vllm_keys(spec(model={"target": str(MODELS / "target")}))
    assert "no token '<think>' or '</think>'" in str(info.value)
    with pytest.raises(SpecError) as info:
        check_vllm_keys(spec(sampling={"chat_template_kwargs": {"return_dict": True}}))
    assert info.value.key == "sampling.chat_template_kwargs.return_dict"


@pytest.mark.vllm
@pytest.mark.models
def test_outputs_split_as_vllms_server_splits_them():
    from transformers import AutoTokenizer

    from batchspec.engine.reasoning import Splitter

    tok = AutoTokenizer.from_pretrained(MODELS / "reasoner")
    split = Splitter("qwen3", tok).split

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    def prompt(think: bool):
        text = tok.apply_chat_template(
            [{"role": "user", "content": "x = 1"}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=think,
        )
        return ids(text)

    out = "<think>\nI read 1 line.\n</think>\n\nx = 2"
    s = split(prompt(True), ids(out), out)
    assert (s.reasoning.strip(), s.answer.strip(), s.ended) == ("I read 1 line.", "x = 2", True)
    assert s.reasoning_tokens == len(ids("<think>\nI read 1 line.\n</think>"))
    # thinking off: the prompt closed the thinking, all of the output is the answer
    s = split(prompt(False), ids("x = 2"), "x = 2")
    assert (s.reasoning, s.answer, s.reasoning_tokens) == (None, "x = 2", 0)
    # cut while thinking: no answer
    s = split(prompt(True), ids("<think>\nI read"), "<think>\nI read")
    assert (s.answer, s.ended, s.reasoning.strip()) == (None, False, "I read")
    assert LENGTH_IN_REASONING == "length_in_reasoning"
