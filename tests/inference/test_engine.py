"""The eager engine on a trained gpt-tiny: padded batches give each row what it gets alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshyard.config.load import load_config
from meshyard.inference.engine import EagerEngine, generate_by_recomputing, padded
from meshyard.inference.loading import describe, load_engine
from meshyard.inference.sampling import Sampling
from meshyard.models.registry import build_model

PROMPTS = [list(b"def add(a, b):\n    return"), list(b"The"), list(b"for i in range(10"), list(b"x")]


@pytest.fixture(scope="module", params=["trained", "untrained"])
def engine(request: pytest.FixtureRequest) -> EagerEngine:
    """The trained run's engine, and an untrained gpt-tiny of the same shape: a few steps
    teach the trained one little beyond frequent bytes (its greedy completions are mostly
    spaces), while an untrained model's argmax follows the context, so reading a wrong
    position or a batch mate's row shows up in its tokens."""
    if request.param == "trained":
        loaded = load_engine(describe(str(request.getfixturevalue("trained_run"))))
        assert isinstance(loaded, EagerEngine)
        return loaded
    torch.manual_seed(0)
    return EagerEngine(build_model(load_config(None, ["--model.name=gpt-tiny"]).model, 256, 64), 256, 64)


def reference_greedy(module: nn.Module, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding written plainly: the whole unpadded sequence through the model each step."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            sequence.append(int(module(torch.tensor([sequence]))[0, -1].argmax()))
    return sequence[len(prompt):]


def test_next_token_logits_of_a_padded_batch_equal_each_sequence_alone(engine):
    batch = engine.next_token_logits(PROMPTS)
    assert batch.shape == (len(PROMPTS), 256) and batch.dtype == torch.float32
    for i, prompt in enumerate(PROMPTS):
        alone = engine.next_token_logits([prompt])[0]
        torch.testing.assert_close(batch[i], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
        with torch.no_grad():
            direct = engine.module(torch.tensor([prompt]))[0, -1]
        torch.testing.assert_close(batch[i], direct, rtol=1e-5, atol=1e-5 * direct.abs().max().item())
    assert not torch.allclose(batch[0], batch[1])  # the rows really are different sequences


def test_greedy_batch_equals_each_row_alone_and_plain_decoding(engine):
    counts = [4, 8, 1, 6]
    batch = engine.generate(PROMPTS, [Sampling(max_new_tokens=n) for n in counts])
    assert [len(row) for row in batch] == counts
    for prompt, count, row in zip(PROMPTS, counts, batch):
        assert row == engine.generate([prompt], [Sampling(max_new_tokens=count)])[0]
        assert row == reference_greedy(engine.module, prompt, count)


def test_seeded_sampling_of_a_row_does_not_depend_on_its_batch_mates(engine):
    mine = Sampling(max_new_tokens=10, temperature=1.0, top_k=40, seed=17)
    alone = engine.generate([PROMPTS[1]], [mine])[0]
    mates = [Sampling(max_new_tokens=4, temperature=0.7, seed=1), Sampling(max_new_tokens=12)]
    batched = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [mates[0], mine, mates[1]])
    assert batched[1] == alone
    assert engine.generate([PROMPTS[1]], [mine])[0] == alone  # the seed, not leftover state, decides
    other = engine.generate([PROMPTS[1]], [Sampling(max_new_tokens=10, temperature=1.0, top_k=40, seed=18)])[0]
    assert other != alone


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, [Sampling(max_new_tokens=8)] * len(PROMPTS))
    top1 = engine.generate(PROMPTS, [Sampling(max_new_tokens=8, temperature=0.9, top_k=1, seed=i) for i in range(4)])
    assert top1 == greedy


def test_each_decoding_step_is_one_forward_over_the_unfinished_rows(engine):
    widths: list[tuple[int, int]] = []

    def recording(batch: torch.Tensor) -> torch.Tensor:
        widths.append(tuple(batch.shape))
        return engine.forward(batch)

    with torch.inference_mode():
        out = generate_by_recomputing(recording, [PROMPTS[1], PROMPTS[3]],
                                      [Sampling(max_new_tokens=3), Sampling(max_new_tokens=5)], 64, 256)
    assert [len(row) for row in out] == [3, 5]
    # Rows 3 and 1 tokens long; each step adds one token to every unfinished row.
    assert widths == [(2, 3), (2, 4), (2, 5), (1, 4), (1, 5)]


def test_zero_new_tokens_and_a_prompt_filling_the_context(engine):
    assert engine.generate([PROMPTS[0]], [Sampling(max_new_tokens=0)]) == [[]]
    full = list(range(64))
    assert engine.next_token_logits([full]).shape == (1, 256)
    assert len(engine.generate([full[:60]], [Sampling(max_new_tokens=4)])[0]) == 4


@pytest.mark.parametrize("call, message", [
    (lambda e: e.next_token_logits([[1, 256]]), r"token id 256, outside this model's vocabulary \[0, 256\)"),
    (lambda e: e.next_token_logits([[-1]]), "token id -1"),
    (lambda e: e.next_token_logits([list(range(65))]), "65 tokens, more than this model's context of 64"),
    (lambda e: e.generate([list(range(60))], [Sampling(max_new_tokens=5)]), "60 tokens [+] 5 new tokens, more than"),
    (lambda e: e.generate([[1], [2]], [Sampling()]), "2 prompts but 1 Sampling"),
    (lambda e: e.next_token_logits([[1], []]), "sequence 1 is empty"),
    (lambda e: e.next_token_logits([]), "no sequences"),
])
def test_bad_input_is_a_value_error_naming_the_fix(engine, call, message):
    with pytest.raises(ValueError, match=message):
        call(engine)


def test_bytes_count_shared_tensors_once_and_warm_up_runs(engine):
    assert engine.module.tok_emb.weight is engine.module.lm_head.weight  # tied embeddings
    expected = sum(p.numel() * p.element_size() for p in engine.module.parameters())  # shared once
    assert engine.bytes == expected
    engine.warm_up()
    assert engine.supports_generate and (engine.vocab_size, engine.context_length) == (256, 64)


class DictOutput(nn.Module):
    """A model that returns its logits in a dict, as Hugging Face models do."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.inner(ids)}


def test_a_model_returning_an_object_with_logits_is_served_alike(engine):
    wrapped = EagerEngine(DictOutput(engine.module), 256, 64)
    torch.testing.assert_close(wrapped.next_token_logits(PROMPTS), engine.next_token_logits(PROMPTS))
    assert wrapped.generate(PROMPTS[:2], [Sampling(5)] * 2) == engine.generate(PROMPTS[:2], [Sampling(5)] * 2)


def test_padding_goes_on_the_right():
    batch, last = padded([[5, 6, 7], [8]])
    assert batch.tolist() == [[5, 6, 7], [8, 0, 0]] and last.tolist() == [2, 0]
