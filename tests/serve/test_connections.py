from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from meshyard.serve.connections import CLIENT_LINK, ClientLink, TurnWriter, guarded_protocol


class Transport:
    """What a connection's writes reached, send by send."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sends.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name == "sockname" else default


def test_the_writes_of_one_turn_leave_in_one_send_in_order():
    async def scenario() -> tuple[list[bytes], list[bytes], int, Any]:
        transport = Transport()
        writer = TurnWriter(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        writer.write(b"")
        writer.write(bytearray(b"data: 1\n\n"))
        held = list(transport.sends), writer.get_write_buffer_size()
        await asyncio.sleep(0)  # the turn ends
        writer.write(b"data: 2\n\n")
        await asyncio.sleep(0)
        return held[0], transport.sends, held[1], writer.get_extra_info("sockname")

    held, sends, pending, sockname = asyncio.run(scenario())
    assert held == [] and pending == len(b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\n")
    assert sends == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\n", b"data: 2\n\n"]
    assert sockname == ("127.0.0.1", 8000)  # everything else is the transport's own


def test_closing_sends_what_waits_first_and_nothing_reaches_a_closed_transport():
    async def scenario() -> tuple[list[bytes], bool]:
        transport = Transport()
        writer = TurnWriter(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        writer.write(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        writer.close()
        sent_by_close = list(transport.sends)
        writer.write(b"late")
        await asyncio.sleep(0)
        return sent_by_close + transport.sends[len(sent_by_close):], transport.closed

    sends, closed = asyncio.run(scenario())
    assert sends == [b"HTTP/1.1 408 Request Timeout\r\n\r\n"] and closed


def cycle_on(transport: Transport, method: str = "POST") -> RequestResponseCycle:
    """uvicorn's own cycle of one request, on ``transport``."""
    logger = logging.getLogger("test")
    return RequestResponseCycle(scope={"type": "http", "method": method, "http_version": "1.1"},  # type: ignore
                                transport=transport, flow=FlowControl(transport), logger=logger,  # type: ignore
                                access_logger=logger, access_log=False, default_headers=[],
                                message_event=asyncio.Event(), expect_100_continue=False, keep_alive=True,
                                on_response=lambda: None)


def test_the_link_writes_a_started_chunked_answers_parts_and_declines_where_send_must():
    async def scenario() -> tuple[list[bool], list[bytes]]:
        transport = Transport()
        cycle = cycle_on(transport)
        link = ClientLink(cycle)
        wrote = [link.write_body(b"early")]  # no answer started: send must start it
        await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
        wrote += [link.write_body(b"data: 1\n\n"), link.write_body(b"")]
        cycle.flow.pause_writing()  # the client reads slower than the server writes
        wrote.append(link.write_body(b"slow"))
        cycle.flow.resume_writing()
        wrote.append(link.write_body(b"data: 2\n\n"))
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        wrote.append(link.write_body(b"after the end"))
        return wrote, transport.sends

    wrote, sends = asyncio.run(scenario())
    assert wrote == [False, True, False, False, True, False]
    assert sends[1:] == [b"9\r\ndata: 1\n\n\r\n", b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]  # as uvicorn frames them


def test_the_link_says_when_the_client_is_gone_and_then_writes_nothing():
    async def scenario() -> tuple[bool, bool, bool, list[bytes]]:
        transport = Transport()
        cycle = cycle_on(transport)
        link = ClientLink(cycle)
        await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
        before = link.gone()
        cycle.disconnected = True  # what the protocol sets when the connection is lost
        return before, link.gone(), link.write_body(b"data: 1\n\n"), transport.sends[1:]

    before, after, wrote, sends = asyncio.run(scenario())
    assert (before, after, wrote, sends) == (False, True, False, [])


def test_the_link_leaves_answers_with_a_length_and_head_requests_to_send():
    async def scenario() -> list[bool]:
        wrote = []
        for method, headers in (("POST", [(b"content-length", b"4")]), ("HEAD", [])):
            cycle = cycle_on(Transport(), method)
            await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
            wrote.append(ClientLink(cycle).write_body(b"body"))
        return wrote

    assert asyncio.run(scenario()) == [False, False]


def test_a_guarded_connection_gives_each_request_its_link_which_sees_the_client_leave():
    links: list[ClientLink] = []
    turns: asyncio.Queue[str] = asyncio.Queue()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        link = scope["extensions"][CLIENT_LINK]
        links.append(link)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert link.write_body(b"data: 1\n\n")  # a chunked answer: the link writes its parts
        if len(links) == 1:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        turns.put_nowait("written")
        await asyncio.sleep(3600 if len(links) == 2 else 0)  # the second answer is under way when the client goes

    async def scenario() -> tuple[list[bool], list[bool], bytes]:
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        config.load()
        transport = Transport()
        protocol = guarded_protocol(10.0, 16, app)(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(transport)  # type: ignore[arg-type]
        for _ in range(2):  # two requests on one kept-alive connection
            protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(turns.get(), 10)
        before = [link.gone() for link in links]
        protocol.connection_lost(None)
        after = [link.gone() for link in links]
        for task in protocol.tasks:
            task.cancel()
        await asyncio.sleep(0)
        return before, after, b"".join(transport.sends)

    before, after, sent = asyncio.run(scenario())
    assert before == [False, False]
    assert after == [False, True]  # only the answer under way lost its client
    assert sent.count(b"9\r\ndata: 1\n\n\r\n") == 2 and sent.count(b"0\r\n\r\n") == 1


def test_the_answer_under_way_learns_its_client_left_with_requests_pipelined_after_it_and_answers_are_freed():
    links: list[ClientLink] = []
    started, left = asyncio.Event(), asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        links.append(scope["extensions"][CLIENT_LINK])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if len(links) == 1:  # a short answer: once given, nothing keeps its request's parts
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        started.set()
        while not links[-1].gone():  # a stream, writing until its client is gone
            await asyncio.sleep(0)
        left.set()

    async def scenario() -> tuple[bool, bool, bool]:
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        config.load()
        protocol = guarded_protocol(10.0, 16, app)(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(Transport())  # type: ignore[arg-type]
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        protocol.data_received(request)
        for _ in range(5):
            await asyncio.sleep(0)
        protocol.data_received(request * 2)  # the stream, and a request pipelined after it
        await asyncio.wait_for(started.wait(), 10)
        first_freed = links[0]._cycle() is None  # without the garbage collector: no reference cycle
        protocol.connection_lost(None)
        await asyncio.wait_for(left.wait(), 10)  # the stream saw its client leave
        return first_freed, left.is_set(), len(links) == 2

    gc.disable()
    try:
        first_freed, stream_gone, pipelined_never_ran = asyncio.run(scenario())
    finally:
        gc.enable()
    assert (first_freed, stream_gone, pipelined_never_ran) == (True, True, True)
