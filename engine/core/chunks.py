"""A feed split over several forwards (a long prompt under the step's token budget) joined into the
one output an unsplit forward gives, so that nothing above the request's machine sees chunks."""

from __future__ import annotations

from typing import Sequence

import torch

from engine.model.backend import ForwardRow, RowOutput
from engine.model.capture import RowCapture

__all__ = ["join_chunks"]


def join_chunks(parts: Sequence[tuple[ForwardRow, RowOutput]]) -> tuple[ForwardRow, RowOutput]:
    """The row and output one forward of every chunk's tokens would have given: logits and top
    log-probs of the last chunk; hidden ``(q_total, d)`` concatenated; attention, when every query
    row was asked for, ``(heads, q_total, kv)`` with each earlier chunk's ``(heads, q_i, kv_i)``
    zero-padded to the last chunk's ``kv`` (causal: the keys after a chunk get no weight from it),
    else the last chunk's newest row."""
    first, (last_row, last_out) = parts[0][0], parts[-1]
    hidden = {layer: torch.cat([out.captured.hidden[layer] for _, out in parts])
              for layer in last_out.captured.hidden}
    attention = dict(last_out.captured.attention)
    if last_row.plan.all_query_rows:
        for layer, newest in last_out.captured.attention.items():
            kv = newest.shape[-1]
            attention[layer] = torch.cat([torch.nn.functional.pad(out.captured.attention[layer],
                                                                  (0, kv - out.captured.attention[layer].shape[-1]))
                                          for _, out in parts], dim=1)
    tokens = tuple(t for row, _ in parts for t in row.tokens)
    row = ForwardRow(first.request_id, first.start, tokens, last_row.plan, last_row.steer, last_row.steer_layer)
    return row, RowOutput(last_out.logits, RowCapture(hidden, attention), last_out.top)
