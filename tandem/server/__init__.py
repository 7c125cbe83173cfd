"""OpenAI-compatible HTTP serving: `serve.serve(config)` for the CLI; `core.spawn_core` +
`app.create_app` to embed a front end (tests do).

Module map, bottom to top: wire (the messages between processes), core (the engine-core
process), core_client (a front end's connection to the cores), served_model (what a front end
knows of the model: limits, tokenizer, per-choice text), protocol (request bodies), errors
(OpenAI error shape), guards (API key and body size, as ASGI middleware), token_bound (a
provable lower bound on a prompt's tokens), tool_calls (tools and tool_choice -> the output's
constraint; generated text -> tool calls), prepare (body -> engine request, off the event
loop), intake (the thread pools preparation runs in), json_count (a helper process that counts
a large body's JSON values off the GIL), metrics (Prometheus), service (admission, per-request
streams, shutdown, engine failure), generate (responses and SSE), app (routes), frontend (a
front end's process: uvicorn with a graceful drain; the supervisor of several), serve (checks
the model, starts the cores, then the front ends).
"""
