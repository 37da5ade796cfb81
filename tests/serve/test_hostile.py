"""``meshyard serve`` under hostile traffic, end to end: malformed requests, half-sent requests
held open, more connections than it keeps.

Two servers run for the module on the trained text model (pinned), both with
``serve.read_timeout_s`` and ``serve.keep_alive_timeout_s`` of 1 s: ``guarded`` keeps 512
connections, ``capped`` 4. Every refusal is checked for its status and its shape (OpenAI's
error object on the OpenAI-compatible routes, ``{"error": paragraph}`` elsewhere), and the
server for answering a good request afterwards.
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from meshyard.serve.connections import MAX_HEAD_BYTES
from tests.serve.servers import ServerProcess, concurrently, running_servers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GENERATE = "/v1/models/tiny/generate"
COMPLETIONS = "/v1/completions"
READ_TIMEOUT_S = 1.0
CAPPED_CONNECTIONS = 4
HELD = 200
GOOD = {GENERATE: {"prompt": "def add(", "max_new_tokens": 2},
        COMPLETIONS: {"model": "tiny", "prompt": "def add(", "max_tokens": 2}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, trained_run) -> list[ServerProcess]:
    common = [str(trained_run), "--pin", "tiny", "--cache", "off", "--serve.max_new_tokens=8", "--serve.threads=1",
              f"--serve.read_timeout_s={READ_TIMEOUT_S}", "--serve.keep_alive_timeout_s=1",
              "--serve.max_body_bytes=1048576", "--serve.device=cpu"]
    arg_lists = [[*common, "--serve.max_connections=512"],
                 [*common, f"--serve.max_connections={CAPPED_CONNECTIONS}"]]
    with running_servers(tmp_path_factory.mktemp("hostile"), arg_lists) as started:
        yield started


@pytest.fixture(scope="module")
def guarded(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def capped(servers) -> ServerProcess:
    return servers[1]


def connect(server: ServerProcess) -> socket.socket:
    address = urlsplit(server.url)
    return socket.create_connection((address.hostname, address.port), timeout=30.0)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def message_of(reply: httpx.Response, path: str) -> str:
    """The error's paragraph, checking the route's error shape."""
    error = reply.json()["error"]
    if path == COMPLETIONS:
        assert set(error) == {"message", "type", "param", "code"}, error
        return error["message"]
    assert isinstance(error, str), error
    return error


def assert_answers_good_requests(server: ServerProcess) -> None:
    for path, body in GOOD.items():
        reply = httpx.post(f"{server.url}{path}", json=body, timeout=60.0)
        assert reply.status_code == 200, server.explain(reply)


def _with_model(path: str, fields: bytes) -> bytes:
    """A JSON object of ``fields`` (raw JSON text), with the model named where the route needs it."""
    return b"{" + (b'"model": "tiny", ' if path == COMPLETIONS else b"") + fields + b"}"


JSON = "application/json"
MALFORMED = [
    # (name, body of the route, Content-Type, status, fragment of the message)
    ("bad JSON", lambda path: b"{not json", JSON, 400, "not valid JSON"),
    ("empty body", lambda path: b"", JSON, 400, "no body"),
    ("a JSON array", lambda path: b"[1, 2]", JSON, 400, "not an object"),
    ("100k nested arrays", lambda path: b"[" * 100_000 + b"]" * 100_000, JSON, 400, "too deeply"),
    ("100k nested objects", lambda path: b'{"a":' * 100_000 + b"1" + b"}" * 100_000, JSON, 400, "too deeply"),
    ("nesting just inside the parser's limit", lambda path: _with_model(path, b'"prompt": ' + b"[" * 900 + b"1"
                                                                       + b"]" * 900), JSON, 422, "prompt"),
    ("NaN", lambda path: _with_model(path, b'"prompt": "hi", "temperature": NaN'), JSON, 400, "NaN"),
    ("-Infinity", lambda path: _with_model(path, b'"prompt": "hi", "temperature": -Infinity'), JSON, 400,
     "-Infinity"),
    ("invalid UTF-8", lambda path: _with_model(path, b'"prompt": "\xff\xfe\xc3("'), JSON, 400, "utf-8"),
    ("a lone surrogate", lambda path: _with_model(path, b'"prompt": "a\\ud800b"'), JSON, 400, "without its pair"),
    ("a lone surrogate in a key", lambda path: _with_model(path, b'"\\udfff": 1, "prompt": "hi"'), JSON, 400,
     "without its pair"),
    ("1e400", lambda path: _with_model(path, b'"prompt": "hi", "temperature": 1e400'), JSON, 422, "finite number"),
    ("a 5000-digit integer", lambda path: _with_model(path, b'"prompt": "hi", "seed": ' + b"7" * 5000), JSON, 400,
     "digits"),
    ("a 4000-digit timeout", lambda path: _with_model(path, b'"prompt": "hi", "timeout_ms": ' + b"7" * 4000), JSON,
     422, "finite number"),
    ("wrong types", lambda path: _with_model(path, b'"prompt": {"a": 1}'), JSON, 422, "prompt"),
    ("a form Content-Type", lambda path: b"prompt=hi", "application/x-www-form-urlencoded", 415, "JSON only"),
    ("a text Content-Type", lambda path: _with_model(path, b'"prompt": "hi"'), "text/plain", 415, "JSON only"),
    ("a body over max_body_bytes", lambda path: _with_model(path, b'"prompt": "' + b"a" * 1_100_000 + b'"'), JSON,
     413, "over the limit"),
]


@pytest.mark.parametrize("path", [GENERATE, COMPLETIONS])
@pytest.mark.parametrize("name, body, content_type, status, fragment", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_request_gets_its_4xx_and_the_server_goes_on(guarded, path, name, body, content_type, status,
                                                                 fragment):
    reply = httpx.post(f"{guarded.url}{path}", content=body(path), headers={"Content-Type": content_type},
                       timeout=60.0)
    assert reply.status_code == status, guarded.explain(reply)
    assert fragment in message_of(reply, path), reply.text
    assert_answers_good_requests(guarded)


@pytest.mark.parametrize("path, body, status", [
    ("/v1/models/nope/generate", {"prompt": "hi"}, 404),
    (COMPLETIONS, {"model": "nope", "prompt": "hi"}, 404),
    (COMPLETIONS, {"model": ["tiny"], "prompt": "hi"}, 400),
])
def test_unknown_models_are_refused_in_the_routes_shape(guarded, path, body, status):
    reply = httpx.post(f"{guarded.url}{path}", json=body, timeout=60.0)
    assert reply.status_code == status, guarded.explain(reply)
    assert message_of(reply, path if path == COMPLETIONS else GENERATE)


def test_a_wrong_method_on_an_openai_route_gets_an_openai_error(guarded):
    reply = httpx.get(f"{guarded.url}{COMPLETIONS}", timeout=60.0)
    assert reply.status_code == 405 and "GET is not accepted" in message_of(reply, COMPLETIONS)


def test_bytes_that_are_no_http_are_answered_400(guarded):
    with connect(guarded) as sock:
        sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert status_of(read_until_closed(sock)) == 400
    assert_answers_good_requests(guarded)


@pytest.mark.parametrize("pieces", [1, 8], ids=["one-send", "eight-sends"])
def test_a_head_longer_than_the_bound_is_answered_431_and_one_within_it_is_served(guarded, pieces):
    """Headers over MAX_HEAD_BYTES, sent at once or in pieces, get 431 and a closed
    connection, whatever the parser would have held; headers well within it are served."""
    body = json.dumps(GOOD[GENERATE]).encode()

    def request(header_bytes: int) -> bytes:
        return (b"POST %s HTTP/1.1\r\nHost: test\r\nConnection: close\r\nX-Padding: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (GENERATE.encode(), b"a" * header_bytes, len(body), body))

    for header_bytes, status in ((MAX_HEAD_BYTES + 1, 431), (MAX_HEAD_BYTES // 2, 200)):
        data = request(header_bytes)
        with connect(guarded) as sock:
            step = -(-len(data) // pieces)
            for start in range(0, len(data), step):
                if select.select([sock], [], [], 0.0)[0]:
                    break  # answered: sending on would reset the connection before the answer is read
                sock.sendall(data[start:start + step])
                time.sleep(0.01)
            answer = read_until_closed(sock)
        assert status_of(answer) == status, answer[:300]
        if status == 431:
            assert str(MAX_HEAD_BYTES) in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert_answers_good_requests(guarded)


def test_trailers_longer_than_the_bound_are_answered_431(guarded):
    """A chunked body's trailers are held by the parser like headers: bounded alike (counted
    over the reads after the one that brought the body's last bytes)."""
    with connect(guarded) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: " % GENERATE.encode())
        try:
            for _ in range(2 * MAX_HEAD_BYTES // 4096):
                time.sleep(0.01)  # reads of their own, as a client holding memory sends them
                sock.sendall(b"a" * 4096)
        except OSError:
            pass  # refused while still sending: the answer is read below
        answer = read_until_closed(sock)
    assert status_of(answer) == 431, answer[:300]
    assert_answers_good_requests(guarded)


def test_blank_lines_dripped_on_a_kept_alive_connection_gain_no_time(guarded):
    """Bytes after an answered request start the next head, under serve.read_timeout_s,
    even the blank lines a parser skips between requests."""
    body = json.dumps(GOOD[GENERATE]).encode()
    with connect(guarded) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n%s" % (GENERATE.encode(),
                                                                                          len(body), body))
        started = time.monotonic()
        answers = b""
        while time.monotonic() - started < READ_TIMEOUT_S + 5.0:
            if select.select([sock], [], [], 0.3)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answers += chunk
            else:
                sock.sendall(b"\r\n")
        waited = time.monotonic() - started
    assert status_of(answers) == 200 and b"408 Request Timeout" in answers, answers[-300:]
    assert waited < READ_TIMEOUT_S + 5.0


def test_good_requests_are_answered_while_200_half_sent_requests_are_held(guarded):
    """Half of the held connections stop inside their headers, half inside an announced body
    (which reaches the route's handler); good requests meanwhile are answered at once, and
    every held connection is answered 408 and closed after serve.read_timeout_s."""
    head = b"POST /v1/models/tiny/generate HTTP/1.1\r\nHost: test\r\nContent-Ty"
    half_body = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 64\r\n\r\n{\"model\": \"tiny\", \"prompt\": \"he")
    held = [connect(guarded) for _ in range(HELD)]
    try:
        for i, sock in enumerate(held):
            sock.sendall(head if i % 2 else half_body)
        calls = [(path, body, {}) for path, body in GOOD.items()] * 8
        replies = concurrently(guarded.url, calls, concurrency=8)
        assert [reply.status_code for reply in replies] == [200] * len(calls), guarded.explain(replies[0])
        answers = [read_until_closed(sock) for sock in held]
    finally:
        for sock in held:
            sock.close()
    assert [status_of(answer) for answer in answers] == [408] * HELD
    body_timeout = json.loads(answers[0].split(b"\r\n\r\n", 1)[1])  # a half body: the route's OpenAI shape
    assert "serve.read_timeout_s" in body_timeout["error"]["message"]
    head_timeout = json.loads(answers[1].split(b"\r\n\r\n", 1)[1])
    assert "line and headers did not arrive" in head_timeout["error"]
    assert_answers_good_requests(guarded)


@pytest.mark.parametrize("sent, answered", [(b"", 0), (b"POST /v1/models/tiny/generate HTTP/1.1\r\nHo", 408)])
def test_a_held_connection_is_closed_after_read_timeout_s(guarded, sent, answered):
    """A connection that sends nothing is closed without an answer; one that stops in its
    headers is answered 408; both after serve.read_timeout_s, not before."""
    with connect(guarded) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        answer = read_until_closed(sock)
        waited = time.monotonic() - started
    assert status_of(answer) == answered
    assert READ_TIMEOUT_S * 0.9 <= waited < READ_TIMEOUT_S + 5.0


def test_dripping_a_header_a_byte_at_a_time_gains_no_time(guarded):
    request = b"POST /v1/models/tiny/generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with connect(guarded) as sock:
        started = time.monotonic()
        for byte in request:  # a byte every 0.1 s: the whole header would take 9 s
            if select.select([sock], [], [], 0.1)[0]:
                break  # answered: sending on would reset the connection before the answer is read
            sock.sendall(bytes([byte]))
        answer = read_until_closed(sock)
        waited = time.monotonic() - started
    assert status_of(answer) == 408 and waited < READ_TIMEOUT_S + 5.0


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_timeout_s(guarded):
    body = json.dumps(GOOD[GENERATE]).encode()
    with connect(guarded) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n%s" % (GENERATE.encode(),
                                                                                          len(body), body))
        started = time.monotonic()
        answer = read_until_closed(sock)
        waited = time.monotonic() - started
    assert status_of(answer) == 200 and waited < 1.0 + 5.0


def test_connections_beyond_max_connections_are_answered_503(capped):
    """Idle connections fill the cap; a request on the next one is answered 503 with
    Retry-After in its route's shape, and its connection closed; once the idle ones go, a
    request is answered again."""
    idle = [connect(capped) for _ in range(CAPPED_CONNECTIONS)]
    try:
        time.sleep(0.2)  # the server has accepted them
        for path, body in GOOD.items():
            reply = httpx.post(f"{capped.url}{path}", json=body, timeout=60.0)
            assert reply.status_code == 503, capped.explain(reply)
            assert reply.headers["retry-after"] == "1" and reply.headers["connection"] == "close"
            assert "serve.max_connections" in message_of(reply, path)
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert_answers_good_requests(capped)
