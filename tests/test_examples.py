"""Every shipped example config is valid for the world size it asks for, and runs there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshyard.cli import main
from meshyard.config.load import load_config
from meshyard.config.sections import Config
from meshyard.data.corpus import load_corpus
from meshyard.metrics.records import read_metrics
from meshyard.plugins import is_custom_reference, load_callable
from meshyard.validate import load_and_validate
from tests.inprocess import train_with_facts

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))


def init_from_overrides(path: Path, folder: Path) -> list[str]:
    """An example that starts from a Hugging Face folder the user has (``model.init_from``)
    gets a tiny random GPT-2 folder of the example's vocabulary in its place, made here
    with ``save_pretrained``: nothing is downloaded."""
    config = load_config(path)
    if not config.model.init_from:
        return []
    transformers = pytest.importorskip("transformers")
    if not (folder / "config.json").exists():
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=config.data.vocab_size or 256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    return [f"--model.init_from={folder}"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_is_valid(path, monkeypatch, tmp_path):
    monkeypatch.chdir(path.parents[1])  # plugin paths are relative to the repository
    config, layout = load_and_validate(path, init_from_overrides(path, tmp_path / "hf"))
    assert layout.dims.world_size == config.run.nproc
    for reference in (config.model.name, config.data.source):
        if is_custom_reference(reference):
            assert callable(load_callable(reference))


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


def tiny_overrides(path: Path, tmp_path: Path) -> list[str]:
    """Shrink an example to seconds: 2 steps on short random samples (a plugin dataset is
    kept), a narrower model, records under tmp_path. Layout and batch arithmetic stay."""
    overrides = ["--train.steps=2", "--data.seq_len=32", "--metrics.progress_bar=false",
                 f"--run.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    config = load_config(path)
    if not is_custom_reference(config.data.source):
        overrides += ["--data.source=random", "--data.random_tokens=65536", "--data.tokenizer=bytes"]
    if not is_custom_reference(config.model.name) and not config.model.init_from:
        overrides.append("--model.d_model=48")  # divisible by every preset's heads (2, 4, 6, 8, 12)
    return overrides + init_from_overrides(path, tmp_path / "hf")


def test_the_text_example_tokenizes_its_own_files(tmp_path, monkeypatch):
    """The example for your own text trains its BPE on the files it names (the training
    itself runs on random tokens above, as every example's does)."""
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "examples" / "text_bpe.toml", [f"--data.cache_dir={tmp_path}"])
    corpus = load_corpus(config.data)
    assert 256 < corpus.vocab_size <= 2048 and corpus.tokenizer_file.parent == tmp_path
    assert len(corpus.tokens) > 200 * config.data.seq_len


# Launched through ``meshyard run`` as a user runs it: its model and dataset are files named
# relative to the directory the command runs in, which the launched workers import.
LAUNCHED = "custom_model"
TRAINED_ON_RANKS = [p for p in EXAMPLES if p.stem != LAUNCHED]


def check_trained(path: Path, records: list[dict], facts: dict) -> None:
    """Two finite steps, with the example's own world size and layout."""
    config = load_config(path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert facts["world_size"] == config.run.nproc and facts["strategy"] == config.parallel.strategy
    assert (facts["tp"], facts["pp"]) == (config.parallel.tp, config.parallel.pp)
    assert facts["activation_checkpointing"] == config.parallel.ac
    if config.parallel.dp_replicate:
        assert facts["dp_replicate"] == config.parallel.dp_replicate


def test_example_launches_as_a_user_runs_it(tmp_path, monkeypatch, capsys):
    """``meshyard run <example>`` trains with the example's own layout and world size."""
    path = next(p for p in EXAMPLES if p.stem == LAUNCHED)
    monkeypatch.chdir(path.parents[1])
    assert main(["run", str(path), *tiny_overrides(path, tmp_path)]) == 0, capsys.readouterr().err[-3000:]
    facts = json.loads((tmp_path / "run" / "run.json").read_text())
    check_trained(path, read_metrics(tmp_path / "run"), facts)


@pytest.fixture(scope="module")
def trained_examples(tmp_path_factory) -> dict[str, tuple[list[dict], dict]]:
    """Every other example, loaded and checked as ``meshyard run`` does, then trained on its
    own world size: the examples of one world size in one spawn of ranks (records and
    rank 0's run facts, by example)."""
    root = tmp_path_factory.mktemp("examples")
    by_world_size: dict[int, list[tuple[str, Config]]] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)  # plugin paths are relative to the repository
        for path in TRAINED_ON_RANKS:
            config, _ = load_and_validate(path, tiny_overrides(path, root / path.stem))
            by_world_size.setdefault(config.run.nproc, []).append((path.stem, config))
        trained = {}
        for world_size, named in by_world_size.items():
            results = train_with_facts([config for _, config in named], world_size)
            trained.update({name: result for (name, _), result in zip(named, results)})
    return trained


@pytest.mark.parametrize("path", TRAINED_ON_RANKS, ids=[p.stem for p in TRAINED_ON_RANKS])
def test_example_trains_on_its_layout(path, trained_examples):
    """The example's layout and world size train, as the workers of ``meshyard run`` would."""
    records, facts = trained_examples[path.stem]
    check_trained(path, records, facts)
