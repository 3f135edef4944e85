"""Engine request streams, followed on worker threads, as the event loop's async iterators.

Each choice of a request is one engine request; a worker thread per choice follows its stream
(serving/requests.py `follow`) and hands the deltas to the event loop. The streams of a caller that stops early,
or of a non-streaming client that disconnects, are cancelled at once, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor

from fastapi import Request

from trtbuild.runtime.async_engine import RequestStream
from trtbuild.runtime.engine_core import RequestOutput
from trtbuild.serving.requests import Accumulated, follow

POLL_S = 0.5  # how often a waiting worker thread looks up, so that shutdown is never stuck behind it


async def deltas(streams: list[RequestStream], workers: Executor) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice, delta) of every stream as they come; the streams are cancelled if the caller stops early."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def pump(i: int, stream: RequestStream) -> None:
        try:
            for output in follow(stream, lambda: False, POLL_S):
                loop.call_soon_threadsafe(queue.put_nowait, (i, output))
        except Exception as e:
            loop.call_soon_threadsafe(queue.put_nowait, (i, e))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, (i, None))

    for i, stream in enumerate(streams):
        loop.run_in_executor(workers, pump, i, stream)
    done = 0
    try:
        while done < len(streams):
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for stream in streams:
            if not stream.finished:
                stream.cancel()


async def collect(request: Request, streams: list[RequestStream], workers: Executor) -> list[Accumulated]:
    """Non-streaming: every choice added up; a client that disconnects first has its requests aborted."""
    wholes = [Accumulated() for _ in streams]

    async def watch() -> None:
        while not all(w.finished for w in wholes):
            if await request.is_disconnected():
                for s in streams:
                    s.cancel()
                return
            await asyncio.sleep(POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        async for i, output in deltas(streams, workers):
            wholes[i].add(output)
    finally:
        watcher.cancel()
    return wholes
