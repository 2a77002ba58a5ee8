"""Benchmark: the model's linear layers on torch's default CPU GEMM (MKL's ``sgemm``) against the
oneDNN-prepacked weights ``backend.weight_prepack`` uses, and MKL's own packed GEMM (what
inductor's ``freezing`` packs a float32 weight as) (``raylens bench --linear-kernels``).

For every distinct ``(out, in)`` shape of the loaded model's ``nn.Linear`` layers and each row
count ``M`` (a decode step of M requests), both kernels multiply the same random input, timed
interleaved; the estimate of a step's GEMM time is the sum over shapes of (layers of that shape ×
the lower quartile of its times: load on a shared machine only adds). The two results' largest
difference relative to the output's scale is reported too (float32 reassociation).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

__all__ = ["run_linear_bench", "format_linear"]


def _quartile(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 4]


def run_linear_bench(engine: Any, *, rows: tuple[int, ...] = (1, 8, 32), repeats: int = 20,
                     progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    import torch

    from engine.model.prepack import PackedLinearForward

    model = engine.backend.reference_model
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    out: dict[str, Any] = {"model": engine.backend.info.model_id, "threads": torch.get_num_threads(),
                           "shapes": {f"{o}x{i}": n for (o, i), n in shapes.items()}, "rows": []}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in rows:
            plain_total = packed_total = mkl_total = 0.0
            worst = 0.0
            for (o, i), count in shapes.items():
                linear = torch.nn.Linear(i, o, bias=False)
                linear.weight.data.copy_(torch.randn(o, i, generator=generator))
                packed = PackedLinearForward(linear, max(rows))
                x = torch.randn(m, i, generator=generator)
                reference = torch.nn.functional.linear(x, linear.weight)
                worst = max(worst, float((packed(x) - reference).abs().max() / reference.abs().max()))
                plain = _quartile(lambda: torch.nn.functional.linear(x, linear.weight), repeats)
                fast = _quartile(lambda: packed(x), repeats)
                plain_total += count * plain
                packed_total += count * fast
                if torch._C.has_mkl:  # what inductor's freezing packs a float32 weight as
                    mkl = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight, max(rows))
                    mkl_total += count * _quartile(
                        lambda: torch.ops.mkl._mkl_linear(x, mkl, linear.weight, None, max(rows)), repeats)
            out["rows"].append({"rows": m, "mkl_ms": 1e3 * plain_total, "onednn_packed_ms": 1e3 * packed_total,
                                "mkl_packed_ms": 1e3 * mkl_total if mkl_total else None,
                                "speedup": plain_total / packed_total, "max_relative_difference": worst})
            progress(f"{m:>4} rows: MKL {1e3 * plain_total:.1f} ms, oneDNN packed {1e3 * packed_total:.1f} ms")
    return out


def format_linear(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}, {report['threads']} threads; linear shapes (out x in: layers) "
             f"{report['shapes']}", "",
             "| rows (requests in a decode step) | MKL `sgemm` (ms per step) | oneDNN prepacked (ms) | speed-up | "
             "MKL packed, as inductor's freezing packs (ms) | largest difference / output scale |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        mkl = row.get("mkl_packed_ms")
        lines.append(f"| {row['rows']} | {row['mkl_ms']:.1f} | {row['onednn_packed_ms']:.1f} | {row['speedup']:.2f}x | "
                     f"{'' if mkl is None else f'{mkl:.1f}'} | {row['max_relative_difference']:.1e} |")
    return "\n".join(lines)
