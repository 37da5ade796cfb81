"""Which of this host's addresses and interfaces reach a peer: no network settings by hand.

Several hosts of one job often share a hostname (containers, network namespaces), and a
host often has several interfaces. torch's defaults then go wrong in three places: the
c10d rendezvous hosts its store only when the endpoint matches the hostname's address,
the agent advertises the hostname's address as the master address, and gloo binds the
interface the hostname resolves to. The kernel's routing table knows better: the source
address of a route to the endpoint is the address peers can reach this host at, and
the interface holding it is the one the job's traffic should use.
"""

from __future__ import annotations

import fcntl
import ipaddress
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # Linux ioctl: the (primary) IPv4 address of an interface


class NetworkError(RuntimeError):
    """The rendezvous endpoint cannot be resolved or reached from this host."""


@dataclass(frozen=True)
class Route:
    """How this host reaches a rendezvous endpoint."""

    endpoint_addr: str
    """The endpoint's host as an IP address."""
    local_addr: str
    """This host's address on the route to the endpoint: where peers reach this host."""
    interface: str
    """The network interface holding ``local_addr`` (what gloo and NCCL should bind)."""
    is_local: bool
    """The endpoint is one of this host's own addresses: this host serves the store."""


def resolve(host: str) -> str:
    """``host`` as an IP address (IPv4 preferred), or ``NetworkError`` naming it."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise NetworkError(f"the rendezvous host '{host}' does not resolve to an address ({exc.strerror}); "
                           "give its IP address or a name every node can resolve") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def source_address(endpoint_addr: str, port: int) -> str:
    """The address the kernel would send from to reach ``endpoint_addr`` (a UDP
    ``connect`` only consults the routing table: no packet leaves)."""
    family = socket.AF_INET6 if ":" in endpoint_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((endpoint_addr, port or 9))
        except OSError as exc:
            raise NetworkError(f"no route from this host to the rendezvous endpoint {endpoint_addr} "
                               f"({exc.strerror}); check the address, or this host's network") from None
        return str(probe.getsockname()[0])


def interface_addresses() -> dict[str, set[str]]:
    """Every interface's addresses: IPv4 from ``ip -o addr`` (secondary addresses
    included) or, without iproute2, each interface's primary one; IPv6 from /proc."""
    found: dict[str, set[str]] = {}
    for name, address in [*_ipv4_addresses(), *_ipv6_addresses()]:
        found.setdefault(name, set()).add(address)
    return found


def _ipv4_addresses() -> list[tuple[str, str]]:
    if shutil.which("ip"):
        listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False)
        if listing.returncode == 0:
            # "2: eth0    inet 10.0.0.2/24 brd ... scope global eth0\ ..."
            return [(fields[1].split("@")[0], fields[3].split("/")[0])
                    for fields in (line.split() for line in listing.stdout.splitlines()) if len(fields) > 3]
    pairs = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            pairs.append((name, socket.inet_ntoa(answer[20:24])))
    return pairs


def _ipv6_addresses() -> list[tuple[str, str]]:
    try:
        with open("/proc/net/if_inet6") as table:
            rows = [line.split() for line in table]
    except OSError:
        return []
    return [(row[5], str(ipaddress.IPv6Address(bytes.fromhex(row[0])))) for row in rows if len(row) >= 6]


def route_to(host: str, port: int = 0) -> Route:
    """This host's side of the route to ``host`` (the rendezvous endpoint)."""
    endpoint = resolve(host)
    local = source_address(endpoint, port)
    owners = interface_addresses()
    interface = next((name for name, addresses in owners.items() if local in addresses), "")
    if not interface:
        raise NetworkError(f"the address {local} this host would use to reach {endpoint} belongs to no "
                           "interface listed by the system; set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
                           "to the interface to use")
    is_local = any(endpoint in addresses for addresses in owners.values())
    return Route(endpoint_addr=endpoint, local_addr=local, interface=interface, is_local=is_local)
