"""OpenAI's API of 2023 and vLLM's extras: /v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize (`protocol`: bodies; `formats`: answers and stream chunks; `routes`)."""
