"""What every API's requests pass through in a front end, whatever their wire format.

Bottom to top: errors (`APIError`, and each API's error shape chosen by the request's path),
guards (API key and body size, as ASGI middleware), token_bound (a provable lower bound on a
prompt's tokens), json_count (a helper process that counts a large body's JSON values off the
GIL), intake (the thread pools preparation runs in), served_model (what a front end knows of the
model: limits, tokenizer, per-choice text), metrics (Prometheus), service (admission, per-request
streams, shutdown, engine failure), respond (a request to a whole answer or a stream, through
its API's `Encoder`).
"""
