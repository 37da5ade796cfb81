"""A host is named by its hostname and the address that reaches the job's master, and
every rank learns every rank's host once."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from meshyard.metrics.ranks import RankWindow
from meshyard.runtime.hosts import gather_host_labels, host_label, host_of, master_address, rank_on_host
from meshyard.runtime.network import interface_addresses
from tests.ranks import run_on_ranks

HOSTNAME = socket.gethostname()
REPO = Path(__file__).resolve().parents[2]


def _own_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback."""
    return sorted(address for addresses in interface_addresses().values() for address in addresses
                  if ":" not in address and not ipaddress.ip_address(address).is_loopback)


def test_without_a_master_a_host_is_its_hostname():
    assert host_label({}) == HOSTNAME
    assert master_address({}) == ""


@pytest.mark.parametrize("address", _own_addresses() or [pytest.param("", marks=pytest.mark.skip(
    reason="this host has no address but loopback"))])
def test_with_a_master_a_host_is_named_by_the_address_that_reaches_it(address):
    """The route to one of this host's own addresses starts from that address."""
    assert host_label({"MASTER_ADDR": address, "MASTER_PORT": "29500"}) == f"{HOSTNAME} ({address})"
    # Under Slurm without MASTER_ADDR the master is the nodelist's first host.
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0",
             "SLURM_JOB_NODELIST": address}
    assert master_address(slurm) == address and host_label(slurm) == f"{HOSTNAME} ({address})"


@pytest.mark.parametrize("master", ["127.0.0.1", "localhost", "name-that-does-not-resolve.invalid"])
def test_a_loopback_or_unreachable_master_leaves_the_hostname(master):
    """Every rank of a local launch reaches its master over loopback (the address adds
    nothing); a master that does not resolve must not stop the run."""
    assert host_label({"MASTER_ADDR": master, "MASTER_PORT": "not a port"}) == HOSTNAME


def test_a_rank_is_named_with_its_host():
    assert rank_on_host(3, "node1 (10.0.0.2)") == "rank 3 on node1 (10.0.0.2)"
    assert rank_on_host(3) == "rank 3"
    assert host_of(["a", "b"], 1) == "b" and host_of(["a", "b"], 2) == "" and host_of([], 0) == ""


def _gather_and_window(rank: int, world_size: int) -> tuple[list[str], dict | None]:
    labels = gather_host_labels(f"host{rank} (10.0.0.{rank + 1})")
    window = RankWindow(every=1, straggler_factor=1.25, hosts=labels)
    window.add({"busy_s": 0.1 * (1 + 2 * rank), "step_time_s": 0.3})  # rank 1 is three times as busy
    return labels, window.gather()


def test_every_rank_gets_every_label_and_stragglers_are_named_with_their_hosts():
    results = run_on_ranks(_gather_and_window)
    expected = ["host0 (10.0.0.1)", "host1 (10.0.0.2)"]
    assert [labels for labels, _ in results] == [expected, expected]
    gathered = results[0][1]
    assert gathered["stragglers"] == [1] and gathered["straggler_hosts"] == ["host1 (10.0.0.2)"]
    assert results[1][1] is None


def test_one_process_is_its_own_host():
    assert gather_host_labels("solo") == ["solo"]


PROBE = "import json; from meshyard.runtime.hosts import host_label; print(json.dumps(host_label()))"


def test_hosts_sharing_a_hostname_get_different_labels():
    """Two network-namespace hosts share this machine's hostname; each is named by its
    own address on the route to host 0 (the master)."""
    netns = pytest.importorskip("tests.netns", reason="the network-namespace harness (tests/netns.py) is absent")
    if reason := netns.unavailable_reason():
        pytest.skip(reason)
    with netns.Hosts(2) as hosts:
        master = {**os.environ, "MASTER_ADDR": hosts.address(0), "MASTER_PORT": "29500"}
        expected = [f"{HOSTNAME} ({hosts.address(0)})", f"{HOSTNAME} ({hosts.address(1)})"]
        labels = []
        for host in (0, 1):
            done = hosts.run(host, [sys.executable, "-c", PROBE], env=master, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            labels.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert labels == expected
