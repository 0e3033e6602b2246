"""Several chunk streams as one: the prompts of one completions request, or
the choices of a request continued one by one after a migration.

Chunk ``c`` of stream ``k`` goes out with ``index = bases[k] + c.index``
and ``more_choices`` true while any choice of any stream is unfinished, so
the merged stream ends (``finished``) with the last choice to finish, like
the stream of one request with several choices. Chunks go out as they
come; an error in one stream ends them all (and closes every stream, which
aborts their sequences in the replicas).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Sequence

from cluster.shared.types import StreamChunk


async def merge_indexed(streams: Sequence[AsyncIterator[StreamChunk]], bases: Sequence[int],
                        widths: Sequence[int]) -> AsyncIterator[StreamChunk]:
    """Merges ``streams`` (stream ``k`` holds ``widths[k]`` choices, numbered from
    ``bases[k]`` in the merged stream); see the module doc."""
    assert len(streams) == len(bases) == len(widths)
    queue: asyncio.Queue = asyncio.Queue()
    unfinished = {bases[k] + i for k in range(len(streams)) for i in range(widths[k])}

    async def pump(k: int) -> None:
        try:
            async for chunk in streams[k]:
                await queue.put((k, chunk))
                if chunk.finished:
                    break
            await queue.put((k, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((k, exc))

    tasks = [asyncio.ensure_future(pump(k)) for k in range(len(streams))]
    open_streams = len(streams)
    try:
        while open_streams:
            k, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:  # this stream ended: whatever it left unfinished, ends with it
                open_streams -= 1
                unfinished -= {bases[k] + i for i in range(widths[k])}
                continue
            index = bases[k] + item.index
            if item.finish_reason is not None:
                unfinished.discard(index)
            yield dataclasses.replace(item, index=index, more_choices=bool(unfinished))
            if not unfinished:
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
