"""``meshyard bench``: each command runs at a tiny size and writes its table, plot and JSON;
bad input gives one message and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshyard.bench.comm import message_sizes, parse_size
from meshyard.bench.report import BenchInputError
from meshyard.bench.scaling import parse_workers
from meshyard.cli import main

TINY_JOB = ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=32", "--data.random_tokens=65536",
            "--train.global_batch=8", "--train.eval_every=0", "--optim.warmup_steps=1"]


def cache(tmp_path) -> str:
    return f"--data.cache_dir={tmp_path / 'cache'}"


def read_json(path):
    record = json.loads(path.read_text())
    assert record["environment"]["torch"] and record["environment"]["cpu_count"] >= 1
    return record


def test_bench_comm_writes_bandwidth_table(tmp_path, capsys):
    out = tmp_path / "comm"
    assert main(["bench", "comm", "--min-bytes", "1K", "--max-bytes", "4K", "--iters", "2", "--warmup", "1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "busbw_GB/s" in printed and "latency" in printed
    record = read_json(out / "comm.json")
    results = record["results"]
    assert {r["op"] for r in results} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    for r in results:
        assert r["world_size"] == 2 and r["time_us"] > 0
        factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}[r["op"]]
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
    assert (out / "comm.png").stat().st_size > 0 and (out / "comm.txt").exists()


def test_bench_scaling_reports_each_worker_count(tmp_path, capsys):
    out = tmp_path / "scaling"
    assert main(["bench", "scaling", "--workers", "1,2", "--steps", "3", "--out", str(out), *TINY_JOB,
                 cache(tmp_path)]) == 0
    assert "efficiency" in capsys.readouterr().out
    points = read_json(out / "scaling.json")["points"]
    assert [p["workers"] for p in points] == [1, 2]
    assert [p["global_batch"] for p in points] == [4, 8]  # weak: 8 / run.nproc 2 per worker
    assert points[0]["speedup"] == 1.0 and points[0]["efficiency"] == 1.0
    assert all(p["tokens_per_s"] > 0 and p["final_loss"] > 0 for p in points)
    assert (out / "scaling.png").stat().st_size > 0 and "workers" in (out / "scaling.txt").read_text()


def test_bench_compression_compares_methods(tmp_path, capsys):
    out = tmp_path / "compression"
    assert main(["bench", "compression", "--methods", "none,topk", "--steps", "3", "--comm.warmup_steps=1",
                 "--out", str(out), *TINY_JOB, cache(tmp_path)]) == 0
    assert "loss_vs_none" in capsys.readouterr().out
    results = {r["method"]: r for r in read_json(out / "compression.json")["results"]}
    assert results["none"]["compression_ratio"] == 1.0 and results["none"]["loss_gap_vs_none"] == 0
    assert results["topk"]["compression_ratio"] > 20
    assert results["topk"]["comm_bytes_per_step"] < results["none"]["comm_bytes_per_step"] / 20
    assert len(results["topk"]["losses"]) == 3
    assert (out / "compression.png").stat().st_size > 0


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "compression", "--methods", "none,gzip"], "unknown compression methods (gzip); known: none, fp16"),
    (["bench", "scaling", "--workers", "1,two"], "not a comma-separated list of positive worker counts"),
    (["bench", "scaling", "--workers", "0,2"], "positive worker counts"),
    (["bench", "scaling", "/no/such/config.toml"], "config file '/no/such/config.toml' does not exist"),
    (["bench", "compression", "--parallel.strategy=fsdp", "--methods", "topk"],
     "does not apply to parallel.strategy = 'fsdp'"),
    (["bench", "comm", "--ops", "all_reduce,alltoall"], "unknown collectives (alltoall)"),
    (["bench", "comm", "--max-bytes", "12X"], "message size '12X' is not a positive size"),
    (["bench", "comm", "--train.steps=3"], "takes no config overrides"),
    (["bench", "scaling", "--steps", "0"], "--steps 0 must be at least 1"),
])
def test_bad_input_exits_2_with_one_message(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_console_script_reports_bad_workers_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "meshyard.cli", "bench", "scaling", "--workers", "1,,4"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--workers '1,,4'" in proc.stderr and "Traceback" not in proc.stderr


def test_argument_parsers():
    assert parse_workers("4, 1,2") == [1, 2, 4]
    with pytest.raises(BenchInputError, match="repeats"):
        parse_workers("2,2")
    assert parse_size("64K") == 65536 and parse_size("16M") == 2**24 and parse_size("100") == 100
    assert message_sizes(1024, 16384) == [1024, 4096, 16384]
    with pytest.raises(BenchInputError, match="larger than"):
        message_sizes(4096, 1024)
