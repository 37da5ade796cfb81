from __future__ import annotations

import pytest
import torch

from meshyard.config.load import load_config
from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape
from meshyard.models.registry import build_model


def test_gpt2_small_preset_has_124m_parameters():
    with torch.device("meta"):
        model = build_model(load_config(None, ["--model.name=gpt2-124m"]).model, vocab_size=50257, seq_len=1024)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_forward_shapes_and_causality():
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=32, context_length=16, n_layer=2, n_head=2, d_model=16))
    tokens = torch.randint(0, 32, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, 32)
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 32
    later = model(changed)
    assert torch.allclose(logits[:, :6], later[:, :6])  # the future does not leak backwards
    assert not torch.allclose(logits[:, 6:], later[:, 6:])


def test_overrides_on_presets_and_context_check():
    cfg = load_config(None, ["--model.name=gpt-small", "--model.n_layer=3"]).model
    model = build_model(cfg, vocab_size=256, seq_len=64)
    assert len(model.blocks) == 3 and model.shape.d_model == GPT_PRESETS["gpt-small"]["d_model"]
    with pytest.raises(ValueError, match="exceeds context_length"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_mlp_and_custom_builder(tmp_path):
    mlp = build_model(load_config(None, ["--model.name=mlp", "--model.d_model=8"]).model, 20, 4)
    assert mlp(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, 20)
    cfg = load_config(None, ["--model.name=examples/custom_model.py:build_model", "--model.options={hidden = 12}"])
    custom = build_model(cfg.model, vocab_size=16, seq_len=8)
    assert custom.embed.weight.shape == (16, 12)


def test_model_files_do_not_import_torch_distributed():
    import pathlib

    import meshyard.models as models

    for path in pathlib.Path(models.__file__).parent.glob("*.py"):
        imports = [line for line in path.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in imports if "torch.distributed" in line], path
