"""Linear layers on oneDNN-prepacked weights: an eager forward calls oneDNN's op itself (the custom
op's dispatch through Python costs microseconds a call, and a decode step makes hundreds), a
compiled one goes through the custom op inductor keeps opaque; both give the plain layer's output."""

from __future__ import annotations

import pytest
import torch

from engine.model.prepack import PackedLinearForward, prepack_supported


@pytest.fixture
def layer():
    if prepack_supported(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("this torch build cannot prepack weights")
    torch.manual_seed(0)
    return torch.nn.Linear(48, 40)


def _refusing(*args):
    raise AssertionError("the custom op was called in an eager forward")


def test_an_eager_forward_calls_onednn_directly_and_matches_the_plain_layer(layer):
    packed = PackedLinearForward(layer, batch_hint=8)
    packed.op = _refusing
    x = torch.randn(2, 5, 48)
    with torch.inference_mode():
        out, plain = packed(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.shape == (2, 5, 40)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


def test_a_forward_being_compiled_goes_through_the_custom_op(layer, monkeypatch):
    packed = PackedLinearForward(layer, batch_hint=8)
    calls = []
    real = packed.op
    packed.op = lambda *args: calls.append(args[0].shape) or real(*args)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(3, 48)
    with torch.inference_mode():
        out = packed(x)
    assert calls == [torch.Size([3, 48])]
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
