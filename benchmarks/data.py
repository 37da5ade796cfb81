"""Step time of a small model fed from local files and from token shards on an S3 server,
with a warm and a cold shard cache, and the bytes each rank downloaded.

The corpus is this Python's standard-library sources (the first --corpus-mb of them), as
byte tokens. It is prepared once with ``meshyard data prepare``'s library call into
shards of --shard-tokens tokens on a moto S3 server that this process runs on the
loopback address; the tokenization it caches is what the local runs read
(``data.source = "text"``, a memory-mapped file). Both read the same token stream, so
every run trains on the same samples. Three ways to feed the same job, in interleaved
rounds (local, warm, cold, local, ...) so drift on a shared machine hits all three:

- local: ``data.source = "text"`` on the same files;
- shards, warm cache: ``data.source = "shards"``, each rank's cache holding every shard
  its samples of the run fall in before the first step (fetched then, not counted);
- shards, cold cache: an empty cache of --cold-cache-shards shards, so every shard is
  downloaded during the run, ahead of need by the look-ahead of the next two steps. In
  the shards' default order (spans of ``data.shuffle_span_shards`` shards, one stretch of
  the corpus per place in the global batch) a rank fetches a shard for each few steps;
  small --shard-tokens make that a fetch or more per step (1024: two per step per rank),
  and --span-shards 0 (a shuffle over the whole corpus) one for nearly every sample.

Step times are rank 0's ``step_time_s`` of the steps after --warmup (the cold cache's
first steps wait for their shards; the look-ahead then runs ahead), as medians over the
steps of each round; the figure is the median of the rounds, with their spread. A
rank's share is the shards its own samples of the run fall in: what it must download at
the least (a cold cache, smaller than the share, downloads some of them again); the
script checks each rank downloaded no shard outside its share. --bandwidth-mbps limits
each rank's downloads to that many MB/s (a shared link per rank); the loopback's own
bandwidth, measured with one stream, is printed beside it. moto's server is Python and
costs CPU per request; on a small machine it competes with the ranks for cores, which a
cluster's object store does not: --server-cores N runs it in a process of its own on N
cores and the ranks of every run (local ones too) on the others.

    python benchmarks/data.py [--nproc 2] [--model gpt-mini] [--steps 40] [--warmup 10] [--rounds 3]
                              [--corpus-mb 16] [--shard-tokens 16384] [--cold-cache-shards 64]
                              [--span-shards 2]
                              [--bandwidth-mbps 0] [--server-cores 0] [--out data.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import meshyard
from meshyard.data.corpus import stdlib_source_files
from meshyard.data.prepare import prepare_shards
from meshyard.data.shard_reader import ShardedTokens
from meshyard.data.shards import ShardStore
from meshyard.metrics.records import read_metrics
from meshyard.runtime.distributed import Runtime
from meshyard.train.build import build_trainer
from meshyard.validate import validate

BUCKET, URL = "bench", "s3://bench/corpus"
MODES = ("local", "warm", "cold")
SEQ_LEN, GLOBAL_BATCH = 128, 16


def start_s3(server_cores: set[int] | None) -> tuple[Any, dict[str, Any]]:
    """A moto S3 server on the loopback address holding BUCKET, and the fsspec options to reach
    it: in this process, or with ``server_cores`` in a process of its own kept on those cores."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if server_cores is None:
        from moto.server import ThreadedMotoServer  # the 'test' extra
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    else:
        server = ServerProcess(subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.sched_setaffinity(0, server_cores)))
        wait_for_port(port)
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    ShardStore(f"s3://{BUCKET}", options).fs.mkdir(BUCKET)
    return server, options


class ServerProcess:
    """A server in a process of its own, stopped like moto's threaded one."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    stop_at = time.monotonic() + timeout_s
    while time.monotonic() < stop_at:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the S3 server did not listen on port {port} within {timeout_s:.0f} s")


def split_cores(server_cores: int) -> tuple[set[int] | None, set[int] | None]:
    """(the server's cores, the ranks' cores): the first ``server_cores`` of this process's
    cores for the server, the rest for the ranks; (None, None) for 0: all share all."""
    if server_cores <= 0:
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if server_cores >= len(cores):
        raise SystemExit(f"--server-cores {server_cores} leaves none of this machine's {len(cores)} cores to the "
                         "ranks: give the server fewer")
    return set(cores[:server_cores]), set(cores[server_cores:])


def corpus_files(megabytes: float) -> list[str]:
    files, size = [], 0
    for path in stdlib_source_files():
        if size >= megabytes * 1e6:
            break
        files.append(str(path))
        size += path.stat().st_size
    return files


def overrides(args: argparse.Namespace, mode: str, files: list[str], options: dict, work: Path, run: str) -> list[str]:
    common = [
        f"--model.name={args.model}", f"--data.seq_len={SEQ_LEN}", "--data.val_fraction=0",
        f"--data.cache_dir={work / 'cache'}", f"--train.global_batch={GLOBAL_BATCH}", f"--train.steps={args.steps}",
        "--train.eval_every=0", "--optim.warmup_steps=2", "--checkpoint.enabled=false", "--metrics.mfu=false",
        "--metrics.progress_bar=false", f"--metrics.log_every={10**6}", f"--run.run_dir={work / run}",
    ]
    if mode == "local":
        return [*common, "--data.source=text", f"--data.paths={json.dumps(files)}"]
    cache = args.cold_cache_shards * args.shard_tokens if mode == "cold" else 1 << 40  # bytes: one per token
    return [*common, "--data.source=shards", f"--data.url={URL}", f"--data.cache_bytes={cache}",
            f"--data.shuffle_span_shards={args.span_shards}", f"--data.storage_options={toml_table(options)}"]


def toml_table(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_table(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def throttle(store: ShardStore, megabytes_per_s: float) -> None:
    """Make ``store``'s reads, from all threads together, no faster than ``megabytes_per_s``."""
    read, lock, free_at = store.read, threading.Lock(), [time.monotonic()]

    def limited(name: str) -> bytes:
        data = read(name)
        with lock:
            start = max(time.monotonic(), free_at[0])
            free_at[0] = start + len(data) / (megabytes_per_s * 1e6)
            until = free_at[0]
        time.sleep(max(0.0, until - time.monotonic()))
        return data
    store.read = limited


def record_names(store: ShardStore) -> tuple[set[str], list[float]]:
    """The names of the files ``store`` reads from now on, and when (unix s) each read ended."""
    read, names, ends = store.read, set(), []

    def recorded(name: str) -> bytes:
        names.add(name)
        data = read(name)
        ends.append(time.time())
        return data
    store.read = recorded
    return names, ends


def share_of(trainer: Any, tokens: ShardedTokens, steps: int) -> list[int]:
    """The shards this rank's samples of the first ``steps`` steps fall in (the run's, and
    the two after it that the look-ahead names while the last ones train)."""
    dataset, sampler = trainer.data.train_loader.dataset, trainer.data.sampler
    indices = [i for step in range(steps) for batch in sampler.step_indices(step) for i in batch]
    starts = [(dataset.first + i) * dataset.seq_len for i in indices]
    return tokens.shards_of(torch.tensor(starts + [s + dataset.seq_len for s in starts]).numpy())


def rank_main(rank: int, world_size: int, folder: str, argv: list[str], mode: str, steps: int,
              bandwidth: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-{mode}", world_size), rank=rank,
                            world_size=world_size)
    cfg = meshyard.load_config(None, argv)
    validate(cfg, world_size)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    built = build_trainer(cfg, Runtime(rank, world_size, rank, torch.device("cpu"), "gloo"), run_dir, "none")
    trainer, figures = built.trainer, {}
    tokens = trainer.data.train_loader.dataset.tokens
    if isinstance(tokens, ShardedTokens):
        cache = tokens.cache
        if bandwidth:
            throttle(cache.store, bandwidth)
        downloaded, fetch_ends = record_names(cache.store)
        share = share_of(trainer, tokens, steps + 2)
        figures = {"share_shards": len(share), "share_bytes": sum(tokens.shards[k].tokens for k in share)
                   * tokens.dtype.itemsize}
        if mode == "warm":  # every shard of the run in the cache before the first step
            for k in share:
                cache.get(tokens.shards[k])
            figures["warmup_bytes"] = cache.fetched_bytes
            cache.fetches = cache.fetched_bytes = 0
        names = {tokens.shards[k].name for k in share}
    dist.barrier()
    try:
        trainer.fit()
    finally:
        trainer.close()
    if isinstance(tokens, ShardedTokens):
        figures.update(fetched_bytes=tokens.cache.fetched_bytes, fetches=tokens.cache.fetches, fetch_ends=fetch_ends,
                       outside_share=sorted(downloaded - names))
    Path(folder, f"{mode}-rank{rank}.json").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def run_mode(args: argparse.Namespace, mode: str, argv: list[str], work: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=work) as folder:
        mp.spawn(rank_main, args=(args.nproc, folder, argv, mode, args.steps, args.bandwidth_mbps),
                 nprocs=args.nproc, join=True)
        ranks = [json.loads(Path(folder, f"{mode}-rank{r}.json").read_text()) for r in range(args.nproc)]
    every = read_metrics(Path(meshyard.load_config(None, argv).run.run_dir))
    records, measured_from = every[args.warmup:], every[args.warmup - 1]["time"] if args.warmup else 0.0
    for rank in ranks:  # fetches that ended during the measured steps (the cold cache's steady state)
        rank["measured_fetches"] = sum(end > measured_from for end in rank.pop("fetch_ends", []))
        rank["measured_steps"] = len(records)
    return {"step_s": statistics.median(r["step_time_s"] for r in records),
            "data_s": statistics.median(r["data_s"] for r in records), "ranks": ranks}


def loopback_megabytes_per_s(options: dict[str, Any], names: list[str]) -> float:
    store = ShardStore(URL, options)
    start, size = time.perf_counter(), 0
    for name in names:
        size += len(store.read(name))
    return size / (time.perf_counter() - start) / 1e6


def summarize(rounds: list[dict[str, dict[str, Any]]], corpus_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"corpus_bytes": corpus_bytes}
    for mode in MODES:
        steps = [r[mode]["step_s"] for r in rounds]
        out[mode] = {"step_s": statistics.median(steps), "step_s_min": min(steps), "step_s_max": max(steps),
                     "data_s": statistics.median(r[mode]["data_s"] for r in rounds)}
        if mode != "local":
            out[mode]["ratio_to_local"] = statistics.median(r[mode]["step_s"] / r["local"]["step_s"] for r in rounds)
            ranks = rounds[-1][mode]["ranks"]
            out[mode]["ranks"] = rounds[-1][mode]["ranks"]
    return out


def print_summary(args: argparse.Namespace, summary: dict[str, Any], loopback: float) -> None:
    local = summary["local"]
    print(f"{args.model}, {args.nproc} ranks, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, {args.rounds} rounds x "
          f"{args.steps - args.warmup} measured steps; corpus {summary['corpus_bytes'] / 1e6:.1f} MB in shards of "
          f"{args.shard_tokens * 1e-6:.3f} MB read in spans of {args.span_shards} (0: shuffled over the whole corpus); "
          f"cold cache {args.cold_cache_shards} shards per rank")
    limit = f", limited to {args.bandwidth_mbps:g} MB/s per rank" if args.bandwidth_mbps else " (no limit injected)"
    where = (f"in its own process on {args.server_cores} core(s), the ranks on the others" if args.server_cores
             else "in this process, sharing the cores with the ranks")
    print(f"S3 server on loopback ({where}): {loopback:.1f} MB/s with one stream{limit}")
    for mode, label in (("local", "local files"), ("warm", "shards, warm cache"), ("cold", "shards, cold cache")):
        figures = summary[mode]
        ratio = "" if mode == "local" else f"  ratio to local {figures['ratio_to_local']:.3f}"
        print(f"{label:19s} {figures['step_s'] * 1e3:7.1f} ms/step (rounds {figures['step_s_min'] * 1e3:.1f}-"
              f"{figures['step_s_max'] * 1e3:.1f}), data phase {figures['data_s'] * 1e3:6.2f} ms{ratio}")
    cold = summary["cold"]["ratio_to_local"]
    print(f"cold cache vs local: {cold:.3f} (target <= 1.05: {'met' if cold <= 1.05 else 'NOT met'})")
    waited = (summary["cold"]["data_s"] - local["data_s"]) * 1e3
    print(f"of the cold cache's {(summary['cold']['step_s'] - local['step_s']) * 1e3:+.1f} ms per step, "
          f"{waited:+.2f} ms is waiting for data (the data phase); the rest is the steps' own compute, slowed or "
          "not by the downloads sharing the CPU")
    for mode in ("cold", "warm"):
        for rank, figures in enumerate(summary[mode]["ranks"]):
            print(f"{mode} cache, rank {rank}: downloaded {figures['fetched_bytes'] / 1e6:6.2f} MB in {figures['fetches']}"
                  f" fetches, {figures['measured_fetches']} of them in the {figures['measured_steps']} measured steps "
                  f"({figures['measured_fetches'] / max(1, figures['measured_steps']):.2f} per step); its share {figures['share_bytes'] / 1e6:6.2f} MB ({figures['share_shards']} shards); "
                  f"{figures['fetched_bytes'] / summary['corpus_bytes']:.2f} of the corpus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of every run's figure")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus-mb", type=float, default=16)
    parser.add_argument("--shard-tokens", type=int, default=1 << 14)
    parser.add_argument("--cold-cache-shards", type=int, default=64)
    parser.add_argument("--span-shards", type=int, default=2,
                        help="data.shuffle_span_shards of the shard runs; 0 shuffles over the whole corpus")
    parser.add_argument("--bandwidth-mbps", type=float, default=0, help="limit each rank's downloads (MB/s); 0: none")
    parser.add_argument("--server-cores", type=int, default=0,
                        help="run the S3 server in its own process on this many cores and every run's ranks on the "
                        "others (as on a cluster, where the object store is not on the training node); 0: the "
                        "server shares all cores with the ranks")
    parser.add_argument("--out", type=Path, help="write the figures to this JSON file")
    args = parser.parse_args()
    server_cores, rank_cores = split_cores(args.server_cores)
    server, options = start_s3(server_cores)
    if rank_cores is not None:
        os.sched_setaffinity(0, rank_cores)  # the ranks, spawned from here, inherit it
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            files = corpus_files(args.corpus_mb)
            prepared = prepare_shards(files, URL, shard_tokens=args.shard_tokens, storage_options=options,
                                      cache_dir=work / "cache", report=lambda _: None)
            loopback = loopback_megabytes_per_s(options, [s.name for s in prepared.index.shards[:16]])
            rounds = []
            for index in range(args.rounds):
                rounds.append({mode: run_mode(args, mode, overrides(args, mode, files, options, work,
                                                                    f"{mode}-{index}"), work) for mode in MODES})
                check_shares(rounds[-1])
    finally:
        server.stop()
    corpus_bytes = prepared.index.total_tokens * prepared.index.element.itemsize
    summary = summarize(rounds, corpus_bytes)
    summary["loopback_mb_per_s"] = loopback
    print_summary(args, summary, loopback)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=1))


def check_shares(round_figures: dict[str, dict[str, Any]]) -> None:
    """No rank downloads a shard outside its share; a warm one downloads nothing during its
    run, and its share before it."""
    for mode in ("warm", "cold"):
        for rank in round_figures[mode]["ranks"]:
            assert not rank["outside_share"], (mode, rank)
    for rank in round_figures["warm"]["ranks"]:
        assert rank["fetched_bytes"] == 0 and rank["warmup_bytes"] == rank["share_bytes"], rank


if __name__ == "__main__":
    main()
