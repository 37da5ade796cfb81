"""Hosts for multi-node tests: Linux network namespaces joined by bridges.

Each host is a network namespace with its loopback up and one veth per network; the other
end of every veth sits in a bridge (one per network) inside a "switch" namespace of its
own, so no interface, address or route of the harness appears in the root namespace and
no packet leaves the namespaces the harness made. Host ``i`` has the address
``10.<k>.<network>.<i + 1>/24``, ``k`` derived from the prefix. The hosts keep the
machine's hostname: hosts that share one hostname, as containers often do, are the case
the product must handle.

Every namespace name starts with the set's prefix (``my<pid>-<n>`` by default), so
parallel sessions never collide and a crashed session's leftovers are recognisable as
stale (their pid is gone). A ``Hosts`` set tears itself down on exit, on failure, and at
interpreter exit as a last resort; ``down`` removes what a killed session left behind.

By hand (as root; ``scripts/netns_hosts.sh`` wraps this)::

    python -m tests.netns up 2 [--networks 2]   # hosts myhand-h0, myhand-h1, left up
    python -m tests.netns exec 0 -- hostname -I
    python -m tests.netns list
    python -m tests.netns down                  # the hand-made hosts and stale sets
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zlib
from typing import Any, Iterator, Sequence

BASE = "my"
"""Every namespace the harness makes starts with this."""
MANUAL_PREFIX = "myhand"
"""The prefix of hosts made by hand (``up``): they outlive the process that made them."""
_SESSION = re.compile(rf"^{BASE}(\d+)-")  # my<pid>-...: a set made by process <pid>
_PREFIX = re.compile(r"^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$")
_sets = itertools.count()


class HarnessError(RuntimeError):
    """A namespace, link or address of the harness could not be made or removed."""


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise HarnessError(f"'{name}' is not installed (network-namespace hosts need iproute2 and util-linux)")
    return path


def _ip(*args: str) -> str:
    """Runs ``ip ARGS``; a failure raises ``HarnessError`` with the command and ip's message."""
    done = subprocess.run([_tool("ip"), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HarnessError(f"'ip {' '.join(args)}' failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def namespaces() -> list[str]:
    """Every named network namespace on this machine (the harness's and any other)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True  # gone meanwhile


def namespace_pids(name: str) -> list[int]:
    """The live processes in namespace ``name`` (zombies waiting to be reaped left out)."""
    try:
        listing = _ip("netns", "pids", name)
    except HarnessError:  # the namespace is gone
        return []
    return [pid for pid in map(int, listing.split()) if not _zombie(pid)]


def kill_namespace(name: str, rounds: int = 500) -> None:
    """SIGKILLs every process in namespace ``name`` until none is left: listing again
    after each round catches children forked while the previous round was killing."""
    for _ in range(rounds):
        pids = namespace_pids(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)  # a killed process leaves the namespace when the kernel has torn it down
    raise HarnessError(f"processes {namespace_pids(name)} in namespace {name} survive SIGKILL")


ETC_NETNS = "/etc/netns"
"""``ip netns exec NAME`` bind-mounts the files of ``/etc/netns/NAME/`` over ``/etc/``."""


def write_name_service(name: str, names_by_address: dict[str, str]) -> None:
    """Name service inside namespace ``name`` that answers at once: the machine's hosts
    file plus a name per harness address, and a nameserver on the namespace's own
    loopback (refused at once). The machine's nameserver is unreachable from the
    namespaces, and every reverse lookup (torch's TCPStore makes one per client) would
    otherwise wait for the resolver's timeout."""
    folder = os.path.join(ETC_NETNS, name)
    os.makedirs(folder, exist_ok=True)
    try:
        with open("/etc/hosts") as handle:
            machine = handle.read()
    except OSError:
        machine = "127.0.0.1 localhost\n"
    lines = "".join(f"{address} {host}\n" for address, host in names_by_address.items())
    with open(os.path.join(folder, "hosts"), "w") as handle:
        handle.write(machine.rstrip("\n") + "\n" + lines)
    with open(os.path.join(folder, "resolv.conf"), "w") as handle:
        handle.write("nameserver 127.0.0.1\n")


def remove(names: Sequence[str]) -> list[str]:
    """Kills the processes in each namespace and deletes it (its veths and bridges go with
    it, and its name-service files); returns the names that could not be removed."""
    for name in names:
        with contextlib.suppress(HarnessError):
            kill_namespace(name)
        with contextlib.suppress(HarnessError):  # deleted even with a survivor: it lives on unnamed
            _ip("netns", "delete", name)
        shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    present = set(namespaces())
    return [name for name in names if name in present]


def members(prefix: str) -> list[str]:
    """The namespaces of the set ``prefix`` (or of every set whose prefix starts ``prefix-``)."""
    return [name for name in namespaces() if name.startswith(f"{prefix}-")]


def stale_prefixes() -> list[str]:
    """``my<pid>`` of every set whose making process is gone (a killed test session)."""
    found = {match.group(1) for name in namespaces() if (match := _SESSION.match(name))}
    return [f"{BASE}{pid}" for pid in sorted(found, key=int) if not os.path.exists(f"/proc/{pid}")]


class Hosts:
    """``count`` hosts on ``networks`` networks, as network namespaces; a context manager
    that tears everything down on exit, also on failure.

    ``prefix`` names the set (namespaces ``<prefix>-h<i>`` and ``<prefix>-sw``); by
    default ``my<pid>-<n>``, unique per process and per set.
    """

    def __init__(self, count: int = 2, networks: int = 1, prefix: str | None = None) -> None:
        if not 1 <= count <= 250 or not 1 <= networks <= 16:
            raise ValueError(f"Hosts(count={count}, networks={networks}): count must be 1-250 and "
                             "networks 1-16 (one /24 per network, one address per host)")
        self.prefix = prefix or f"{BASE}{os.getpid()}-{next(_sets)}"
        if not _PREFIX.match(self.prefix):
            raise ValueError(f"prefix '{self.prefix}' must be letters, digits, '_', '.' and inner '-'")
        self.names: list[str] = [f"{self.prefix}-h{host}" for host in range(count)]
        self.switch = f"{self.prefix}-sw"
        self.networks = networks
        self._subnet = 16 + zlib.crc32(self.prefix.encode()) % 200
        self._processes: list[subprocess.Popen] = []
        self._closed = False
        taken = set(namespaces()) & {*self.names, self.switch}
        if taken:
            raise HarnessError(f"namespaces {sorted(taken)} exist already: another set uses the prefix "
                               f"'{self.prefix}'; remove it with `python -m tests.netns down --prefix {self.prefix}` "
                               "or choose another prefix")
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        for network in range(self.networks):
            _ip("-n", self.switch, "link", "add", f"br{network}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br{network}", "up")
        for host, name in enumerate(self.names):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            for network in range(self.networks):
                self._wire(host, network)
        known = {self.address(host, network): f"{name}-n{network}" for host, name in enumerate(self.names)
                 for network in range(self.networks)}
        for name in self.names:
            write_name_service(name, known)

    def _wire(self, host: int, network: int) -> None:
        """A veth pair made inside the switch namespace, its host end moved straight into
        the host: its name never exists in the root namespace, so nothing can clash there."""
        port, nic, name = f"s{host}n{network}", self.interface(host, network), self.names[host]
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", nic, "netns", name)
        _ip("-n", self.switch, "link", "set", port, "master", f"br{network}", "up")
        _ip("-n", name, "addr", "add", f"{self.address(host, network)}/24", "dev", nic)
        _ip("-n", name, "link", "set", nic, "up")

    def _check(self, host: int, network: int = 0) -> None:
        if not 0 <= host < len(self.names) or not 0 <= network < self.networks:
            raise IndexError(f"host {host}, network {network}: this set has hosts 0-{len(self.names) - 1} "
                             f"and networks 0-{self.networks - 1}")

    def address(self, host: int, network: int = 0) -> str:
        """Host ``host``'s IPv4 address on ``network`` (``10.<k>.<network>.<host + 1>``)."""
        self._check(host, network)
        return f"10.{self._subnet}.{network}.{host + 1}"

    def interface(self, host: int, network: int = 0) -> str:
        """The name of host ``host``'s veth on ``network`` (distinct per host, so a test
        can tell which host answered)."""
        self._check(host, network)
        return f"h{host}n{network}"

    def popen(self, host: int, argv: list[str], *, env: dict | None = None, cwd: Any = None,
              private_dirs: Sequence[str] = (), **popen_kwargs: Any) -> subprocess.Popen:
        """Starts ``argv`` inside host ``host`` (``ip netns exec``) in a session and process
        group of its own. ``env`` replaces the environment as in ``subprocess.Popen`` (None:
        this process's). Each of ``private_dirs`` gets a fresh tmpfs that only this process
        tree sees (a private mount namespace): storage the other hosts do not share."""
        self._check(host)
        prefix = [_tool("ip"), "netns", "exec", self.names[host], *_private_mounts(private_dirs)]
        popen_kwargs["start_new_session"] = True  # kill_host and run's timeout take the whole group
        process = subprocess.Popen([*prefix, *argv], env=env, cwd=cwd, **popen_kwargs)
        self._processes.append(process)
        return process

    def run(self, host: int, argv: list[str], *, input: Any = None, timeout: float | None = None,
            check: bool = False, capture_output: bool = False, **kw: Any) -> subprocess.CompletedProcess:
        """``popen`` and wait, like ``subprocess.run`` (``check`` False by default); on a
        timeout the whole process group is killed before ``TimeoutExpired`` propagates."""
        if capture_output:
            kw["stdout"] = kw["stderr"] = subprocess.PIPE
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        process = self.popen(host, argv, **kw)
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        done = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
        if check:
            done.check_returncode()
        return done

    def kill_host(self, host: int) -> None:
        """SIGKILLs every process in host ``host``'s namespace, whatever its process group
        (agents and workers alike), as a host losing power would; the network stays."""
        self._check(host)
        kill_namespace(self.names[host])
        self._reap()

    def _reap(self, wait: float = 0.0) -> None:
        """Collects the exit status of the processes this set started (no zombies left)."""
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait) if wait else process.poll()
        self._processes = [process for process in self._processes if process.returncode is None]

    def _teardown(self) -> list[str]:
        atexit.unregister(self.close)
        left = remove([*self.names, self.switch])
        self._reap(wait=5.0)
        return left

    def close(self) -> None:
        """Kills every process in the hosts and deletes their namespaces, links and bridges."""
        if self._closed:
            return
        self._closed = True
        left = self._teardown()
        if left:
            raise HarnessError(f"namespaces {left} could not be removed; try `python -m tests.netns down "
                               f"--prefix {self.prefix}`")

    def detach(self) -> None:
        """Leaves the hosts up after this process exits (hosts made by hand)."""
        self._closed = True
        atexit.unregister(self.close)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _private_mounts(paths: Sequence[str]) -> list[str]:
    """The command prefix that mounts a fresh tmpfs on each of ``paths`` in a private mount
    namespace, then execs the command (so the command keeps the process's pid)."""
    if not paths:
        return []
    paths = [os.path.abspath(path) for path in paths]
    for path in paths:
        os.makedirs(path, exist_ok=True)  # a mount point must exist
    mount = shlex.quote(_tool("mount"))
    script = (f'n={len(paths)}; while [ "$n" -gt 0 ]; do {mount} -t tmpfs meshyard-private "$1" || exit 126; '
              'shift; n=$((n - 1)); done; exec "$@"')
    return [_tool("unshare"), "--mount", "--propagation", "private", _tool("sh"), "-c", script, "sh", *paths]


@functools.cache
def unavailable_reason() -> str | None:
    """Why hosts cannot be made here (None: they can); tried once per process."""
    if not sys.platform.startswith("linux"):
        return "network-namespace hosts need Linux"
    if os.geteuid() != 0:
        return "network-namespace hosts need root (creating namespaces, veth pairs and bridges does)"
    try:
        for tool in ("ip", "unshare", "mount", "sh"):
            _tool(tool)
        with Hosts(count=1, prefix=f"{BASE}{os.getpid()}-probe"):
            pass
    except (HarnessError, OSError) as exc:
        return f"network-namespace hosts cannot be made here: {exc}"
    return None


@contextlib.contextmanager
def hosts_or_skip(count: int = 2, networks: int = 1) -> Iterator[Hosts]:
    """A ``Hosts`` set for a test or fixture, or a pytest skip naming why none can be made."""
    import pytest  # the command line below runs without pytest

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with Hosts(count, networks) as hosts:
        yield hosts


def _addresses(name: str) -> str:
    listing = _ip("-n", name, "-o", "-4", "addr", "show")
    fields = [line.split() for line in listing.splitlines()]
    return " ".join(f"{row[1]}={row[3]}" for row in fields if len(row) > 3 and row[1] != "lo")


def _list() -> None:
    stale = set(stale_prefixes())
    for name in namespaces():
        if not name.startswith(BASE):
            continue
        match = _SESSION.match(name)
        state = "stale" if match and f"{BASE}{match.group(1)}" in stale else "up"
        print(f"{name}\t{state}\t{len(namespace_pids(name))} processes\t{_addresses(name)}")


def _down(prefix: str | None) -> int:
    """Removes the set ``prefix``, or (no prefix) the hand-made hosts and every stale set."""
    prefixes = [prefix] if prefix else [MANUAL_PREFIX, *stale_prefixes()]
    names = [name for each in prefixes for name in members(each)]
    left = remove(names)
    print(f"removed {len(names) - len(left)} namespaces" + (f"; left: {' '.join(left)}" if left else ""))
    return 1 if left else 0


def _up(count: int, networks: int, prefix: str) -> int:
    hosts = Hosts(count, networks, prefix)
    hosts.detach()
    for host, name in enumerate(hosts.names):
        nics = " ".join(f"{hosts.interface(host, n)}={hosts.address(host, n)}" for n in range(networks))
        print(f"host {host}: {name}\t{nics}")
    return 0


def _exec(host: int, prefix: str, argv: list[str]) -> int:
    name = f"{prefix}-h{host}"
    if name not in namespaces():
        print(f"no host {host} under prefix '{prefix}' (namespace {name}); make hosts with `up` first",
              file=sys.stderr)
        return 2
    command = argv[1:] if argv[:1] == ["--"] else argv
    os.execv(_tool("ip"), ["ip", "netns", "exec", name, *(command or [os.environ.get("SHELL", "/bin/sh")])])
    return 0  # not reached: execv replaces this process


def main(argv: Sequence[str] | None = None) -> int:
    """``up [N] [--networks M] [--prefix P]``, ``down [--prefix P]``, ``list``,
    ``exec [--prefix P] H [--] CMD...`` (options of ``exec`` before the host number)."""
    parser = argparse.ArgumentParser(prog="python -m tests.netns", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make hosts and leave them up")
    up.add_argument("count", type=int, nargs="?", default=2)
    up.add_argument("--networks", type=int, default=1)
    up.add_argument("--prefix", default=MANUAL_PREFIX)
    down = commands.add_parser("down", help="remove a set (default: the hand-made hosts and stale sets)")
    down.add_argument("--prefix")
    commands.add_parser("list", help="the harness's namespaces, their state and addresses")
    run = commands.add_parser("exec", help="run a command (default: a shell) inside a host")
    run.add_argument("--prefix", default=MANUAL_PREFIX)
    run.add_argument("host", type=int)
    run.add_argument("cmd", nargs=argparse.REMAINDER)  # everything after the host, its options included
    args = parser.parse_args(argv)
    if args.command == "list":
        _list()
        return 0
    if args.command == "down":
        return _down(args.prefix)
    if args.command == "exec":
        return _exec(args.host, args.prefix, args.cmd)
    return _up(args.count, args.networks, args.prefix)


if __name__ == "__main__":
    sys.exit(main())
