"""The newer model families through the server: Gemma 3, a mixture of experts, and layers of
different windows (several block tables), each in a real engine-core process answering the
official `openai` client, streamed and not, as the offline `LLM` answers."""

from __future__ import annotations

import pytest
from test_server import ENGINE_OPTIONS, assert_idle, greedy, start_server

from tandem import LLM


@pytest.fixture(params=["Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "sliding"])
def checkpoint(request, tiny_checkpoints, sliding_qwen3):
    if request.param == "sliding":
        return sliding_qwen3
    return tiny_checkpoints[request.param]


def test_completions_equal_offline_streamed_and_not(checkpoint):
    prompts = [[5, 17, 300, 42, 8, 77, 91, 12, 600, 3, 44], [9, 10, 11]]
    offline = LLM(str(checkpoint), **ENGINE_OPTIONS)
    try:
        expected = [o.token_ids for o in offline.generate(prompts, greedy(12))]
        texts = [o.text for o in offline.generate(prompts, greedy(12))]
    finally:
        offline.close()
    live = start_server(checkpoint)
    try:
        client, model = live.client(), live.model.model_path.name
        for prompt, ids, text in zip(prompts, expected, texts, strict=True):
            kwargs = dict(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                          extra_body={"ignore_eos": True})  # fmt: skip
            out = client.completions.create(**kwargs, logprobs=0)
            assert out.choices[0].text == text
            assert len(out.choices[0].logprobs.tokens) == len(ids)
            streamed = "".join(
                chunk.choices[0].text for chunk in client.completions.create(**kwargs, stream=True)
            )
            assert streamed == text
        assert_idle(live)
    finally:
        live.stop()
