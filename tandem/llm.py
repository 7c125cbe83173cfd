"""The offline Python API, in the shape vLLM users know: LLM(...).generate(prompts, params)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm import tqdm

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.lora import LoRARequest
from tandem.request import CompletionOutput, RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling params: the model's own defaults (its
        generation_config.json or GGUF metadata) over SamplingParams' (vLLM's)."""
        return SamplingParams(**self.engine.generation_defaults.values)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. Every prompt is validated before any runs.

        Each output's `outputs` holds the prompt's n samples (SamplingParams.n) in index order;
        its own text, token_ids and finish_reason are those of sample 0. Without
        `sampling_params`, the model's defaults apply (`get_default_sampling_params`).
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); an adapter not loaded yet is loaded first.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine = self.engine
        requests = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras, strict=True)):
            try:  # refuse the whole call before any work starts: nothing is half done
                requests.append(engine.make_request(prompt, p, lora_request=lora))
            except ValueError as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None  # LoraError stays one
        ids = [engine.submit(request) for request in requests]
        index = {request_id: i for i, request_id in enumerate(ids)}
        samples: list[dict[int, RequestOutput]] = [{} for _ in ids]
        total = sum(request.params.n for request in requests)
        show = sys.stderr.isatty() and total > 1 if use_tqdm is None else use_tqdm
        with tqdm(total=total, desc="generate", unit="seq", disable=not show) as bar:
            for output in engine.stream_outputs():
                if output.finished and output.request_id in index:
                    samples[index[output.request_id]][output.index] = output
                    bar.update(1)
        results = []
        for finished in samples:
            first = finished[0]
            first.outputs = [
                CompletionOutput(
                    i, out.text, out.token_ids, out.finish_reason, out.logprobs, out.reasoning
                )
                for i, out in sorted(finished.items())
            ]
            results.append(first)
        return results

    def close(self) -> None:
        self.engine.close()
