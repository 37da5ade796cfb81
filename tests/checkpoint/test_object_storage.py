"""Checkpoints on S3, through a real S3-compatible server (moto) on the loopback address."""

from __future__ import annotations

import pytest

import meshyard
from meshyard.checkpoint.cli import main as ckpt_main
from meshyard.checkpoint.tools import list_checkpoints, model_state, resolve
from meshyard.cli import build_parser
from meshyard.config.load import load_config
from tests.conftest import tiny_config
from tests.s3_server import start_s3_server

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def s3_endpoint():
    server, endpoint = start_s3_server("meshyard")
    yield endpoint
    server.stop()


def test_s3_round_trip(tmp_path, s3_endpoint, monkeypatch):
    options = f'{{ key = "testing", secret = "testing", client_kwargs = {{ endpoint_url = "{s3_endpoint}" }} }}'
    url = "s3://meshyard/runs/first"
    common = ["--checkpoint.enabled=true", f"--checkpoint.dir={url}", f"--checkpoint.storage_options={options}",
              "--checkpoint.interval=2", "--optim.schedule=constant"]
    first = meshyard.run(tiny_config(tmp_path / "a", *common, "--train.steps=4"), nproc=2)
    storage = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    rows = list_checkpoints(url, storage, checksums=True)
    assert [(r["name"], r["valid"]) for r in rows] == [("step-00000002", True), ("step-00000004", True)]
    assert rows[-1]["latest"] and rows[-1]["world_size"] == 2
    saved = model_state(resolve(url, storage))

    # A second run started from the first's recorded config (credentials redacted there,
    # taken from the environment by s3fs) continues from step 4, in one process. It keeps
    # the first run's checkpoints: retention deletes only a run's own.
    assert "<redacted>" in (first.run_dir / "config.toml").read_text()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    recorded = load_config(first.run_dir / "config.toml", ["--train.steps=6", "--parallel.strategy=none",
                                                           f"--run.run_dir={tmp_path / 'b' / 'run'}"])
    second = meshyard.run(recorded, nproc=1)
    assert [r["step"] for r in second.metrics()] == [5, 6]
    s3fs.S3FileSystem.clear_instance_cache()  # the run wrote through another client than this process's cached one
    assert [r["name"] for r in list_checkpoints(url, storage)] == ["step-00000002", "step-00000004", "step-00000006"]
    assert first.summary["steps"] == 4 and saved["tok_emb.weight"].shape[1] == 64

    # The command-line tools reach the same bucket.
    out = tmp_path / "model.safetensors"
    args = build_parser().parse_args(["ckpt", "export", url, "--out", str(out),
                                      "--storage-option", "key=testing", "--storage-option", "secret=testing",
                                      "--storage-option", f"endpoint_url={s3_endpoint}"])
    assert ckpt_main(args, []) == 0 and out.stat().st_size > 0
