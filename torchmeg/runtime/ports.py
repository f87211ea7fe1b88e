"""Ports for servers that another process binds seconds later: torchrun's workers' TCPStore (rank 0
binds MASTER_PORT after its imports), a rendezvous endpoint, torchft's lighthouse.

A port found free by binding port 0 (torch's `get_free_port`, what torchrun's agent does for
MASTER_PORT) comes from the kernel's ephemeral range (32768-60999 on Linux by default), the range the
kernel also hands out as the local end of every outgoing connection. Between the release of such a port
and the server's bind, any connection on the machine (gloo opens a full mesh per group) may take it,
and the server fails with EADDRINUSE: seen in CI as a replica group's rank 0 failing to start. So these
ports are drawn at random (from the OS's entropy: forked processes do not repeat each other's draws)
from a range below the ephemeral one, which outgoing connections never use, and checked free by a bind.
(tests/launch.py draws the suite's own ports from 20000 up; this range stays below it.)
"""
from __future__ import annotations

import random
import socket

RANGE = (10000, 20000)
_DRAW = random.SystemRandom()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_in(lo: int, hi: int, draw=_DRAW, host: str = "") -> int | None:
    """A port in [lo, hi) that no socket holds now (up to 200 random draws), or None."""
    for _ in range(200):
        port = draw.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use
            return port
    return None


def unused_port() -> int:
    """A port no socket holds now, below the ephemeral range (any free port if none is found there)."""
    lo, hi = RANGE
    start = ephemeral_start()
    port = free_port_in(lo, min(hi, start) if start > lo else hi)
    if port is not None:
        return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
