"""A row's prompt as the engine sees it: its token ids (a text prompt tokenized, chat messages
rendered with the tokenizer's chat template) and whether vLLM would take a prompt of that
length. The tokenizer is the engine's; ``validate`` uses the same functions without an engine."""

from __future__ import annotations

from batchspec.io.rows import Row


def prompt_token_ids(tokenizer, row: Row, template_kwargs: dict | None = None) -> list[int]:
    """Tokenize a text prompt, or render chat messages with the tokenizer's chat template (and
    ``template_kwargs``, its variables: ``chat_template_kwargs``)."""
    if row.messages is not None:
        ids = tokenizer.apply_chat_template(
            row.messages, tokenize=True, add_generation_prompt=True, **(template_kwargs or {})
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(row.prompt))


def length_error(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why vLLM would refuse a prompt of this length, or None if it fits.

    vLLM refuses a prompt that leaves no room for one output token (``prompt >= max_model_len``);
    a prompt that fits but whose ``max_tokens`` would not is generated until ``length``."""
    if num_prompt_tokens >= max_model_len:
        return (
            f"prompt too long: {num_prompt_tokens} prompt tokens leave no room for output "
            f"within max_model_len {max_model_len}"
        )
    return None
