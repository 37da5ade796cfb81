"""What a worker takes from the config before training starts."""

from __future__ import annotations

import pytest

import meshyard.worker
from meshyard.config.dump import config_to_dict
from meshyard.fault.failure import RankFailed
from meshyard.runtime.environment import ClusterEnvironment
from meshyard.runtime.job import Job
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


def test_a_worker_takes_the_job_its_caller_already_read(make_config, monkeypatch):
    seen: list[object] = []

    def fake_init(env, *args, **other):
        seen.append(env)
        raise Stop

    def read_again(cls, env=None):
        raise AssertionError("the environment was read again")

    monkeypatch.setattr(meshyard.worker, "init_distributed", fake_init)
    monkeypatch.setattr(Job, "detect", classmethod(read_again))
    cluster = ClusterEnvironment("torchrun", 0, 1, 0, 1, "127.0.0.1", 29500)
    with pytest.raises(RankFailed):
        meshyard.worker.run_worker(config_to_dict(make_config()), job=Job(cluster, "job-7"))
    assert seen == [cluster]
