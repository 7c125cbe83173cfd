"""Whether a tokenizer can turn a conversation into a prompt: shared by `tandem chat` and the
server's /v1/chat/completions, which word the advice for their own users."""

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
