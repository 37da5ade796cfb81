"""Real ``meshyard serve`` processes for the end-to-end tests.

``running_servers(folder, [args, ...])`` starts one server per argument list at once (on a
free port, with ``--ready-file``), waits until each listens and, where it pins models,
until ``/readyz`` says they are loaded; it stops them with SIGTERM afterwards and fails if
one does not exit 0. Each server writes its output to a log file in ``folder``;
``ServerProcess.explain(response)`` puts the log's end into an assertion message, so a
failing test shows what the server said.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

START_TIMEOUT_S = 120.0  # a server imports torch and describes its models first
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 4000


def serve_command() -> list[str]:
    """``meshyard serve`` through the entry point."""
    return [sys.executable, "-m", "meshyard.cli", "serve"]


@dataclass
class ServerProcess:
    """A started server: its URL (once it listens), process and log file."""

    process: subprocess.Popen
    log_path: Path
    ready_file: Path
    url: str = ""

    def log(self) -> str:
        """The end of what the server printed."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-LOG_TAIL_CHARS:]

    def explain(self, response: httpx.Response | Reply | None = None) -> str:
        """An assertion message: the response (when given) and the end of the server's log."""
        head = "" if response is None else f"{response.status_code} {response.text[:2000]}\n"
        return f"{head}--- server log ({self.log_path}) ---\n{self.log()}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` in ``/metrics`` whose labels include ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=30.0).text
        return sum(value for sample, found, value in parse_metrics(text)
                   if sample == name and labels.items() <= found.items())


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        samples.append((name, {key: raw.strip('"') for key, raw in labels.items()}, float(value)))
    return samples


def launch(folder: Path, args: list[str], index: int = 0) -> ServerProcess:
    """Starts ``meshyard serve ARGS --port 0 --ready-file F``; returns without waiting."""
    log_path, ready_file = folder / f"server-{index}.log", folder / f"server-{index}.ready.json"
    command = [*serve_command(), *args, "--port", "0", "--ready-file", str(ready_file)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    return ServerProcess(process, log_path, ready_file)


def wait_until_listening(server: ServerProcess) -> None:
    """Waits for the ready file (the server listens) or fails with the server's log."""
    stop_at = time.monotonic() + START_TIMEOUT_S
    while not server.ready_file.exists():
        if server.process.poll() is not None:
            pytest.fail(f"meshyard serve exited with {server.process.returncode} before listening\n"
                        + server.explain())
        if time.monotonic() > stop_at:
            pytest.fail(f"meshyard serve did not listen within {START_TIMEOUT_S:.0f} s\n" + server.explain())
        time.sleep(0.05)
    server.url = json.loads(server.ready_file.read_text())["url"]


def wait_until_ready(server: ServerProcess) -> None:
    """Waits until ``/readyz`` answers 200 (its pinned models are loaded)."""
    stop_at = time.monotonic() + START_TIMEOUT_S
    while httpx.get(f"{server.url}/readyz", timeout=30.0).status_code != 200:
        if time.monotonic() > stop_at:
            pytest.fail(f"/readyz stayed 503 for {START_TIMEOUT_S:.0f} s\n" + server.explain())
        time.sleep(0.05)


def exit_code(server: ServerProcess) -> int:
    """The exit code once the process ends (SIGKILL after STOP_TIMEOUT_S: the code says so)."""
    try:
        server.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    return server.process.returncode


@contextmanager
def running_servers(folder: Path, arg_lists: list[list[str]]) -> Iterator[list[ServerProcess]]:
    """Servers for ``arg_lists``, started together, ready, and stopped afterwards; a server
    that does not exit 0 on SIGTERM fails the fixture that used this."""
    servers = [launch(folder, args, index) for index, args in enumerate(arg_lists)]
    try:
        for server in servers:
            wait_until_listening(server)
            wait_until_ready(server)
        yield servers
    finally:
        for server in servers:  # all at once: each takes a moment to shut down
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        codes = [exit_code(server) for server in servers]
    failed = [(server, code) for server, code in zip(servers, codes) if code != 0]
    if failed:
        server, code = failed[0]
        pytest.fail(f"meshyard serve exited with {code} after SIGTERM (expected 0)\n" + server.explain())



@dataclass
class Reply:
    """An HTTP answer as far as the tests read it (the names httpx.Response uses)."""

    status_code: int
    headers: Any  # http.client.HTTPMessage: case-insensitive lookup
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def concurrently(url: str, calls: list[tuple[str, dict[str, Any], dict[str, str]]],
                 concurrency: int = 16) -> list[Reply]:
    """POSTs ``calls`` (path, JSON body, headers) from ``concurrency`` threads, each over its
    own kept-alive connection; the replies in the order of ``calls``. The standard library's
    client costs a tenth of the CPU time of an async httpx client per request, which matters
    for the thousands of requests of the canary test on two cores."""
    address = urllib.parse.urlsplit(url)
    local = threading.local()
    opened: list[http.client.HTTPConnection] = []

    def post(call: tuple[str, dict[str, Any], dict[str, str]]) -> Reply:
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60.0)
            opened.append(local.connection)
        path, body, headers = call
        local.connection.request("POST", path, body=json.dumps(body),
                                 headers={"Content-Type": "application/json", **headers})
        response = local.connection.getresponse()
        return Reply(response.status, response.headers, response.read().decode())

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(post, calls))
    finally:
        for connection in opened:
            connection.close()
