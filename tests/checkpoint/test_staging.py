"""HostStager: the copy an async save writes, taken off the training thread into host
buffers that one stager keeps for the whole run."""

from __future__ import annotations

import torch

from meshyard.checkpoint.staging import HostStager


def _state() -> dict:
    return {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3)},
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "kind": type(None)}


def test_one_stager_stages_save_after_save_into_the_same_buffers():
    state = _state()
    stager = HostStager(torch.device("cpu"))
    try:
        staged_pointers = None
        for save in range(3):
            expected = state["model"]["w"].clone()
            staged = stager.stage(state).result()
            torch.testing.assert_close(staged["model"]["w"], expected, rtol=0, atol=0)
            assert staged["optim"]["param_groups"] == state["optim"]["param_groups"]
            assert staged["kind"] is type(None)  # classes are copied as themselves
            pointers = [staged["model"]["w"].data_ptr(), staged["optim"]["state"][0]["exp_avg"].data_ptr()]
            assert pointers[0] != state["model"]["w"].data_ptr()  # a copy, not the tensor itself
            if staged_pointers is not None:
                assert pointers == staged_pointers  # the first save's buffers, refilled
            staged_pointers = pointers
            with torch.no_grad():  # the next optimizer step, in place as optimizers update
                state["model"]["w"].add_(1.0)
                state["optim"]["state"][0]["exp_avg"].mul_(0.5)
            if save == 0:
                torch.testing.assert_close(staged["model"]["w"], expected, rtol=0, atol=0)  # kept apart
    finally:
        stager.close()


def test_staging_runs_off_the_calling_thread():
    stager = HostStager(torch.device("cpu"))
    try:
        future = stager.stage(_state())
        assert stager.should_synchronize_after_execute is False  # DCP does not wait for it
        assert set(future.result()) == {"model", "optim", "kind"}
    finally:
        stager.close()


def test_on_cuda_the_stager_pins_every_buffer_down_to_one_byte(monkeypatch):
    """Fused AdamW's per-parameter ``step`` is a 4-byte device tensor: torch's default
    threshold (5 bytes) would leave its host buffer unpinned, and that copy synchronous."""
    import meshyard.checkpoint.staging as staging

    built: list[dict] = []

    class RecordingStager:
        def __init__(self, **options) -> None:
            built.append(options)

        def close(self) -> None:
            pass

    monkeypatch.setattr(staging, "StateDictStager", RecordingStager)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())  # no GPU here: only the options matter
    stager = HostStager(torch.device("cuda"))
    stager.close()
    assert stager.pins_memory
    assert built == [{"pin_memory": True, "share_memory": False, "pin_memory_min_bytes": 1}]


def test_torch_stager_with_these_options_pins_a_4_byte_storage_and_skips_empty_ones(monkeypatch):
    """torch's own decision, with its pinning calls recorded instead of made (no GPU here)."""
    import torch.distributed.checkpoint._state_dict_stager as torch_stager

    pinned: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # read once, by the constructor
    stager = torch_stager.StateDictStager(pin_memory=True, share_memory=False, pin_memory_min_bytes=1)
    monkeypatch.setattr(torch_stager.pin_memory_utils, "pin_memory", lambda pointer, size: pinned.append(size))
    monkeypatch.setattr(torch_stager.pin_memory_utils, "unpin_memory", lambda pointer: None)
    stager.stage({"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3), "empty": torch.zeros(0)})
    assert sorted(pinned) == [4, 48]
    stager.close()


def test_warm_does_nothing_on_the_cpu():
    stager = HostStager(torch.device("cpu"))
    try:
        assert not stager.pins_memory
        stager.warm(_state())  # nothing to pin, so nothing staged
        assert len(stager._stager._cached_storage_mapping) == 0
    finally:
        stager.close()
