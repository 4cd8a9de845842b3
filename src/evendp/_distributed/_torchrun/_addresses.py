"""Which of this machine's addresses and interfaces a run's listeners bind (issue 35).

torch's ``TCPStore`` listens on every interface, gloo on the one this machine's name resolves
to; a run's store need only be reachable at ``--master-addr``, its ranks on the network that
reaches it. Standard library only (torchrun's agent has nothing of evendp on its path).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys

__all__ = ["interface_toward", "listen_on", "local_address", "loopback_address", "resolves"]


def _resolved(host: str) -> list[str]:
    """The addresses ``host`` is or resolves to, in the resolver's order (``[]``: none)."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:  # a host name
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def resolves(host: str) -> bool:
    """Whether ``host`` is an address, or a name that resolves to one.

    >>> resolves("127.0.0.1"), resolves("no-such-host.invalid")
    (True, False)
    """
    return bool(_resolved(host))


def _is_ours(address: str) -> bool:
    """Whether ``address`` is this machine's: a socket binds to it (port 0, nothing sent)."""
    if ipaddress.ip_address(address).is_loopback:
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def local_address(host: str) -> str | None:
    """The address of this machine that ``host`` is or resolves to (all of them this
    machine's), else ``None``: where a store served at ``host`` may listen alone.

    >>> local_address("127.0.0.1"), local_address("localhost"), local_address("::1")
    ('127.0.0.1', '127.0.0.1', '::1')
    >>> local_address("198.51.100.7") is None  # a documentation address: not this machine's
    True
    """
    found = _resolved(host)
    if not found or not all(_is_ours(a) for a in found):
        return None
    if "127.0.0.1" in found:
        return "127.0.0.1"
    return ([a for a in found if ":" not in a] or found)[0]


def loopback_address(host: str) -> str | None:
    """:func:`local_address` when it is a loopback one (a one-machine run), else ``None``.

    >>> loopback_address("localhost"), loopback_address("198.51.100.7")
    ('127.0.0.1', None)
    """
    address = local_address(host)
    return address if address and ipaddress.ip_address(address).is_loopback else None


def interface_toward(host: str) -> str | None:
    """The name of this machine's interface that reaches ``host`` (Linux, IPv4: the one
    the kernel would send from, found by connecting a UDP socket, which sends nothing),
    else ``None``.

    >>> interface_toward("127.0.0.1") in ("lo", "lo0")
    True
    """
    found = [a for a in _resolved(host) if ":" not in a]
    if not found:
        return None
    if ipaddress.ip_address(found[0]).is_loopback:
        return "lo0" if sys.platform == "darwin" else "lo"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((found[0], 9))  # a route lookup; UDP's connect sends nothing
            source = probe.getsockname()[0]
    except OSError:
        return None
    return _interface_of(source)


def _interface_of(address: str) -> str | None:
    """The interface whose (primary) IPv4 address is ``address`` (Linux ``SIOCGIFADDR``)."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def _listen(address: str, port: int) -> int:
    """A socket listening on ``address:port`` only; the store takes its descriptor over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:  # in torch's words: torchrun retries another port
            raise RuntimeError("Address already in use") from None
        raise
    return sock.detach()


def listen_on(host: str, port: int) -> int | None:
    """The descriptor of a socket listening on ``host:port`` alone (for a ``TCPStore``'s
    ``master_listen_fd``) when ``host`` is this machine's; else ``None``."""
    address = local_address(host)
    return None if address is None else _listen(address, port)
