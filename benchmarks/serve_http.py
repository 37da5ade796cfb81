"""The HTTP layer of `meshyard serve` alone: the server's CPU per streamed event, with no model.

Two server processes run the same Starlette application, whose one route answers every
request with a stream of ``--events`` server-sent events (each as long as a completion's
chunk, one per event-loop turn, as a decoding step would send them) followed by
``[DONE]``, through meshyard's ``EventStream``: one behind meshyard's connection guard
(``meshyard.serve.connections``: uvicorn's httptools protocol with the read deadline, the
connection cap and one send per turn), one behind uvicorn's pure-Python h11 protocol. A
light closed-loop client on loopback keeps ``--concurrency`` streams open; the servers take
turns, in alternating rounds. Printed for each: the server process's CPU (user + system)
per event, request and response start included, events per second, and the ratio.

    python benchmarks/serve_http.py [--concurrency 16] [--requests 320] [--events 8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from serve import Connection

REPO = Path(__file__).resolve().parents[1]
CHUNK = ('data: {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1, '
         '"model": "bench", "choices": [{"text": "a", "index": 0, "logprobs": null, "finish_reason": null}]}\n\n')


def serve(protocol: str, port: int, events: int) -> None:
    """The server process: the stream route behind ``protocol`` ("guarded" or "h11")."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Route

    from meshyard.serve.connections import guarded_protocol
    from meshyard.serve.event_stream import EventStream
    from meshyard.serve.routes import connection_refusal

    async def chunks():
        for _ in range(events):
            await asyncio.sleep(0)  # one event per turn, as a decoding step's would come
            yield CHUNK
        yield "data: [DONE]\n\n"

    async def route(request):
        await request.body()
        return EventStream(chunks(), headers={"Cache-Control": "no-cache"})

    app = Starlette(routes=[Route("/v1/completions", route, methods=["POST"])])
    http = guarded_protocol(10.0, 4096, connection_refusal(4096)) if protocol == "guarded" else "h11"
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http=http)


class Server:
    def __init__(self, protocol: str, events: int) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.protocol = protocol
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", protocol, "--port", str(port),
                                         "--events", str(events)],
                                        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None:
                    raise SystemExit(f"the {protocol} server exited with {self.process.returncode}")
                time.sleep(0.1)
        raise SystemExit(f"the {protocol} server did not listen within 60 s")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


async def load(url: str, concurrency: int, requests: int, events: int) -> None:
    """``requests`` streams, ``concurrency`` at a time, each read to its end and checked."""
    async def one_client(count: int) -> None:
        connection = await Connection.open(url)
        try:
            for _ in range(count):
                status, arrivals, body = await connection.post_stream("/v1/completions", {}, b'data: {"id"')
                if status != 200 or len(arrivals) != events or not body.endswith(b"data: [DONE]\n\n"):
                    raise SystemExit(f"a stream went wrong: {status}, {len(arrivals)} events, {body[-60:]!r}")
        finally:
            connection.close()

    shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(one_client(share) for share in shares))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=320, help="streams per server and round")
    parser.add_argument("--events", type=int, default=8, help="events per stream, [DONE] not counted")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.events)
        return
    if not Path("/proc/self/stat").exists():
        raise SystemExit("this benchmark reads the server's CPU time from /proc (Linux)")
    servers = [Server("guarded", args.events), Server("h11", args.events)]
    cpu = {server.protocol: 0.0 for server in servers}
    wall = dict.fromkeys(cpu, 0.0)
    try:
        for server in servers:  # warm both
            asyncio.run(load(server.url, args.concurrency, args.concurrency, args.events))
        for round_ in range(args.rounds):
            for server in servers if round_ % 2 == 0 else servers[::-1]:
                before, start = server.cpu_s(), time.perf_counter()
                asyncio.run(load(server.url, args.concurrency, args.requests, args.events))
                wall[server.protocol] += time.perf_counter() - start
                cpu[server.protocol] += server.cpu_s() - before
    finally:
        for server in servers:
            server.stop()
    events = args.rounds * args.requests * args.events
    print(f"{args.rounds} rounds of {args.requests} streams of {args.events} events, {args.concurrency} at a time")
    for protocol in cpu:
        print(f"{protocol:8} server CPU per event {cpu[protocol] / events * 1e6:6.1f} us   "
              f"events/s {events / wall[protocol]:8.0f}")
    print(f"guarded / h11 server CPU per event: {cpu['guarded'] / cpu['h11']:.2f}")


if __name__ == "__main__":
    main()
