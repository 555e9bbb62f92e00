"""Free TCP ports for a benchmark's or test's rendezvous (a ``TCPStore``, a process
group's ``init_method``), picked where no other socket of this host is handed one.

A port from ``bind(("127.0.0.1", 0))`` is an ephemeral port: the kernel hands the same
range to every outgoing connection and every other ``bind(0)``, and a connection that
closed keeps its port in TIME_WAIT for a minute. Between the pick and the rendezvous'
own bind (a process start, a process group's set-up) one of them may take it: the CI
machine saw ``EADDRINUSE`` on a store's port that way. These ports are drawn at random
below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where only an
explicit bind takes a port, and checked free when picked.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_ports"]

#: Lowest port drawn (above the well-known and most registered service ports).
LOW = 20000
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> tuple[int, ...]:
    """``n`` distinct TCP ports of 127.0.0.1, free when picked, below the ephemeral range
    (ephemeral ones when that range leaves too little room below it)."""
    hi = _ephemeral_low()
    socks: list[socket.socket] = []
    try:
        tries = 0
        while len(socks) < n and hi - LOW >= 1000 and tries < 200 * n:
            tries += 1
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", _rng.randrange(LOW, hi)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room below the ephemeral range: the kernel's choice
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        # All held at once until here, so the n ports are distinct.
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()
