"""Test helpers: config builders, a character tokenizer and a scripted model backend.

The scripted backend stands in for the *model* (it implements the Backend protocol with
predictable logits), so the real generation loop, ModManager and payload builder can be tested for
exact event/action semantics without a model's noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mods.types import AdjustedLogits, ForwardPass

REPO = Path(__file__).resolve().parent.parent
SHARED_DOCS = REPO.parent / "shared" / "docs"
TEST_MODS = Path(__file__).resolve().parent / "mods"

FP32_NOISE_TOL = 1e-4  # float32 reassociation noise between attention kernels of one model


def build_config(**backend_overrides: Any):
    """The local config (embedded model on CPU) with backend overrides. The environment is ignored
    (a developer's CONCORDANCE_* must not change test results) except where the model cache is."""
    import os

    from engine.config import load_config

    env = {k: os.environ[k] for k in ("RAYLENS_MODEL_CACHE",) if k in os.environ}
    return load_config(REPO / "configs" / "local.yaml", env=env, overrides={"backend": backend_overrides})


def keeping_logits(cfg: Any) -> Any:
    """``cfg`` with ``generation.keep_logits`` on: for tests that compare every ForwardPass's
    logits after the run (the default releases them once their step is over)."""
    return dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, keep_logits=True))


@contextlib.contextmanager
def loopback_http_server(handler: type) -> Iterator[Any]:
    """A real HTTP server on 127.0.0.1 (a free port) in a thread, shut down on exit: the stand-in
    for remote services (ingest backend, Neuronpedia) in tests."""
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def build_generation_cfg(**overrides: Any):
    from engine.config import GenerationConfig

    return dataclasses.replace(GenerationConfig(), **overrides)


def lark_chain(n: int) -> str:
    """A Lark grammar of ``n`` rules, each calling the next: llguidance's compile recurses ``n``
    deep (5,000 overflow an 8 MiB stack: the grammar that used to crash the generator)."""
    return "\n".join(["start: r0", *(f'r{i}: "a{i % 10}" r{i + 1}' for i in range(n - 1)), f'r{n - 1}: "z"'])


# ------------------------------------------------------------------------------ scripted model


class CharTokenizer:
    """One token per character: printable ASCII at id = ord(c) - 22 (10..104), newline 105;
    specials below 10 (BOS 1, EOS 2)."""

    bos_token_id = 1
    eos_token_id = 2
    vocab_size = 128
    _NEWLINE = 105

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self._NEWLINE if c == "\n" else ord(c) - 22 for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def _char(self, token: int, skip: bool) -> str:
        if token == self._NEWLINE:
            return "\n"
        if token >= 10:
            return chr(token + 22)
        return "" if skip else f"<{token}>"

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return "".join(self._char(int(i), skip_special_tokens) for i in ids)

    def batch_decode(self, batch: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in batch]

    def get_vocab(self) -> dict[str, int]:
        return {self.decode([i]): i for i in range(self.vocab_size)}

    def __len__(self) -> int:
        return self.vocab_size


class ScriptedBackend:
    """A 'model' that wants to write ``script`` after the prompt, one character per step.

    Logits: 10 for the scripted next character, 5 for the character after it, 0 elsewhere; past
    the script's end it predicts EOS. It implements the Backend protocol (a model runner over
    block tables it is handed) and counts forwards (one per row) for assertions.
    """

    def __init__(self, script: str = "hello world", vocab_size: int = 128) -> None:
        import torch

        from engine.config import BackendConfig
        from engine.model.backend import KVLayout, ModelInfo

        self.tok = CharTokenizer()
        self.script = self.tok.encode(script) + [self.tok.eos_token_id]
        self.config = BackendConfig(model_id="scripted", device="cpu", hidden_state_layer=0, prefix_caching=False)
        self.device = torch.device("cpu")
        self.info = ModelInfo("scripted", vocab_size, 8, 2, 2, 1, 4096, (self.tok.eos_token_id,), "cpu", "float32")
        self.forward_count = 0
        self.max_batch = 8
        self.max_sequence = 4096
        self.kv_layout = KVLayout(block_size=16, blocks=64, max_blocks=4096, block_bytes=0)
        self.sequences: dict[int, dict[str, Any]] = {}  # first block of a table -> what was fed

    def tokenizer(self) -> CharTokenizer:
        return self.tok

    def _logits(self, seq: dict[str, Any]):
        import torch

        position = len(seq["tokens"]) - seq["prompt_len"]
        logits = torch.zeros(self.info.vocab_size)
        first = self.script[min(position, len(self.script) - 1)]
        second = self.script[min(position + 1, len(self.script) - 1)]
        logits[second] = 5.0
        logits[first] = 10.0
        return logits

    def _feed(self, seq: dict[str, Any], start: int, tokens: Sequence[int]) -> None:
        del seq["tokens"][start:]
        seq["tokens"].extend(int(t) for t in tokens)
        if start == 0:
            seq["prompt_len"] = len(tokens)

    def execute(self, batch: Any) -> Any:
        import torch

        from engine.model.backend import ForwardOutput, top_logprobs
        from engine.model.capture import RowCapture
        from engine.model.vocab_search import row_max

        logits = []
        for row in batch.rows:
            seq = self._sequence_of(row)
            self._feed(seq, row.start, row.tokens)
            self.forward_count += 1
            logits.append(self._logits(seq))
        stacked = torch.stack(logits)
        # what its rows ask besides their logits, as a model runner computes it: the payload's top
        # log-probs, the greedy argmax (each row's first maximum)
        top = top_logprobs(stacked) if any(r.top for r in batch.rows) else None
        argmax = ([found if row.argmax else None for found, row in zip(row_max(stacked)[1].tolist(), batch.rows)]
                  if any(r.argmax for r in batch.rows) else None)
        return ForwardOutput(stacked, top, tuple(RowCapture() for _ in batch.rows), argmax=argmax)

    def _sequence_of(self, row: Any) -> dict[str, Any]:
        """What the row's sequence was fed so far. A sequence is known by its table's first block,
        which a request keeps while it runs (prefix caching is off here, so no block is shared);
        a prompt fed from position 0 starts it afresh."""
        first = row.table[0]
        if row.start == 0 or first not in self.sequences:
            self.sequences[first] = {"tokens": [], "prompt_len": 0}
        return self.sequences[first]

    def shutdown(self) -> None:
        self.sequences.clear()


class ScriptedAnswerBackend(ScriptedBackend):
    """A 'model' that answers whatever it is asked with the next characters of ``answers``.

    Only the tokens it writes itself advance it — a fed token equal to what it predicted last —
    and erasing never rewinds it: a self-prompted question gets the next scripted answer. When the
    answers are used up it predicts EOS.
    """

    def __init__(self, answers: str) -> None:
        super().__init__("")
        self.answers = self.tok.encode(answers)
        self.written = 0
        self._predicted: dict[int, int] = {}

    def _next(self) -> int:
        return self.answers[self.written] if self.written < len(self.answers) else self.tok.eos_token_id

    def _logits(self, seq: dict[str, Any]):
        import torch

        logits = torch.zeros(self.info.vocab_size)
        logits[self._next()] = 10.0
        return logits

    def _feed(self, seq: dict[str, Any], start: int, tokens: Sequence[int]) -> None:
        fresh = [int(t) for t in tokens][max(0, len(seq["tokens"]) - start):]
        predicted = self._predicted.get(id(seq))
        if fresh and predicted is not None and fresh[0] == predicted and self.written < len(self.answers):
            self.written += 1
        super()._feed(seq, start, tokens)
        self._predicted[id(seq)] = self._next()


def forward_prompt(engine: Any, ids: Sequence[int], names: Sequence[str]) -> Any:
    """One prefill-shaped forward of ``ids`` on blocks of its own, capturing ``names`` for every
    position (run by the engine's step loop between steps; the blocks are freed afterwards).
    Returns the row's :class:`RowOutput`."""
    from engine.model.capture import CapturePlan

    plan = CapturePlan.of(names, engine.backend.info.num_layers, all_query_rows=True)
    return engine.loop.forward_prompt(ids, plan, timeout=600)


def scripted_engine(script: str = "hello world", *, answers: str | None = None, **generation: Any):
    """An Engine over :class:`ScriptedBackend` (or :class:`ScriptedAnswerBackend` with
    ``answers``), greedy by default."""
    from engine import Engine
    from engine.config import RaylensConfig

    gen = build_generation_cfg(**{"temperature": 0.0, "max_tokens": 32, **generation})
    backend = ScriptedAnswerBackend(answers) if answers is not None else ScriptedBackend(script)
    return Engine(RaylensConfig(generation=gen), backend=backend)


def text_of(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def event_types(result: Any) -> list[str]:
    return [type(e).__name__ for e in result.events]


def assert_payload_valid(payload: dict[str, Any]) -> None:
    """Schema-valid, positions consistent, and no internals (hidden states, attention, input ids) leaked."""
    from engine.schemas import payload_validator

    errors = sorted(payload_validator().iter_errors(payload), key=lambda e: list(e.path))
    assert not errors, f"payload violates the ingest schema: {[f'{list(e.path)}: {e.message}' for e in errors[:5]]}"
    events = payload["events"]
    assert [e["sequence_order"] for e in events] == list(range(len(events)))
    for call in payload["mod_calls"]:
        assert 0 <= call["event_sequence_order"] < len(events), call
    for entry in payload["mod_logs"] + payload["actions"]:
        assert 0 <= entry["mod_call_sequence"] < len(payload["mod_calls"]), entry
    text = str(payload)
    for forbidden in ("hidden_states", "attention_patterns", "'input_ids'", "'layer'"):
        assert forbidden not in text, f"{forbidden} leaked into the ingest payload"


def masked(logits: Any, banned: Sequence[int], value: float = -1e9) -> np.ndarray:
    arr = logits.to_numpy().copy()
    arr[0, list(banned)] = value
    return arr


def ban_best_mod(steps: int, *, copy: bool = False,
                 then: Callable[[Any, np.ndarray], None] | None = None) -> Callable[..., Any]:
    """The usual logits mod, edit-and-return, hearing ForwardPass only (its guard turns every other
    event away): for its first ``steps`` steps it bans the best token and hands back the row it was
    lent (``copy``: a copy of it, which the engine never takes for the lent row); ``then(event,
    row)`` runs on the edited row before it is handed back."""
    def ban_best(event, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step < steps:
            logits = event.logits.to_numpy()
            logits[0, int(logits.argmax())] = -1e9
            if then is not None:
                then(event, logits)
            return AdjustedLogits(type(event.logits).from_numpy(logits.copy() if copy else logits))
        return None
    return ban_best
