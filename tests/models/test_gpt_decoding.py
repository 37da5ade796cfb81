from __future__ import annotations

import pytest
import torch

from meshyard.inference.int8 import quantize_named_linears
from meshyard.models.gpt import GPT, Block, GPTShape

VOCAB, CONTEXT = 50, 48

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(**shape: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=VOCAB, context_length=CONTEXT, **({"n_layer": 2, "n_head": 4, "d_model": 32}
                                                                       | shape))).eval()


def assert_close(decoded: torch.Tensor, reference: torch.Tensor) -> None:
    error = (decoded - reference).abs().max() / reference.abs().max()
    assert error < 1e-5, f"logits differ by {error:.2e} (relative)"


def decode(model: GPT, prompts: dict[int, list[int]], slots: list[int], steps: int) -> list[torch.Tensor]:
    """Prefill each slot's prompt but its last token, then ``steps`` greedy decoding steps over
    ``slots`` (in that row order), the first one of the prompts' last tokens; each step's logits
    [B, V], and the prompts extended by the chosen tokens."""
    cache = model.init_kv_cache(max(prompts) + 1, CONTEXT)
    with torch.inference_mode():
        for slot, prompt in prompts.items():
            model(torch.tensor([prompt[:-1]]), cache=cache, slots=[slot], positions=[0])
        every = []
        for _ in range(steps):
            logits = model(torch.tensor([[prompts[s][-1]] for s in slots]), cache=cache, slots=slots)[:, -1]
            every.append(logits)
            for row, slot in enumerate(slots):
                prompts[slot].append(int(torch.argmax(logits[row])))
    return every


def prompts_of_mixed_lengths() -> dict[int, list[int]]:
    # Slots 0-2 are attended together, each row masked past its own end; slot 4 has no
    # neighbour: a group of its own.
    generator = torch.Generator().manual_seed(3)
    return {slot: torch.randint(0, VOCAB, (length,), generator=generator).tolist()
            for slot, length in ((0, 30), (1, 3), (2, 7), (4, 5))}


def test_the_decoding_step_equals_the_modules_forward_for_rows_of_mixed_lengths():
    model = make_model(n_layer=3)
    slots = [4, 2, 0, 1]  # out of slot order: the groups' rows go back in row order
    by_modules = model.train()  # dropout is 0: the same function, computed through the modules
    expected = decode(by_modules, prompts_of_mixed_lengths(), slots, 8)
    model.eval()
    prompts = prompts_of_mixed_lengths()
    decoded = decode(model, prompts, slots, 8)
    assert model._decoder is not None
    for step_logits, reference in zip(decoded, expected):
        assert_close(step_logits, reference)
    with torch.inference_mode():  # and the training forward over each whole sequence
        for row, slot in enumerate(slots):
            assert_close(decoded[-1][row], model(torch.tensor([prompts[slot][:-1]]))[0, -1])


def test_the_decoding_step_calls_no_module(monkeypatch):
    model = make_model()
    cache = model.init_kv_cache(2, CONTEXT)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=cache)  # a prefill goes through the blocks

        def refuse(*args, **kwargs):
            raise AssertionError("a decoding step went through a block's forward")
        monkeypatch.setattr(Block, "forward", refuse)
        assert model(torch.tensor([[7], [8]]), cache=cache).shape == (2, 1, VOCAB)


def test_models_the_decoder_does_not_know_keep_the_module_path():
    model = make_model()
    model.init_kv_cache(1)
    assert model._decoder is not None
    hooked = make_model()
    hooked.blocks[1].mlp.register_forward_hook(lambda module, args, output: output * 2)
    hooked.init_kv_cache(1)
    assert hooked._decoder is None
    prompts = prompts_of_mixed_lengths()
    decoded = decode(hooked, prompts, [1, 2], 4)
    with torch.inference_mode():  # the hook ran in every step, as in the whole forward
        for row, slot in enumerate([1, 2]):
            assert_close(decoded[-1][row], hooked(torch.tensor([prompts[slot][:-1]]))[0, -1])

    int8 = quantize_named_linears(model, ["blocks.0.attn.qkv", "blocks.1.mlp.fc"])
    int8.init_kv_cache(1)
    assert int8._decoder is None  # made with the cache: the copy's int8 layers are seen
    # Its steps run the int8 layers, not the float weights the copied model was made from.
    float_steps = decode(model, prompts_of_mixed_lengths(), [1, 2], 2)
    int8_steps = decode(int8, prompts_of_mixed_lengths(), [1, 2], 2)
    assert (int8_steps[0] - float_steps[0]).abs().max() > 1e-4


def test_a_step_over_every_slot_in_fixed_shapes_equals_the_grouped_step():
    # The fixed-shape step (what a CUDA graph replays) computes every slot and keeps only the
    # asked-for rows' keys and values: a held slot left out (3) and free slots stay as they were.
    expected_model, model = make_model(n_layer=3), make_model(n_layer=3)
    prompts = prompts_of_mixed_lengths()
    prompts[3] = [5, 6, 7]
    slots = [4, 2, 0, 1]
    expected = decode(expected_model, {s: list(p) for s, p in prompts.items()}, slots, 8)
    cache = model.init_kv_cache(6, CONTEXT)
    cache.every_slot_steps = True
    with torch.inference_mode():
        for slot, prompt in prompts.items():
            model(torch.tensor([prompt[:-1]]), cache=cache, slots=[slot], positions=[0])
        held = cache.keys[0][3].clone(), cache.lengths[3].item()
        for step in range(8):
            logits = model(torch.tensor([[prompts[s][-1]] for s in slots]), cache=cache, slots=slots)[:, -1]
            assert_close(logits, expected[step])
            for row, slot in enumerate(slots):
                prompts[slot].append(int(torch.argmax(logits[row])))
    assert torch.equal(cache.keys[0][3], held[0]) and cache.lengths[3].item() == held[1]
    assert cache.lengths.tolist() == [len(prompts[s]) - 1 if s in slots else (2 if s == 3 else 0)
                                      for s in range(6)]
    # Right after, the slots step on through the grouped path from where they are.
    cache.every_slot_steps = False
    with torch.inference_mode():
        logits = model(torch.tensor([[prompts[s][-1]] for s in slots]), cache=cache, slots=slots)[:, -1]
        for row, slot in enumerate(slots):
            assert_close(logits[row], model(torch.tensor([prompts[slot]]))[0, -1])


def test_hooks_on_the_model_itself_keep_the_decoder_and_run_around_each_step():
    # A benchmark times each forward from hooks on the model: its decoding steps must still
    # be the fast ones, and the hooks must see them.
    model = make_model()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    model.register_forward_hook(lambda module, args, kwargs, output: seen.append(tuple(output.shape)),
                                with_kwargs=True)
    model.init_kv_cache(1)
    assert model._decoder is not None
    decoded = decode(model, {0: [1, 2, 3]}, [0], 2)
    assert seen == ["pre", (1, 2, VOCAB), "pre", (1, 1, VOCAB), "pre", (1, 1, VOCAB)]  # prefill, 2 steps
    assert_close(decoded[-1][0], make_model()(torch.tensor([[1, 2, 3, int(decoded[0][0].argmax())]]))[0, -1])
    model.blocks[0].register_forward_pre_hook(lambda module, args: None)  # below the model: not known
    model.init_kv_cache(1)
    assert model._decoder is None
