"""The socket interface for gloo/NCCL: the one whose route reaches the master, a user's choice
kept, a loopback master left to torch's default. Uses only this machine's own addresses (a
connected UDP socket sends nothing); the two-host test in tests/multiprocess covers real links.
"""

from __future__ import annotations

import sys

import pytest

from shardwise.communication._netif import (
    _ipv4_interfaces,
    interface_of_address,
    interface_to,
    route_source_address,
    socket_ifname_env,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux ioctls")


def own_address() -> tuple[str, str]:
    """A non-loopback IPv4 address of this machine and its interface, or skip."""
    found = [(n, a) for n, a in _ipv4_interfaces() if not a.startswith("127.")]
    if not found:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return found[0]


def test_loopback_master_keeps_torch_default() -> None:
    assert interface_of_address("127.0.0.1") == "lo"
    assert route_source_address("127.0.0.1") == "127.0.0.1"
    for master in ("127.0.0.1", "localhost", "::1"):
        assert interface_to(master) is None
        assert socket_ifname_env(master, {}) == {}


def test_the_interface_that_holds_the_route_source_is_picked() -> None:
    name, addr = own_address()
    assert interface_of_address(addr) == name
    assert interface_to(addr) == name
    assert socket_ifname_env(addr, {}) == {"GLOO_SOCKET_IFNAME": name}  # NCCL picks its own


def test_a_value_the_user_set_is_kept() -> None:
    name, addr = own_address()
    assert socket_ifname_env(addr, {"GLOO_SOCKET_IFNAME": "mine"}) == {}
    assert socket_ifname_env(addr, {"NCCL_SOCKET_IFNAME": "b"}) == {"GLOO_SOCKET_IFNAME": name}


def test_unknown_addresses_give_none() -> None:
    assert interface_of_address("not an address") is None
    unused = "203.0.113.77"  # TEST-NET-3, only looked up in this machine's own table
    if unused in {a for _, a in _ipv4_interfaces()}:
        pytest.skip(f"this machine has {unused}")
    assert interface_of_address(unused) is None
    assert interface_of_address("fe80::dead:beef:1") is None
