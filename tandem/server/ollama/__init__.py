"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version
(`protocol`: bodies and their translation; `encoder`: NDJSON chunks and answers; `routes`)."""
