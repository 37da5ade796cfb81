"""A real redis-server on loopback for tests, started by scripts/redis_server.sh.

``start_redis(folder)`` returns the server's URL and a function that stops it; where Redis
cannot start (not root and not installed, no apt-get, no network), it skips the calling
test, or every test of a fixture that calls it, with the script's own reason. The first
call on a fresh machine installs Debian's redis-server (about half a minute); later calls
start in well under a second. Use it from a fixture of the scope the tests share, e.g.::

    @pytest.fixture(scope="session")
    def redis_url(tmp_path_factory):
        url, stop = start_redis(tmp_path_factory.mktemp("redis"))
        yield url
        stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.launch.sockets import alive

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "redis_server.sh"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_redis(folder: Path, port: int | None = None) -> tuple[str, Callable[[], None]]:
    """Starts redis-server on ``port`` (a free one by default) with its files in ``folder``;
    returns (``redis://127.0.0.1:PORT/0``, stop). Skips with the reason when it cannot start."""
    port = port or free_port()
    pidfile = Path(folder) / f"redis-{port}.pid"
    try:
        done = subprocess.run(["bash", str(SCRIPT), str(port), str(pidfile)], capture_output=True, text=True,
                              timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"scripts/redis_server.sh could not run: {exc}")
    if done.returncode != 0:
        lines = (done.stderr.strip() or done.stdout.strip() or "scripts/redis_server.sh failed").splitlines()
        pytest.skip(lines[-1])
    pid = int(pidfile.read_text().strip())
    return f"redis://127.0.0.1:{port}/0", lambda: _stop(pid)


def _stop(pid: int, timeout_s: float = 10.0) -> None:
    """Ends the server (it saves nothing: it runs with --save ''), waiting until it is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    stop_at = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < stop_at:
        time.sleep(0.02)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)

