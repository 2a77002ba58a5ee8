"""Benchmark: guidellm (PyPI) streaming chat completions at ``concurrency`` clients against
``raylens serve`` on loopback, and in the same run the very requests guidellm sent, in-process on
the engine at the same concurrency. The report: output tokens/s of both and their ratio (the goal
is served >= 0.9x in-process), and TTFT p50/p95 of both.

guidellm is the client users run against OpenAI-compatible servers; running it unchanged (its own
process, synthetic prompts of ``prompt_tokens`` tokens from the local tokenizer, its /health
pre-flight check) measures what a user measures. The in-process side replays the prompts guidellm
logged (its JSON report keeps each request's body), so both sides run the same token counts.
Nothing is downloaded: the tokenizer is the model's local directory and the hub is set offline.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from engine.config.checks import is_int, is_real, require_fields
from engine.errors import RaylensError

from .measure import _machine

__all__ = ["GuidellmBench", "GuidellmRunError", "run_guidellm_bench", "format_guidellm", "guidellm_command"]


class GuidellmRunError(RaylensError):
    """guidellm exited with an error, or some of its requests failed (the server refused them)."""


@dataclass(frozen=True)
class GuidellmBench:
    """One guidellm run. ``requests``: how many guidellm sends (and the engine replays);
    ``worker_processes``: guidellm's client processes (one drives 8 streams; more compete with the
    server for this machine's cores)."""

    concurrency: int = 8
    requests: int = 32
    prompt_tokens: int = 128
    output_tokens: int = 64
    seed: int = 42
    worker_processes: int = 1
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        counts = ("concurrency", "requests", "prompt_tokens", "output_tokens", "worker_processes")
        require_fields(self, "", [(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an integer >= 1")
                                  for name in counts])
        require_fields(self, "", [
            ("requests", self.requests >= self.concurrency,
             f">= `concurrency` ({self.concurrency}): at least one request per client"),
            ("timeout_s", is_real(self.timeout_s) and self.timeout_s > 0, "a number > 0"),
        ])


def guidellm_command(url: str, model_id: str, tokenizer_dir: str, bench: GuidellmBench, output: Path) -> list[str]:
    """The ``guidellm run`` command line (the same a user types; see docs/openai-harnesses.md)."""
    return [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={url},model={model_id},request_format=/v1/chat/completions",
        "--profile", f"kind=concurrent,streams={bench.concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={bench.prompt_tokens},output_tokens={bench.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--constraint", f"kind=max_requests,count={bench.requests}",
        "--seed", f"kind=static,value={bench.seed}",
        "--output", f"kind=json,path={output}",
        "--disable-console-interactive",
    ]


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"p50": statistics.median(ordered), "p95": pick(0.95)}


def _run_guidellm(url: str, model_id: str, tokenizer_dir: str, bench: GuidellmBench) -> dict[str, Any]:
    """guidellm's report (its JSON output, one benchmark); raises when it failed or lost requests."""
    with tempfile.TemporaryDirectory(prefix="raylens-guidellm-") as tmp:
        output = Path(tmp) / "guidellm.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "GUIDELLM__MAX_WORKER_PROCESSES": str(bench.worker_processes)}
        done = subprocess.run(guidellm_command(url, model_id, tokenizer_dir, bench, output), env=env,
                              capture_output=True, text=True, timeout=bench.timeout_s)
        if done.returncode != 0 or not output.is_file():
            raise GuidellmRunError(f"guidellm exited with {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
        report = json.loads(output.read_text())
    benchmark = report["benchmarks"][0]
    errored = benchmark["requests"]["errored"]
    if errored:
        raise GuidellmRunError(f"{len(errored)} of guidellm's requests failed; the first: "
                               f"{errored[0]['info'].get('error')} (a 400 is a request field the server refuses: "
                               "guidellm streams with stream_options.continuous_usage_stats, vLLM's extension)")
    return benchmark


def _served(benchmark: dict[str, Any]) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """(the messages of every request guidellm sent, the served side's numbers)."""
    done = benchmark["requests"]["successful"]
    messages = []
    for request in done:
        body = json.loads(request["request_args"])["body"]
        messages.append([{"role": m["role"], "content": "".join(p["text"] for p in m["content"])}
                         if isinstance(m["content"], list) else m for m in body["messages"]])
    tokens = sum(r["output_tokens"] for r in done)
    span = max(r["request_end_time"] for r in done) - min(r["request_start_time"] for r in done)
    ttft = [r["time_to_first_token_ms"] for r in done]
    return messages, {"requests": len(done), "output_tokens": tokens, "seconds": span, "tokens_per_s": tokens / span,
                      "ttft_ms": _percentiles(ttft),
                      "guidellm_output_tokens_per_s_mean": benchmark["metrics"]["output_tokens_per_second"]
                      ["successful"]["mean"],
                      "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in done)}


def _in_process(engine: Any, messages: list[list[dict[str, Any]]], bench: GuidellmBench) -> dict[str, Any]:
    """The same requests on the engine: ``concurrency`` threads, each taking the next request when its
    last one ends (guidellm's concurrent profile); TTFT from submit to the first token. The prefix
    cache is skipped: the served run has just computed these very prompts, and reusing them would
    make this side's prefill nearly free."""
    from pipelines.serve.engine_stream import TokenEvent

    work: queue.Queue[list[dict[str, Any]]] = queue.Queue()
    for item in messages:
        work.put(item)
    ttft: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                item = work.get_nowait()
            except queue.Empty:
                return
            started, first, tokens = time.perf_counter(), None, 0
            for event in engine.submit(messages=item, max_tokens=bench.output_tokens, ignore_eos=True,
                                       prefix_cache=False):
                if isinstance(event, TokenEvent):
                    first = first if first is not None else time.perf_counter()
                    tokens += len(event.token_ids)
            with lock:
                ttft.append(((first or time.perf_counter()) - started) * 1000.0)
                counts.append(tokens)

    threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(bench.concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    span = time.perf_counter() - started
    return {"requests": len(counts), "output_tokens": sum(counts), "seconds": span, "tokens_per_s": sum(counts) / span,
            "ttft_ms": _percentiles(ttft)}


def run_guidellm_bench(engine: Any, bench: GuidellmBench = GuidellmBench(), *,
                       progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """guidellm against a loopback server on ``engine``, then the same requests in-process."""
    import importlib.metadata

    import httpx

    from engine.model.loading import resolve_model_path
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    load_before = os.getloadavg()  # this machine's other work shifts both sides; the report shows it
    tokenizer_dir = resolve_model_path(engine.backend.config.model_id, engine.backend.config.model_cache_dir)
    model_id = engine.backend.info.model_id
    settings = ServeSettings(max_new_tokens=max(bench.output_tokens, 16), request_timeout_s=bench.timeout_s)
    with serve_in_thread(build_app(engine, settings)) as url:
        warm = httpx.post(f"{url}/v1/chat/completions", timeout=bench.timeout_s,
                          json={"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        warm.raise_for_status()
        progress(f"guidellm: {bench.requests} streaming chat requests at {bench.concurrency} concurrent on {url}")
        benchmark = _run_guidellm(url, model_id, tokenizer_dir, bench)
    messages, served = _served(benchmark)
    progress(f"served: {served['tokens_per_s']:.1f} tok/s, TTFT p50 {served['ttft_ms']['p50']:.0f} ms")
    local = _in_process(engine, messages, bench)
    progress(f"in-process: {local['tokens_per_s']:.1f} tok/s, TTFT p50 {local['ttft_ms']['p50']:.0f} ms")
    return {"machine": _machine(engine.backend), "model": model_id, "bench": asdict(bench),
            "guidellm": importlib.metadata.version("guidellm"), "route": "/v1/chat/completions (stream)",
            "served": served, "in_process": local, "ratio": served["tokens_per_s"] / local["tokens_per_s"],
            "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()}}


def format_guidellm(report: dict[str, Any]) -> str:
    bench, served, local = report["bench"], report["served"], report["in_process"]
    lines = [f"{report['model']} on {report['machine']['device']}: guidellm {report['guidellm']}, "
             f"{bench['requests']} requests at {bench['concurrency']} concurrent, "
             f"~{bench['prompt_tokens']} prompt tokens (+ chat template), {bench['output_tokens']} new tokens", "",
             "| side | output tok/s | TTFT p50 ms | TTFT p95 ms |", "|---|---|---|---|"]
    for name, row in (("raylens serve (guidellm)", served), ("in-process", local)):
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['ttft_ms']['p50']:.0f} | {row['ttft_ms']['p95']:.0f} |")
    lines += ["", f"served / in-process tokens/s: {report['ratio']:.2f}x (goal >= 0.9x)"]
    return "\n".join(lines)
