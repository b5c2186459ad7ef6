"""This machine's loopback: the address and interface ddlab's torch.distributed processes talk over on one host,
so that nothing listens on the network."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

ADDRESS = "127.0.0.1"


def interface() -> str:
    """The name of this machine's loopback interface (lo on Linux, lo0 on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ADDRESS for a in addresses):
            return name
    return "lo"


@contextmanager
def gloo_on_loopback() -> Iterator[None]:
    """gloo's sockets on the loopback interface while inside, whatever GLOO_SOCKET_IFNAME says; its value is put
    back on the way out. For a group that never needs another host."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = interface()
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before
