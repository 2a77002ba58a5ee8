"""The README's GPU rows from a ``raylens bench --concurrency …`` report, beside the memory
roofline: ``python -m pipelines.bench.gpu_rows REPORT.json [--model llama31-8b]``.

The roofline is what memory bandwidth allows a decode step: every step reads every weight once
(shared by the batch) and each row's keys/values, so ``N`` rows make at most
``N · bandwidth / (weight bytes + N · context · KV bytes per position)`` tokens/s. The bandwidth is
measured here, a device-to-device copy of 2 GiB (read and write counted), on the device the report
ran on; the weight bytes are the model's parameters in its dtype, counted on the meta device (no
memory). The goals are the issue's: one stream ≥ 140 tokens/s, ≥ 1.0× HF static at 32, ≥ 4,000
tokens/s at 128 with the default capture, a logits mod on each request ≥ 0.8× mod-free.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["measure_bandwidth", "weight_bytes", "format_gpu_rows", "main"]

REPO = Path(__file__).resolve().parents[2]


def measure_bandwidth(device: str, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (bytes read + bytes written, over the median time)."""
    import statistics

    import torch

    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 2 * nbytes / statistics.median(times[2:])


def weight_bytes(name: str) -> tuple[int, int]:
    """(parameter bytes, KV bytes per position) of ``configs/models/<name>.json`` in its bench dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelines.bench.batching import RANDOM_MODELS

    spec = json.loads((REPO / "configs" / "models" / f"{name}.json").read_text())
    config = LlamaConfig(**{k: v for k, v in spec.items() if not k.startswith("_")})
    size = torch.empty((), dtype=getattr(torch, RANDOM_MODELS[name][1])).element_size()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size
    return sum(p.numel() for p in model.parameters()) * size, kv


def _find(report: dict[str, Any], path: str) -> dict[str, Any]:
    """The report's row of ``path`` (empty when it did not run)."""
    return next((row for row in report["rows"] if row["path"] == path), {})


def _row(report: dict[str, Any], path: str) -> float | None:
    return _find(report, path).get("tokens_per_s")


def format_gpu_rows(report: dict[str, Any], bandwidth: float, weights: int, kv_per_position: int,
                    context: int) -> str:
    machine = report.get("machine", {})
    lines = [f"{machine.get('gpu', report['device'])}, torch {machine.get('torch')}, transformers "
             f"{machine.get('transformers')}, {report['dtype']}, {report['new_tokens']} new tokens, median of "
             f"{report['repeats']}; attention: {report.get('attention')}; decode {report.get('graph_stats')}",
             f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB; "
             f"~{context} positions per request", "",
             "| path | tokens/s | vs HF `generate` (same N) | roofline (tokens/s) |", "|---|---:|---:|---:|"]
    for row in report["rows"]:
        n = row["concurrency"]
        roof = n * bandwidth / (weights + n * context * kv_per_position)
        lines.append(f"| {row['path']} | {row['tokens_per_s']:,.1f} | {row['vs_hf_padded']:.2f}× | {roof:,.0f} |")
    single = _row(report, "raylens, 1 request (default capture)")
    goals = [("one stream, default capture ≥ 140 tokens/s", single, 140.0)]
    static32, ours32 = _row(report, "hf generate, static cache, batch of 32"), \
        _row(report, "raylens, 32 concurrent (default capture)")
    if static32 and ours32:
        goals.append(("32 concurrent ≥ 1.0× HF static", ours32 / static32, 1.0))
    goals.append(("128 concurrent, default capture ≥ 4,000 tokens/s",
                  _row(report, "raylens, 128 concurrent (default capture)"), 4000.0))
    for n in sorted({row["concurrency"] for row in report["rows"] if row["concurrency"] > 1}):
        free, modded = _row(report, f"raylens, {n} concurrent (default capture)"), \
            _row(report, f"raylens, {n} concurrent + logits mod each")
        paired = _find(report, f"raylens, {n} concurrent + logits mod each").get("vs_mod_free")
        if paired is not None:  # the median of each round's ratio (a report from before it: the medians' ratio)
            goals.append((f"{n} concurrent, a logits mod each ≥ 0.8× mod-free", paired, 0.8))
        elif free and modded:
            goals.append((f"{n} concurrent, a logits mod each ≥ 0.8× mod-free", modded / free, 0.8))
    lines += ["", "| goal | measured | met |", "|---|---:|---|"]
    for name, value, bound in goals:
        shown = "not run" if value is None else f"{value:,.2f}"
        lines.append(f"| {name} | {shown} | {'' if value is None else 'yes' if value >= bound else '**no**'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench.gpu_rows", description=__doc__.split("\n")[0])
    parser.add_argument("report", help="the JSON `raylens bench --concurrency … --out` wrote")
    parser.add_argument("--model", default="llama31-8b", help="configs/models/<name>.json the report ran")
    parser.add_argument("--context", type=int, default=100, help="positions per request for the roofline's KV reads")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.report).read_text())
    report = data.get("concurrency", data)
    device = report["device"]
    bandwidth = measure_bandwidth(device)
    weights, kv = weight_bytes(args.model)
    print(format_gpu_rows(report, bandwidth, weights, kv, args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
