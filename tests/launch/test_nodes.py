"""Jobs on two hosts (network namespaces sharing one hostname and the filesystem), each
launched as a user launches one: the same ``meshyard run --nnodes ...`` on every host,
no network setting given by hand.

One job config throughout: a deterministic tiny GPT on the recording dataset (every
sample a rank reads is logged), so runs compare step by step and sample by sample.
Starting a job's agents and workers costs far more than its steps, so a job that loses
or gains a host is started once and serves every test about what it went through.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

import meshyard
from meshyard.config.load import load_config
from meshyard.data.sampling import GlobalBatchSampler
from meshyard.fault.preemption import EXIT_PREEMPTED
from meshyard.metrics.records import read_metrics
from tests.checkpoint.recording_dataset import seen_indices

REPO = Path(__file__).resolve().parents[2]
STEPS, GLOBAL_BATCH, INTERVAL = 30, 16, 5
JOB = [
    "--model.name=gpt-tiny", "--data.source=tests/checkpoint/recording_dataset.py:build", "--data.seq_len=16",
    f"--train.global_batch={GLOBAL_BATCH}", f"--train.steps={STEPS}", "--train.eval_every=0",
    "--train.deterministic=true", "--optim.schedule=constant", "--optim.warmup_steps=2",
    "--precision.dtype=fp32", "--metrics.progress_bar=false", "--metrics.mfu=false",  # no matmul peak timed at each start
    f"--checkpoint.interval={INTERVAL}",
    "--checkpoint.async_save=false", "--fault.grace_period_s=30",
    "--run.rdzv_timeout_s=120", "--run.rdzv_last_call_s=2",
]
_ports = itertools.count(29411)


class Job:
    """One multi-node job: its command per host, its run directory and sample records."""

    def __init__(self, hosts, folder: Path, nnodes: str, *overrides: str, nproc: int = 2, steps: int = STEPS) -> None:
        self.hosts, self.folder, self.steps = hosts, folder, steps
        folder.mkdir(parents=True, exist_ok=True)
        self.rdzv_id = folder.name
        self.run_dir = folder / "runs" / f"meshyard-{self.rdzv_id}"
        self.port = next(_ports)
        self.command = [
            sys.executable, "-m", "meshyard.cli", "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-endpoint", f"{hosts.address(0)}:{self.port}", "--rdzv-id", self.rdzv_id, *JOB,
            f"--run.dir={folder / 'runs'}", f"--data.cache_dir={folder / 'seen'}",
            *([f"--train.steps={steps}"] if steps != STEPS else []), *overrides,
        ]
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, host: int, *extra: str, **popen: object) -> subprocess.Popen:
        log = (self.folder / f"host{host}.log").open("a")
        self.procs[host] = self.hosts.popen(host, [*self.command, *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)
        return self.procs[host]

    def start_all(self) -> Job:
        for host in range(len(self.hosts.names)):
            self.start(host)
        return self

    def wait(self, timeout: float = 240) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        for host, proc in self.procs.items():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"host {host} did not finish in {timeout}s:\n{self.logs()}") from None
        return {host: proc.returncode for host, proc in self.procs.items()}

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        path = self.run_dir / "metrics.jsonl"

        def reached() -> bool:
            text = path.read_text() if path.exists() else ""
            lines = text[: text.rfind("\n") + 1].splitlines()  # not the line being written
            return bool(lines) and json.loads(lines[-1])["step"] >= step

        self._wait_until(reached, f"step {step}", timeout)

    def wait_for_restarts(self, count: int, timeout: float = 180) -> None:
        """Until the job has resumed ``count`` times (rank 0 notes each resume before its
        first step, after run.json); only whole lines count."""
        path = self.run_dir / "restarts.jsonl"
        self._wait_until(lambda: path.exists() and path.read_text().count("\n") >= count, f"restart {count}", timeout)

    def wait_for_failure_noticed(self, timeout: float = 180) -> None:
        """Until a worker of the hosts still running recorded that a peer is gone: their
        agent has the failure in hand (the workers of a killed host record nothing)."""
        self._wait_until(lambda: any((self.run_dir / "logs" / "failures").glob("restart0-rank*.json")),
                         "a recorded failure", timeout)

    def _wait_until(self, condition: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if any(proc.poll() is not None for proc in self.procs.values()):
                raise AssertionError(f"a host ended before {what}:\n{self.logs()}")
            time.sleep(0.005)
        raise AssertionError(f"{what} not reached in {timeout}s:\n{self.logs()}")

    def lose(self, host: int) -> None:
        """Host ``host``'s agent and workers killed at once, as a host losing power."""
        self.hosts.kill_host(host)
        del self.procs[host]

    def facts(self) -> dict:
        """run.json: what rank 0 recorded at the job's latest start."""
        return json.loads((self.run_dir / "run.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- host {path.stem}\n{path.read_text()[-3000:]}"
                         for path in sorted(self.folder.glob("host*.log")))

    def losses(self) -> list[float]:
        records = read_metrics(self.run_dir)
        assert [r["step"] for r in records] == list(range(1, self.steps + 1)), self.logs()
        return [r["loss"] for r in records]

    def restarts(self) -> list[dict]:
        path = self.run_dir / "restarts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finished(job: Job, timeout: float = 240) -> Job:
    codes = job.wait(timeout)
    assert codes == {0: 0, 1: 0}, job.logs()
    return job


@pytest.fixture(autouse=True)
def no_leftovers(netns_hosts):
    """A failed test leaves no agent or worker running into the next one."""
    yield
    for host in range(len(netns_hosts.names)):
        netns_hosts.kill_host(host)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    folder = tmp_path_factory.mktemp("one")
    config = load_config(None, [*JOB, f"--run.run_dir={folder / 'run'}", f"--data.cache_dir={folder / 'seen'}"])
    return [r["loss"] for r in meshyard.run(config, nproc=1).metrics()]


@pytest.fixture(scope="module")
def reference(netns_hosts, tmp_path_factory) -> Job:
    """An uninterrupted 2 hosts x 2 processes DDP job."""
    return _finished(Job(netns_hosts, tmp_path_factory.mktemp("ref"), "2").start_all())


def test_two_hosts_ddp_match_one_process(reference, one_process):
    assert reference.losses() == pytest.approx(one_process, rel=1e-5)
    facts = reference.facts()
    assert facts["world_size"] == 4
    _assert_each_sample_once(reference)
    assert len(seen_indices(reference.folder / "seen")) == STEPS * GLOBAL_BATCH  # nothing read twice


@pytest.fixture(scope="module")
def fixed_size_fsdp(netns_hosts, tmp_path_factory) -> Job:
    """A 2 hosts x 2 processes FSDP job of a fixed size that loses host 1 at step 12: host
    0 must wait for it, and the same command on host 1 brings the job back to 4 ranks."""
    job = Job(netns_hosts, tmp_path_factory.mktemp("fixed"), "2", "--fault.max_restarts=2",
              "--parallel.strategy=fsdp").start_all()
    job.wait_for_step(12)
    job.lose(1)
    # The host that is left notices the loss, then has nobody to go on with: it waits
    # (through its rendezvous, not giving up) for host 1, which only comes back after.
    job.wait_for_failure_noticed()
    assert job.procs[0].poll() is None, "the surviving host should wait for the lost one:\n" + job.logs()
    job.start(1)  # the host comes back: the same command
    return _finished(job)


def test_two_hosts_fsdp_match_one_process(fixed_size_fsdp, one_process):
    # Every step ran on the 4 ranks of both hosts: those up to the checkpoint before the
    # loss, and the rest after the resume from it.
    assert fixed_size_fsdp.facts()["world_size"] == 4
    assert fixed_size_fsdp.losses() == pytest.approx(one_process, rel=1e-5)


def _assert_each_sample_once(job: Job) -> None:
    """The samples read: exactly those of the job's steps in the sampler's order, each
    read again only in the steps redone after a failure (those restarts.jsonl records
    as lost) and in the one step each restart may have had in flight."""
    sampler = GlobalBatchSampler(2048, GLOBAL_BATCH, GLOBAL_BATCH, 0, 1, seed=1234)  # the default train.seed
    expected = {index for step in range(job.steps) for batch in sampler.step_indices(step) for index in batch}
    reads = seen_indices(job.folder / "seen")
    assert set(reads) == expected, "a sample was skipped or a foreign one read"
    restarts = job.restarts()
    lost = sum(entry["steps_lost"] for entry in restarts)
    assert len(reads) - len(expected) <= (lost + max(1, len(restarts))) * GLOBAL_BATCH, \
        "samples were read again beyond the lost steps"


@pytest.fixture(scope="module")
def elastic_fsdp(netns_hosts, tmp_path_factory) -> tuple[Job, dict]:
    """One elastic FSDP job of 1 to 2 hosts through both changes of size: it loses host 1
    at step 12 (the sharded model and optimizer state go from 4 shards to 2), goes on
    alone, and takes host 1 in when it comes back (2 shards to 4). Returns the job and
    its run.json while it ran on one host."""
    # Slow while on fewer than 4 ranks (slow_dataset.build_until_joined): once host 1 is
    # started again, some 50 steps (40 s) are left for it to arrive, so it always joins
    # before the end.
    steps = 2 * STEPS + INTERVAL
    job = Job(netns_hosts, tmp_path_factory.mktemp("elastic"), "1:2", "--fault.max_restarts=2",
              "--parallel.strategy=fsdp", "--data.source=tests/launch/slow_dataset.py:build_until_joined",
              steps=steps).start_all()
    job.wait_for_step(12)
    job.lose(1)
    job.wait_for_restarts(1)
    alone = job.facts()
    # Host 1 comes back once the job trains on one host (its metrics now end at the
    # step it resumed from).
    job.wait_for_step(job.restarts()[0]["resumed_step"] + 1)
    job.start(1)
    return _finished(job), alone


def test_elastic_job_goes_on_without_a_lost_host(elastic_fsdp, reference):
    job, alone = elastic_fsdp
    restarts = job.restarts()
    assert len(restarts) == 2, job.logs()  # the loss, then the join
    lost = restarts[0]
    assert lost["resumed_step"] % INTERVAL == 0 and lost["last_recorded_step"] >= 12
    assert lost["steps_lost"] == lost["last_recorded_step"] - lost["resumed_step"]
    assert alone["world_size"] == 2  # resharded onto one host
    assert {host.split()[-1] for host in alone["hosts"]} == {f"({job.hosts.address(0)})"}
    # 2 ranks instead of 4 sum gradients in another order: equal to float precision.
    assert job.losses()[:STEPS] == pytest.approx(reference.losses(), rel=1e-5)
    _assert_each_sample_once(job)


def test_elastic_job_takes_in_a_host_that_joins(elastic_fsdp):
    job, _ = elastic_fsdp
    facts = job.facts()
    assert facts["world_size"] == 4 and {host.split()[-1] for host in facts["hosts"]} == {
        f"({job.hosts.address(0)})", f"({job.hosts.address(1)})"}
    restarts = job.restarts()
    assert len(restarts) == 2, job.logs()
    joined = restarts[1]
    assert INTERVAL <= joined["resumed_step"] < job.steps
    assert [r["step"] for r in read_metrics(job.run_dir)] == list(range(1, job.steps + 1))
    _assert_each_sample_once(job)


def test_fixed_size_job_waits_for_the_lost_host_and_resumes(fixed_size_fsdp, reference):
    job = fixed_size_fsdp
    restarts = job.restarts()
    assert len(restarts) == 1 and restarts[0]["resumed_step"] % INTERVAL == 0
    assert restarts[0]["steps_lost"] == restarts[0]["last_recorded_step"] - restarts[0]["resumed_step"]
    assert job.facts()["world_size"] == 4
    # The first step after a resume can round differently in its 4-rank gradient sums.
    assert job.losses() == pytest.approx(reference.losses(), rel=1e-5)
    _assert_each_sample_once(job)


@pytest.fixture(scope="module")
def one_per_host(netns_hosts, tmp_path_factory) -> Job:
    """An uninterrupted job of one process per host, with fixed node ranks (the static
    rendezvous): sums of two are exact in any order, so a resumed job must match it bit
    for bit."""
    job = Job(netns_hosts, tmp_path_factory.mktemp("pairs"), "2", nproc=1)
    for host in (0, 1):
        job.start(host, "--node-rank", str(host))
    return _finished(job)


def test_sigterm_to_one_agent_saves_everywhere_then_resumes_bit_identically(netns_hosts, tmp_path, one_per_host):
    job = Job(netns_hosts, tmp_path / "term", "2", nproc=1).start_all()
    job.wait_for_step(8)
    job.procs[1].send_signal(signal.SIGTERM)  # the agent of the host without the rendezvous
    codes = job.wait()
    assert codes == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, job.logs()
    stopped = json.loads((job.run_dir / "preemption.json").read_text())
    assert stopped["signal"].startswith("SIGTERM") and stopped["checkpoint"]
    _finished(job.start_all())  # the same commands again
    assert job.losses() == one_per_host.losses()
    assert job.restarts()[-1]["resumed_step"] == stopped["step"]
    _assert_each_sample_once(job)


def test_a_checkpoint_folder_one_host_cannot_see_is_refused_on_every_host(netns_hosts, tmp_path):
    job = Job(netns_hosts, tmp_path / "private", "2", nproc=1)
    job.start(0)
    job.start(1, private_dirs=[str(job.folder / "runs")])  # host 1 sees its own empty folder there
    codes = job.wait()
    assert codes == {0: 2, 1: 2}, job.logs()
    host0 = (job.folder / "host0.log").read_text()
    assert "is not shared by every rank" in host0 and f"({netns_hosts.address(1)})" in host0
    assert "Traceback" not in job.logs()


def test_fixed_node_ranks_use_the_static_rendezvous(one_per_host, one_process, netns_hosts):
    assert "serves the rendezvous" in (one_per_host.folder / "host0.log").read_text()
    assert "joins it" in (one_per_host.folder / "host1.log").read_text()
    assert one_per_host.losses() == pytest.approx(one_process, rel=1e-5)
    hosts = json.loads((one_per_host.run_dir / "run.json").read_text())["hosts"]
    assert [host.split()[-1] for host in hosts] == [f"({netns_hosts.address(0)})", f"({netns_hosts.address(1)})"]
