from __future__ import annotations

from meshyard.runtime.environment import detect_environment, generated_rendezvous_id, job_identity


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
                              "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu07" and env.master_port == 20000 + 123456 % 10000


def test_a_batch_step_is_not_a_rank_of_its_job():
    # sbatch gives the batch script the job's task count and SLURM_PROCID=0, but no step id:
    # it starts the ranks (through srun) rather than being one.
    batch = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7",
             "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert detect_environment(batch) is None
    task = detect_environment({**batch, "SLURM_STEP_ID": "0"})
    assert (task.source, task.rank, task.world_size) == ("slurm", 0, 8)


def test_the_job_identity_is_the_schedulers_job_then_the_rendezvous_id():
    assert job_identity({}) == ""
    assert job_identity({"SLURM_JOB_ID": "123", "TORCHELASTIC_RUN_ID": "x"}) == "slurm123"  # a requeue keeps it
    assert job_identity({"SLURM_JOB_ID": "124", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "7"}) == "slurm100_7"
    assert job_identity({"TORCHELASTIC_RUN_ID": "job-7"}) == "job-7"
    assert job_identity({"TORCHELASTIC_RUN_ID": "none"}) == ""  # torchrun's static rendezvous
    assert job_identity({"PET_RDZV_ID": "pet-id"}) == "pet-id"  # Kubeflow's setting for torchrun's --rdzv-id
    made_up = {"TORCHELASTIC_RUN_ID": "1b4e28ba-2fa1-41d2-883f-0016d3cca427"}
    assert job_identity(made_up) == made_up["TORCHELASTIC_RUN_ID"] and generated_rendezvous_id(made_up)
    assert not generated_rendezvous_id({"TORCHELASTIC_RUN_ID": "job-7"})


def test_a_kubeflow_job_is_named_by_the_host_kubeflow_names_after_it():
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert job_identity({**pod, "MASTER_ADDR": "gpt-small-master-0", "RANK": "1", "WORLD_SIZE": "4"}) == "gpt-small"
    assert job_identity({**pod, "PET_RDZV_ENDPOINT": "elastic-gpt-worker-0:23456"}) == "elastic-gpt"
    assert job_identity({**pod, "PET_MASTER_ADDR": "tj-1-node-0-0.tj-1", "PET_MASTER_PORT": "29400"}) == "tj-1"
    assert job_identity({**pod, "MASTER_ADDR": "10.0.0.7"}) == ""  # an address names no job
    assert job_identity({"MASTER_ADDR": "gpt-small-master-0"}) == ""  # outside Kubernetes it is only a host name
