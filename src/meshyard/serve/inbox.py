"""What a streamed request's reader is handed, step by step, on the event loop.

``Inbox`` is the little of ``asyncio.Queue`` a stream needs: items put in, and a reader
that takes everything put since it last looked, waiting while there is nothing. A
streamed completion is handed one item per decoding step; the queue's bookkeeping (its
getters' deque, a wake-up per put, ``empty`` and ``get_nowait`` per item taken) was a
fifth of what the event loop spent per streamed token.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    """Items from the batcher to one reader (both on the event loop; one reader at a time)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[T]:
        """Every item put since the last take, in order; waits for one while there is none."""
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        items, self._items = self._items, []
        return items
