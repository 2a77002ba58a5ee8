"""A small pool of reused child processes that compile grammars (:mod:`.compile_worker`), so that a
grammar crashing llguidance's compiler (:mod:`.native` says how it does) kills a child and fails
its own request, never the engine's process.

Each child runs one job at a time, so a crash or a time-out belongs to that job alone; the child
is then replaced on the next job. A child's start (Python, llguidance, the token table: about a
second) is not part of a job's time-out. Children exit when the pool closes, when it is garbage
collected, or when this process dies (their stdin closes).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from engine.core.structured.compile_worker import WorkerSetup

__all__ = ["CompilePool", "Verdict"]

# the child's entry (not ``-m``: the module is already imported by its package when it runs)
_CHILD_MAIN = "from engine.core.structured.compile_worker import main; raise SystemExit(main())"
#: how long a new child may take to start (import llguidance, build the tokenizer) before the job fails
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Verdict:
    """A child's answer about one grammar. ``grammar``: llguidance's grammar text, which compiled
    and took its first step under the limits; else ``reason`` says why not, ``crashed`` whether
    the child died of it or was stopped at the time-out, and ``timed_out`` which (a time-out may
    come of a loaded machine rather than of the grammar)."""

    grammar: str | None
    reason: str = ""
    crashed: bool = False
    timed_out: bool = False


class _Worker:
    """One child process and the two pipes of its protocol."""

    def __init__(self, setup: WorkerSetup) -> None:
        from multiprocessing.connection import Connection

        job_read, job_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's imports
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD_MAIN], stdin=job_read, stdout=reply_write,
                                         env=env)
        finally:
            os.close(job_read)
            os.close(reply_write)
        self.jobs, self.replies = Connection(job_write, readable=False), Connection(reply_read, writable=False)
        try:
            self.jobs.send(dataclasses.asdict(setup))
            if not self.replies.poll(START_TIMEOUT_S):
                raise TimeoutError(f"no answer within {START_TIMEOUT_S:g} s")
            self.replies.recv()
        except (OSError, EOFError) as err:
            code = self.stop()
            raise RuntimeError(f"the grammar compiler process could not start ({type(err).__name__}: {err}; "
                               f"{_exit_status(code)})") from None

    def run(self, kind: str, source: str, timeout_s: float) -> Verdict:
        try:
            self.jobs.send((kind, source))
            if not self.replies.poll(timeout_s):
                self.stop()
                return Verdict(None, f"did not compile within {timeout_s:g} s (structured.compile_timeout_s)",
                               crashed=True, timed_out=True)
            status, value = self.replies.recv()
        except (OSError, EOFError):  # the child died mid-job
            return Verdict(None, f"crashed the grammar compiler ({_exit_status(self.stop())})", crashed=True)
        return Verdict(value) if status == "ok" else Verdict(None, str(value))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """End the child (closing its stdin would end an idle one; a busy one is killed); its exit status."""
        for conn in (self.jobs, self.replies):
            conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _stop_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.stop()
    workers.clear()


class CompilePool:
    """``workers`` reused children; :meth:`check` runs one grammar in a free one (waiting for one
    when all are busy; each job is bounded by ``timeout_s``)."""

    def __init__(self, setup: WorkerSetup, *, workers: int, timeout_s: float) -> None:
        self.setup, self.timeout_s = setup, timeout_s
        self._slots: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._slots.put(None)  # started on first use
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self.crashes = 0  # children lost to a grammar (crashed or stopped at the time-out)
        self._finalizer = weakref.finalize(self, _stop_all, self._live)

    def check(self, kind: str, source: str) -> Verdict:
        worker = self._slots.get()
        try:
            if worker is None or not worker.alive:
                worker = self._replace(worker)
            verdict = worker.run(kind, source, self.timeout_s)
            if verdict.crashed:
                with self._lock:
                    self.crashes += 1
                    self._live.discard(worker)
                worker = None
            return verdict
        finally:
            self._slots.put(worker)

    def _replace(self, old: _Worker | None) -> _Worker:
        if old is not None:
            old.stop()
        with self._lock:
            self._live.discard(old)
        worker = _Worker(self.setup)
        with self._lock:
            self._live.add(worker)
        return worker

    @property
    def pids(self) -> list[int]:
        """The live children's process ids (for status and tests)."""
        with self._lock:
            return [w.proc.pid for w in self._live if w.alive]

    def close(self) -> None:
        self._finalizer()


def token_table_setup(tokenizer: Any, vocab_size: int, eos: int, limits: dict[str, int]) -> WorkerSetup:
    """The child's :class:`WorkerSetup`, read from this process's llguidance tokenizer: the child
    builds one over the same token bytes and special ids, so its compile sees the same token trie."""
    tokens = [bytes(tokenizer.decode_bytes([i])) for i in range(vocab_size)]
    special = [i for i in range(vocab_size) if tokenizer.is_special_token(i)]
    return WorkerSetup(tokens=tokens, special_token_ids=special, eos=eos, bos=None, vocab_size=vocab_size,
                       limits=dict(limits))
