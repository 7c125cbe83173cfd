"""Turning a conversation into a prompt: whether a tokenizer can (shared by `tandem chat`, the
benchmark's chat workload and the server's /v1/chat/completions, which word the advice for their
own users), and the prompt's token ids."""

from __future__ import annotations

NO_TOKENIZER = "this model has no tokenizer (its folder has no tokenizer files)"
NO_CHAT_TEMPLATE = "this model's tokenizer has no chat template"


def chat_template_problem(tokenizer) -> str | None:
    """Why `tokenizer` cannot render a conversation (None: it can). A folder without tokenizer
    files gives None for the tokenizer; a base model's tokenizer often has no template."""
    if tokenizer is None:
        return NO_TOKENIZER
    if not getattr(tokenizer, "chat_template", None):
        return NO_CHAT_TEMPLATE
    return None


def render_chat_text(tokenizer, messages: list[dict[str, str]]) -> str:
    """`messages` through the chat template, ready for the assistant's turn, as text. Raises
    ValueError if the template refuses them."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja's TemplateError, raise_exception() in templates
        raise ValueError(f"the chat template refused the conversation: {exc}") from None


def render_chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """`messages` through the chat template, ready for the assistant's turn, as token ids.
    Raises ValueError if the template refuses them."""
    text = render_chat_text(tokenizer, messages)
    # The template writes any BOS itself: tokenizing with special tokens would add another.
    return tokenizer(text, add_special_tokens=False).input_ids
