"""Reasoning models without an engine: the spec's refusals, the parser checked against vLLM's
registry and the model's vocabulary, each output split as vLLM's server splits it (the chat
template's own markers, never a row's text, deciding whether the prompt ended the thinking), the
verify steps attributed to the thinking or the answer, and the chat template's arguments checked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers.jobs import MODELS

from batchspec.columns import LENGTH_IN_REASONING
from batchspec.engine.checks import row_template_kwargs, template_kwargs
from batchspec.engine.reasoning import split_acceptance
from batchspec.engine.rows import Asked, result_rows
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
@pytest.mark.reasoner
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


def reasoner():
    """The reasoner's tokenizer, a qwen3 splitter over it, and its tokenizer's ids for a text."""
    from transformers import AutoTokenizer

    from batchspec.engine.reasoning import Splitter

    tok = AutoTokenizer.from_pretrained(MODELS / "reasoner")
    return tok, Splitter("qwen3", tok), lambda text: tok(text, add_special_tokens=False)["input_ids"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


#: The reasoner's reply with its thinking, and the same reply written with thinking off.
THOUGHT = "<think>\nI read 1 line.\n</think>\n\nx = 2"


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.reasoner
def test_outputs_split_as_vllms_server_splits_them():
    tok, splitter, ids = reasoner()
    split = splitter.split
    ended = splitter.prompt_ends_thinking

    s = split(ended(user("x = 1"), {"enable_thinking": True}), ids(THOUGHT), THOUGHT)
    assert (s.reasoning.strip(), s.answer.strip(), s.ended) == ("I read 1 line.", "x = 2", True)
    assert s.reasoning_tokens == len(ids("<think>\nI read 1 line.\n</think>"))
    # thinking off: the template closed the thinking, all of the output is the answer
    assert ended(user("x = 1"), {"enable_thinking": False})
    s = split(True, ids("x = 2"), "x = 2")
    assert (s.reasoning, s.answer, s.reasoning_tokens) == (None, "x = 2", 0)
    # cut while thinking: no answer
    s = split(False, ids("<think>\nI read"), "<think>\nI read")
    assert (s.answer, s.ended, s.reasoning.strip()) == (None, False, "I read")
    assert LENGTH_IN_REASONING == "length_in_reasoning"


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.reasoner
@pytest.mark.parametrize(
    "messages",
    [
        user("Why does my parser stop at </think>?"),
        user("x = 1\n<think>\n\n</think>\n\n"),  # the template's empty block, typed by the row
        [{"role": "system", "content": "Never write </think>."}, *user("x = 1")],
        [
            *user("x = 1 </think>"),
            {"role": "assistant", "content": "<think>\nI read 1 line.\n</think>\n\nx = 2"},
            *user("x = 3"),
        ],
    ],
    ids=["user", "trailing-empty-block", "system", "earlier-turns"],
)
def test_a_marker_in_the_rows_text_never_ends_the_thinking(messages):
    tok, splitter, ids = reasoner()
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the row as the engine returns it: the output's own markers split it
    reply = SimpleNamespace(
        index=0, token_ids=ids(THOUGHT), text=THOUGHT, finish_reason="stop", stop_reason=None, logprobs=None
    )
    output = SimpleNamespace(prompt_token_ids=ids(prompt), metrics=None, outputs=[reply])
    row = result_rows(output, reasoning=splitter)[0]
    assert (row["reasoning_text"].strip(), row["generated_text"].strip()) == ("I read 1 line.", "x = 2")
    assert row["num_reasoning_tokens"] == len(ids("<think>\nI read 1 line.\n</think>"))
    # as the engine asks for it: the template's tail did not end the thinking
    asked = Asked(thinking_ended=splitter.prompt_ends_thinking(messages, {}))
    assert result_rows(output, asked=asked, reasoning=splitter)[0] == row
    # the row's marker is the marker token itself: the prompt's ids cannot tell it from the template's
    assert tok.convert_tokens_to_ids("</think>") in ids(prompt)
    for kwargs in ({}, {"enable_thinking": True}):
        assert not splitter.prompt_ends_thinking(messages, kwargs)
    # the template's own block still ends it, whatever the row holds
    assert splitter.prompt_ends_thinking(messages, {"enable_thinking": False})


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.reasoner
def test_each_request_carries_what_its_own_template_said():
    from batchspec.engine.llm import Engine

    tok, splitter, ids = reasoner()
    engine = Engine.__new__(Engine)  # no engine start-up: only what _prepare reads
    engine.adapters = SimpleNamespace(pick=lambda lora: (None, None))
    engine.sampling_params = lambda overrides: (SimpleNamespace(temperature=0.0), Asked())
    engine.tokenizer, engine.reasoning, engine.base_template_kwargs = tok, splitter, {}
    engine.refuse_random_sampling, engine.max_model_len = False, 4096

    def ended(**row) -> bool:
        request, refused = engine._prepare(Row(shard="s", index=0, request_id="r", kept={}, **row))
        assert refused is None
        return request.asked.thinking_ended

    said = user("Why does my parser stop at </think>?")
    assert not ended(messages=said)
    assert ended(messages=said, overrides={"chat_template_kwargs": {"enable_thinking": False}})
    assert not ended(prompt="x = 1 </think>\n\n")


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.reasoner
def test_a_text_prompt_is_the_rows_own_text_and_the_output_decides():
    tok, splitter, ids = reasoner()
    # a text prompt written as the template writes thinking off: still the row's text
    text = tok.apply_chat_template(
        user("x = 1"), tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.endswith("<think>\n\n</think>\n\n")
    reply = SimpleNamespace(
        index=0, token_ids=ids("x = 2"), text="x = 2", finish_reason="length", stop_reason=None, logprobs=None
    )
    output = SimpleNamespace(prompt_token_ids=ids(text), metrics=None, outputs=[reply])
    row = result_rows(output, reasoning=splitter)[0]
    # the output never ended the thinking: qwen3's parser takes it all for thinking
    assert (row["generated_text"], row["reasoning_text"], row["finish_reason"]) == (
        None,
        "x = 2",
        LENGTH_IN_REASONING,
    )
    assert not splitter.prompt_ends_thinking(None)


@pytest.mark.vllm
@pytest.mark.models
@pytest.mark.reasoner
def test_a_template_that_writes_no_row_text_or_fails_on_the_mark():
    tok, splitter, _ = reasoner()
    # a template that writes none of the row's text wrote all of the prompt
    tok.chat_template = "{{ '<|assistant|>\n<think>\n\n</think>\n\n' }}"
    assert splitter.prompt_ends_thinking(user("x = 1"))
    # one that refuses the marked text: the prompt's tail is unknown, so the output decides
    tok.chat_template = (
        "{% if messages[-1]['content'] != 'x = 1' %}{{ raise_exception('no') }}{% endif %}"
        "{{ '<|assistant|>\n<think>\n\n</think>\n\n' }}"
    )
    assert not splitter.prompt_ends_thinking(user("x = 1"))
