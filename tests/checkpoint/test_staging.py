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
