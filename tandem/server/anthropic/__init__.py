"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens (`protocol`: bodies and
their translation; `messages`: messages, the event stream and the error shape; `routes`)."""
