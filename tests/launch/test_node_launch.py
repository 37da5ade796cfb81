"""``meshyard run --nnodes ...`` on one machine over the loopback interface: the flags and
their [run] keys, the layout checked at every node count of an elastic range, the messages
of a job whose nodes do not meet, and two "nodes" started side by side that train together.

The jobs between real hosts (network namespaces) are in ``test_nodes.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from meshyard.cli import build_parser, main
from meshyard.config.load import ConfigError, load_config
from meshyard.launch.nodes import Nodes, bind_interface
from meshyard.launch.rendezvous import NODES_BACKEND, node_store
from meshyard.runtime.environment import job_identity
from meshyard.runtime.network import Route
from meshyard.validate import validate_local_launch
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
# A seconds-long job on random tokens, its run directory named by the job's id under <tmp>/runs.
JOB = ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=16", "--data.random_tokens=65536",
       "--train.steps=3", "--train.global_batch=4", "--train.eval_every=0", "--optim.warmup_steps=1",
       "--metrics.progress_bar=false", "--checkpoint.enabled=false"]
# Variables by which a scheduler or torchrun would lend the job an id (``job_identity``).
JOB_ID_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PET_", "KUBERNETES_")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def no_scheduler(monkeypatch):
    """An environment naming no job, as on a machine where a user starts the command by hand."""
    for name in list(os.environ):
        if name.startswith(JOB_ID_PREFIXES) or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    assert job_identity() == ""


def _job(tmp_path: Path) -> list[str]:
    return [*JOB, f"--run.dir={tmp_path / 'runs'}", f"--data.cache_dir={tmp_path / 'cache'}"]


def _node(tmp_path: Path, *flags: str) -> subprocess.Popen:
    """One node's ``meshyard run``, as a user starts it."""
    cmd = [sys.executable, "-m", "meshyard.cli", "run", *flags, *_job(tmp_path)]
    env = {name: value for name, value in os.environ.items() if not name.startswith(JOB_ID_PREFIXES)}
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"a node did not finish in {timeout}s:\n{out[-2000:]}\n{err[-3000:]}") from None
    return proc.returncode, out, err


# --- the command line ---------------------------------------------------------------

def test_several_nodes_without_an_id_exit_2_naming_rdzv_id_before_any_run_directory(tmp_path, capsys,
                                                                                      no_scheduler):
    code = main(["run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", *_job(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "run.nnodes = '2' needs run.rdzv_id (--rdzv-id ID)" in err and "e.g. --rdzv-id" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flags, fragment", [
    (["--nnodes", "0"], "run.nnodes = '0' is neither a node count"),
    (["--nnodes", "2"], "run.nnodes = '2' needs run.rdzv_endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:99999"], "run.rdzv_endpoint = 'h:99999' is not HOST[:PORT]"),
    (["--nnodes", "2", "--rdzv-endpoint", "h", "--node-rank", "2"], "run.node_rank = 2 must be below run.nnodes = 2"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "h", "--node-rank", "0"], "run.node_rank = 0 fixes the nodes' ranks"),
    (["--nproc-per-node", "2", "--parallel.strategy=none"], "'none' runs one process but the world size is 2"),
    (["--nproc-per-node", "3", "--nnodes", "2", "--rdzv-endpoint", "h", "--rdzv-id", "j"],
     "not divisible by the data-parallel size 6"),
])
def test_the_flags_are_the_run_keys(flags, fragment, tmp_path, capsys, no_scheduler):
    assert main(["run", *flags, *_job(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_nproc_per_node_is_nproc():
    parser = build_parser()
    assert parser.parse_args(["run", "--nproc-per-node", "3"]).nproc == 3
    assert parser.parse_args(["run", "--nproc", "3"]).nproc == 3


def test_an_unresolvable_endpoint_exits_2_naming_rdzv_endpoint(tmp_path, capsys, no_scheduler):
    code = main(["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "no-such-host.invalid:29400",
                 "--rdzv-id", "unresolved", *_job(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "run.rdzv_endpoint" in err and "'no-such-host.invalid' does not resolve" in err
    assert "Traceback" not in err


def test_an_unresolvable_endpoint_leaves_no_run_directory(tmp_path, capsys, no_scheduler):
    """The route to the endpoint is looked up before the run directory is made: bad input
    leaves nothing behind, this one included."""
    assert main(["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "no-such-host.invalid",
                 "--rdzv-id", "unresolved", *_job(tmp_path)]) == 2
    assert "run directory" not in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


# --- the layout at every node count ---------------------------------------------------

def _range_config(tmp_path: Path, tp: int):
    return tiny_config(tmp_path, "--run.nproc=2", "--run.nnodes=1:2", "--run.rdzv_endpoint=127.0.0.1",
                       "--model.n_head=4", f"--parallel.tp={tp}", "--parallel.strategy=fsdp")


def test_an_elastic_range_whose_fewer_nodes_cannot_hold_the_layout_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        validate_local_launch(_range_config(tmp_path, tp=4))
    text = str(info.value)
    assert "run.nnodes = '1:2' lets the job run on fewer nodes" in text
    assert "with 1 node(s) (2 ranks)" in text and "narrow the range or change the layout" in text
    assert "with 2 node(s)" not in text  # the largest count fits


def test_an_elastic_range_that_fits_at_every_node_count_passes(tmp_path):
    config, checked = validate_local_launch(_range_config(tmp_path, tp=2))
    assert config.run.nproc == 2
    assert checked.dims.tp == 2 and checked.dims.world_size == 4  # checked at its largest size


# --- which agent of a host serves the rendezvous ---------------------------------------

def _loopback_run(port: int):
    return load_config(None, ["--run.nnodes=2", f"--run.rdzv_endpoint=127.0.0.1:{port}"]).run


def test_the_agent_owning_the_endpoint_serves_unless_another_serves_already():
    port = free_port()
    alone = Nodes.of(_loopback_run(port), "j")
    assert alone.serves_rendezvous and alone.route.is_local and alone.route.interface == "lo"
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert not Nodes.of(_loopback_run(port), "j").serves_rendezvous


def test_a_second_agent_told_to_serve_the_store_joins_it_instead():
    """Two agents of one host may both find the port free and both be told to serve:
    the second to bind it reaches the first one's store as a client."""
    params = RendezvousParameters(backend=NODES_BACKEND, endpoint=f"127.0.0.1:{free_port()}", run_id="j",
                                  min_nodes=1, max_nodes=2, is_host=True)
    first = node_store(params)
    second = node_store(params)
    second.set("from-second", "1")
    assert first.get("from-second") == b"1"
    assert first.num_keys() == second.num_keys()
    del second, first  # the client before the server, here rather than at a later collection


# --- real launches --------------------------------------------------------------------

def test_one_node_of_two_alone_says_the_nodes_did_not_meet(tmp_path):
    port = free_port()
    proc = _node(tmp_path, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "t", "--run.rdzv_timeout_s=5")
    code, out, err = _finish(proc, timeout=120)
    assert code == 1, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out
    # Before torch 2.12 a line on the agent's grace period comes first.
    [paragraph] = [line for line in err.splitlines() if line.startswith("meshyard: the nodes did not meet")]
    assert f"127.0.0.1:{port}" in paragraph and "'t'" in paragraph and "run.rdzv_timeout_s" in paragraph


def test_an_interface_the_user_chose_is_kept():
    route = Route(endpoint_addr="10.0.0.1", local_addr="10.0.0.2", interface="eth1", is_local=False)
    environ = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert bind_interface(route, environ) == ["NCCL_SOCKET_IFNAME"]
    assert environ == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth1"}
