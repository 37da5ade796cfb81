from __future__ import annotations

import pytest
import torch

from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.kv_cache import SPLIT_COST_ELEMENTS, KVCache, group_slots, last_columns, supports_kv_cache
from meshyard.models.mlp import MLP

VOCAB, CONTEXT = 48, 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=VOCAB, context_length=CONTEXT, n_layer=2, n_head=4, d_model=32)).eval()


def recomputed(model: GPT, sequence: list[int]) -> torch.Tensor:
    """Logits after the last token of ``sequence``, from the training forward over all of it."""
    return model(torch.tensor([sequence]))[0, -1]


def assert_close(cached: torch.Tensor, reference: torch.Tensor) -> None:
    error = (cached - reference).abs().max() / reference.abs().max()
    assert error < 1e-5, f"cached logits differ from recomputed ones by {error:.2e} (relative)"


@torch.inference_mode()
def test_cached_decoding_matches_recomputation_for_rows_of_different_lengths(model):
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (7, 2, 12)]
    cache = model.init_kv_cache(5, CONTEXT)
    slots = [3, 0, 4]  # not consecutive: the gather path
    for slot, sequence in zip(slots, sequences):
        prefill = model(torch.tensor([sequence]), cache=cache, slots=[slot], positions=[0])
        assert torch.equal(prefill[0], model(torch.tensor([sequence]))[0])  # same computation as training
    assert cache.lengths[slots].tolist() == [7, 2, 12]
    for _ in range(6):
        new = torch.randint(0, VOCAB, (3, 1), generator=generator)
        logits = model(new, cache=cache, slots=slots)
        assert logits.shape == (3, 1, VOCAB)
        for row, sequence in enumerate(sequences):
            sequence.append(int(new[row, 0]))
            assert_close(logits[row, 0], recomputed(model, sequence))
    assert cache.lengths[slots].tolist() == [13, 8, 18]


@torch.inference_mode()
def test_a_batched_prefill_and_a_chunk_at_an_offset(model):
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    cache = model.init_kv_cache(2)
    assert cache.max_length == CONTEXT
    first = model(tokens[:, :6], cache=cache)  # every slot from position 0: the causal path
    rest = model(tokens[:, 6:], cache=cache, slots=[0, 1], positions=[6, 6])  # four tokens at once
    full = model(tokens)
    # Six tokens against ten: the CPU may pick other kernels for the two shapes, so the
    # same maths agrees to rounding, not bit for bit.
    assert_close(first, full[:, :6])
    assert_close(rest, full[:, 6:])


@torch.inference_mode()
def test_a_released_slot_serves_a_new_sequence_without_the_old_ones_keys(model):
    cache = model.init_kv_cache(2, 16)
    long, short = list(range(1, 15)), [5, 9, 2]
    slot = cache.allocate()
    other = cache.allocate()
    assert (slot, other, cache.free_slots) == (0, 1, 0)
    with pytest.raises(RuntimeError, match="all 2 slots"):
        cache.allocate()
    model(torch.tensor([long]), cache=cache, slots=[slot], positions=[0])
    cache.release(slot)
    assert cache.allocate() == slot and int(cache.lengths[slot]) == 0
    model(torch.tensor([short[:2]]), cache=cache, slots=[slot], positions=[0])
    logits = model(torch.tensor([[short[2]]]), cache=cache, slots=[slot])
    assert_close(logits[0, -1], recomputed(model, short))  # the 14 stale positions are masked out
    cache.release(slot)
    with pytest.raises(ValueError, match="release each allocated slot exactly once"):
        cache.release(slot)


def test_bad_requests_are_refused_with_the_fix(model):
    cache = model.init_kv_cache(2, 8)
    token = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="skip past what slots"):
        model(token, cache=cache, slots=[0], positions=[3])
    with pytest.raises(ValueError, match="exceed the cache's max_length=8"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache, slots=[1], positions=[0])
    with pytest.raises(ValueError, match="must be distinct"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache, slots=[0, 0])
    with pytest.raises(ValueError, match="longer than the model's context_length"):
        model.init_kv_cache(1, CONTEXT + 1)
    with pytest.raises(ValueError, match="positive sizes"):
        KVCache(1, 0, 1, 4, 4)


def test_cache_layout_and_protocol_detection(model):
    cache = model.init_kv_cache(3, 16, dtype=torch.float64)
    assert len(cache.keys) == len(cache.values) == 2
    assert cache.keys[0].shape == (3, 4, 16, 8) and cache.keys[0].dtype == torch.float64
    assert cache.bytes == 2 * 2 * 3 * 4 * 16 * 8 * 8
    assert supports_kv_cache(model)
    assert not supports_kv_cache(MLP(vocab_size=8, d_model=4))


def test_rows_are_split_where_reading_past_short_rows_costs_more_than_another_call():
    split = 64  # positions one more attention call is worth
    row_elements = SPLIT_COST_ELEMENTS // split
    slots, ends = torch.tensor([0, 1, 2, 5, 6]), torch.tensor([300, 10, 12, 5, 7])
    # Slot 0's 300 positions would be read for rows 1 and 2 too (600 > 64): cut; slots 5 and 6
    # are not consecutive with 2: never one call.
    assert group_slots(slots, ends, row_elements) == [(0, 1), (1, 3), (3, 5)]
    assert group_slots(torch.tensor([3, 4, 5]), torch.tensor([40, 50, 60]), row_elements) == [(0, 3)]


@torch.inference_mode()
def test_a_step_reads_consecutive_slots_in_place_and_answers_in_row_order(model):
    cache = model.init_kv_cache(6, CONTEXT)
    sequences = {5: list(range(1, 25)), 1: [3, 4, 5], 2: [6, 7, 8, 9]}
    for slot, sequence in sequences.items():
        model(torch.tensor([sequence]), cache=cache, slots=[slot], positions=[0])
    step = cache.begin([5, 1, 2], None, 1)
    assert [(g.slots, g.span) for g in step.groups] == [(slice(1, 3), 5), (slice(5, 6), 25)]
    assert step.order.tolist() == [2, 0, 1]  # groups hold rows of slots 1, 2, 5: back to 5, 1, 2
    cache.lengths[[5, 1, 2]] -= 1  # undo the step begun above
    new = torch.tensor([[7], [8], [9]])
    logits = model(new, cache=cache, slots=[5, 1, 2])
    for row, slot in enumerate([5, 1, 2]):
        assert_close(logits[row, 0], recomputed(model, sequences[slot] + [int(new[row, 0])]))


def test_a_new_sequence_takes_the_free_slot_beside_the_shortest_ones(model):
    cache = model.init_kv_cache(4, CONTEXT)
    for slot, length in zip([cache.allocate() for _ in range(4)], [20, 20, 2, 2]):
        model(torch.ones(1, length, dtype=torch.long), cache=cache, slots=[slot], positions=[0])
    cache.release(1)
    cache.release(3)
    assert cache.allocate() == 3  # beside slot 2's 2 positions, not slot 0's 20


def test_repeated_decoding_steps_over_the_same_slots_match_the_full_forward():
    # Later steps reuse the first step's plan (groups, order) with spans one longer: every
    # step's logits must still be those of a forward over the whole sequence, also after a
    # row leaves (a new plan) and with rows out of slot order and of different lengths.
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=50, context_length=64, n_layer=2, n_head=2, d_model=32)).eval()
    cache = model.init_kv_cache(4, 64)
    sequences = {slot: torch.randint(0, 50, (length,)).tolist() for slot, length in ((2, 3), (0, 11), (3, 5), (1, 4))}
    with torch.inference_mode():
        for slot, sequence in sequences.items():
            model(torch.tensor([sequence[:-1]]), cache=cache, slots=[slot], positions=[0])  # the last comes next
        slots = [2, 0, 3, 1]
        for step in range(12):
            if step == 6:
                slots = [2, 3, 1]  # slot 0's sequence finished
            logits = model(torch.tensor([[sequences[s][-1]] for s in slots]), cache=cache, slots=slots)[:, -1]
            for row, slot in enumerate(slots):
                full = model(torch.tensor([sequences[slot]]))[0, -1]
                assert_close(logits[row], full)
                sequences[slot].append(int(torch.argmax(logits[row])))
    assert cache.lengths.tolist() == [len(sequences[s]) - 1 for s in range(4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_mask_for_cuda_attention_starts_and_strides_on_16_byte_boundaries(dtype):
    # CUDA's memory-efficient attention loads the mask in 16-byte vectors from its start;
    # a view of a wide mask's last columns would start mid-vector on most steps.
    wide = torch.zeros(3, 1, 1, 37, dtype=dtype)
    wide[..., :20] = float("-inf")
    per_vector = 16 // wide.element_size()
    for span in range(1, 38):
        mask = last_columns(wide, span, align=True)
        assert torch.equal(mask, wide[..., -span:])
        assert mask.storage_offset() % per_vector == 0
        assert all(stride % per_vector == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    # Off CUDA the view itself: no copy per step.
    assert last_columns(wide, 5, align=False).data_ptr() == wide[..., -5:].data_ptr()
    assert last_columns(wide, 5).data_ptr() == wide[..., -5:].data_ptr()


def test_cached_forwards_on_cuda_keep_to_attention_kernels_that_need_no_plan_per_shape():
    # The key length changes every step: cuDNN's attention would build a plan each time.
    from meshyard.models.kv_cache import planless_attention

    with planless_attention(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    with planless_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
