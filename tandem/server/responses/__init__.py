"""OpenAI's Responses API: /v1/responses (`protocol`: bodies and their translation; `encoder`:
response objects and the event stream; `store`: stored responses; `routes`)."""
