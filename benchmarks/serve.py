"""Batching and streaming in `meshyard serve`: throughput and latency side by side on the
same model, in the same job.

1. Dynamic batching. Two server processes serve the same checkpoint: one batches
(serve.max_batch_size, waiting at most serve.max_wait_ms for a batch to fill), the other
runs every request alone (max_batch_size 1). For each concurrency a bounded closed-loop load
generator on loopback keeps that many generate requests in flight (each client sends its
next request when the last one is answered) until it has sent its share; the servers take
turns, so both see the same machine. The prediction cache is off and every prompt differs,
so every request runs the model. Printed: requests/s and p50/p95/p99 latency for each side,
the throughput ratio and the p95 ratio (target: >= 3x throughput at equal or lower p95 for
concurrency >= 16).

A low-traffic run then sends one request at a time with pauses between them: there a
batch never fills, so batching can only add its wait; its p99 must exceed the unbatched
p99 by at most max_wait_ms.

2. Streaming. ``POST /v1/completions`` through both schedulers (the batching server above,
serve.scheduler "dynamic", and a third process with "continuous"), asked with and without
``stream: true`` by the light client below, which reads the server-sent events as they
come. For each scheduler and concurrency the two modes alternate in rounds (streamed first
in even rounds, answered whole first in odd ones), so a burst of load on the shared machine
hits both alike. Printed for each: completion tokens/s, time to first token (TTFT) p50/p95
(for a request answered whole, its full latency), for streamed requests the inter-token
latency p50/p95 (the gaps between a stream's chunks: one per step), and the server
process's CPU time per token. The streaming cost is streamed tokens/s over whole-answer
tokens/s at concurrency 16 over all rounds (target: >= 0.95, i.e. streaming costs at most
5% of throughput), printed with the median and range of the rounds' own ratios. Rounds
must last seconds: with the former 64 requests a round (0.2 s) the ratio of one unchanged
server swung between 0.77 and 1.20 from run to run.

    python benchmarks/serve.py [--run RUN_DIR] [--model gpt-mini] [--concurrency 1,4,16,32]
                               [--requests 256] [--new-tokens 8] [--prompt-tokens 32]
                               [--stream-concurrency 16] [--stream-requests 512] [--stream-rounds 8]
                               [--parts batching,streaming]

``--run`` must hold a model with a tokenizer for part 2 (the default run trains one step on
the repository's README.md, byte-tokenized).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

import meshyard

REPO = Path(__file__).resolve().parents[1]


def train_run(args: argparse.Namespace, folder: Path) -> Path:
    """A checkpointed run of the benchmark's model: weights do not matter for speed."""
    run_dir = folder / "run"
    corpus = folder / "corpus.txt"  # any text: the completions route needs the run's tokenizer
    corpus.write_text((REPO / "README.md").read_text())
    config = meshyard.load_config(None, [
        f"--model.name={args.model}", "--data.source=text", f"--data.paths=['{corpus}']",
        f"--data.cache_dir={folder / 'cache'}",
        f"--data.seq_len={args.prompt_tokens + args.new_tokens}", "--train.steps=1", "--train.global_batch=2",
        "--train.eval_every=0", "--metrics.progress_bar=false", "--checkpoint.enabled=true",
        "--checkpoint.async_save=false", f"--run.run_dir={run_dir}", "--run.name=bench",
    ])
    meshyard.run(config, nproc=1, resume="none")
    return run_dir


class ServerProcess:
    """One `meshyard serve` process on a free loopback port."""

    def __init__(self, run_dir: Path, folder: Path, label: str, *overrides: str) -> None:
        self.ready_file = folder / f"{label}.ready.json"
        self.log = open(folder / f"{label}.log", "w")
        command = [sys.executable, "-m", "meshyard.cli", "serve", str(run_dir), "--port", "0",
                   "--ready-file", str(self.ready_file), "--cache", "off", "--serve.max_queue=4096",
                   "--serve.request_timeout_s=600", *overrides]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        self.url = self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server exited with {self.process.returncode}; see {self.log.name}")
            if self.ready_file.exists() and self.ready_file.read_text().strip():
                url = json.loads(self.ready_file.read_text())["url"]
                if httpx.get(f"{url}/readyz").status_code == 200:
                    return url
            time.sleep(0.1)
        raise SystemExit(f"server not ready after {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams: a load generator this light
    leaves the 2 cores to the server (an httpx client cost several times the CPU per request)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> "Connection":
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, parts.netloc)

    async def post(self, path: str, payload: dict) -> tuple[int, bytes]:
        status, headers = await self._send(path, payload)
        return status, await self.reader.readexactly(int(headers["content-length"]))

    async def post_stream(self, path: str, payload: dict, chunk_marker: bytes) -> tuple[int, list[float], bytes]:
        """A streamed answer (chunked transfer encoding): its status, the arrival time of
        each piece holding ``chunk_marker`` (once per marker in it), and the whole body."""
        status, headers = await self._send(path, payload)
        if headers.get("transfer-encoding") != "chunked":
            return status, [], await self.reader.readexactly(int(headers.get("content-length", 0)))
        arrivals, body = [], b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            piece = (await self.reader.readexactly(size + 2))[:-2]
            if size == 0:
                return status, arrivals, body
            arrivals.extend([time.perf_counter()] * piece.count(chunk_marker))
            body += piece

    async def _send(self, path: str, payload: dict) -> tuple[int, dict[str, str]]:
        body = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in
                   (line.partition(":") for line in lines[1:] if line)}
        return int(lines[0].split()[1]), headers

    def close(self) -> None:
        self.writer.close()


async def closed_loop(url: str, model: str, concurrency: int, requests: int, args: argparse.Namespace,
                      pause_s: float = 0.0, seed: int = 0) -> tuple[float, list[float]]:
    """Wall seconds and per-request latencies of ``requests`` requests, ``concurrency`` at a time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 256) for _ in range(args.prompt_tokens)] for _ in range(requests)]
    latencies: list[float] = []
    connections = [await Connection.open(url) for _ in range(concurrency)]

    async def one_client(connection: Connection, share: list[list[int]]) -> None:
        for prompt in share:
            start = time.perf_counter()
            status, body = await connection.post(f"/v1/models/{model}/generate",
                                                 {"tokens": prompt, "max_new_tokens": args.new_tokens})
            latencies.append(time.perf_counter() - start)
            if status != 200:
                raise SystemExit(f"request failed: {status} {body[:500]!r}")
            if pause_s:
                await asyncio.sleep(pause_s)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one_client(connection, prompts[i::concurrency])
                               for i, connection in enumerate(connections)))
    finally:
        for connection in connections:
            connection.close()
    return time.perf_counter() - start, latencies


def mean_batch_size(url: str) -> float:
    """From the server's batch-size histogram: the mean size of the batches it ran."""
    total = count = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("meshyard_serve_batch_size_sum"):
            total += float(line.split()[-1])
        elif line.startswith("meshyard_serve_batch_size_count"):
            count += float(line.split()[-1])
    return total / count if count else 0.0


def summary(wall_s: float, latencies: list[float]) -> dict[str, float]:
    return {"rps": len(latencies) / wall_s, "p50": percentile(latencies, 50) * 1e3,
            "p95": percentile(latencies, 95) * 1e3, "p99": percentile(latencies, 99) * 1e3}


def sweep(servers: dict[str, ServerProcess], args: argparse.Namespace) -> list[tuple[int, dict, dict]]:
    rows = []
    for concurrency in args.concurrency:
        figures = {}
        for label in ("batched", "unbatched"):  # warm both first, then measure in turn
            asyncio.run(closed_loop(servers[label].url, "bench", concurrency, concurrency * 2, args, seed=1))
        for label in ("batched", "unbatched"):
            wall, latencies = asyncio.run(closed_loop(servers[label].url, "bench", concurrency,
                                                      args.requests, args, seed=concurrency))
            figures[label] = summary(wall, latencies)
        rows.append((concurrency, figures["batched"], figures["unbatched"]))
    return rows


def print_sweep(rows: list[tuple[int, dict, dict]], args: argparse.Namespace) -> bool:
    print(f"{'conc':>5} | {'batched: req/s   p50   p95   p99 (ms)':>40} | {'unbatched: req/s   p50   p95   p99':>36}"
          f" | {'x req/s':>7} {'p95 b/u':>7}")
    met = True
    for concurrency, on, off in rows:
        ratio, p95_ratio = on["rps"] / off["rps"], on["p95"] / off["p95"]
        print(f"{concurrency:>5} | {on['rps']:>18.1f} {on['p50']:>6.1f} {on['p95']:>6.1f} {on['p99']:>6.1f}"
              f" | {off['rps']:>17.1f} {off['p50']:>6.1f} {off['p95']:>6.1f} {off['p99']:>6.1f}"
              f" | {ratio:>7.2f} {p95_ratio:>7.2f}")
        if concurrency >= 16:
            met &= ratio >= 3.0 and p95_ratio <= 1.0
    print(f"target (concurrency >= 16): >= 3x throughput at equal or lower p95: {'met' if met else 'NOT met'}")
    return met


def low_traffic(servers: dict[str, ServerProcess], args: argparse.Namespace) -> bool:
    """One request at a time, 20 ms apart: batching can only add its wait."""
    p99 = {}
    for label in ("batched", "unbatched"):
        _, latencies = asyncio.run(closed_loop(servers[label].url, "bench", 1, args.low_traffic_requests, args,
                                               pause_s=0.02, seed=99))
        p99[label] = percentile(latencies, 99) * 1e3
        print(f"low traffic, {label:<9}: p50 {statistics.median(latencies) * 1e3:.1f} ms, p99 {p99[label]:.1f} ms")
    added = p99["batched"] - p99["unbatched"]
    met = added <= args.max_wait_ms
    print(f"p99 added by batching at low traffic: {added:+.1f} ms (max_wait_ms {args.max_wait_ms:g}): "
          f"{'within' if met else 'OVER'}")
    return met


@dataclass
class Streaming:
    """One scheduler, concurrency and mode, over all its rounds."""

    wall_s: float = 0.0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # to the first chunk (whole: to the answer)
    gaps_s: list[float] = field(default_factory=list)  # between a stream's chunks
    rounds: list[float] = field(default_factory=list)  # each round's tokens/s
    server_cpu_s: float = 0.0  # the server process's user + system time over the rounds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def add(self, round_: "Streaming", server_cpu_s: float) -> None:
        """One round's figures, and the server's CPU time during it."""
        self.wall_s += round_.wall_s
        self.tokens += round_.tokens
        self.ttft_s += round_.ttft_s
        self.gaps_s += round_.gaps_s
        self.rounds.append(round_.tokens_per_s)
        self.server_cpu_s += server_cpu_s


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def completions_load(url: str, concurrency: int, requests: int, stream: bool, args: argparse.Namespace,
                           into: Streaming, seed: int) -> None:
    """``requests`` completions, ``concurrency`` at a time, streamed or answered whole, added
    to ``into``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 256) for _ in range(args.prompt_tokens)] for _ in range(requests)]

    async def one_client(share: list[list[int]]) -> None:
        connection = await Connection.open(url)  # the light client: the server's cost is measured, not httpx's
        try:
            for prompt in share:
                body = {"model": "bench", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
                        "stream": stream}
                start = time.perf_counter()
                if not stream:
                    status, answer = await connection.post("/v1/completions", body)
                    if status != 200:
                        raise SystemExit(f"request failed: {status} {answer[:500]!r}")
                    into.ttft_s.append(time.perf_counter() - start)
                    continue
                status, chunks, answer = await connection.post_stream("/v1/completions", body, b'data: {"id"')
                if status != 200 or b'data: {"error"' in answer or not chunks:
                    raise SystemExit(f"stream failed: {status} {answer[:500]!r}")
                into.ttft_s.append(chunks[0] - start)
                into.gaps_s.extend(b - a for a, b in zip(chunks, chunks[1:]))
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(one_client(prompts[i::concurrency]) for i in range(concurrency)))
    into.wall_s += time.perf_counter() - start
    into.tokens += requests * args.new_tokens  # no stop strings: every completion has max_tokens


def stream_sweep(servers: dict[str, ServerProcess], args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    """(scheduler, concurrency) -> {"streamed": Streaming, "whole": Streaming}, the modes in
    alternating rounds."""
    results = {}
    for scheduler, label in (("dynamic", "batched"), ("continuous", "continuous")):
        url = servers[label].url
        for concurrency in args.stream_concurrency:
            modes = {"streamed": Streaming(), "whole": Streaming()}
            for stream in (True, False):  # warm both paths first
                asyncio.run(completions_load(url, concurrency, concurrency, stream, args, Streaming(), seed=1))
            for round_ in range(args.stream_rounds):
                order = ("streamed", "whole") if round_ % 2 == 0 else ("whole", "streamed")
                for mode in order:
                    one, cpu_before = Streaming(), process_cpu_s(servers[label].process.pid)
                    asyncio.run(completions_load(url, concurrency, args.stream_requests, mode == "streamed", args,
                                                 one, seed=1000 * concurrency + round_))
                    modes[mode].add(one, process_cpu_s(servers[label].process.pid) - cpu_before)
            results[(scheduler, concurrency)] = modes
    return results


def print_streaming(results: dict[tuple[str, int], dict], args: argparse.Namespace) -> bool:
    print(f"\nstreaming: POST /v1/completions, {args.new_tokens} tokens each, {args.stream_rounds} rounds of "
          f"{args.stream_requests} requests per mode, streamed and whole in alternation")
    print(f"{'scheduler':<10} {'conc':>4} {'mode':<8} | {'tok/s':>7} | {'TTFT p50':>8} {'p95 (ms)':>8} | "
          f"{'ITL p50':>7} {'p95 (ms)':>8} | {'server CPU us/token':>19}")
    for (scheduler, concurrency), modes in results.items():
        for mode, m in modes.items():
            itl = (f"{percentile(m.gaps_s, 50) * 1e3:>7.1f} {percentile(m.gaps_s, 95) * 1e3:>8.1f}" if m.gaps_s
                   else f"{'-':>7} {'-':>8}")
            print(f"{scheduler:<10} {concurrency:>4} {mode:<8} | {m.tokens_per_s:>7.0f} | "
                  f"{percentile(m.ttft_s, 50) * 1e3:>8.1f} {percentile(m.ttft_s, 95) * 1e3:>8.1f} | {itl} | "
                  f"{m.server_cpu_s / m.tokens * 1e6:>19.1f}")
    met = True
    for (scheduler, concurrency), modes in results.items():
        if concurrency != 16:
            continue
        ratio = modes["streamed"].tokens_per_s / modes["whole"].tokens_per_s
        by_round = [streamed / whole for streamed, whole in zip(modes["streamed"].rounds, modes["whole"].rounds)]
        met &= ratio >= 0.95
        print(f"streaming cost, {scheduler}, concurrency 16: streamed / whole tokens/s = {ratio:.3f} "
              f"(rounds: median {statistics.median(by_round):.3f}, {min(by_round):.3f}-{max(by_round):.3f}; "
              f"target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="run directory to serve (default: train --model for one step)")
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--concurrency", default="1,4,16,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=256, help="requests per side and concurrency")
    parser.add_argument("--low-traffic-requests", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--stream-concurrency", default="16", type=lambda s: [int(x) for x in s.split(",")],
                        help="concurrencies of part 2 (the streaming cost is read at 16)")
    parser.add_argument("--stream-requests", type=int, default=512, help="requests per mode and round in part 2")
    parser.add_argument("--stream-rounds", type=int, default=8, help="alternating rounds per mode in part 2")
    parser.add_argument("--parts", default="batching,streaming", type=lambda s: s.split(","),
                        help="which parts to run: batching (1), streaming (2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        run_dir = Path(args.run) if args.run else train_run(args, folder)
        servers = {
            "batched": ServerProcess(run_dir, folder, "batched", f"--serve.max_batch_size={args.max_batch}",
                                     f"--serve.max_wait_ms={args.max_wait_ms}", "--serve.scheduler=dynamic"),
        }
        if "batching" in args.parts:
            servers["unbatched"] = ServerProcess(run_dir, folder, "unbatched", "--serve.max_batch_size=1",
                                                 "--serve.scheduler=dynamic")
        if "streaming" in args.parts:
            servers["continuous"] = ServerProcess(run_dir, folder, "continuous", "--serve.scheduler=continuous",
                                                  f"--serve.max_batch_size={args.max_batch}")
        met = True
        try:
            print(f"model {args.model}: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, "
                  f"max_batch_size {args.max_batch}, max_wait_ms {args.max_wait_ms:g}")
            if "batching" in args.parts:
                print(f"1. dynamic batching: {args.requests} requests per cell")
                met &= print_sweep(sweep(servers, args), args)
                print(f"mean batch size of the batching server: {mean_batch_size(servers['batched'].url):.1f}")
                met &= low_traffic(servers, args)
            if "streaming" in args.parts:
                met &= print_streaming(stream_sweep(servers, args), args)
        finally:
            for server in servers.values():
                server.stop()
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
