"""Trained runs the inference, serving and export tests share: built once per session, each in
a few seconds (registered as a plugin by ``tests/conftest.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshyard.api import run
from meshyard.config.load import load_config

# A few KB of English and Python: the byte tokenizer's kind of text (what data.source
# "text" trains on), long enough for a handful of 64-token batches.
_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. A model answers requests one token at a "
    "time, and a server batches the requests that arrive together so the matrix products "
    "stay large. Short prompts wait a little; long completions share each decoding step. "
)
_PYTHON = (
    "def add(a: int, b: int) -> int:\n    return a + b\n\n"
    "for i in range(10):\n    print(add(i, i * 2))\n\n"
    "class Counter:\n    def __init__(self) -> None:\n        self.n = 0\n\n"
    "    def tick(self) -> int:\n        self.n += 1\n        return self.n\n\n"
)
CORPUS_TEXT = (_ENGLISH + _PYTHON) * 12

# A user's own causal language model (nanoGPT-style): token and position embeddings, one
# pre-norm block with causal attention, logits [B, T, V] out.
CUSTOM_MODEL = '''
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, context_length: int, d: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(context_length, d)
        self.block = Block(d, heads=4)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.block(self.tok(idx) + self.pos(positions))))


def build(vocab_size: int, context_length: int) -> nn.Module:
    return TinyLM(vocab_size, context_length)
'''

_COMMON = [
    "--data.seq_len=64", "--model.context_length=64", "--train.steps=3", "--train.global_batch=8",
    "--train.eval_every=0", "--optim.warmup_steps=1", "--metrics.progress_bar=false",
    "--checkpoint.enabled=true", "--checkpoint.save_final=true", "--checkpoint.async_save=false",
    "--run.name=tiny",
]


def train(folder: Path, *overrides: str) -> Path:
    """Train a tiny run in this process (one worker) and return its run directory."""
    cfg = load_config(None, [*_COMMON, f"--run.run_dir={folder / 'run'}",
                             f"--data.cache_dir={folder / 'cache'}", *overrides])
    return run(cfg, nproc=1, resume="none").run_dir


def _text_run(folder: Path, seed: int) -> Path:
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS_TEXT)
    return train(folder, "--model.name=gpt-tiny", "--data.source=text", f"--data.paths=['{corpus}']",
                 f"--train.seed={seed}")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gpt-tiny run (context 64) trained on byte-tokenized text, checkpoint at its end."""
    return _text_run(tmp_path_factory.mktemp("trained"), seed=1234)


@pytest.fixture(scope="session")
def second_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape and name as ``trained_run``, another seed: a canary version."""
    return _text_run(tmp_path_factory.mktemp("second"), seed=4321)


@pytest.fixture(scope="session")
def custom_model_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of a user's own model file (``model.name = "file.py:build"``) on random
    tokens over 97 ids: no tokenizer, served through the logits endpoint."""
    folder = tmp_path_factory.mktemp("custom")
    model_file = folder / "tiny_lm.py"
    model_file.write_text(CUSTOM_MODEL)
    return train(folder, f"--model.name={model_file}:build", "--data.source=random",
                 "--data.vocab_size=97", "--data.random_tokens=8192", "--run.name=custom")


@pytest.fixture(scope="session")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-tiny trained on a text file and a .jsonl file through a byte-level BPE of at most
    300 tokens trained on them (``data.tokenizer = "bpe:300"``), its vocabulary padded to a
    multiple of 64."""
    folder = tmp_path_factory.mktemp("bpe")
    (folder / "corpus.txt").write_text(CORPUS_TEXT)
    (folder / "notes.jsonl").write_text("".join(json.dumps({"body": line}) + "\n"
                                                for line in CORPUS_TEXT.splitlines() if line.strip()))
    return train(folder, "--model.name=gpt-tiny", "--data.source=text", f"--data.paths=['{folder}/corpus.txt', "
                 f"'{folder}/notes.jsonl']", "--data.tokenizer=bpe:300", "--data.text_field=body",
                 "--model.pad_vocab_multiple=64", "--run.name=bpe")
