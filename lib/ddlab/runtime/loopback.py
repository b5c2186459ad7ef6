"""This machine's loopback: the address and interface ddlab's torch.distributed processes talk over on one host,
so that nothing listens on the network."""

from __future__ import annotations

import socket

import psutil

ADDRESS = "127.0.0.1"


def interface() -> str:
    """The name of this machine's loopback interface (lo on Linux, lo0 on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ADDRESS for a in addresses):
            return name
    return "lo"
