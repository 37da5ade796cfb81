"""A model trained through a subword tokenizer, served: the run directory's tokenizer.json
encodes prompts and decodes completions, and a padded vocabulary's ids are never sampled.

The run (``bpe_run``, tests/trained_runs.py) trains a byte-level BPE of at most 300 tokens
on its text and .jsonl files, and pads the model's vocabulary to a multiple of 64.
"""

from __future__ import annotations

import json

import torch

from meshyard.data.tokenizer import EOT, TextTokenizer
from meshyard.inference.loading import describe, load_engine
from meshyard.inference.sampling import Sampling
from meshyard.run_dir import RunDir

TEXT = "The quick brown fox answers requests one token at a time.\ndef add(a, b):\n    return a + b\n"


def test_the_run_directory_records_the_tokenizer_it_trained_with(bpe_run):
    recorded = RunDir(bpe_run).tokenizer
    facts = RunDir(bpe_run).read_run_facts()
    assert recorded.read_text() == open(facts["tokenizer_file"]).read()
    assert "tokens of bpe:300" in facts["data"]
    tokenizer = TextTokenizer.from_str(recorded.read_text())
    assert 256 < tokenizer.vocab_size <= 300 and tokenizer.eot_id == tokenizer.tokenizer.token_to_id(EOT)


def test_serving_encodes_and_decodes_text_with_the_runs_tokenizer(bpe_run):
    source = describe(str(bpe_run))
    tokenizer = source.tokenizer
    assert isinstance(tokenizer, TextTokenizer)
    assert tokenizer.to_str() == RunDir(bpe_run).tokenizer.read_text()
    ids = tokenizer.encode(TEXT)
    assert len(ids) < 0.8 * len(TEXT.encode()) and tokenizer.decode(ids) == TEXT  # merges learnt, exact round trip
    engine = load_engine(source)
    assert source.vocab_size == engine.vocab_size == tokenizer.vocab_size
    assert engine.module.tok_emb.weight.shape[0] == 320  # at most 300 ids, padded to a multiple of 64
    [new] = engine.generate([ids[:20]], [Sampling(max_new_tokens=8)])
    assert isinstance(tokenizer.decode(new), str) and all(0 <= t < tokenizer.vocab_size for t in new)
    assert engine.next_token_logits([ids[:20]]).shape == (1, tokenizer.vocab_size)


def test_padded_ids_are_never_sampled_even_when_their_logits_are_largest(bpe_run):
    source = describe(str(bpe_run))
    engine = load_engine(source)
    head = engine.module.lm_head
    vocab, rows = source.vocab_size, head.weight.shape[0]
    assert rows > vocab  # the model's vocabulary is padded

    def padding_first(module, inputs, logits):  # make every padded id the model's favourite
        return torch.cat([logits[..., :vocab], torch.full_like(logits[..., vocab:], 100.0)], dim=-1)

    head.register_forward_hook(padding_first)
    prompt = source.tokenizer.encode(TEXT)[:10]
    assert int(engine.module(torch.tensor([prompt]))[0, -1].argmax()) >= vocab  # unmasked, greedy picks padding
    greedy, hot = Sampling(max_new_tokens=12), Sampling(max_new_tokens=12, temperature=2.0, seed=1)
    for new in engine.generate([prompt, prompt], [greedy, hot]):
        assert all(0 <= t < vocab for t in new)


def test_an_export_carries_the_tokenizer(bpe_run, tmp_path):
    from meshyard.export.exporter import ExportRequest, export_model

    out = tmp_path / "model.safetensors"
    export_model(ExportRequest(str(bpe_run), "safetensors", out), report=lambda _: None)
    facts = json.loads(open(f"{out}.json").read())
    assert facts["tokenizer"] == json.loads(RunDir(bpe_run).tokenizer.read_text())
    exported = describe(str(out))
    assert isinstance(exported.tokenizer, TextTokenizer) and exported.tokenizer.decode(
        exported.tokenizer.encode(TEXT)) == TEXT
    engine = load_engine(exported)
    assert engine.vocab_size == exported.vocab_size == exported.tokenizer.vocab_size
    [new] = engine.generate([exported.tokenizer.encode(TEXT)[:10]], [Sampling(max_new_tokens=4)])
    assert all(0 <= t < engine.vocab_size for t in new)
