"""Benchmark: the attention-streaming WebSocket on a loopback server beside the same requests
in-process (``raylens bench --serve``)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable, Sequence

from .measure import PROMPT, _machine

__all__ = ["run_serve_bench", "format_serve"]


def run_serve_bench(engine: Any, *, new_tokens: int = 32, streams: Sequence[int] = (1, 4, 16),
                    progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The attention-streaming WebSocket on a loopback server beside the same requests in-process.

    Per-token latency (median gap between token messages) with attention off and on, bytes per
    token for each attention encoding, and tokens/s with ``streams`` concurrent clients against the
    same number of concurrent in-process requests (threads over ``submit``)."""
    import asyncio
    import threading

    import websockets

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    ids = engine.encode(PROMPT)
    base = {"type": "generate", "input_ids": ids, "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    async def one(url: str, extra: dict[str, Any]) -> tuple[list[float], int, int]:
        gaps: list[float] = []
        size = tokens = 0
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({**base, **extra}))
            last = time.perf_counter()
            while True:
                raw = await ws.recv()
                now = time.perf_counter()
                size += len(raw)
                if isinstance(raw, bytes):
                    continue
                kind = json.loads(raw)["type"]
                if kind != "token":
                    return gaps, size, tokens
                gaps.append((now - last) * 1000.0)
                last, tokens = now, tokens + 1

    encodings: dict[str, dict[str, Any]] = {"attention off": {}, "per_layer float32 base64": {"return_attention": True},
                 "per_layer float16 gzip": {"return_attention": True, "attention_dtype": "float16",
                                            "attention_compression": "gzip"},
                 "per_layer float32 binary frames": {"return_attention": True, "binary": True},
                 "aggregated mean": {"return_attention": True, "attention_format": "aggregated"}}
    report: dict[str, Any] = {"machine": _machine(engine.backend), "model": engine.backend.info.model_id,
                              "prompt_tokens": len(ids), "new_tokens": new_tokens, "latency_ms": {},
                              "bytes_per_token": {}, "tokens_per_s": {}}
    settings = ServeSettings(max_new_tokens=new_tokens, max_ws_connections=max(streams) + 1)
    with serve_in_thread(build_app(engine, settings)) as http_url:
        url = http_url.replace("http://", "ws://") + "/api/v1/generate/stream"
        asyncio.run(one(url, {"max_new_tokens": 2}))  # warm-up
        for name, extra in encodings.items():
            gaps, size, tokens = asyncio.run(one(url, extra))
            report["latency_ms"][name] = statistics.median(gaps[1:] or gaps)  # after the first (prefill) token
            report["bytes_per_token"][name] = size / max(tokens, 1)
            progress(f"{name}: {report['latency_ms'][name]:.1f} ms/token, {report['bytes_per_token'][name]:.0f} B/token")
        for n in streams:
            async def many() -> int:
                results = await asyncio.gather(*(one(url, {}) for _ in range(n)))
                return sum(tokens for _, _, tokens in results)

            started = time.perf_counter()
            total = asyncio.run(many())
            served = total / (time.perf_counter() - started)

            def in_process(out: list[int]) -> None:
                handle = engine.submit(input_ids=ids, max_tokens=new_tokens, temperature=0, ignore_eos=True)
                out.append(sum(len(e.token_ids) for e in handle if hasattr(e, "token_ids")))

            counts: list[int] = []
            threads = [threading.Thread(target=in_process, args=(counts,)) for _ in range(n)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            local = sum(counts) / (time.perf_counter() - started)
            report["tokens_per_s"][n] = {"websocket": served, "in_process": local, "ratio": served / local}
            progress(f"{n} streams: websocket {served:.1f} tok/s, in-process {local:.1f} tok/s")
    return report


def format_serve(report: dict[str, Any]) -> str:
    lines = [f"{report['model']} on {report['machine']['device']}, prompt {report['prompt_tokens']} tokens, "
             f"{report['new_tokens']} new tokens", "", "| stream | ms/token | bytes/token |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.1f} | {report['bytes_per_token'][name]:.0f} |"
              for name, ms in report["latency_ms"].items()]
    lines += ["", "| concurrent streams | WebSocket tok/s | in-process tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {n} | {row['websocket']:.1f} | {row['in_process']:.1f} | {row['ratio']:.2f} |"
              for n, row in report["tokens_per_s"].items()]
    return "\n".join(lines)
