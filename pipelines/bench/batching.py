"""Benchmark: many concurrent requests through the step loop beside transformers' own batched
``generate``, in one process, same prompts, greedy, interleaved repeats, medians.

Rows for each concurrency N:

* ``hf generate, padded batch of N`` — left-padded prompts, one ``model.generate`` call (dynamic
  cache), the reference;
* ``hf generate, static cache, batch of N`` — on CUDA only (transformers compiles the forward);
* ``raylens, N concurrent requests`` — N requests submitted at once (default capture: hidden states
  and attention at the configured layer), with and without a logits-adjusting mod on every one;
* ``raylens, N concurrent, no announcement overlap`` — the same with every step's Sampled/Added
  announced before the next forward is launched (on a CPU, where that is the default, the row is
  ``announcements overlapped`` instead): the overlap's effect, side by side;
* ``raylens, 1 request`` and ``hf generate, 1 request`` for the single-stream ratio.

Each raylens row also reports the mean host time from a step's sampled ids to the next forward's
launch: on a GPU the device idles for that long every step.

Tokens/s counts new tokens over the whole call (prefill included) for every path. On a GPU machine
``--random-model llama31-8b`` builds Llama-3.1-8B's architecture (``configs/models/llama31-8b.json``)
with random bf16 weights once (speed does not depend on weight values) and benchmarks that.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_concurrency_bench", "format_concurrency", "build_random_model", "RANDOM_MODELS"]

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works.",
    "Describe a walk through an autumn forest.",
    "What makes a good cup of tea?",
    "Tell me about the history of maps.",
    "Describe the sea at night.",
    "List five things to pack for a camping trip and say why.",
    "How do bees make honey?",
]
REPO = Path(__file__).resolve().parents[2]


def _prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (take {i // len(PROMPTS) + 1})")
            for i in range(n)]


RANDOM_MODELS = {  # name → where it is built: its config file in configs/models/ says why each exists
    "llama31-8b": ("cuda", "bfloat16"),  # the production shapes, on a GPU
    "near-free": ("cpu", "float32"),  # 2 layers of width 64: what remains of a step is host work
}


def build_random_model(name: str = "llama31-8b", *, out: str | Path | None = None, tokenizer: str | None = None,
                       progress: Callable[[str], None] = lambda _: None) -> Path:
    """A directory ``from_pretrained`` loads: the named architecture (``configs/models/<name>.json``)
    with random weights on its device and dtype (:data:`RANDOM_MODELS`) and a tokenizer (default:
    the embedded model's; ids past its vocabulary decode to ""). Built once; seeded, so the same
    weights every time."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.model.loading import resolve_model_path

    device, dtype = RANDOM_MODELS[name]
    spec = json.loads((REPO / "configs" / "models" / f"{name}.json").read_text())
    target = Path(out or f"/tmp/raylens-{name}-random")
    if (target / "config.json").is_file():
        return target
    progress(f"building {name} with random {dtype} weights in {target} (once)…")
    started = time.perf_counter()
    config = LlamaConfig(**{k: v for k, v in spec.items() if not k.startswith("_")})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        torch.manual_seed(0)  # a script's one-off build, not a request: the global seed is fine here
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(target)
    source = tokenizer or resolve_model_path("embedded:smollm2-135m-instruct")
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    progress(f"built in {time.perf_counter() - started:.0f} s")
    return target


def run_concurrency_bench(engine: Any, *, concurrency: list[int], new_tokens: int = 64, repeats: int = 3,
                          hf_static: list[int] | None = None,
                          progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """``hf_static``: the N whose HF static-cache rows run on CUDA (None: every N and the single
    request); each batch shape costs transformers 40–90 s of compiling."""
    import torch

    backend = engine.backend
    model, tokenizer = backend.reference_model, engine.tokenizer
    device = backend.device
    from .measure import _machine, _mask_mod

    logits_mod = _mask_mod()  # the single-stream bench's logits mod: numpy edit, back through from_numpy
    if max(concurrency) > backend.max_batch:
        raise ValueError(f"`--concurrency` must be <= backend.max_batch ({backend.max_batch}), got {max(concurrency)}")

    def hf_batch(ids_list: list[list[int]], static: bool = False) -> Callable[[], int]:
        width = max(len(ids) for ids in ids_list)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in ids_list], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in ids_list], device=device)
        extra = {"cache_implementation": "static"} if static else {}

        def run() -> int:
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, **extra)
            return (out.shape[1] - width) * len(ids_list)
        return run

    loop = engine.loop
    gaps: dict[Callable[[], int], list[float]] = {}  # per raylens run: mean host gap before a launch, ms
    # per raylens run: the engine's own time per request-step, µs — the run's wall time less the
    # time inside the backend's forward calls (on a GPU a forward returns once launched, so there
    # it is the host time outside launches), over the tokens the run produced
    engine_us: dict[Callable[[], int], list[float]] = {}
    forward_s = [0.0]

    def ours(ids_list: list[list[int]], mods: list[Any] | None, *, overlap: bool | None = None,
             keep_logits: bool | None = None, top_tokens: bool | None = None) -> Callable[[], int]:
        def run() -> int:
            stats = loop.stats
            before = (stats.launch_gaps, stats.launch_gap_s)
            default = loop.defer_announcements
            loop.defer_announcements = default if overlap is None else overlap
            started, forwarded = time.perf_counter(), forward_s[0]
            try:
                with loop.admission_held():  # every request starts in the same step, as HF's batch does
                    handles = [engine.submit(input_ids=ids, max_tokens=new_tokens, temperature=0.0,
                                             ignore_eos=True, mods=mods, keep_logits=keep_logits,
                                             payload_top_tokens=top_tokens)
                               for ids in ids_list]
                produced = sum(len(h.result().sequence_ids) for h in handles)
            finally:
                loop.defer_announcements = default
            outside = (time.perf_counter() - started) - (forward_s[0] - forwarded)
            engine_us.setdefault(run, []).append(1e6 * outside / max(produced, 1))
            count = stats.launch_gaps - before[0]
            gaps.setdefault(run, []).append(1000.0 * (stats.launch_gap_s - before[1]) / count if count else 0.0)
            return produced
        return run

    def capture(hidden: bool, attention: bool, fn: Callable[[], int]) -> Callable[[], int]:
        def run() -> int:
            engine.set_capture(hidden_states=hidden, attention=attention)
            try:
                return fn()
            finally:
                engine.set_capture(hidden_states=True, attention=True)  # the default capture
        inner[run] = fn  # what it measured is recorded under the run it wraps
        return run

    inner: dict[Callable[[], int], Callable[[], int]] = {}

    paths: dict[str, Callable[[], int]] = {}
    single = [engine.encode(PROMPTS[0])]
    paths["hf generate, 1 request"] = hf_batch(single)
    static_for = (lambda n: device.type == "cuda" and (hf_static is None or n in hf_static))  # noqa: E731
    if static_for(1):
        paths["hf generate, static cache, 1 request"] = hf_batch(single, static=True)
    paths["raylens, 1 request (no capture)"] = capture(False, False, ours(single, None))
    paths["raylens, 1 request (default capture)"] = ours(single, None)
    paths["raylens, 1 request + logits mod"] = ours(single, [logits_mod])
    mod_free = {"raylens, 1 request + logits mod": "raylens, 1 request (default capture)"}  # mod row: its baseline
    for n in concurrency:
        ids_list = [engine.encode(p) for p in _prompts(n)]
        paths[f"hf generate, padded batch of {n}"] = hf_batch(ids_list)
        if static_for(n):
            paths[f"hf generate, static cache, batch of {n}"] = hf_batch(ids_list, static=True)
        paths[f"raylens, {n} concurrent (default capture)"] = ours(ids_list, None)
        # what a payload that lists each step's top tokens costs (sent payloads do; off by default here)
        paths[f"raylens, {n} concurrent, payload top tokens"] = ours(ids_list, None, top_tokens=True)
        overlap = loop.defer_announcements  # the device's default: on with CUDA, off on a CPU
        paths[f"raylens, {n} concurrent, {'no announcement overlap' if overlap else 'announcements overlapped'}"] = \
            ours(ids_list, None, overlap=not overlap)
        paths[f"raylens, {n} concurrent + logits mod each"] = ours(ids_list, [logits_mod])
        # what keeping every step's logits in the results costs (keep_logits=True; off by default)
        paths[f"raylens, {n} concurrent + logits mod each, logits kept"] = ours(ids_list, [logits_mod],
                                                                              keep_logits=True)
        for kept in ("", ", logits kept"):
            mod_free[f"raylens, {n} concurrent + logits mod each{kept}"] = f"raylens, {n} concurrent (default capture)"
    runs: dict[str, list[float]] = {name: [] for name in paths}
    inner_forward = backend.execute

    def timed_forward(rows: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner_forward(rows)
        finally:
            forward_s[0] += time.perf_counter() - t0

    def forget_warm_up() -> None:
        gaps.clear()
        engine_us.clear()

    backend.execute = timed_forward  # this instance only, for this bench; removed below
    try:
        _measure(paths, runs, repeats, device, progress, after_warm_up=forget_warm_up)
    finally:
        del backend.execute
    medians = {name: statistics.median(v) for name, v in runs.items()}
    graph_stats = dict(getattr(backend, "graph_stats", {}))
    paired = _paired_with_mod_free(runs, mod_free)
    rows = []
    for name, value in medians.items():
        measured = inner.get(paths[name], paths[name])
        gap = gaps.get(measured)
        n = 1 if "1 request" in name else int(name.split("of ")[-1].split()[0]) if "batch of" in name \
            else int(name.split(", ")[1].split()[0])
        reference = medians["hf generate, 1 request"] if n == 1 else medians[f"hf generate, padded batch of {n}"]
        own = engine_us.get(measured)
        rows.append({"path": name, "concurrency": n, "tokens_per_s": value, "vs_hf_padded": value / reference,
                     "runs": runs[name], "launch_gap_ms": statistics.median(gap) if gap else None,
                     "us_per_request_step": 1e6 / value if value else None,
                     "engine_us_per_request_step": statistics.median(own) if own else None})
        if name in paired:  # a mod's row: its throughput over the mod-free run of the same round
            rows[-1]["vs_mod_free"] = statistics.median(paired[name])
            rows[-1]["vs_mod_free_runs"] = paired[name]
    return {"model": backend.info.model_id, "device": backend.info.device, "dtype": backend.info.dtype,
            "new_tokens": new_tokens, "repeats": repeats, "rows": rows, "graph_stats": graph_stats,
            "attention": getattr(backend, "paged_reason", None), "prepacked_linears": getattr(backend, "prepacked", None),
            "machine": _machine(backend)}


def _paired_with_mod_free(runs: dict[str, list[float]], mod_free: dict[str, str]) -> dict[str, list[float]]:
    """Each mod row's tokens/s over its mod-free row's (``mod_free``: mod row → mod-free row),
    round by round. The two runs of a round are seconds apart, so a ratio per round cancels the
    host's drift between rounds, which a ratio of the two medians (each taken over rounds minutes
    apart) does not; the row reports the median of these ratios."""
    paired: dict[str, list[float]] = {}
    for name, free in mod_free.items():
        values = runs.get(name)
        if values and free in runs and len(runs[free]) == len(values):
            paired[name] = [mod / base for mod, base in zip(values, runs[free])]
    return paired


def _measure(paths: dict[str, Callable[[], int]], runs: dict[str, list[float]], repeats: int, device: Any,
             progress: Callable[[str], None], *, after_warm_up: Callable[[], Any] = lambda: None) -> None:
    """Warm every path up, then time ``repeats`` interleaved rounds of all of them (tokens/s)."""
    import torch

    from engine.engine import freeze_startup_objects

    for name, fn in paths.items():  # warm-up (and, for static caches, compilation) outside the timing
        started = time.perf_counter()
        fn()
        progress(f"warm-up {name}: {time.perf_counter() - started:.1f} s")
    after_warm_up()  # what the paths recorded while warming up is not a measurement
    # transformers' compilation leaves hundreds of thousands of long-lived objects: frozen like the
    # engine's own, so no timed run pays a full garbage collection for the warm-up's leftovers
    freeze_startup_objects()
    for r in range(repeats):
        for name, fn in paths.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            produced = fn()
            elapsed = time.perf_counter() - started
            runs[name].append(produced / elapsed)
            progress(f"repeat {r + 1}/{repeats}  {name:<48} {produced / elapsed:9.1f} tok/s")


def format_concurrency(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']} on {report['device']} ({report['dtype']}), {report['new_tokens']} new tokens "
             f"per request, greedy, median of {report['repeats']}; {report.get('machine')}; "
             f"decode {report.get('graph_stats')}", "",
             "| path | tokens/s | vs hf generate (same N) | vs mod-free (same N, each round) | µs per request-step | "
             "engine's own µs per request-step | host gap before a launch (ms) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        gap, wall, own = row.get("launch_gap_ms"), row.get("us_per_request_step"), row.get("engine_us_per_request_step")
        free = row.get("vs_mod_free")
        lines.append(f"| {row['path']} | {row['tokens_per_s']:.1f} | {row['vs_hf_padded']:.2f}x | "
                     f"{'' if free is None else f'{free:.2f}x'} | "
                     f"{'' if wall is None else f'{wall:.0f}'} | {'' if own is None else f'{own:.0f}'} | "
                     f"{'' if gap is None else f'{gap:.2f}'} |")
    return "\n".join(lines)
