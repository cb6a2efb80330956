"""Which network interface the job's socket transports use: the one that routes to the master.

gloo (and NCCL's socket bootstrap) advertise to the other ranks the address of one local
interface. Without ``GLOO_SOCKET_IFNAME``, torch picks the address the host name resolves to,
often ``127.0.0.1``: then every rank of a multi-host job tells the others to connect to their
own loopback, and the full mesh fails with "Connection refused, remote=[127.0.0.1]".

- `route_source_address`: the local address the kernel would send from to reach an address (a
  UDP socket ``connect`` sends nothing; ``getsockname`` gives the chosen source).
- `interface_of_address`: the interface holding a local address (IPv4 through the
  ``SIOCGIFCONF`` ioctl, which also lists secondary addresses; IPv6 from ``/proc/net/if_inet6``).
- `interface_to`: both steps, for a host name or an address; None for a loopback master.
- `socket_ifname_env`: the ``GLOO_SOCKET_IFNAME`` value to add to an environment where the
  user did not set it (a user's value is always kept). ``NCCL_SOCKET_IFNAME`` is left to NCCL,
  which already skips loopback and picks its own fastest interface (the one that routes to the
  master may be a slower management network).

Pure Python and the standard library only: `shardwise run` calls it for its workers and
`communication.init()` for every other launcher (torchrun, mpirun).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16 bytes of name, 24 of union
_IF_INET6 = Path("/proc/net/if_inet6")


def route_source_address(addr: str) -> str | None:
    """The local address this machine sends from to reach the numeric address `addr`.

    Args:
        addr: an IPv4 or IPv6 address.

    Returns:
        The source address the routing table picks, or None when `addr` is unreachable.

    Example:
        >>> route_source_address("127.0.0.1")
        '127.0.0.1'
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP: chooses a route, sends nothing
            return str(s.getsockname()[0]).split("%")[0]
    except OSError:
        return None


def _ipv4_interfaces() -> list[tuple[str, str]]:
    """``(interface label, address)`` of every IPv4 address (``SIOCGIFCONF``)."""
    size = 64 * _IFREQ_SIZE
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while True:
            buf = array.array("B", bytes(size))
            addr, _ = buf.buffer_info()
            ifconf = struct.pack("iL", size, addr)
            used = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, ifconf))[0]
            if used < size:
                break
            size *= 2
    raw = buf.tobytes()[:used]
    found = []
    for off in range(0, used, _IFREQ_SIZE):
        name = raw[off : off + 16].split(b"\0", 1)[0].decode(errors="replace")
        found.append((name, socket.inet_ntoa(raw[off + 20 : off + 24])))
    return found


def _ipv6_interfaces() -> list[tuple[str, str]]:
    """``(interface, address)`` of every IPv6 address, from ``/proc/net/if_inet6``."""
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and len(fields[0]) == 32:
            packed = bytes.fromhex(fields[0])
            found.append((fields[5], str(ipaddress.IPv6Address(packed))))
    return found


def interface_of_address(addr: str) -> str | None:
    """The name of the local interface that holds address `addr`.

    Args:
        addr: a numeric IPv4 or IPv6 address.

    Returns:
        The interface name (an IPv4 alias keeps its label, e.g. ``eth0:1``), or None when no
        interface of this machine has `addr`.

    Example:
        >>> interface_of_address("127.0.0.1")
        'lo'
    """
    try:
        want = ipaddress.ip_address(addr)
        table = _ipv6_interfaces() if want.version == 6 else _ipv4_interfaces()
    except (ValueError, OSError):
        return None
    return next((name for name, a in table if ipaddress.ip_address(a) == want), None)


def interface_to(host: str) -> str | None:
    """The interface whose route reaches `host` (a name or an address).

    Args:
        host: the master's host name or address.

    Returns:
        The interface name, or None when `host` is a loopback address (one machine: torch's
        default already works), does not resolve, or has no route.

    Example:
        >>> interface_to("127.0.0.1") is None
        True
    """
    try:
        addr = str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
        if ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            return None
    except (OSError, ValueError):
        return None
    source = route_source_address(addr)
    if source is None:
        return None
    return interface_of_address(source)


def socket_ifname_env(master_addr: str, env: Mapping[str, str]) -> dict[str, str]:
    """The socket-interface variables to add to `env` for a job whose store is `master_addr`.

    Args:
        master_addr: the rendezvous host (``MASTER_ADDR`` / ``--master_addr``).
        env: the environment the process group will be created in.

    Returns:
        ``{"GLOO_SOCKET_IFNAME": name}``; empty when `env` already sets it, or `interface_to`
        finds none (a loopback master keeps torch's default).

    Example:
        >>> socket_ifname_env("127.0.0.1", {})
        {}
    """
    missing = [k for k in (GLOO_IFNAME,) if not env.get(k)]
    if not missing:
        return {}
    name = interface_to(master_addr)
    return {} if name is None else dict.fromkeys(missing, name)
