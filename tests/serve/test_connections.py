from __future__ import annotations

import asyncio
from typing import Any

from meshyard.serve.connections import TurnWriter


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
