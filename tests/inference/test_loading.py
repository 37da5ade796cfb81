"""From a run directory, checkpoint or checkpoint folder to a described and loaded model."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from meshyard.checkpoint.locate import locate
from meshyard.checkpoint.tools import model_state
from meshyard.inference.loading import describe, load_engine, vocab_from_shapes
from meshyard.inference.sampling import Sampling
from meshyard.inference.source import ModelSource, ModelSourceError
from meshyard.inference.tokenizer import ByteTokenizer

STEP = "step-00000003"


def checkpoint_of(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / STEP


def test_a_run_directory_is_described_from_its_config_and_newest_checkpoint(trained_run):
    source = describe(str(trained_run))
    assert (source.path, source.name, source.vocab_size, source.context_length) == (str(trained_run), "tiny", 256, 64)
    assert re.fullmatch(r"step-3\.[0-9a-f]{6}", source.version)
    assert isinstance(source.tokenizer, ByteTokenizer) and source.config is not None
    assert source.config.model.name == "gpt-tiny"
    assert Path(source.checkpoint) == checkpoint_of(trained_run)
    tensors = model_state(locate(str(trained_run), {}))
    tied_head = tensors["lm_head.weight"]
    # The checkpoint holds the tied head under both names; the model holds it once.
    assert source.estimated_bytes == sum(t.numel() * t.element_size() for t in tensors.values()) - (
        tied_head.numel() * tied_head.element_size()) == load_engine(source).bytes
    assert describe(str(trained_run), name="chat").name == "chat"


def test_a_checkpoint_and_its_folder_describe_the_same_version(trained_run):
    whole = describe(str(trained_run))
    for path in (checkpoint_of(trained_run), trained_run / "checkpoints"):
        source = describe(str(path))
        assert (source.name, source.version, source.vocab_size, source.context_length) == \
               (whole.name, whole.version, whole.vocab_size, whole.context_length)
        assert source.config == whole.config


def test_a_checkpoint_moved_away_from_its_run_takes_the_config_its_manifest_recorded(trained_run, tmp_path):
    moved = tmp_path / "kept" / STEP
    shutil.copytree(checkpoint_of(trained_run), moved)
    source = describe(str(moved))
    assert (source.name, source.version, source.vocab_size) == ("tiny", describe(str(trained_run)).version, 256)
    engine = load_engine(source)
    assert engine.next_token_logits([[1, 2, 3]]).shape == (1, 256)


def test_the_loaded_engine_holds_the_checkpoints_weights(trained_run):
    engine = load_engine(describe(str(trained_run)))
    saved = model_state(locate(str(trained_run), {}))
    loaded = engine.module.state_dict()
    assert saved.keys() == loaded.keys()
    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key
    assert not engine.module.training


def test_the_canary_run_has_the_same_name_and_another_version(trained_run, second_run):
    main, canary = describe(str(trained_run)), describe(str(second_run))
    assert main.name == canary.name == "tiny"
    assert main.version != canary.version and main != canary
    assert main.version.startswith("step-3.") and canary.version.startswith("step-3.")
    logits = [load_engine(s).next_token_logits([[72, 105]]) for s in (main, canary)]
    assert not torch.allclose(*logits)  # different weights behind the versions


def test_a_users_own_model_is_described_and_loaded(custom_model_run):
    source = describe(str(custom_model_run))
    assert (source.name, source.vocab_size, source.context_length, source.tokenizer) == ("custom", 97, 64, None)
    assert source.config is not None and source.config.model.name.endswith("tiny_lm.py:build")
    engine = load_engine(source)
    assert type(engine.module).__name__ == "TinyLM"
    logits = engine.next_token_logits([[1, 2, 3], [96]])
    assert logits.shape == (2, 97)
    with torch.no_grad():
        torch.testing.assert_close(logits[1], engine.module(torch.tensor([[96]]))[0, -1])
    assert [len(r) for r in engine.generate([[5, 6], [7]], [Sampling(3), Sampling(2)])] == [3, 2]
    with pytest.raises(ValueError, match="token id 97"):
        engine.next_token_logits([[97]])


def test_a_missing_path_names_what_to_give(tmp_path):
    with pytest.raises(ModelSourceError, match=rf"{tmp_path / 'nope'} does not exist; give a run directory"):
        describe(str(tmp_path / "nope"))


def test_a_folder_without_checkpoints_names_what_to_give(tmp_path, trained_run):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    shutil.copy(trained_run / "config.toml", empty / "config.toml")
    with pytest.raises(ModelSourceError, match="holds no checkpoint.*to serve a model give a run directory") as info:
        describe(str(empty))
    assert str(empty) in str(info.value)


def test_a_run_without_a_valid_checkpoint_says_why_each_was_skipped(tmp_path, trained_run):
    run = tmp_path / "damaged-run"
    shutil.copytree(checkpoint_of(trained_run), run / "checkpoints" / STEP)
    shutil.copy(trained_run / "config.toml", run / "config.toml")
    (run / "checkpoints" / STEP / "__0_0.distcp").unlink()
    with pytest.raises(ModelSourceError, match=r"none of the 1 checkpoints .* is valid \(checkpoint .*"
                                               r"__0_0.distcp is missing.*\); to serve a model give"):
        describe(str(run))


def test_a_checkpoint_in_another_runtime_than_eager_asks_for_an_export(trained_run):
    with pytest.raises(ModelSourceError, match="export the model first with meshyard export .* --format torchscript"):
        load_engine(describe(str(trained_run)), runtime="torchscript")


def test_a_model_whose_file_is_gone_is_a_clear_error(custom_model_run, tmp_path):
    source = describe(str(custom_model_run))
    assert source.config is not None
    moved = source.config.model.name.replace(str(custom_model_run.parent), str(tmp_path))
    config = type(source.config)(**{**vars(source.config), "model": type(source.config.model)(
        **{**vars(source.config.model), "name": moved})})
    gone = ModelSource(**{**vars(source), "config": config})
    with pytest.raises(ModelSourceError, match="cannot be built here.*does not exist"):
        load_engine(gone)


def test_vocabulary_from_tensor_shapes():
    assert vocab_from_shapes({"tok_emb.weight": (300, 8), "pos_emb.weight": (64, 8), "lm_head.weight": (300, 8)}) == 300
    assert vocab_from_shapes({"pos.weight": (64, 8), "head.weight": (50, 8)}) == 50
    assert vocab_from_shapes({"layer.weight": (8, 8)}) is None
