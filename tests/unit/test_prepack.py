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


def test_a_forward_being_compiled_goes_through_the_custom_op(layer):
    """Compiled for real (a backend that only records the graph dynamo hands it): patching
    ``torch.compiler.is_compiling`` instead would leak, since torch._dynamo imported inside the patch
    binds the patched function for the rest of the process."""
    packed = PackedLinearForward(layer, batch_hint=8)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    x = torch.randn(3, 48)
    with torch.inference_mode():
        out = torch.compile(packed.__call__, backend=recording, fullgraph=True)(x)
    assert len(graphs) == 1 and torch.ops.raylens.packed_linear.default in graphs[0], graphs
    assert torch.ops.mkldnn._linear_pointwise.default not in graphs[0], graphs
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
