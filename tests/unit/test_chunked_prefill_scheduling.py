"""The scheduler's token budget and chunked prefill, on a scripted model: decoding rows first, one
token each; prompt chunks fill the rest; a chunked prompt's joined internals equal one forward's;
a request cancelled mid-prefill leaves at the next step and frees its slot.

The integration twin (tests/integration/test_chunked_prefill.py) checks the same on the embedded
model, events and SAE rows included.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.core.chunks import join_chunks
from engine.core.result import FinishReason
from engine.core.scheduler import plan_tokens
from engine.model.backend import ForwardRow, RowOutput
from engine.model.capture import CapturePlan, RowCapture, attention_pattern
from mods import Prefilled
from tests.helpers import CharTokenizer, ScriptedBackend, build_generation_cfg, event_types

TOK = CharTokenizer()
LONG = "Please summarise the following long document carefully."  # 55 characters


def test_decoding_rows_take_one_token_each_first_and_prompt_chunks_fill_the_rest():
    # (decoding, tokens it has to feed) per running request
    running = [(False, 50), (True, 1), (False, 7), (True, 1), (True, 0)]
    # two decoding rows reserve 2 tokens; the first prompt takes the other 8, the second waits
    assert plan_tokens(running, 10) == [(1, 1), (3, 1), (0, 8)]
    running = [(False, 3), (True, 1), (False, 4), (False, 9)]
    assert plan_tokens(running, 10) == [(1, 1), (0, 3), (2, 4), (3, 2)]  # 10 in all


def test_a_decoding_row_with_several_tokens_to_feed_takes_what_the_reservations_leave():
    running = [(True, 9), (True, 1), (True, 1), (False, 5)]
    plan = plan_tokens(running, 6)
    assert plan == [(0, 4), (1, 1), (2, 1)]  # every decoding row fed; nothing left for the prompt
    assert sum(n for _, n in plan) == 6


def test_a_budget_below_max_batch_is_refused_with_the_fix():
    from engine.config import BackendConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"`max_step_tokens` must be >= max_batch \(8"):
        BackendConfig(model_id="m", max_batch=8, max_step_tokens=4)
    assert BackendConfig(model_id="m", max_batch=8, max_step_tokens=8).max_step_tokens == 8
    with pytest.raises(ValueError, match="max_step_tokens"):
        from engine.core.kv_manager import KVManager
        from engine.core.scheduler import Scheduler
        from engine.model.backend import KVLayout

        Scheduler(KVManager(KVLayout(16, 4, 4, 0)), max_batch=8, max_step_tokens=4, max_sequence=64)


def test_joined_chunks_equal_one_forward_of_the_whole_prompt():
    torch.manual_seed(0)
    heads, length, dim = 3, 11, 8
    query, key = torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim)
    hidden = torch.randn(length, 16)
    whole = attention_pattern(query, key, None, dim ** -0.5, 1, newest_row_only=False)[0]  # (h, P, P)
    plan = CapturePlan(all_query_rows=True)
    parts = []
    for start, end in [(0, 4), (4, 5), (5, 11)]:  # a one-token chunk too
        pattern = attention_pattern(query[:, :, start:end], key[:, :, :end], None, dim ** -0.5, 1,
                                    newest_row_only=False)[0]  # (h, q, end)
        capture = RowCapture({16: hidden[start:end]}, {16: pattern})
        parts.append((ForwardRow("r", start, tuple(range(start, end)), plan),
                      RowOutput(torch.full((5,), float(end)), capture, (None, None))))
    row, output = join_chunks(parts)
    assert (row.start, row.tokens) == (0, tuple(range(length)))
    assert torch.equal(output.captured.hidden[16], hidden)
    assert output.captured.attention[16].shape == (heads, length, length)
    scale = whole.abs().max()
    assert (output.captured.attention[16] - whole).abs().max() <= 1e-6 * scale
    assert torch.equal(output.logits, parts[-1][1].logits)  # the position after the last chunk
    # positive control: an unpadded, unjoined chunk is not the whole pattern
    assert parts[0][1].captured.attention[16].shape != whole.shape


class ChunkingBackend(ScriptedBackend):
    """The scripted model with a token budget, knowing each request's prompt length (so a prompt
    fed in chunks still writes the script after it), recording every row it was asked to feed.
    ``pause_on``: on that request's first row, signal ``paused`` and wait for ``resume``."""

    def __init__(self, prompt_lens: dict[str, int], *, max_batch: int, max_step_tokens: int,
                 pause_on: str | None = None) -> None:
        from engine.config import BackendConfig

        super().__init__("hello world")
        self.config = BackendConfig(model_id="scripted", device="cpu", hidden_state_layer=0, max_batch=max_batch,
                                    max_step_tokens=max_step_tokens)
        self.max_batch = max_batch
        self.prompt_lens = prompt_lens
        self.forwards: list[list[tuple[str, int, int]]] = []  # per forward: (request, start, tokens)
        self.pause_on, self.paused, self.resume = pause_on, threading.Event(), threading.Event()

    def _sequence_of(self, row):
        seq = super()._sequence_of(row)
        seq["declared"] = self.prompt_lens[row.request_id]
        return seq

    def _feed(self, seq: dict[str, Any], start: int, tokens: Any) -> None:
        super()._feed(seq, start, tokens)
        seq["prompt_len"] = seq["declared"]

    def _logits(self, seq: dict[str, Any]):
        if len(seq["tokens"]) < seq["prompt_len"]:  # mid-prefill: a prediction nobody reads
            return torch.zeros(self.info.vocab_size)
        return super()._logits(seq)

    def execute(self, batch):
        rows = batch.rows
        self.forwards.append([(r.request_id, r.start, len(r.tokens)) for r in rows])
        if self.pause_on is not None and any(r.request_id == self.pause_on for r in rows) and not self.paused.is_set():
            self.paused.set()
            assert self.resume.wait(60), "the test never resumed the forward"
        return super().execute(batch)


def _engine(backend):
    from engine import Engine
    from engine.config import RaylensConfig

    return Engine(RaylensConfig(generation=build_generation_cfg(temperature=0.0, max_tokens=32)), backend=backend)


def test_a_long_prompt_is_prefilled_in_chunks_while_its_neighbour_gets_a_token_every_step():
    ids = {"short": TOK.encode("Q:"), "long": TOK.encode(LONG)}
    backend = ChunkingBackend({k: len(v) for k, v in ids.items()}, max_batch=2, max_step_tokens=4,
                              pause_on="short")
    eng = _engine(backend)
    try:
        short = eng.submit(input_ids=ids["short"], request_id="short")
        assert backend.paused.wait(60)  # the short one is in its first forward: the long one joins it
        long = eng.submit(input_ids=ids["long"], request_id="long")
        backend.resume.set()
        short_result, long_result = short.result(timeout=60), long.result(timeout=60)
    finally:
        backend.resume.set()
        eng.close()
    assert short_result.output_text == long_result.output_text == "hello world"
    assert event_types(long_result).count("Prefilled") == 1 and isinstance(long_result.events[0], Prefilled)
    assert long_result.events[0].input_ids == ids["long"]
    chunks = [(start, n) for rows in backend.forwards for rid, start, n in rows if rid == "long" and start < len(LONG)]
    assert len(chunks) >= math.ceil(len(LONG) / 4) and len(chunks) > 1
    assert [s for s, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]  # contiguous
    assert sum(n for _, n in chunks) == len(LONG)
    for rows in backend.forwards:
        assert sum(n for _, _, n in rows) <= 4, f"a step fed more than the budget: {rows}"
    # from the long prompt's first chunk to the short request's last row, every forward fed both:
    # one token of the short one and a chunk of the long prompt
    fed = [{rid: (start, n) for rid, start, n in rows} for rows in backend.forwards]
    first_long = min(i for i, rows in enumerate(fed) if "long" in rows)
    last_short = max(i for i, rows in enumerate(fed) if "short" in rows)
    assert last_short - first_long >= 5, "the two never shared steps: the test proved nothing"
    for rows in fed[first_long:last_short + 1]:
        assert rows["short"][1] == 1 and sum(rows["long"]) <= len(LONG), rows


def test_a_request_cancelled_mid_prefill_leaves_at_the_next_step_and_frees_its_slot():
    ids = {"long": TOK.encode(LONG), "next": TOK.encode("Q:")}
    backend = ChunkingBackend({k: len(v) for k, v in ids.items()}, max_batch=1, max_step_tokens=4,
                              pause_on="long")
    eng = _engine(backend)
    try:
        long = eng.submit(input_ids=ids["long"], request_id="long")
        waiting = eng.submit(input_ids=ids["next"], request_id="next")  # queued: the one slot is taken
        assert backend.paused.wait(60), "the long prompt's first chunk never reached the model"
        long.cancel()
        backend.resume.set()
        long_result, next_result = long.result(timeout=60), waiting.result(timeout=60)
        eng_blocks_used = eng.cache_stats()["blocks_used"]
    finally:
        backend.resume.set()
        eng.close()
    assert long_result.finish_reason is FinishReason.CANCELLED
    assert long_result.events == [] and long_result.output_ids == []  # Prefilled never came
    fed = [(start, n) for rows in backend.forwards for rid, start, n in rows if rid == "long"]
    assert fed == [(0, 4)], "the cancelled request was fed again after its cancel"
    assert len(LONG) > 4  # positive control: it needed more chunks than it got
    assert next_result.output_text == "hello world"  # the queued request ran in its batch place ...
    assert eng_blocks_used == 0  # ... and every block went back to the pool


def test_forced_tokens_longer_than_the_budget_are_fed_over_several_steps_with_the_same_events():
    """A decoding request's forced chunk that does not fit one step is fed in parts; no step runs
    on the forward before it, and everything a mod or the stream sees equals an unsplit run."""
    from mods import ForceTokens, ForwardPass

    forced = TOK.encode(" and so on")  # 10 tokens, more than a step of 4 feeds

    def force_once(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step == 1:
            return ForceTokens(forced)
        return None

    def run(budget):
        ids = TOK.encode("Q:")
        backend = ChunkingBackend({"r": len(ids)}, max_batch=1, max_step_tokens=budget)
        eng = _engine(backend)
        try:
            handle = eng.submit(input_ids=ids, request_id="r", mods=[force_once])
            stream = [(e.token_ids, e.forced) for e in handle]
            return handle.result(timeout=60), stream, backend.forwards
        finally:
            eng.close()

    (split, split_stream, split_rows), (whole, whole_stream, whole_rows) = run(4), run(512)
    assert [n for rows in split_rows for _, _, n in rows if n > 1][1:] == [4, 4, 2]  # the forced feed, in parts
    assert [n for rows in whole_rows for _, _, n in rows if n > 1][1:] == [len(forced)]  # positive control
    assert split.sequence_ids == whole.sequence_ids and forced == split.sequence_ids[1:1 + len(forced)]
    assert [(type(e).__name__, e.step) for e in split.events] == [(type(e).__name__, e.step) for e in whole.events]
    assert [e.input_ids for e in split.events if isinstance(e, ForwardPass)] == \
        [e.input_ids for e in whole.events if isinstance(e, ForwardPass)]
    assert split_stream == whole_stream and split.finish_reason is whole.finish_reason
