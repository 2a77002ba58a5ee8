"""The one SAE hand-off: one retry policy and one set of counters whatever transport carries the
blocks, and one factory that picks the transport from the config.

Transports under test: the real in-process one (inline and on its thread), fed a writer that
fails, and ``OffThreadTransport`` — a small transport of the Ray workers' shape (no local SAE,
each send answered by a future that another thread settles later), fed the same failures.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import pytest
import torch

from engine.config import RaylensConfig, RayConfig, SAEConfig
from engine.errors import ConfigError
from engine.model.backend import ForwardRecord
from engine.services.sae_handoff import (HandoffStats, LocalTransport, RetryPolicy, SAEHandoff, build_handoff,
                                         handoff_mode)
from pipelines.cluster.actor_specs import runs_sae_workers

from .test_sae_and_recorder import D_IN, LAYER, load, sae_dir  # noqa: F401  (the module's SAE fixture)

NO_WAIT = RetryPolicy(attempts=3, backoff_s=0.0)


class WorkerDied(RuntimeError):
    pass


class FlakyWriter:
    """Stores rows, but the first ``failures`` writes of each batch fail (``None``: every write)."""

    def __init__(self, failures: int | None) -> None:
        self.failures = failures
        self.tries: dict[str, int] = {}
        self.stored: dict[str, int] = {}
        self.missing: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def attempt(self, batch_id: str, rows: int) -> int:
        with self._lock:
            self.tries[batch_id] = self.tries.get(batch_id, 0) + 1
            if self.failures is None or self.tries[batch_id] <= self.failures:
                raise WorkerDied(f"attempt {self.tries[batch_id]} of {batch_id} failed")
            self.stored[batch_id] = rows
            return rows

    def write(self, rows, batch_id, request_id) -> int:
        return self.attempt(batch_id, rows.num_rows)

    def record_missing(self, meta, reason) -> None:
        self.missing.append((meta.batch_id, reason))


class OffThreadTransport:
    """The SAE workers' shape without Ray: no local SAE; ``prepare`` copies the block once, each
    ``send`` starts a thread that settles the future later (one row per token)."""

    mode = "ray-workers"
    encoder = None

    def __init__(self, writer: FlakyWriter) -> None:
        self.writer = writer
        self.prepared = 0
        self.threads: list[threading.Thread] = []

    def prepare(self, block):
        self.prepared += 1
        return block.meta(), block.hidden().clone()

    def send(self, prepared) -> Future:
        meta, hidden = prepared
        future: Future = Future()

        def work() -> None:
            try:
                future.set_result(self.writer.attempt(meta.batch_id, hidden.shape[0]))
            except Exception as err:
                future.set_exception(err)

        thread = threading.Thread(target=work)
        self.threads.append(thread)
        thread.start()
        return future

    def record_missing(self, meta, reason) -> None:
        self.writer.record_missing(meta, reason)

    def close(self) -> None:
        for thread in self.threads:
            thread.join()


def transport(kind: str, writer: FlakyWriter, sae_dir):
    if kind == "off-thread":
        return OffThreadTransport(writer)
    return LocalTransport(load(sae_dir), writer.write, writer.record_missing, model_id="m", threaded=kind == "thread")


def run(handoff: SAEHandoff, *, forwards: int = 4) -> None:
    """A prefill of 3 tokens then one token per forward, through the hand-off as the loop calls it;
    nothing it raises may reach the loop."""
    gen = torch.Generator().manual_seed(1)
    handoff.on_forward("r", 0, ForwardRecord(0, (1, 2, 3), {LAYER: torch.randn(3, D_IN, generator=gen)}))
    for step in range(1, forwards):
        hidden = torch.randn(1, D_IN, generator=gen)
        handoff.on_forward("r", step, ForwardRecord(2 + step, (10 + step,), {LAYER: hidden}))
    handoff.finish("r")
    handoff.close()


KINDS = ["inline", "thread", "off-thread"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_that_fails_twice_then_succeeds_is_retried_and_stored(kind, sae_dir):
    writer = FlakyWriter(failures=2)
    handoff = SAEHandoff(transport(kind, writer, sae_dir), layer=LAYER, block_steps=2, max_pending=4, retry=NO_WAIT)
    run(handoff)
    blocks = 4 if kind == "inline" else 2  # inline: a block per forward; otherwise 4 forwards in blocks of 2
    assert writer.missing == [] and len(writer.stored) == blocks
    assert set(writer.tries.values()) == {3}  # every block: two failures, then stored
    assert handoff.stats == HandoffStats(blocks_submitted=blocks, blocks_stored=blocks, blocks_retried=2 * blocks,
                                         blocks_missing=0, rows_written=sum(writer.stored.values()),
                                         backlog_waits=handoff.stats.backlog_waits,
                                         max_backlog=handoff.stats.max_backlog)
    assert handoff.stats.rows_written > 0 and handoff.backlog == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_that_always_fails_is_recorded_missing_and_the_loop_goes_on(kind, sae_dir):
    writer = FlakyWriter(failures=None)
    handoff = SAEHandoff(transport(kind, writer, sae_dir), layer=LAYER, block_steps=4, max_pending=4, retry=NO_WAIT)
    run(handoff, forwards=1)  # one block; raises nothing
    assert writer.tries == {"r/0": 3} and writer.stored == {}
    assert writer.missing == [("r/0", "WorkerDied: attempt 3 of r/0 failed")]
    assert (handoff.stats.blocks_submitted, handoff.stats.blocks_stored, handoff.stats.blocks_retried,
            handoff.stats.blocks_missing, handoff.stats.rows_written) == (1, 0, 2, 1, 0)


@pytest.mark.parametrize("kind", ["inline", "off-thread"])
def test_a_retry_waits_out_its_backoff_without_holding_up_the_loop(kind, sae_dir):
    """The loop's call hands the block off and returns while the failed block is parked; later
    calls (here: the closing drain) send it when its back-off is over."""
    writer = FlakyWriter(failures=2)
    handoff = SAEHandoff(transport(kind, writer, sae_dir), layer=LAYER, block_steps=1, max_pending=4,
                         retry=RetryPolicy(attempts=3, backoff_s=0.05))
    gen = torch.Generator().manual_seed(1)
    handoff.on_forward("r", 0, ForwardRecord(0, (1, 2, 3), {LAYER: torch.randn(3, D_IN, generator=gen)}))
    if kind == "off-thread":  # the worker answers later: the next hand-off settles the failure
        while writer.tries.get("r/0", 0) < 1:
            threading.Event().wait(0.01)
        handoff.on_forward("r", 1, ForwardRecord(3, (4,), {LAYER: torch.randn(1, D_IN, generator=gen)}))
    # the first attempt failed and was settled by a loop call that returned without re-sending
    assert writer.tries["r/0"] == 1 and handoff.stats.blocks_retried >= 1 and handoff.backlog >= 1
    handoff.finish("r")
    handoff.close()
    assert set(writer.tries.values()) == {3} and set(writer.stored) == set(writer.tries) and writer.missing == []
    assert handoff.backlog == 0


def test_the_attempts_come_from_the_policy(sae_dir):
    writer = FlakyWriter(failures=None)
    handoff = SAEHandoff(OffThreadTransport(writer), layer=LAYER, block_steps=4, max_pending=4,
                         retry=RetryPolicy(attempts=1, backoff_s=0.0))
    run(handoff)
    assert writer.tries == {"r/0": 1} and handoff.stats.blocks_retried == 0 and handoff.stats.blocks_missing == 1


def test_a_block_that_cannot_even_be_prepared_is_recorded_missing():
    writer = FlakyWriter(failures=0)

    class Unpreparable(OffThreadTransport):
        def prepare(self, block):
            raise MemoryError("no room for the host copy")

    handoff = SAEHandoff(Unpreparable(writer), layer=LAYER, block_steps=4, max_pending=4, retry=NO_WAIT)
    run(handoff)
    assert writer.missing == [("r/0", "MemoryError: no room for the host copy")] and writer.tries == {}
    assert handoff.stats.blocks_missing == 1 and handoff.stats.blocks_submitted == 1


def test_the_backoff_doubles_per_failure_and_is_validated():
    policy = RetryPolicy(attempts=4, backoff_s=0.5)
    assert [policy.delay_s(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    with pytest.raises(ConfigError, match="`attempts` must be >= 1"):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError, match="`backoff_s` must be >= 0"):
        RetryPolicy(backoff_s=-1.0)
    with pytest.raises(ConfigError, match="`sae.retry_attempts` must be >= 1"):
        SAEConfig(retry_attempts=0)
    with pytest.raises(ConfigError, match="`sae.retry_backoff_s` must be a finite number >= 0"):
        SAEConfig(retry_backoff_s=float("nan"))


# ------------------------------------------------------------------------------- the factory


def config(mode: str, **sae) -> RaylensConfig:
    return RaylensConfig(sae=SAEConfig(mode=mode, block_steps=5, max_pending_blocks=7, **sae),
                         ray=RayConfig(max_inflight_blocks=3))


@pytest.mark.parametrize("mode,ray,expected", [
    ("inline", False, "inline"), ("inline", True, "inline"),
    ("nearline", False, "thread"), ("nearline", True, "ray-workers"),
])
def test_the_factory_picks_the_transport_from_the_config(mode, ray, expected, sae_dir):
    cfg = config(mode, retry_attempts=5, retry_backoff_s=0.25)
    writer = FlakyWriter(failures=0)
    built: list[str] = []

    def local(threaded: bool) -> LocalTransport:
        built.append("thread" if threaded else "inline")
        return LocalTransport(load(sae_dir), writer.write, writer.record_missing, model_id="m", threaded=threaded)

    def remote() -> OffThreadTransport:
        built.append("ray-workers")
        return OffThreadTransport(writer)

    handoff = build_handoff(cfg, ray=ray, local=local, remote=remote)
    try:
        assert handoff_mode(cfg.sae, ray=ray) == expected and built == [expected]
        assert handoff.transport.mode == expected
        assert handoff.retry == RetryPolicy(attempts=5, backoff_s=0.25)
        assert handoff.max_pending == (3 if expected == "ray-workers" else 7)
        assert handoff.mode == ("inline" if expected == "inline" else "nearline")
        assert handoff.blocks.block_steps == (1 if expected == "inline" else 5)
        if ray:  # the Ray topology starts SAE workers exactly when the generator's hand-off needs them
            enabled = dataclasses.replace(cfg, sae=dataclasses.replace(cfg.sae, enabled=True),
                                          activations=dataclasses.replace(cfg.activations, enabled=True))
            assert runs_sae_workers(enabled) == (expected == "ray-workers")
    finally:
        handoff.close()


def test_nearline_on_ray_without_workers_is_refused():
    with pytest.raises(ConfigError, match="`remote` must be the SAE workers' transport"):
        build_handoff(config("nearline"), ray=True, local=lambda threaded: None)  # type: ignore[arg-type,return-value]
