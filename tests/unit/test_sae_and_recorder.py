"""SAE loading/encoding through sae-lens, and the SAE hand-off in process (inline, thread).

A tiny random TopK SAE saved in sae-lens' format stands in for a trained one (no model needed).
"""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest
import torch

from engine.services.sae_handoff import LocalTransport, RetryPolicy, SAEHandoff
from engine.model.backend import ForwardRecord
from engine.services.sae import SAEEncoder, SAELoadError, SAEShapeError, sae_layer_from_hook

D_IN, D_SAE, LAYER = 32, 64, 3


def save_sae(path, *, hook=f"blocks.{LAYER}.hook_resid_post", d_in=D_IN):
    from sae_lens import TopKSAE, TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(0)
    sae = TopKSAE(TopKSAEConfig(d_in=d_in, d_sae=D_SAE, k=8, metadata=SAEMetadata(hook_name=hook)))
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_()
    sae.save_model(path)
    return path


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory):
    return save_sae(tmp_path_factory.mktemp("sae") / "tiny")


def load(sae_dir, **kw):
    args = dict(layer=LAYER, top_k=5, model_hidden_size=D_IN, model_layers=8)
    args.update(kw)
    return SAEEncoder.load(str(sae_dir), **args)


def test_encode_topk_is_sae_lens_encode_then_topk(sae_dir):
    encoder = load(sae_dir)
    x = torch.randn(10, D_IN)
    values, indices = encoder.encode_topk(x)
    expected = torch.topk(encoder.sae.encode(x), 5)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(indices, expected.indices)
    assert encoder.identity.layer == LAYER and encoder.identity.d_sae == D_SAE
    small_batches = SAEEncoder(encoder.sae, encoder.identity, batch_tokens=3).encode_topk(x)
    torch.testing.assert_close(small_batches[0], values)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"model_hidden_size": 48}, SAEShapeError, "input width must equal the model's hidden size 48, got d_in=32"),
    ({"layer": 4}, SAEShapeError, "must match the SAE's hook blocks.3.hook_resid_post"),
    ({"model_layers": 2}, SAEShapeError, r"must be in \[0, 0\] \(the SAE's hook blocks.3.hook_resid_post reads"),
    ({"model_layers": 4}, SAEShapeError, "a step reads the last layer, 3, after the final norm"),
    ({"top_k": D_SAE + 1}, SAEShapeError, "`top_k` must be in"),
])
def test_an_sae_that_does_not_fit_the_model_is_refused(sae_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        load(sae_dir, **kwargs)


def test_missing_unknown_and_corrupt_saes_are_clear(tmp_path, sae_dir):
    with pytest.raises(SAELoadError, match="must be one of llama_scope_lxr_8x"):
        load(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SAELoadError, match="missing cfg.json, sae_weights.safetensors"):
        load(empty)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "cfg.json").write_text("{ not json")
    (corrupt / "sae_weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(SAELoadError, match="cannot be loaded"):
        load(corrupt)
    odd_hook = save_sae(tmp_path / "mlp", hook="blocks.3.hook_mlp_out")
    with pytest.raises(SAEShapeError, match="must be a residual stream"):
        load(odd_hook)


def test_hook_names_map_to_model_layers():
    assert sae_layer_from_hook("blocks.16.hook_resid_post") == 16
    assert sae_layer_from_hook("blocks.16.hook_resid_pre") == 15
    with pytest.raises(SAEShapeError):
        sae_layer_from_hook("blocks.0.hook_resid_pre")


# ---------------------------------------------------------------------------------- recorder


def forwards(n_steps=7, prompt=4, seed=0):
    """A prefill of ``prompt`` tokens then one token per step, as the loop reports them."""
    gen = torch.Generator().manual_seed(seed)
    out = [(0, ForwardRecord(0, tuple(range(100, 100 + prompt)), {LAYER: torch.randn(prompt, D_IN, generator=gen)}))]
    for step in range(1, n_steps + 1):
        out.append((step, ForwardRecord(prompt + step - 1, (200 + step,), {LAYER: torch.randn(1, D_IN, generator=gen)})))
    return out


class Collector:
    def __init__(self, fail=False, gate=None):
        self.tables, self.missing, self.calls, self.fail, self.gate = [], [], 0, fail, gate

    def write(self, rows, batch_id, request_id):
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(timeout=60)
        if self.fail:
            raise RuntimeError("disk on fire")
        self.tables.append(rows)
        return rows.num_rows

    def record_missing(self, block, reason):
        self.missing.append((block.batch_id, reason))


def local_handoff(encoder, collector, mode, *, block_steps=3, max_pending=8, skip=True, retry=RetryPolicy(2, 0.0)):
    transport = LocalTransport(encoder, collector.write, collector.record_missing, model_id="m",
                               threaded=mode == "nearline")
    return SAEHandoff(transport, layer=LAYER, block_steps=block_steps, max_pending=max_pending, retry=retry,
                      skip_first_position=skip)


def run_recorder(encoder, mode, collector=None, block_steps=3, skip=True, max_pending=8, request_id="r"):
    collector = collector or Collector()
    recorder = local_handoff(encoder, collector, mode, block_steps=block_steps, max_pending=max_pending, skip=skip)
    for step, record in forwards():
        recorder.on_forward(request_id, step, record)
    recorder.finish(request_id)
    recorder.close()
    return recorder, collector


def keyed(tables):
    rows = pa.concat_tables(tables).to_pylist()
    return sorted(rows, key=lambda r: (r["step"], r["token_position"], r["rank"]))


def test_nearline_and_inline_store_the_same_rows(sae_dir):
    encoder = load(sae_dir)
    inline, inline_rows = run_recorder(encoder, "inline")
    nearline, nearline_rows = run_recorder(encoder, "nearline")
    a, b = keyed(inline_rows.tables), keyed(nearline_rows.tables)
    assert len(a) == len(b) == (3 + 7) * 5  # prompt minus position 0, seven steps, top-5 each
    for x, y in zip(a, b):
        assert (x["step"], x["token_position"], x["token_id"], x["feature_id"], x["rank"]) == \
               (y["step"], y["token_position"], y["token_id"], y["feature_id"], y["rank"])
        assert x["activation_value"] == pytest.approx(y["activation_value"], rel=1e-4)
    assert {x["source_mode"] for x in a} == {"inline"} and {y["source_mode"] for y in b} == {"nearline"}
    assert inline.stats.blocks_stored == 8 and nearline.stats.blocks_stored == 3  # 8 forwards in blocks of 3


def test_position_zero_is_skipped_unless_asked(sae_dir):
    encoder = load(sae_dir)
    _, skipped = run_recorder(encoder, "inline")
    _, kept = run_recorder(encoder, "inline", skip=False)
    assert 0 not in {r["token_position"] for r in keyed(skipped.tables)}
    assert 0 in {r["token_position"] for r in keyed(kept.tables)}


def test_a_failing_block_is_retried_once_then_recorded_missing(sae_dir):
    recorder, collector = run_recorder(load(sae_dir), "nearline", Collector(fail=True), block_steps=100)
    assert collector.calls == 2 and recorder.stats.blocks_missing == 1 and recorder.stats.blocks_retried == 1
    assert collector.missing == [("r/0", "RuntimeError: disk on fire")]


def test_nearline_back_pressure_makes_the_loop_wait_instead_of_dropping(sae_dir):
    gate = threading.Event()
    collector = Collector(gate=gate)
    recorder = local_handoff(load(sae_dir), collector, "nearline", block_steps=1, max_pending=1)
    loop = threading.Thread(target=lambda: [recorder.on_forward("r", s, rec) for s, rec in forwards()])
    loop.start()
    deadline = time.monotonic() + 60
    while recorder.stats.backlog_waits == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.stats.backlog_waits >= 1  # the encoder is stuck: the loop waits at the bound
    gate.set()
    loop.join(timeout=60)
    recorder.finish("r")
    recorder.close()
    assert recorder.stats.blocks_stored == 8 and recorder.stats.blocks_missing == 0  # nothing dropped
