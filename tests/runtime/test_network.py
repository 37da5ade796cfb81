"""Which address and interface reach a peer, measured between real hosts: network
namespaces that share one hostname (tests/netns.py); and the host harness itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from meshyard.runtime import network
from meshyard.runtime.network import Route, interface_addresses, route_to
from tests.launch.sockets import listening
from tests.netns import Hosts, hosts_or_skip, members, namespace_pids, namespaces, remove, stale_prefixes, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "netns_hosts.sh"

# route_to must run inside a host's namespace, so each probe is a process there. It loads
# network.py by its path: the module needs only the standard library, and importing the
# meshyard package would import torch, seconds per probe.
PROBE = """
import dataclasses, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("probed_network", sys.argv[1])
network = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = network  # dataclasses look their module up by name
spec.loader.exec_module(network)
answers = []
for endpoint in sys.argv[2:]:
    try:
        answers.append(dataclasses.asdict(network.route_to(endpoint, 29400)))
    except network.NetworkError as exc:
        answers.append({"error": str(exc)})
print(json.dumps(answers))
"""

LISTENER = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    connection, peer = server.accept()
    with connection:
        connection.sendall(connection.recv(64).upper() + b" from " + peer[0].encode())
"""

CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as connection:
    connection.sendall(b"ping")
    print(connection.recv(128).decode())
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(2) as made:
        yield made


@pytest.fixture(scope="module")
def two_nic_hosts() -> Iterator[Hosts]:
    with hosts_or_skip(2, networks=2) as made:
        yield made


def routes(hosts: Hosts, host: int, *endpoints: str) -> list[dict]:
    """``route_to`` of each endpoint, computed inside host ``host`` (a dict of the Route's
    fields, or ``{"error": message}`` for a NetworkError)."""
    done = hosts.run(host, [sys.executable, "-c", PROBE, network.__file__, *endpoints],
                     capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def expected(endpoint: str, local: str, interface: str, is_local: bool) -> dict:
    return {"endpoint_addr": endpoint, "local_addr": local, "interface": interface, "is_local": is_local}


def test_route_on_loopback():
    assert route_to("127.0.0.1", 29400) == Route("127.0.0.1", "127.0.0.1", "lo", True)
    assert route_to("localhost") == Route("127.0.0.1", "127.0.0.1", "lo", True)


def test_a_peer_is_reached_from_this_hosts_own_address_and_veth(hosts):
    # Both hosts carry the machine's hostname, which resolves to loopback: only the route
    # tells host 1 which of its addresses host 0 can reach it at.
    assert routes(hosts, 1, hosts.address(0)) == [
        expected(hosts.address(0), hosts.address(1), hosts.interface(1), False)]


def test_an_endpoint_on_this_host_is_local_on_its_veth_not_loopback(hosts):
    assert routes(hosts, 0, hosts.address(0)) == [
        expected(hosts.address(0), hosts.address(0), hosts.interface(0), True)]


def test_with_several_nics_the_endpoints_network_chooses_address_and_interface(two_nic_hosts):
    h = two_nic_hosts
    assert routes(h, 1, h.address(0, 0), h.address(0, 1)) == [
        expected(h.address(0, 0), h.address(1, 0), h.interface(1, 0), False),
        expected(h.address(0, 1), h.address(1, 1), h.interface(1, 1), False)]
    assert routes(h, 0, h.address(0, 1)) == [expected(h.address(0, 1), h.address(0, 1), h.interface(0, 1), True)]


def test_an_unresolvable_or_unreachable_endpoint_is_named(hosts):
    # Asked inside a host: its name lookups and packets cannot leave the namespaces.
    unresolvable, unreachable = routes(hosts, 1, "no-such-host.invalid", "192.0.2.1")
    assert "the rendezvous host 'no-such-host.invalid' does not resolve" in unresolvable["error"]
    assert "give its IP address or a name every node can resolve" in unresolvable["error"]
    assert "no route from this host to the rendezvous endpoint 192.0.2.1" in unreachable["error"]


# The harness itself: what the multi-node tests rely on.

def test_tcp_between_hosts_works_and_stays_inside(hosts):
    listener = hosts.popen(0, [sys.executable, "-c", LISTENER, hosts.address(0)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        inside = hosts.run(0, [sys.executable, "-c", "import json, sys; from tests.launch.sockets import listening; "
                           f"print(json.dumps(listening({port})))"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert json.loads(inside.stdout) == [hosts.address(0)]
        assert hosts.address(0) not in listening(port=port)  # the root namespace's socket table
        reply = hosts.run(1, [sys.executable, "-c", CLIENT, hosts.address(0), str(port)],
                          capture_output=True, text=True, timeout=60)
        assert reply.stdout.strip() == f"PING from {hosts.address(1)}", reply.stderr
        assert listener.wait(timeout=60) == 0
    finally:
        listener.kill()
        listener.communicate()
    # No address, interface or route of the harness exists in the root namespace.
    root_addresses = set().union(*interface_addresses().values())
    assert not {hosts.address(0), hosts.address(1)} & root_addresses
    assert not {hosts.interface(0), hosts.interface(1)} & {name for _, name in socket.if_nameindex()}


def test_hosts_share_the_machines_hostname(hosts):
    names = [hosts.run(host, ["uname", "-n"], capture_output=True, text=True).stdout.strip() for host in (0, 1)]
    assert names == [socket.gethostname()] * 2


def test_kill_host_kills_every_process_of_that_host_only(hosts):
    survivor = hosts.popen(0, ["sleep", "300"])
    # A child in a session of its own escapes its parent's process group, not the namespace.
    victim = hosts.popen(1, ["sh", "-c", "setsid sleep 300 & echo started; exec sleep 300"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline() == "started\n"
        assert victim.pid in namespace_pids(hosts.names[1]) and len(namespace_pids(hosts.names[1])) == 2
        hosts.kill_host(1)
        assert namespace_pids(hosts.names[1]) == []
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert survivor.poll() is None and namespace_pids(hosts.names[0]) == [survivor.pid]
    finally:
        hosts.kill_host(0)
        hosts.kill_host(1)
        victim.stdout.close()
    assert survivor.wait(timeout=30) == -signal.SIGKILL


def test_private_dirs_are_a_filesystem_of_that_process_tree_only(hosts, tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "from-root").write_text("root")
    listing = ["sh", "-c", 'echo zero > "$0/from-host0"; ls -A "$0"', str(folder)]
    assert hosts.run(0, listing, private_dirs=[str(folder)], capture_output=True, text=True).stdout.split() == [
        "from-host0"]  # a fresh, empty filesystem: the machine's file is not there
    assert os.listdir(folder) == ["from-root"]  # and what the host wrote stays in it
    assert str(folder) not in Path("/proc/self/mountinfo").read_text()
    shared = hosts.run(1, ["ls", "-A", str(folder)], capture_output=True, text=True)
    assert shared.stdout.split() == ["from-root"]  # without private_dirs, hosts share the machine's files
    private = hosts.run(1, ["ls", "-A", str(folder)], private_dirs=[str(folder)], capture_output=True, text=True)
    assert (private.returncode, private.stdout) == (0, "")


def test_hosts_are_torn_down_on_failure():
    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="a failure inside"):
        with Hosts(2) as made:
            made_names = [*made.names, made.switch]
            sleeper = made.popen(1, ["sleep", "300"])
            assert set(made_names) <= set(namespaces())
            raise RuntimeError("a failure inside")
    assert not set(made_names) & set(namespaces())
    assert sleeper.wait(timeout=30) == -signal.SIGKILL


def test_hosts_by_hand_through_the_script():
    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)
    prefix = f"mytest{os.getpid()}"
    up = subprocess.run([SCRIPT, "up", "2", "--prefix", prefix], capture_output=True, text=True, check=True)
    try:
        assert sorted(members(prefix)) == [f"{prefix}-h0", f"{prefix}-h1", f"{prefix}-sw"]
        address = up.stdout.splitlines()[1].split("h1n0=")[1]
        shown = subprocess.run([SCRIPT, "exec", "--prefix", prefix, "1", "ip", "-o", "-4", "addr"],
                               capture_output=True, text=True, check=True)
        assert f"inet {address}/24" in shown.stdout
        assert f"{prefix}-h1\tup" in subprocess.run([SCRIPT, "list"], capture_output=True, text=True).stdout
    finally:
        down = subprocess.run([SCRIPT, "down", "--prefix", prefix], capture_output=True, text=True)
    assert (down.returncode, members(prefix)) == (0, [])


def test_sets_of_a_killed_session_are_stale_and_removed():
    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Hosts(1, prefix=f"my{gone.pid}-0")
    stale.detach()  # as if its process had been killed before tearing down
    try:
        with Hosts(1):
            assert f"my{gone.pid}" in stale_prefixes() and f"my{os.getpid()}" not in stale_prefixes()
        down = subprocess.run([SCRIPT, "down", "--prefix", f"my{gone.pid}"], capture_output=True, text=True)
        assert (down.returncode, members(f"my{gone.pid}")) == (0, [])
    finally:
        remove(members(f"my{gone.pid}"))
