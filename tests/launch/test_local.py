"""The local launcher: signals reach the workers, which save; none outlives the launcher."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal

from torch.distributed.launcher.api import LaunchConfig

from meshyard.launch import local
from meshyard.launch.local import FIXED_SHUTDOWN_TIMEOUT_S, launch_config, quiet_agent_logs
from tests.checkpoint.helpers import finish, latest_checkpoint, start, wait_for_step, worker_pid
from tests.launch.sockets import alive, listening


def test_configured_signals_are_passed_on_with_the_grace_period():
    config = launch_config(nproc=2, grace_period_s=45, signals=["SIGUSR1", "SIGTERM", "SIGUSR2"])
    handled = config.signals_to_handle.split(",")
    assert {"SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"} <= set(handled) and len(handled) == len(set(handled))
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        assert config.shutdown_timeout == 45


def test_torch_without_shutdown_timeout_still_launches(monkeypatch, capsys):
    """torch before 2.12 has no ``LaunchConfig.shutdown_timeout``: its agent waits a fixed 30 s."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(LaunchConfig) if f.name != "shutdown_timeout"]
    older = dataclasses.make_dataclass("LaunchConfig", fields)
    monkeypatch.setattr(local, "LaunchConfig", older)
    config = launch_config(nproc=2, grace_period_s=FIXED_SHUTDOWN_TIMEOUT_S + 30, signals=["SIGUSR1"])
    assert isinstance(config, older) and "SIGUSR1" in config.signals_to_handle
    assert "fault.grace_period_s = 60" in capsys.readouterr().err


def test_sigusr1_to_launcher_saves_exits_75_and_leaves_no_worker(tmp_path):
    """SIGUSR1 (Slurm's --signal) is not among the agent's own stop signals; sent to the
    launcher, it must still reach every worker instead of killing the launcher alone."""
    sig = signal.SIGUSR1
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--train.steps=400", "--checkpoint.interval=100")
    wait_for_step(run_dir, 3, proc)
    workers = [worker_pid(run_dir, rank) for rank in (0, 1)]
    # The launcher's rendezvous store is reachable from this machine only.
    assert listening(pid=proc.pid) and set(listening(pid=proc.pid)) == {"127.0.0.1"}
    proc.send_signal(sig)
    code, _, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "Traceback" not in err
    record = json.loads((run_dir / "preemption.json").read_text())
    assert sig.name in record["signal"] and record["within_grace"] and record["step"] >= 3
    assert latest_checkpoint(run_dir).name == f"step-{record['step']:08d}"
    assert not [pid for pid in workers if alive(pid)]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_agents_records_stay_off_the_console_and_go_to_its_log(tmp_path):
    """The agent's loggers reach the console through torch's handlers: those drop the
    agent's records (any agent logger, even one created later) and nothing else."""
    console = Collect()
    holders = [logging.getLogger("torch.distributed"), logging.getLogger("torch")]
    for holder in holders:
        holder.addHandler(console)
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    spawn = logging.getLogger("torch.multiprocessing.spawn")
    other = logging.getLogger("torch.distributed.elasticity")  # a name beside the agent's
    try:
        with quiet_agent_logs(tmp_path / "logs" / "agent.log"):
            agent.error("failed (exitcode: 1) local_rank: 0")
            spawn.warning("Terminating process 1 via signal SIGTERM")
            logging.getLogger("torch.distributed.elastic.new_module").error("later logger")
            other.warning("not the agent's")
        agent.error("after the launch")
    finally:
        for holder in holders:
            holder.removeHandler(console)
    assert console.messages == ["not the agent's", "after the launch"]
    kept = (tmp_path / "logs" / "agent.log").read_text()
    assert "failed (exitcode: 1)" in kept and "Terminating process" in kept and "later logger" in kept
    assert "not the agent's" not in kept and "after the launch" not in kept
