"""Async-save staging on a GPU: every host buffer pinned (the 4-byte ``step`` of fused
AdamW too), and the buffers a warm-up allocates are the ones the saves use."""

from __future__ import annotations

import pytest
import torch

from meshyard.checkpoint.staging import HostStager

pytestmark = pytest.mark.gpu


def _fused_adamw_state() -> dict:
    model = torch.nn.Linear(64, 32, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()["state"]}
    assert state["optim"][0]["step"].nbytes == 4 and state["optim"][0]["step"].is_cuda
    return state


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key])]
    return [value] if isinstance(value, torch.Tensor) else []


def test_every_staged_buffer_is_pinned_and_warm_up_buffers_are_reused():
    state = _fused_adamw_state()
    stager = HostStager(torch.device("cuda"))
    try:
        stager.warm(state)
        buffers = len(stager._stager._cached_storage_mapping)  # one per device storage
        assert buffers == len(_tensors(state))
        staged = _tensors(stager.stage(state).result())
        assert len(stager._stager._cached_storage_mapping) == buffers  # the save found them all ready
        assert all(t.device.type == "cpu" and t.is_pinned() for t in staged)
        for original, copy in zip(_tensors(state), staged):
            torch.testing.assert_close(copy, original.cpu(), rtol=0, atol=0)
        again = _tensors(stager.stage(state).result())
        assert [t.data_ptr() for t in again] == [t.data_ptr() for t in staged]
    finally:
        stager.close()
