"""The dashboard in a real headless Chromium: figures drawn, new records shown as they arrive.

Chromium comes from scripts/chromium.sh (installed once when missing and root), and the
tests skip with its reason when it cannot be had. One server and one browser profile
serve the module: each Chromium start costs about a second.
"""

from __future__ import annotations

import re
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from meshyard.doctor.dashboard.app import bind, build_app, url_of
from meshyard.doctor.dashboard.run_source import Payload, RunDirSource
from meshyard.doctor.figures import FIGURES
from tests.doctor.dashboard.records import append_records, make_run

uvicorn = pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[3]
POLL_MS = 200
BROWSER_TIMEOUT_S = 60
# Virtual time: Chromium runs the page's timers this long, pausing the clock while a fetch
# is under way, so the polls happen however slow the machine is.
VIRTUAL_MS = 3000


class ArrivingRecords:
    """The run directory's source, with steps 4 and 5 appended to its records right after
    the page's first poll: the page must show them at a later one."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.inner = run_dir, RunDirSource(run_dir)
        self.title, self.polls = self.inner.title, 0

    def since(self, offset: float) -> Payload:
        payload = self.inner.since(offset)
        if offset > 0:
            self.polls += 1
            if self.polls == 1:
                append_records(self.run_dir, range(4, 6))
        return payload


@pytest.fixture(scope="module")
def chromium() -> str:
    found = subprocess.run([str(ROOT / "scripts" / "chromium.sh")], capture_output=True, text=True, timeout=600)
    if found.returncode != 0:
        pytest.skip(found.stderr.strip() or "scripts/chromium.sh found no Chromium")
    return found.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """(url, source) of a dashboard served from a thread, on a run with steps 1-3."""
    source = ArrivingRecords(make_run(tmp_path_factory.mktemp("dashboard") / "run", range(1, 4)))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(source, POLL_MS), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield url_of(sock), source
    server.should_exit = True
    thread.join(timeout=10)


def browse(chromium: str, profile: Path, url: str, *action: str) -> str:
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,1500",
         f"--virtual-time-budget={VIRTUAL_MS}", *action, url],
        capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_page_draws_every_figure_and_shows_records_that_arrive(chromium, dashboard, tmp_path):
    url, source = dashboard
    dom = browse(chromium, tmp_path / "profile", url, "--dump-dom")
    assert source.polls >= 2, "the page did not poll twice"
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-last-step="5"' in body, body  # steps 4-5 came after the first poll
    assert re.search(r'id="stat-step"><b>5</b>', dom)
    for figure in FIGURES:
        drawn = re.search(rf'<figure data-figure="{figure.name}">(.*?)</figure>', dom, re.S).group(1)
        assert "<svg" in drawn and ("<polyline" in drawn or "<polygon" in drawn), figure.name
    assert dom.count("<polygon") >= 6  # the breakdown's stacked parts
    assert "restart: restart 1: from step 2" in dom and "guard: step 3 not kept (loss spike)" in dom
    assert re.search(r"id=\"status\"[^>]*>live, updated", dom), re.search(r"id=\"status\"[^<]*", dom).group(0)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_a_screenshot_of_the_dashboard_is_a_real_picture(chromium, dashboard, tmp_path):
    import matplotlib.image

    shot = tmp_path / "dashboard.png"
    browse(chromium, tmp_path / "profile", dashboard[0], f"--screenshot={shot}")
    data = shot.read_bytes()
    assert png_size(data) == (1280, 1500) and len(data) > 40_000
    pixels = matplotlib.image.imread(shot)[..., :3].reshape(-1, 3)
    colours = {tuple(row) for row in (pixels[::97] * 255).astype(int).tolist()}
    assert len(colours) > 50  # lines, fills and text, not a blank page
