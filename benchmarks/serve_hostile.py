"""`meshyard serve` under hostile traffic: good requests' latency and answers while malformed
requests are mixed in, without and then with a couple of hundred half-sent requests held open.

One server process serves a tiny text model (prediction cache off, so every good request
runs it). A closed loop of clients (threads, each over its own kept-alive connection, each
sending its next request when the last is answered) sends good requests to
``/v1/models/NAME/generate`` and ``/v1/completions`` in turn, and in place of a share of
them (``--malformed``, 20%) a malformed one of a kind drawn at random: bad JSON, 100k nested
arrays, NaN, bytes that are not UTF-8, 1e400, a 5000-digit integer, wrong types, an unknown
model, a form Content-Type, a body over serve.max_body_bytes, on both routes. The second
phase adds ``--held`` connections that send half a request (half the headers, or the
headers and half the announced body) and wait; when the server closes one after
serve.read_timeout_s, another takes its place.

Printed per phase: good requests' p50/p99 latency and throughput, every status per kind,
what the held connections saw (408s, closes), and one CHECK line per phase: no good request
got a 5xx other than 503/504, another status than 200/503/504, or a dropped connection, and
every malformed one a 4xx (an oversize body may instead see its connection reset while it
still sends).

    python benchmarks/serve_hostile.py [--run RUN_DIR] [--seconds 15] [--clients 64]
                                       [--malformed 0.2] [--held 200] [--read-timeout 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import meshyard

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench"
GENERATE = f"/v1/models/{MODEL}/generate"
COMPLETIONS = "/v1/completions"
BODY_LIMIT = 1_048_576
WORDS = "the quick brown fox jumps over a lazy dog while models answer requests one token at a time".split()


def train_run(folder: Path) -> Path:
    """A gpt-tiny run on byte-tokenized text: it has a tokenizer, so both routes take text."""
    corpus = folder / "corpus.txt"
    corpus.write_text(" ".join(WORDS * 400))
    config = meshyard.load_config(None, [
        "--model.name=gpt-tiny", "--data.source=text", f"--data.paths=['{corpus}']", "--data.seq_len=64",
        "--model.context_length=64", "--train.steps=2", "--train.global_batch=4", "--train.eval_every=0",
        "--metrics.progress_bar=false", "--checkpoint.enabled=true", "--checkpoint.async_save=false",
        f"--run.run_dir={folder / 'run'}", f"--data.cache_dir={folder / 'cache'}", f"--run.name={MODEL}",
    ])
    meshyard.run(config, nproc=1, resume="none")
    return folder / "run"


def start_server(run_dir: Path, folder: Path, read_timeout_s: float) -> tuple[subprocess.Popen, str]:
    """`meshyard serve` on a free loopback port, once it is ready."""
    ready = folder / "server.ready.json"
    log = open(folder / "server.log", "w")
    command = [sys.executable, "-m", "meshyard.cli", "serve", str(run_dir), "--port", "0", "--ready-file", str(ready),
               "--cache", "off", "--pin", MODEL, "--serve.max_new_tokens=8", "--serve.threads=1",
               f"--serve.read_timeout_s={read_timeout_s}", f"--serve.max_body_bytes={BODY_LIMIT}"]
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}; see {log.name}")
        if ready.exists():
            url = json.loads(ready.read_text())["url"]
            if httpx.get(f"{url}/readyz").status_code == 200:
                return process, url
        time.sleep(0.1)
    raise SystemExit(f"server not ready after 120 s; see {log.name}")


def good_request(i: int) -> tuple[str, bytes]:
    prompt = " ".join(random.choices(WORDS, k=6))
    if i % 2:
        return COMPLETIONS, json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    return GENERATE, json.dumps({"prompt": prompt, "max_new_tokens": 4}).encode()


def malformed_kinds() -> dict[str, tuple[str, bytes, str]]:
    """kind -> (route, body, Content-Type) of a request the server must refuse with a 4xx."""
    prompt = '"prompt": "hello"'
    bodies = {
        "bad-json": (b"{not json", "application/json"),
        "deep-nesting": (b"[" * 100_000 + b"]" * 100_000, "application/json"),
        "nan": (b'{"model": "bench", ' + prompt.encode() + b', "temperature": NaN}', "application/json"),
        "infinity": (b'{"model": "bench", ' + prompt.encode() + b', "max_tokens": Infinity}', "application/json"),
        "invalid-utf8": (b'{"model": "bench", "prompt": "\xff\xfe\xc3("}', "application/json"),
        "huge-float": (b'{"model": "bench", ' + prompt.encode() + b', "temperature": 1e400}', "application/json"),
        "huge-int": (b'{"model": "bench", ' + prompt.encode() + b', "max_tokens": ' + b"9" * 5000 + b"}",
                     "application/json"),
        "wrong-type": (b'{"model": "bench", "prompt": {"a": 1}, "max_tokens": "four"}', "application/json"),
        "unknown-model": (b'{"model": "no-such-model", ' + prompt.encode() + b"}", "application/json"),
        "form-content-type": (b"model=bench&prompt=hello", "application/x-www-form-urlencoded"),
        "oversize": (b'{"prompt": "' + b"a" * (BODY_LIMIT + 1024) + b'"}', "application/json"),
    }
    kinds = {}
    for name, (body, content_type) in bodies.items():
        kinds[f"{name} completions"] = (COMPLETIONS, body, content_type)
        own = body.replace(b'"model": "bench", ', b"") if name != "unknown-model" else body
        route = GENERATE if name != "unknown-model" else "/v1/models/no-such-model/generate"
        kinds[f"{name} generate"] = (route, own, content_type)
    return kinds


@dataclass
class Tally:
    """What one phase's clients saw."""

    latencies: list[float] = field(default_factory=list)
    good: Counter = field(default_factory=Counter)
    bad: dict[str, Counter] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_good(self, outcome: str, seconds: float) -> None:
        with self.lock:
            self.good[outcome] += 1
            if outcome == "200":
                self.latencies.append(seconds)

    def add_bad(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.bad.setdefault(kind, Counter())[outcome] += 1


def client(host: str, port: int, stop_at: float, share: float, kinds: dict, tally: Tally, seed: int) -> None:
    """One closed-loop client over its own kept-alive connection (a new one after a failure)."""
    rng = random.Random(seed)
    conn: http.client.HTTPConnection | None = None
    i = seed
    while time.monotonic() < stop_at:
        i += 1
        malformed = rng.random() < share
        kind = rng.choice(list(kinds)) if malformed else ""
        path, body, content_type = kinds[kind] if malformed else (*good_request(i), "application/json")
        conn = conn or http.client.HTTPConnection(host, port, timeout=60)
        started = time.monotonic()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            response.read()
            outcome = str(response.status)
            if response.will_close:
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as exc:
            outcome = f"dropped ({type(exc).__name__})"
            conn.close()
            conn = None
        if malformed:
            tally.add_bad(kind, outcome)
        else:
            tally.add_good(outcome, time.monotonic() - started)
    if conn is not None:
        conn.close()


HALF_HEAD = b"POST /v1/models/bench/generate HTTP/1.1\r\nHost: bench\r\nContent-Ty"
HALF_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
             b"Content-Length: 64\r\n\r\n" + b'{"model": "bench", "prompt": "hel')


class Holder:
    """``count`` connections, each sending half a request and waiting; one the server closes is
    replaced at once. Counts the 408 answers and the closes they saw."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.address, self.count = (host, port), count
        self.selector = selectors.DefaultSelector()
        self.seen: Counter = Counter()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _open(self, n: int) -> None:
        sock = socket.create_connection(self.address)
        sock.sendall(HALF_HEAD if n % 2 else HALF_BODY)
        self.selector.register(sock, selectors.EVENT_READ, n)

    def _hold(self) -> None:
        for n in range(self.count):
            self._open(n)
        while not self.stopping.is_set():
            for key, _ in self.selector.select(timeout=0.2):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if data:  # an answer (its status counted), or the rest of one
                    if data.startswith(b"HTTP/"):
                        self.seen[data.split(b" ", 2)[1].decode(errors="replace")] += 1
                    continue
                self.seen["closed"] += 1
                self.selector.unregister(sock)
                sock.close()
                self._open(key.data)

    def __enter__(self) -> "Holder":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


def run_phase(url: str, args: argparse.Namespace, held: int) -> tuple[Tally, float, Counter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    kinds, tally = malformed_kinds(), Tally()
    holder = Holder(host, int(port), held)
    with holder:
        time.sleep(0.5 if held else 0)  # the held connections are open before the clients start
        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(host, int(port), started + args.seconds, args.malformed,
                                                         kinds, tally, seed)) for seed in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
    return tally, elapsed, holder.seen


def report(name: str, tally: Tally, elapsed: float, held: Counter) -> bool:
    """Prints a phase's figures; whether its CHECK passed."""
    lat = sorted(tally.latencies)
    p50 = statistics.median(lat) * 1000 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else float("nan")
    print(f"\n== {name}")
    print(f"good requests: {sum(tally.good.values())}, {len(lat) / elapsed:.1f}/s answered 200, "
          f"p50 {p50:.1f} ms, p99 {p99:.1f} ms; statuses {dict(tally.good)}")
    bad_total = Counter()
    for kind in sorted(tally.bad):
        bad_total.update(tally.bad[kind])
        print(f"  malformed {kind:32s} {dict(tally.bad[kind])}")
    print(f"malformed requests: {sum(bad_total.values())}; statuses {dict(bad_total)}")
    if held:
        print(f"held connections saw: {dict(held)}")
    wrong_good = {k: v for k, v in tally.good.items() if k not in ("200", "503", "504")}
    wrong_bad = {kind: {k: v for k, v in seen.items() if not k.startswith("4")
                        and not (kind.startswith("oversize") and k.startswith("dropped"))}
                 for kind, seen in tally.bad.items()}
    wrong_bad = {kind: seen for kind, seen in wrong_bad.items() if seen}
    ok = not wrong_good and not wrong_bad
    print(f"CHECK {name}: good requests only 200/503/504, no dropped connection; malformed only 4xx: "
          f"{'PASS' if ok else 'FAIL'}" + ("" if ok else f" (good {wrong_good}, malformed {wrong_bad})"))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="run directory of a text model named 'bench' (default: train one)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--malformed", type=float, default=0.2, help="share of malformed requests")
    parser.add_argument("--held", type=int, default=200, help="half-open connections held in the second phase")
    parser.add_argument("--read-timeout", type=float, default=5.0, help="the server's serve.read_timeout_s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-hostile-") as tmp:
        folder = Path(tmp)
        run_dir = args.run or train_run(folder)
        process, url = start_server(run_dir, folder, args.read_timeout)
        try:
            print(f"{args.clients} clients, {args.malformed:.0%} malformed, {args.seconds:g} s per phase, "
                  f"serve.read_timeout_s={args.read_timeout:g}, server {url}")
            results = [report(name, *run_phase(url, args, held))
                       for name, held in (("without held connections", 0),
                                          (f"with {args.held} held half-open connections", args.held))]
            alive = httpx.get(f"{url}/healthz").status_code == 200
            failures = (folder / "server.log").read_text().count("Traceback")
            print(f"\nserver answers /healthz afterwards: {alive}; tracebacks in its log: {failures}")
        finally:
            process.terminate()
            process.wait(30)
    if not (all(results) and alive and not failures):
        sys.exit(1)


if __name__ == "__main__":
    main()
