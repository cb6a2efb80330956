"""Two test hosts on one machine: network namespaces joined by a veth pair.

`two_hosts()` creates namespaces ``<tag>a`` and ``<tag>b`` (a unique tag per call), moves one
end of a veth pair into each, gives them `ADDRS` (a private /24 that exists only inside these
two namespaces) and brings the pair and each namespace's loopback up; on exit it deletes both
namespaces (which also deletes the veth pair), even after a failure. `skip_reason()` says why
the machine cannot do this (not root, no ``ip``, no namespace support), or None.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

ADDRS = ("10.231.0.1", "10.231.0.2")


@dataclass(frozen=True)
class Host:
    """One test host: its namespace, its veth interface and its address."""

    netns: str
    ifname: str
    addr: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def skip_reason() -> str | None:
    """Why two namespaced hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2) to create network namespaces"
    probe = f"swprobe{uuid.uuid4().hex[:6]}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaced hosts joined by a veth pair (see the module docstring)."""
    tag = f"sw{uuid.uuid4().hex[:8]}"  # interface names have at most 15 characters
    hosts = (Host(f"{tag}a", f"{tag}a", ADDRS[0]), Host(f"{tag}b", f"{tag}b", ADDRS[1]))
    made: list[str] = []
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
            made.append(h.netns)
        _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for h in hosts:
            _ip("link", "set", h.ifname, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        subprocess.run(["ip", "link", "delete", hosts[0].ifname], capture_output=True)
