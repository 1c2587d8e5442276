"""Reasoning models (``model.reasoning_parser``): the parser checked before any weights load, and
each output split into its thinking and its answer, as vLLM's OpenAI server splits them.

vLLM's offline ``LLM`` returns the thinking and the answer as one text (vLLM issue #17292); its
server splits them with the model's reasoning parser. This module does what the server does, with
the same parser: a chat template that ends the thinking in the prompt (an empty think block, as
Qwen3's writes for ``enable_thinking: false``) makes the whole output the answer; otherwise the
parser finds where the thinking ends. Only the template's own markers, after the row's text,
decide that (:meth:`Splitter.prompt_ends_thinking`): a row's text is data, whatever it holds. An
output the parser finds still thinking has no answer: ``generated_text`` is null, and
``finish_reason`` is :data:`LENGTH_IN_REASONING` where ``max_tokens`` cut it.

With speculation on, the engine records each verify step's accepted and proposed draft tokens
(``per_request_spec_decode_metrics: detailed``), and :func:`split_acceptance` attributes each
step to the thinking or the answer by the position of its first token."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchspec.columns import LENGTH_IN_REASONING
from batchspec.errors import SpecError

log = logging.getLogger(__name__)

__all__ = ["LENGTH_IN_REASONING", "Splitter", "check_reasoning", "parser_for", "split_acceptance"]


def parser_names() -> list[str]:
    """The reasoning parsers this vLLM knows, by name."""
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


def parser_for(name: str, tokenizer) -> Any:
    """vLLM's reasoning parser ``name`` over ``tokenizer``; SpecError naming
    ``model.reasoning_parser`` for a name vLLM does not know, or a tokenizer the parser cannot
    work with (its markers are not single tokens of the vocabulary)."""
    names = parser_names()
    if name not in names:
        from batchspec.engine.vllm_info import vllm_version

        raise SpecError(
            "model.reasoning_parser",
            f"vLLM {vllm_version()} has no reasoning parser {name!r}; it has: {', '.join(names)}",
        )
    from vllm.reasoning import ReasoningParserManager

    try:
        parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
        markers = [m for m in (parser.reasoning_start_str, parser.reasoning_end_str) if m]
    except Exception as exc:  # noqa: BLE001 (each parser raises its own on a foreign vocabulary)
        raise SpecError(
            "model.reasoning_parser",
            f"vLLM's {name!r} parser cannot read this model's outputs: {exc}",
        ) from exc
    # a parser that looks its markers up as tokens finds nothing in a model without them, and
    # would call every output the thinking (or none of it)
    vocab = tokenizer.get_vocab()
    missing = [m for m in markers if m not in vocab]
    if missing:
        raise SpecError(
            "model.reasoning_parser",
            f"vLLM's {name!r} parser reads the thinking between {' and '.join(map(repr, markers))}, "
            f"and this model's vocabulary has no token {' or '.join(map(repr, missing))}: "
            "is the model a reasoning model of that family?",
        )
    return parser


def check_reasoning(spec, tokenizer=None) -> None:
    """``model.reasoning_parser`` checked against vLLM's registry and the model's tokenizer
    (loaded here unless given), before any weights load."""
    name = spec.model.reasoning_parser
    if name is None:
        return
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            spec.model.engine.get("tokenizer") or spec.model.target,
            trust_remote_code=spec.model.engine.get("trust_remote_code") is True,
        )
    parser_for(name, tokenizer)


@dataclass(frozen=True)
class Split:
    """One output's thinking and answer."""

    #: The thinking, markers removed; None when the model did not think.
    reasoning: str | None
    #: The answer; None when the output never left the thinking.
    answer: str | None
    #: Output tokens up to the end of the thinking (its markers included).
    reasoning_tokens: int
    #: True when the output (or the chat template, in the prompt) ended the thinking.
    ended: bool


class Splitter:
    """Splits outputs with one parser (parsers keep no state across whole outputs)."""

    def __init__(self, name: str, tokenizer):
        self.tokenizer = tokenizer
        self.parser = parser_for(name, tokenizer)
        end = self.parser.reasoning_end_str
        #: the end marker's token ids (None: the parser has no single end marker)
        self.end_ids = tokenizer.encode(end, add_special_tokens=False) if end else None
        # digits, as the filters a template applies to a message's text (upper, trim, escape)
        # leave them as they are
        self._text_end = f"#{secrets.randbelow(10**16):016d}#"

    def prompt_ends_thinking(self, messages: Sequence[Mapping] | None, template_kwargs=None) -> bool:
        """Whether the chat template ends the thinking in the prompt it renders for ``messages``
        (with ``template_kwargs``), as Qwen3's does for ``enable_thinking: false``.

        Only what the template writes after the last message's text counts. A row's text is data:
        a ``</think>`` in it tokenizes as the marker does, so the prompt's ids cannot tell the
        two apart. The messages are rendered again, each text field (all but ``role``) followed
        by a mark, and the parser reads what follows the last mark. A text prompt (``messages``
        None) is the row's own text, so it never ends the thinking: the output decides."""
        if messages is None:
            return False
        mark = self._text_end
        marked = [
            {k: v + mark if isinstance(v, str) and k != "role" else v for k, v in m.items()} for m in messages
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                marked, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
            )
        except Exception:  # noqa: BLE001 (the template's own errors)
            # the prompt itself rendered; without the template's tail the output decides
            log.debug("cannot render the chat template with marked texts", exc_info=True)
            return False
        # no mark: the template wrote none of the row's text, so all of the prompt is its own
        tail = text.rpartition(mark)[2]
        return bool(self.parser.is_reasoning_end(self.tokenizer.encode(tail, add_special_tokens=False)))

    def split(self, prompt_ended: bool, output_ids: Sequence[int], text: str) -> Split:
        """``output_ids`` and ``text`` as thinking and answer; ``prompt_ended`` is
        :meth:`prompt_ends_thinking`'s answer for the request's prompt."""
        if prompt_ended:
            # the template closed the thinking (enable_thinking: false): all of it is the answer
            return Split(None, text, 0, True)
        ids = list(output_ids)
        ended = self.parser.is_reasoning_end(ids)
        reasoning, answer = self.parser.extract_reasoning(text, None)
        if not ended:
            return Split(reasoning if reasoning is not None else text, None, len(ids), False)
        return Split(reasoning, answer if answer is not None else "", self._thinking_tokens(ids), True)

    def _thinking_tokens(self, ids: list[int]) -> int:
        """Output tokens up to the first end marker, as the text is split (a model may write
        another after a thinking budget forced the first); the parser's count where it has no
        single end marker."""
        end = self.end_ids
        if end:
            for i in range(len(ids) - len(end) + 1):
                if ids[i : i + len(end)] == end:
                    return i + len(end)
        return len(ids) - len(self.parser.extract_content_ids(ids))


def split_acceptance(
    per_step_accepted: Sequence[int], per_step_drafted: Sequence[int], reasoning_tokens: int
) -> tuple[int, int]:
    """``(drafted, accepted)`` draft tokens of the verify steps that began inside the thinking.

    The first output token comes from the prompt's prefill; each verify step then emits its
    accepted draft tokens and one more, so step i begins at the output position one past the
    tokens before it. A step that crosses the end of the thinking counts as thinking."""
    position, drafted, accepted = 1, 0, 0
    for took, proposed in zip(per_step_accepted, per_step_drafted, strict=False):
        if position >= reasoning_tokens:
            break
        drafted += proposed
        accepted += took
        position += took + 1
    return drafted, accepted
