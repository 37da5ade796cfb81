from __future__ import annotations

from meshyard.runtime.environment import detect_environment


def test_plain_process_has_no_environment():
    assert detect_environment({}) is None
    assert detect_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # salloc shell, one task


def test_torchrun():
    env = detect_environment({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        "torchrun", 3, 8, 1, "node0", 1234)


def test_kubeflow_pod():
    env = detect_environment({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (env.source, env.rank, env.local_rank, env.master_addr) == ("kubeflow", 1, 0, "job-master-0")


def test_slurm():
    env = detect_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                              "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
                              "SLURM_JOB_ID": "123456"})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu07" and env.master_port == 20000 + 123456 % 10000
