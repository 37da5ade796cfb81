"""The server's HTTP connections: a deadline on what a client owes, a cap on how many stay open,
a bound on a request's head, and one send per event-loop turn.

uvicorn closes a kept-alive connection that idles, but nothing bounds how long a client
may take to send a request's line and headers: a client that sends half a header and
waits holds its connection (a socket, a file descriptor, memory) for ever, and a few
thousand such clients ("slowloris") exhaust the server without sending one whole
request. ``GuardedProtocol`` is uvicorn's httptools protocol with four additions:

- **read deadline**: while the protocol itself waits on the client (a new connection's
  first request, a request whose head has begun to arrive, or the rest of a body the
  application answered without reading) the client has ``read_timeout_s`` to deliver it.
  Past it, a half-sent head is answered 408 and the connection closed; a connection that
  sent nothing, or owes only an unread body, is closed without an answer. Once the head is
  in, the body is the application's to read, under the same deadline
  (``meshyard.serve.requests.read_body``), so its 408 carries the route's error shape.
- **connection cap**: a connection opened beyond ``max_connections`` gets ``refusal`` in
  place of the application: its first request is answered by it (503) and the connection
  closed. Answering after the request's head has arrived, rather than at once, lets the
  client read the answer instead of a reset.
- **head bound**: a request line and headers (or a chunked body's trailers) longer than
  ``MAX_HEAD_BYTES`` are answered 431 and the connection closed; the parser would otherwise
  hold a header of any length. A pipelined request's 431 follows the answer under way.
- **one send per turn**: what the server writes to a connection during one event-loop turn
  leaves in one send (``TurnWriter``): a response's head with its body, or with a stream's
  first event; a stream's last event with ``[DONE]`` and the end of the body.

Each request's scope also carries its ``ClientLink`` (``extensions[CLIENT_LINK]``): whether its
client is gone, read without awaiting, and a started stream's events written without the
middleware and ``send`` each would otherwise pass.

httptools (llhttp, in C) parses; uvicorn's pure-Python h11 protocol cost twice the server's
CPU per streamed event (31 against 16 us per event, request and response start included,
measured on this project's 2-core CPU machine). The guard follows the parser's callbacks
(a message begun, its head complete, the message complete) and is kept by the same event
loop as everything else, one timer per connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import weakref
from typing import Any, Awaitable, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

log = logging.getLogger("meshyard.serve")

Asgi = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
CLIENT_LINK = "meshyard.client_link"
"""The scope extension under which a request's ``ClientLink`` is."""
SPARE_FILES = 256
"""Open files the server needs beside its connections (models, logs, the listening socket)."""
MAX_HEAD_BYTES = 32 * 1024
"""The longest request line and headers (or chunked body's trailers) a connection takes. What
arrives in the read that brought the message's start or its last body bytes is not counted,
so the parser holds at most this and one read (256 KiB)."""


def error_answer(status: str, message: str) -> bytes:
    """A whole HTTP answer that closes its connection, for a request refused before any route
    saw it (so it has no route's error shape)."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def request_timeout_answer(read_timeout_s: float) -> bytes:
    """The answer to a request whose head did not arrive in time."""
    return error_answer("408 Request Timeout", f"the request's line and headers did not arrive within "
                        f"{read_timeout_s:g} s (serve.read_timeout_s), so the server closed the connection; send "
                        "the whole request at once, or ask the operator for a longer serve.read_timeout_s")


def head_too_large_answer() -> bytes:
    """The answer to a request whose line and headers exceed ``MAX_HEAD_BYTES``."""
    return error_answer("431 Request Header Fields Too Large", f"the request's line and headers exceed "
                        f"{MAX_HEAD_BYTES} bytes, so the server closed the connection; send shorter headers (and "
                        "put large inputs in the body)")


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a read deadline, a connection cap and a bound on what
    the parser holds (see the module's docstring); ``guarded_protocol`` makes one with the
    server's settings."""

    read_timeout_s: float = 10.0
    max_connections: int = 512
    refusal: Asgi | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = False  # bytes of a request have come, its head is not complete
        self._body_owed = False  # a request's head is in, the rest of its message is not
        self._head_bytes = 0  # the line and headers of the request being read, as parsed
        self._held_bytes = 0  # bytes read since the parser last passed a part of a message on
        self._passed_on = False  # during one read: the parser passed a part on
        self._refused = False  # refused 431: nothing more is parsed
        self._unanswered: list[RequestResponseCycle] = []  # the answer under way and those queued after it
        super().connection_made(TurnWriter(transport, self.loop))  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections and self.refusal is not None:
            self.app = self.refusal
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._body_owed and (self.cycle is None or self.cycle.response_complete):
            # Any byte on an idle connection (even the CRLFs the parser skips between
            # requests) starts a head the client now owes, under the read deadline.
            self._in_head = True
        self._passed_on = False
        super().data_received(data)
        if (self._in_head or self._body_owed) and not self._passed_on and not self._refused:
            # The parser holds these bytes (a header or trailer not passed on yet): bound
            # them. The read in which a part was passed on is not counted, so what it holds
            # is at most MAX_HEAD_BYTES and one read.
            self._held_bytes += len(data)
            if self._held_bytes > MAX_HEAD_BYTES:
                self._refuse()
        self._watch()

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        # A keep-alive timer armed when an unread body drained must not close the
        # connection while this request is answered.
        self._unset_keepalive_if_required()
        self._in_head, self._head_bytes = True, 0
        self._part_passed_on()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse()
            return
        self._in_head, self._body_owed = False, True
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # the request's cycle (not an upgrade)
            self.scope.setdefault("extensions", {})[CLIENT_LINK] = ClientLink(self.cycle)
            self._unanswered.append(self.cycle)

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._part_passed_on()
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._body_owed = False
        self._part_passed_on()
        self._disarm()  # a head that follows has the whole read timeout from now
        drained_after_answer = self.cycle.response_complete
        super().on_message_complete()
        if drained_after_answer and self.timeout_keep_alive_task is None and not self.transport.is_closing():
            # uvicorn armed its keep-alive timeout at the answer and dropped it at the unread
            # body's bytes: the connection is idle again.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        if self._refused and not self.pipeline and not self.transport.is_closing():
            self._answer_refusal()  # refused while answers were under way or queued: now they are sent
        super().on_response_complete()
        self._unanswered = [cycle for cycle in self._unanswered if not cycle.response_complete]
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        # uvicorn tells only the newest request; the answer under way when requests were
        # pipelined after it must learn it too, or its stream would run on for nobody.
        for cycle in self._unanswered:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._unanswered = []

    def _part_passed_on(self) -> None:
        self._passed_on, self._held_bytes = True, 0

    def _refuse(self) -> None:
        """431 for a head (or trailers) over MAX_HEAD_BYTES, and the connection closed. The
        answers to the requests before it, under way or queued (pipelined), go first: the
        431 is then the answer to the refused request, as the client pairs them."""
        refused = None if self._in_head else self.cycle  # trailers: the request already has a cycle
        self._refused, self._in_head, self._body_owed = True, False, False
        if refused is not None and self.pipeline and self.pipeline[0][0] is refused:
            self.pipeline.popleft()  # queued, never started: it is answered by the 431
        elif refused is not None or self.cycle is None or self.cycle.response_complete:
            if not self.pipeline:
                self._answer_refusal()  # nothing before it is left to answer
            return
        # Else the answer to an earlier request is under way: on_response_complete sends the
        # 431 once it and any queued ones are out.

    def _answer_refusal(self) -> None:
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if not answering:  # else the 431 would land inside that answer: the connection just closes
            self.transport.write(head_too_large_answer())
        self.transport.close()

    def _owed(self) -> bool:
        """Whether the protocol waits on the client for bytes that no application reads: the
        first request, a begun one, or the rest of a body answered unread. An idle kept-alive
        connection owes nothing (uvicorn's keep-alive timeout closes it)."""
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return False  # an application is answering: it reads the body under its own deadline
        return self._in_head or self._body_owed or self.cycle is None

    def _watch(self) -> None:
        """Arms the deadline when bytes become owed (it counts from then, not from each
        arrival, so dripping a byte at a time gains nothing) and lifts it when they are in."""
        if not self._owed():
            self._disarm()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self._owed():
            return
        if self._in_head:
            self.transport.write(request_timeout_answer(self.read_timeout_s))
        self.transport.close()


def client_link(scope: dict[str, Any]) -> ClientLink | None:
    """The ``ClientLink`` of a request, where its server gives one (``GuardedProtocol`` does)."""
    return scope.get("extensions", {}).get(CLIENT_LINK)


class ClientLink:
    """A request's connection as its route may use it beside ASGI's ``receive`` and ``send``
    (in the request's scope, under ``extensions[CLIENT_LINK]``): whether the client is gone,
    read without awaiting anything, and a started chunked answer's body parts written at once.

    Both answer per decoding step what ASGI answers at a cost: Starlette's
    ``Request.is_disconnected`` opens and cancels an anyio cancel scope at every call (a tenth
    of the event loop's time when a continuous batch asked it for each row at each step), and
    each streamed event went through two middleware wrappers and uvicorn's ``send``."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        # Weak: the cycle holds the scope that holds this link, and a strong reference would
        # leave every request's cycle, scope and body to the garbage collector.
        self._cycle = weakref.ref(cycle)

    def gone(self) -> bool:
        """Whether the client closed its connection before the answer was complete (no longer
        asked once it is: by then nothing holds the cycle, and the answer counts as given)."""
        cycle = self._cycle()
        return cycle is not None and cycle.disconnected

    def write_body(self, body: bytes) -> bool:
        """Writes ``body`` as the next part of a started chunked answer and says True; says
        False, writing nothing, where ``send`` must carry it instead: the answer is not a
        started chunked one, or the client is gone or reads slower than the server writes
        (``send`` then waits for the client, so a slow reader does not grow the buffer)."""
        cycle = self._cycle()
        if (cycle is None or cycle.disconnected or not cycle.response_started or cycle.response_complete or not body
                or not cycle.chunked_encoding or cycle.flow.write_paused or cycle.scope["method"] == "HEAD"):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class TurnWriter:
    """A connection's transport whose writes of one event-loop turn leave in one send, at the
    start of the next turn (nothing waits longer than the rest of its own turn). Each send is
    a system call that also wakes the client (50-80 us per send on loopback here, under
    load), and uvicorn writes a response's head, each body part and the end of a chunked body
    separately: a streamed completion of 8 tokens took 11 sends, one answered whole 2."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def flush(self) -> None:
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(data) for data in self._pending)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(read_timeout_s: float, max_connections: int, refusal: Asgi) -> type[GuardedProtocol]:
    """``GuardedProtocol`` with these settings, as the class uvicorn's ``Config(http=...)`` takes
    (uvicorn makes each connection's protocol from the class alone)."""
    settings = {"read_timeout_s": read_timeout_s, "max_connections": max_connections,
                "refusal": staticmethod(refusal)}
    return type("GuardedProtocol", (GuardedProtocol,), settings)


def make_room_for(max_connections: int) -> None:
    """Raises the process's soft open-file limit, where the hard limit allows, so that
    ``max_connections`` sockets fit beside the server's own files; says so in the log when
    they cannot (connections beyond the limit then fail at accept, not with a 503)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + SPARE_FILES
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("serve.max_connections = %d needs about %d open files, but the process may open at most %d "
                    "(ulimit -n); lower serve.max_connections or raise the limit", max_connections, needed, hard)
