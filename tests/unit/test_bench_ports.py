"""Rendezvous ports for benchmarks and process tests come from below the ephemeral
range, distinct, and free when picked."""

from __future__ import annotations

import socket

from omnilink._bench import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    picked = ports.free_ports(8)
    assert len(set(picked)) == 8
    for p in picked:
        if low - ports.LOW >= 1000:
            assert ports.LOW <= p < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


def test_a_taken_port_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, taken, taken + 1 if taken + 1 < 65536 else taken - 1])
        monkeypatch.setattr(ports, "LOW", 1)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports._rng, "randrange", lambda lo, hi: next(draws))
        (p,) = ports.free_ports(1)
        assert p != taken
