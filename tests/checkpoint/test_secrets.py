"""Storage credentials are never written down, and a run started from the recorded
config.toml takes them from the environment instead."""

from __future__ import annotations

import os

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import meshyard
from meshyard.config.load import load_config
from tests.conftest import tiny_config

TOKEN = "tok-5b1f0e9c7d"
PASSWORD = "pw-a83c61d2e4"
BUCKET = "/secret-test-bucket"


class CredentialedMemoryFS(MemoryFileSystem):
    """An in-memory store that, like a cloud store, refuses a wrong token and otherwise
    falls back to the environment (as fsspec backends fall back to their usual sources)."""

    protocol = "credmem"
    cachable = False

    def __init__(self, *args, token: str | None = None, **kwargs) -> None:
        if (token or os.environ.get("CREDMEM_TOKEN")) != TOKEN:
            raise PermissionError(f"credmem: access denied for token {token!r}")
        super().__init__(*args, **kwargs)


@pytest.fixture
def credmem():
    fsspec.register_implementation("credmem", CredentialedMemoryFS, clobber=True)
    yield
    for path in stored_objects():
        del MemoryFileSystem.store[path]


def stored_objects() -> dict[str, bytes]:
    return {path: f.getvalue() for path, f in MemoryFileSystem.store.items() if BUCKET in path}


def test_no_secret_is_recorded_and_resume_takes_credentials_from_the_environment(tmp_path, credmem, monkeypatch):
    options = f'{{ token = "{TOKEN}", extra = {{ password = "{PASSWORD}", region = "eu-1" }} }}'
    first = meshyard.run(tiny_config(tmp_path / "a", "--checkpoint.enabled=true", "--checkpoint.interval=2",
                                     f"--checkpoint.dir=credmem://{BUCKET}/ckpts",
                                     f"--checkpoint.storage_options={options}"), nproc=1)
    objects = stored_objects()
    assert any(path.endswith("step-00000004/manifest.json") for path in objects)
    files = {str(p): p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()}
    assert "config.toml" in " ".join(files) and b'token = "<redacted>"' in files[str(first.run_dir / "config.toml")]
    for where, data in {**files, **objects}.items():
        assert TOKEN.encode() not in data and PASSWORD.encode() not in data, f"a secret is in {where}"
    assert b"eu-1" in files[str(first.run_dir / "config.toml")]  # what is not a secret stays

    recorded = load_config(first.run_dir / "config.toml", ["--train.steps=6", f"--run.run_dir={tmp_path / 'b'}"])
    with pytest.raises(Exception, match="access denied"):
        meshyard.run(recorded, nproc=1)  # no credentials anywhere: the store refuses
    monkeypatch.setenv("CREDMEM_TOKEN", TOKEN)
    second = meshyard.run(recorded, nproc=1)
    assert [r["step"] for r in second.metrics()] == [5, 6]
