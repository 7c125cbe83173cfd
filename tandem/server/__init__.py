"""The server: `serve.serve(config)` for the CLI; `core.process.start_core` + `app.create_app`
to embed a front end (tests do).

Layers, bottom to top (`tests/test_layers.py` holds them):
- `core/`: the engine-core process (`process`), the messages between processes (`wire`), a
  front end's connection to the cores (`client`);
- `frontend/`: what every request passes through whatever its API (errors and their shapes,
  guards, the prompt bound, intake lanes, `ServedModel`, metrics, `GenerationService` with the
  `Encoder` protocol, `respond`);
- `generation/`: the translation every API shares (`request`: Tandem's own request form;
  `fields`: bodies that accept unknown fields; `prepare`: a job to engine requests; `tools`:
  tool plans and parsers; `output`: an answer as text and tool-call blocks);
- one package per API, none importing another: `openai/` (completions, chat completions,
  models, tokenize), `responses/`, `anthropic/`, `ollama/`;
- `app` (every API's routes on one app), `frontend_process` (uvicorn with a graceful drain; the
  supervisor of several front ends), `serve` (checks the model, starts the cores, then the front
  ends).
"""
