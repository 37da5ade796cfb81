from __future__ import annotations

import asyncio

from meshyard.serve.inbox import Inbox

HANG_GUARD_S = 10.0


def test_a_take_gives_everything_put_since_the_last_in_order_and_waits_while_empty():
    async def scenario() -> list[list[object]]:
        inbox: Inbox[object] = Inbox()
        inbox.put(1)
        inbox.put(2)
        taken = [await inbox.take()]
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing there: the reader waits
        inbox.put(3)
        inbox.put(None)  # both before the reader runs again: it gets both at once
        taken.append(await waiting)
        return taken

    assert asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S)) == [[1, 2], [3, None]]


def test_a_reader_cancelled_while_waiting_leaves_the_inbox_usable():
    async def scenario() -> list[object]:
        inbox: Inbox[object] = Inbox()
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        inbox.put("after")  # puts nothing into a cancelled wait
        return await inbox.take()

    assert asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S)) == ["after"]
