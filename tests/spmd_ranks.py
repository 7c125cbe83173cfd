"""One rank of tests/test_launcher.py's SPMD runs, started by torchrun: a whole engine over
its shard (`distributed_executor_backend="external_launcher"`), both loops; writes what it
generated to `{out}.{rank}.json`."""

from __future__ import annotations

import json
import os
import sys

from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 90))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)


def main(path: str, out: str) -> None:
    result: dict = {"rank": int(os.environ["RANK"])}
    for loop in ("sync", "async"):
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                  dtype="float32", device="cpu", kv_cache_memory_gib=1 / 16,
                  async_scheduling=loop == "async")  # fmt: skip
        result["blocks"] = llm.engine.num_kv_blocks
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            result[f"{loop}-{name}"] = [
                o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)
            ]
        llm.close()
    with open(f"{out}.{result['rank']}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
