"""Which address the store binds and which interface gloo uses (issue 35, ``_addresses.py``).

A ``--master-addr`` that is this machine's address off loopback (node 0 on a cluster's
network) used to leave the store on every interface and gloo on whatever this machine's name
resolves to. These tests take this machine's own interfaces as they are, and send nothing:
an address is known to be ours by binding a socket to it (no listen), an interface by a UDP
socket's connect (a route lookup). What they cannot show here: a store listening on a
network interface, and two machines' gloo across one (tests stay off the network).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys

import pytest

from evendp._distributed._torchrun._addresses import (
    interface_toward,
    local_address,
    loopback_address,
)
from evendp._planning._launch import interface_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")


def _own_addresses() -> dict[str, str]:
    """This machine's interfaces' IPv4 addresses off loopback: address -> interface."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()))
            except OSError:
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not address.startswith("127."):
                found[address] = name
    return found


def test_an_address_of_this_machine_off_loopback_is_bound_and_its_interface_named() -> None:
    own = _own_addresses()
    if not own:
        pytest.skip("this machine has no IPv4 address off loopback")
    for address, name in own.items():
        assert local_address(address) == address
        assert loopback_address(address) is None  # not a one-machine run's
        assert interface_toward(address) == name
        torchrun = ["python", "-m", "torch.distributed.run", "--master-addr", address]
        assert interface_env(torchrun) == {"GLOO_SOCKET_IFNAME": name}  # NCCL picks its own


def test_another_machines_address_is_not_bound_and_gloo_takes_the_route_to_it() -> None:
    """Node 1's view: node 0's address is not this machine's (the store is node 0's to
    serve), and gloo listens on the interface the kernel would reach it through."""
    names = set(_own_addresses().values())
    for address in ("198.51.100.7", "203.0.113.9"):  # documentation addresses: nobody's
        assert local_address(address) is None
        toward = interface_toward(address)  # None where no route leads off this machine
        assert toward is None or toward in names, toward
        torchrun = ["python", "-m", "torch.distributed.run", "--master-addr", address]
        assert interface_env(torchrun) == ({} if toward is None else {"GLOO_SOCKET_IFNAME": toward})


def test_a_loopback_address_other_than_127_0_0_1_is_bound_as_given() -> None:
    assert local_address("127.0.0.2") == "127.0.0.2"
    assert interface_toward("127.0.0.2") == "lo"
    torchrun = ["python", "-m", "torch.distributed.run", "--rdzv-endpoint", "127.0.0.2:29400"]
    assert interface_env(torchrun) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_a_name_that_resolves_nowhere_binds_nothing() -> None:
    assert local_address("no-such-host.invalid") is None
    assert interface_toward("no-such-host.invalid") is None
