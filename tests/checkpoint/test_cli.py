"""``meshyard ckpt``: list, verify, inspect and export, as a user calls them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import meshyard
from meshyard.cli import main
from meshyard.config.load import load_config
from meshyard.models.registry import build_model


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path_factory.mktemp("ckpt-cli"), "--parallel.strategy=fsdp", "--checkpoint.enabled=true",
                      "--checkpoint.interval=2", "--train.steps=4")
    return meshyard.run(cfg, nproc=2)


def test_list_and_verify(fsdp_run, capsys):
    assert main(["ckpt", "list", str(fsdp_run.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step-00000002" in out and "step-00000004" in out and "fsdp" in out
    assert main(["ckpt", "verify", str(fsdp_run.run_dir)]) == 0


def test_verify_fails_on_a_damaged_checkpoint(fsdp_run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(fsdp_run.run_dir / "checkpoints", copy)
    shard = copy / "step-00000002" / "__0_0.distcp"
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    assert main(["ckpt", "verify", str(copy)]) == 1
    assert "SHA-256" in capsys.readouterr().out


def test_export_has_plain_names_that_load_into_the_model(fsdp_run, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(fsdp_run.run_dir), "--out", str(out)]) == 0
    tensors = load_file(str(out))
    cfg = load_config(fsdp_run.run_dir / "config.toml")
    model = build_model(cfg.model, vocab_size=256, seq_len=cfg.data.seq_len)
    model.load_state_dict(tensors, strict=True)  # no "module." or FSDP prefixes
    torch_file = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(fsdp_run.run_dir / "checkpoints" / "step-00000002"),
                 "--out", str(torch_file)]) == 0
    assert set(torch.load(torch_file, weights_only=True)) == set(tensors)
    assert main(["ckpt", "inspect", str(fsdp_run.run_dir)]) == 0
    assert "blocks.0.attn.qkv.weight" in capsys.readouterr().out


def test_bad_path_exits_2(tmp_path, capsys):
    assert main(["ckpt", "list", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert main(["ckpt", "list", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no checkpoint" in capsys.readouterr().err
    assert main(["ckpt", "list", str(tmp_path), "--train.steps=3"]) == 2


def test_inspect_and_export_skip_a_damaged_newest_checkpoint(fsdp_run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(fsdp_run.run_dir / "checkpoints", copy / "checkpoints")
    manifest_path = copy / "checkpoints" / "step-00000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["__0_0.distcp"]["size"] += 1  # the manifest disagrees with the file
    manifest_path.write_text(json.dumps(manifest))
    assert main(["ckpt", "inspect", str(copy)]) == 0
    captured = capsys.readouterr()
    assert '"step": 2,' in captured.out and "step-00000004 is not valid" in captured.err
    assert main(["ckpt", "export", str(copy), "--out", str(tmp_path / "model.pt")]) == 0
    # Named exactly, it is shown as it is, and not exported.
    assert main(["ckpt", "inspect", str(copy / "checkpoints" / "step-00000004")]) == 0
    out = capsys.readouterr().out
    assert '"step": 4,' in out and "__0_0.distcp" in out  # the problem
    assert main(["ckpt", "export", str(copy / "checkpoints" / "step-00000004"), "--out", str(tmp_path / "x.pt")]) == 2


def test_safetensors_export_without_the_package_names_the_extra(fsdp_run, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(fsdp_run.run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'meshyard[safetensors]'" in err and "Traceback" not in err
    assert not out.exists()
    # A torch.save export needs no extra.
    assert main(["ckpt", "export", str(fsdp_run.run_dir), "--out", str(tmp_path / "model.pt")]) == 0
