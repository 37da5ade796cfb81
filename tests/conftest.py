"""Shared fixtures: every test leaves no process group behind, and runs stay in tmp dirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshyard.config.load import load_config
from meshyard.config.sections import Config
from meshyard.runtime.distributed import shutdown_distributed
from meshyard.validate import with_local_nproc

# Trained runs that the inference, serving and export tests share (session fixtures, built on first use).
pytest_plugins = ["tests.trained_runs"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, not failed, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's in-process models: tiny forwards on a busy 2-core
    machine (or beside server processes the test started) otherwise wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def destroy_process_groups():
    yield
    shutdown_distributed(settle_s=2.0)  # each group freed here, never on its own gloo thread


def tiny_config(tmp_path: Path, *overrides: str) -> Config:
    """A seconds-long job: 2-layer GPT, short samples, random tokens, records under tmp_path.
    No MFU (each worker would first time a matmul peak for up to a few seconds); the tests
    of MFU turn it back on."""
    base = [
        "--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=32", "--data.random_tokens=65536",
        "--metrics.mfu=false",
        "--train.steps=4", "--train.global_batch=8", "--train.eval_every=0", "--optim.warmup_steps=2",
        "--metrics.progress_bar=false", "--checkpoint.enabled=false", f"--run.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    return with_local_nproc(load_config(None, [*base, *overrides]))


@pytest.fixture
def make_config(tmp_path):
    return lambda *overrides: tiny_config(tmp_path, *overrides)
