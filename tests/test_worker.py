"""What a worker takes from the config before training starts."""

from __future__ import annotations

import pytest

import meshyard.worker
from meshyard.config.dump import config_to_dict
from meshyard.fault.failure import RankFailed
from meshyard.validate import validate


class Stop(Exception):
    pass


def test_process_group_timeout_comes_from_the_config(make_config, monkeypatch):
    seen: list[float] = []

    def fake_init(env, device, threads, timeout_s, **other):
        seen.append(timeout_s)
        raise Stop

    monkeypatch.setattr(meshyard.worker, "init_distributed", fake_init)
    with pytest.raises(RankFailed) as failure:  # a worker's failure, told in one paragraph
        meshyard.worker.run_worker(config_to_dict(make_config("--fault.collective_timeout_s=1234.5")))
    assert isinstance(failure.value.__cause__, Stop)
    assert seen == [1234.5]


def test_process_group_timeout_must_be_positive(make_config):
    with pytest.raises(Exception, match="fault.collective_timeout_s = 0.0 must be positive"):
        validate(make_config("--fault.collective_timeout_s=0"), 1)
