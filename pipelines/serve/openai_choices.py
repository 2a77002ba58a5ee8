"""The ``n`` choices of one OpenAI request: ``n`` engine requests in the one step loop, as candidates.

``Engine.candidates`` runs ``n`` completions of a prompt as rows of the same batch, candidate ``i``
seeded ``seed + i``; the routes do the same with streams of their own (the answer needs each
choice's tokens as they come, its log-probs and its own finish reason, in index order rather than
ranked). Every choice's request is accepted before any response starts, so a bad request fails
whole; leaving early cancels them all.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from engine.config import choice_seed
from engine.core.inputs import GenerationRequest
from pipelines.cluster.prompt_keys import same_replica

from .bridge import Stream, open_stream
from .openai_text import ChoiceText
from .service import Service

__all__ = ["Choice", "open_choices", "seeded", "interleave"]


@dataclass
class Choice:
    """One choice in flight: its index in the answer, its stream and what the client saw of it."""

    index: int
    stream: Stream
    text: ChoiceText

    async def run_to_end(self) -> Any:
        """Read the choice's stream to its end (its text follows every token) and return the
        engine's result; the request is cancelled if this is left early."""
        try:
            async for _ in self.text.follow(self.stream):
                pass
            return await self.stream.result()
        finally:
            self.stream.cancel()

    @staticmethod
    async def gather(choices: Sequence["Choice"], run: Callable[["Choice"], Awaitable[Any]]) -> list[Any]:
        """``run`` every choice concurrently; the first failure cancels the others and is raised."""
        tasks = [asyncio.ensure_future(run(c)) for c in choices]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            for choice in choices:
                choice.stream.cancel()


def seeded(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """``n`` copies of ``request``, copy ``i`` seeded ``seed + i`` modulo 2**64 (unseeded copies stay unseeded:
    each draws its own), as :meth:`engine.Engine.candidates` seeds its candidates."""
    if n == 1:
        return [request]
    return [request.replace(seed=choice_seed(request.seed, i)) for i in range(n)]


async def open_choices(service: Service, requests: Sequence[GenerationRequest],
                       new_text: Callable[[], ChoiceText], *, first_index: int = 0) -> list[Choice]:
    """Submit every request; each becomes choice ``first_index + i``. Bad input raises the coded
    error before anything is answered, and cancels the choices already accepted."""
    choices: list[Choice] = []
    try:
        with same_replica():  # the n choices run on one replica, as rows of one batch
            for i, request in enumerate(requests):
                stream = await open_stream(service.engine, request, timeout_s=service.settings.request_timeout_s)
                text = new_text()
                text.stop_ids = stream.handle.request.stop_ids
                choices.append(Choice(first_index + i, stream, text))
    except BaseException:
        for choice in choices:
            choice.stream.cancel()
        raise
    return choices


async def interleave(sources: Sequence[AsyncIterator[str]]) -> AsyncIterator[str]:
    """Every item of every source as it comes (one source: in its own order, nothing between). A
    source's error is raised here and ends the others."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def drain(source: AsyncIterator[str]) -> None:
        try:
            async for item in source:
                queue.put_nowait(("item", item))
            queue.put_nowait(("done", None))
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # raised by the reader below
            queue.put_nowait(("error", err))

    tasks = [asyncio.ensure_future(drain(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "done":
                left -= 1
            else:
                raise value
    finally:
        for task in tasks:
            task.cancel()
