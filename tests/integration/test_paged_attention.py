"""Attention that reads the paged KV pool in place (``backend.paged_attention``) gives what the
gathering forward gives, step by step, on the same weights: left-padded prefills of different
lengths over block tables that are not in order, decode steps, a chunk fed after cached positions
(a prefix hit's shape) beside a decoding row, a Backtrack (a row feeding again from an earlier
position, its stale keys still in its blocks), the static decode buffers (the CUDA-graph path)
and a sliding window. Logits, each row's captured residual stream and attention pattern are
compared; a greedy token only where its margin over the runner-up exceeds the tolerance (random
weights make near-ties).

On a CPU the plain-torch ``reference`` kernel runs (the plumbing: metadata, packing and unpacking
of queries, causal alignment, windows, capture); on CUDA the FlashAttention varlen kernel
``auto`` picks (bfloat16, 256-position blocks). Tiny random models: nothing downloaded, so the
CUDA case runs on a lent GPU machine without the embedded model's package."""

from __future__ import annotations

import random

import pytest

from tests.random_models import VOCAB, tiny_model_dir

CASES = [
    pytest.param("cpu", "reference", "float32", 16, id="cpu-reference"),
    pytest.param("cuda", "auto", "bfloat16", 256, id="cuda-flash", marks=pytest.mark.skipif(
        "not __import__('torch').cuda.is_available()",
        reason="needs a CUDA device: FlashAttention's paged varlen kernels run on CUDA only, and this machine has "
               "none (the CPU case checks the same plumbing with the reference kernel)")),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {"llama": tiny_model_dir(root), "mistral": tiny_model_dir(root, "mistral", sliding_window=24)}


def _backend(path, device, kernel, dtype, block_size, graph_decode):
    from engine.config import BackendConfig
    from engine.model.hf import HuggingFaceBackend

    return HuggingFaceBackend(BackendConfig(
        model_id=str(path), device=device, dtype=dtype, hidden_state_layer=0, max_batch=4, max_sequence=1024,
        kv_block_size=block_size, kv_cache_tokens=24 * block_size, paged_attention=kernel, prefix_caching=False,
        graph_decode=graph_decode))


def _steps(block_size: int):
    """(rows as (id, start, tokens), all_query_rows) per forward, over tables whose blocks are
    interleaved between rows."""
    rng = random.Random(7)
    unit = block_size // 16  # the same scenario in positions scaled to the block size
    lengths = [40 * unit, 7 * unit, 33 * unit]
    tables = {"a": [1, 4, 7, 10, 13, 16], "b": [2, 5, 8, 11, 14, 17], "c": [3, 6, 9, 12, 15, 18]}
    ids = lambda n: tuple(rng.randrange(3, VOCAB) for _ in range(n))  # noqa: E731
    steps = [([("a", 0, ids(lengths[0])), ("b", 0, ids(lengths[1])), ("c", 0, ids(lengths[2]))], True)]
    ends = dict(zip("abc", lengths))
    for _ in range(3):
        steps.append(([(r, ends[r], ids(1)) for r in "abc"], False))
        ends = {r: e + 1 for r, e in ends.items()}
    steps.append(([("a", ends["a"], ids(5)), ("b", ends["b"], ids(1))], True))  # a chunk beside a decode
    ends["a"] += 5
    ends["b"] += 1
    steps.append(([("c", ends["c"] - 3, ids(1)), ("a", ends["a"], ids(1))], False))  # c backtracked 3 positions
    return tables, steps


def _run(backend, tables, steps):
    from engine.model.backend import ForwardBatch, ForwardRow
    from engine.model.capture import CapturePlan, event_plan

    names = event_plan(0, hidden_states=True, attention=True) | event_plan(1, hidden_states=False, attention=True)
    outs = []
    for rows, every_query in steps:
        plan = CapturePlan(names, every_query)
        batch = tuple(ForwardRow(r, start, tokens, plan, table=tables[r]) for r, start, tokens in rows)
        outs.append(backend.execute(ForwardBatch(batch, 24)))
    return outs


def _compare(paged, gathered, tol):
    import torch

    compared = 0
    for step, (p, g) in enumerate(zip(paged, gathered)):
        scale = float(g.logits.abs().max())
        diff = float((p.logits.float() - g.logits.float()).abs().max())
        assert diff <= tol * scale, f"step {step}: logits differ by {diff:.3g}, bound {tol * scale:.3g}"
        top = g.logits.float().topk(2, dim=-1)
        clear = (top.values[:, 0] - top.values[:, 1]) > 2 * tol * scale
        assert torch.equal(p.logits.argmax(-1)[clear], top.indices[clear, 0]), f"step {step}: a clear greedy token moved"
        for row, (cp, cg) in enumerate(zip(p.captured, g.captured)):
            for layer, tensor in cg.hidden.items():
                assert cp.hidden[layer].shape == tensor.shape
                bound = tol * float(tensor.abs().max())
                assert float((cp.hidden[layer] - tensor).abs().max()) <= bound, f"step {step} row {row}: hidden {layer}"
            assert cp.attention.keys() == cg.attention.keys() == {0, 1}
            for layer, pattern in cg.attention.items():
                assert cp.attention[layer].shape == pattern.shape, f"step {step} row {row}: pattern {layer} shape"
                assert float((cp.attention[layer] - pattern).abs().max()) <= tol, f"step {step} row {row}: pattern {layer}"
                compared += 1
    return compared


@pytest.mark.parametrize("device,kernel,dtype,block_size", CASES)
@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("graph_decode", ["off", "static"])
def test_paged_attention_gives_the_gathering_forwards_results(models, device, kernel, dtype, block_size, family,
                                                              graph_decode):
    if device == "cuda" and graph_decode == "static":
        graph_decode = "auto"  # on CUDA: the decode steps replay captured graphs
    paged = _backend(models[family], device, kernel, dtype, block_size, graph_decode)
    assert paged.paged_kernel is not None, f"no paged kernel here: {paged.paged_reason}"
    gathered = _backend(models[family], device, "off", dtype, block_size, graph_decode)
    assert gathered.paged_kernel is None
    tables, steps = _steps(block_size)
    tol = 1e-4 if dtype == "float32" else 3e-2
    compared = _compare(_run(paged, tables, steps), _run(gathered, tables, steps), tol)
    assert compared >= 2 * sum(len(rows) for rows, _ in steps), "fewer captured patterns than rows: nothing compared"
    if graph_decode != "off":
        assert paged.graph_stats["static_steps"] > 0, "the static decode path never ran"


def test_kernel_selection_says_why_a_kernel_cannot_serve():
    """``auto`` names the condition that failed; ``off`` and a soft-capped model take none."""
    import torch

    from engine.model.paged_attention import FLASH_PAGE_MULTIPLE, select_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kernel, reason = select_kernel("auto", device=cpu, dtype=torch.float32, block_size=256, softcapped=False)
    assert kernel is None and "CUDA only" in reason
    kernel, reason = select_kernel("auto", device=cuda, dtype=torch.float32, block_size=256, softcapped=False)
    assert kernel is None and "float16 or bfloat16" in reason
    kernel, reason = select_kernel("auto", device=cuda, dtype=torch.bfloat16, block_size=16, softcapped=False)
    assert kernel is None and f"multiple of {FLASH_PAGE_MULTIPLE}" in reason and "kv_block_size" in reason
    kernel, reason = select_kernel("reference", device=cpu, dtype=torch.float32, block_size=16, softcapped=True)
    assert kernel is None and "soft-caps" in reason
    kernel, _ = select_kernel("reference", device=cpu, dtype=torch.float32, block_size=16, softcapped=False)
    assert kernel is not None and kernel.name == "reference"
    assert select_kernel("off", device=cpu, dtype=torch.float32, block_size=16, softcapped=False)[0] is None
