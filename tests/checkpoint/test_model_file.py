"""The one safetensors writer (``meshyard ckpt export`` and ``meshyard export``): the same
metadata whoever writes, a shared tensor stored once, and what readers get back."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from meshyard.checkpoint.model_file import read_model_file, write_model_file


def metadata(path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_a_shared_tensor_is_stored_once_and_read_back_under_both_names(tmp_path):
    table = torch.randn(5, 3)
    path = tmp_path / "model.safetensors"
    write_model_file({"tok_emb.weight": table, "lm_head.weight": table, "ln.bias": torch.zeros(3)}, path)
    assert set(load_file(str(path))) == {"tok_emb.weight", "ln.bias"}
    tensors, int8_layers = read_model_file(path)
    assert set(tensors) == {"tok_emb.weight", "lm_head.weight", "ln.bias"} and int8_layers == []
    assert torch.equal(tensors["lm_head.weight"], table)


def test_every_writer_records_the_same_metadata_keys(tmp_path):
    checkpoint, export = tmp_path / "ckpt.safetensors", tmp_path / "export.safetensors"
    write_model_file({"w": torch.ones(2), "v": torch.ones(2)}, checkpoint, step=40)
    write_model_file({"w": torch.ones(2)}, export, int8_linears=["blocks.1.fc", "blocks.0.fc"])
    assert metadata(checkpoint) == {"format": "pt", "step": "40", "meshyard.tied": "{}",
                                    "meshyard.int8_linears": "[]"}
    assert metadata(export)["format"] == "pt"
    assert json.loads(metadata(export)["meshyard.int8_linears"]) == ["blocks.0.fc", "blocks.1.fc"]
    assert set(load_file(str(checkpoint))) == {"w", "v"}  # equal values but separate tensors: both kept
