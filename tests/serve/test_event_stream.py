from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from meshyard.serve.connections import CLIENT_LINK
from meshyard.serve.event_stream import EventStream

HANG_GUARD_S = 10.0


class Client:
    """The ASGI side of one request: what the response sent, and a disconnect to trigger."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent if m["type"] == "http.response.body"]


def test_each_event_is_written_as_it_comes_then_the_end():
    async def events() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        await asyncio.sleep(0)
        yield "data: 2\n\ndata: 3\n\n"

    async def scenario() -> tuple[Client, set[asyncio.Task]]:
        client = Client()
        before = asyncio.all_tasks()
        await EventStream(events(), headers={"Cache-Control": "no-cache"})({"type": "http"}, client.receive,
                                                                           client.send)
        await asyncio.sleep(0)  # the watcher's cancellation runs
        return client, asyncio.all_tasks() - before

    client, left_over = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"cache-control", b"no-cache") in start["headers"]
    assert client.bodies() == [(b"data: 1\n\n", True), (b"data: 2\n\ndata: 3\n\n", True), (b"", False)]
    assert left_over == set()  # the watcher is gone with the stream


def test_a_client_that_leaves_closes_the_events_and_the_response_ends_quietly():
    closed = asyncio.Event()

    async def events(client: Client) -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            client.left.set()  # the client goes while the next event is being made
            await asyncio.Event().wait()  # a step that never comes
            yield "data: never\n\n"
        finally:
            closed.set()

    async def scenario() -> tuple[Client, bool, int]:
        client = Client()
        await EventStream(events(client))({"type": "http"}, client.receive, client.send)
        task = asyncio.current_task()
        await asyncio.sleep(0)  # the task was not left cancelled: it goes on awaiting
        return client, closed.is_set(), task.cancelling()

    client, was_closed, cancelling = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    assert was_closed and cancelling == 0
    assert client.bodies() == [(b"data: 1\n\n", True)]


class Link:
    """A connection's link that takes body parts until told to decline (a slow reader)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.declining = False

    def gone(self) -> bool:
        return False

    def write_body(self, body: bytes) -> bool:
        if self.declining:
            return False
        self.written.append(body)
        return True


def test_events_go_through_the_connections_link_and_through_send_where_it_declines():
    link = Link()

    async def events() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        link.declining = True
        yield "data: 2\n\n"
        link.declining = False
        yield "data: 3\n\n"

    async def scenario() -> Client:
        client = Client()
        scope = {"type": "http", "extensions": {CLIENT_LINK: link}}
        await EventStream(events())(scope, client.receive, client.send)
        return client

    client = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    assert client.sent[0]["type"] == "http.response.start"  # the start goes through send: middleware sees it
    assert link.written == [b"data: 1\n\n", b"data: 3\n\n"]
    assert client.bodies() == [(b"data: 2\n\n", True), (b"", False)]  # and the end, which completes the answer
