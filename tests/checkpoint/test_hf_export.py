"""``meshyard ckpt export --format hf``: a folder ``transformers`` loads, with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from meshyard.checkpoint.hf_export import export_hugging_face
from meshyard.checkpoint.locate import locate
from meshyard.checkpoint.tools import CheckpointToolError, model_state
from meshyard.config.load import load_config
from meshyard.models.gpt import GPT
from meshyard.models.registry import gpt_shape

transformers = pytest.importorskip("transformers")


def _meshyard_model(run_dir, ref) -> GPT:
    cfg = load_config(run_dir / "config.toml")
    state = model_state(ref)
    model = GPT(gpt_shape(cfg.model, state["tok_emb.weight"].shape[0], state["pos_emb.weight"].shape[0]))
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000], ids=["one file", "sharded"])
def test_a_gpt_run_loads_as_gpt2_with_the_same_logits(trained_run, tmp_path, max_shard_bytes):
    ref = locate(str(trained_run), {})
    out = tmp_path / "hf"
    export_hugging_face(ref, out, report=lambda message: None,
                        **({"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}))
    files = sorted(path.name for path in out.iterdir())
    if max_shard_bytes:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and set(shards) <= set(files) and "model.safetensors" not in files
        assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as the embedding
    else:
        assert {"config.json", "generation_config.json", "model.safetensors"} <= set(files)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ours = _meshyard_model(trained_run, ref)
    tokens = torch.randint(0, ours.shape.vocab_size, (2, ours.shape.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = loaded(tokens).logits
        expected = ours(tokens)
    torch.testing.assert_close(theirs, expected, rtol=1e-5, atol=1e-5)


def test_a_model_gpt2_cannot_express_is_refused_in_one_paragraph(custom_model_run, tmp_path):
    ref = locate(str(custom_model_run), {})
    with pytest.raises(CheckpointToolError, match="--format hf writes meshyard's GPT .*this checkpoint's model is"):
        export_hugging_face(ref, tmp_path / "hf", report=lambda message: None)
    assert not (tmp_path / "hf").exists()


def test_ckpt_export_writes_a_folder_from_the_command_line(trained_run, tmp_path, capsys):
    from meshyard.cli import main

    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(trained_run), "--format", "hf", "--out", str(out), "--max-shard-gb", "0.00004"]) == 0
    assert "as GPT2LMHeadModel" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    assert main(["ckpt", "export", str(trained_run), "--format", "hf", "--out", str(out), "--max-shard-gb", "0"]) == 2
    assert "meshyard ckpt: --max-shard-gb 0 must be positive" in capsys.readouterr().err


def test_a_hugging_face_folder_trained_and_exported_loads_back_with_the_trained_weights(tmp_path):
    """HF folder -> 2 steps of training from it (model.name = "hf") -> --format hf -> from_pretrained:
    the architecture and config are the folder's own, the weights the trained ones."""
    from tests.conftest import tiny_config
    from tests.inprocess import fit_here

    source = tmp_path / "source"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).save_pretrained(source)
    cfg = tiny_config(tmp_path / "train", "--model.name=hf", f"--model.init_from={source}", "--train.steps=2",
                      "--checkpoint.enabled=true", "--checkpoint.async_save=false", "--parallel.strategy=none")
    fit_here(cfg)
    ref = locate(str(cfg.run.run_dir), {})
    out = export_hugging_face(ref, tmp_path / "exported", report=lambda message: None)
    exported = json.loads((out / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert exported["architectures"] == ["GPT2LMHeadModel"]
    assert {key: exported[key] for key in ("n_embd", "n_layer", "n_head", "vocab_size")} == {
        key: original[key] for key in ("n_embd", "n_layer", "n_head", "vocab_size")}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    trained = model_state(ref)
    assert trained.keys() >= {name for name, _ in loaded.named_parameters()}
    for name, parameter in loaded.named_parameters():
        torch.testing.assert_close(parameter.detach(), trained[name], rtol=0, atol=0)
    before = transformers.AutoModelForCausalLM.from_pretrained(source)
    assert not torch.equal(before.transformer.h[0].attn.c_attn.weight, loaded.transformer.h[0].attn.c_attn.weight)
