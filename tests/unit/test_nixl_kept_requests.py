"""Kept transfer requests (nixl ``agent.KEPT_REQUESTS``): a WRITE of the same pieces to
the same peer posts the request kept from the last one again instead of building a new
one; every payload still arrives bit for bit, and kept requests are released when
memory is deregistered (a staging buffer that grows), the peer is removed, or the
agent closes. A staged WRITE keeps its request only with ``KEEP_STAGED_REQUESTS`` (set
here: host payloads are always staged); WRITEs from a CUDA tensor's own memory keep
theirs by default (``tests/gpu/test_nixl_gpu.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from omnilink.connectors import backend_unavailable
from omnilink.connectors.nixl import agent as nixl_agent
from omnilink.connectors.nixl import connector as nixl_connector
from tests.nixl_pair import count_creates, nixl_pair

_REASON = backend_unavailable("nixl")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(nixl_agent, "KEPT_REQUESTS", 4)
    monkeypatch.setattr(nixl_connector, "KEEP_STAGED_REQUESTS", True)  # host payloads are staged
    with nixl_pair(monkeypatch, f"olnx/kept-{os.getpid()}", pool_bytes=32 << 20, extent_bytes=8 << 20) as p:
        yield p


def test_a_write_of_the_same_pieces_posts_the_kept_request_again(pair):
    tx, rx = pair
    n = 1 << 20  # written, not inline
    tx.put("warm", {"t": torch.zeros(n, dtype=torch.uint8)})
    del rx.get("warm")["t"]
    agent = tx._tx.agent
    made = count_creates(agent)
    for i in range(6):
        t = torch.full((n,), i, dtype=torch.uint8)
        tx.put(f"k{i}", {"t": t})
        got = rx.get(f"k{i}")
        assert torch.equal(got["t"], t)
        del got  # its block comes free: the next payload takes it again
    # One block reused each time: a request made at most for the first few (before the
    # freed block came back to the sender), then posted again.
    assert len(made) <= 2, len(made)
    assert 1 <= len(agent._kept) <= nixl_agent.KEPT_REQUESTS and not agent._posted


def test_kept_requests_are_bounded_and_released_with_their_memory(pair):
    tx, rx = pair
    agent = tx._tx.agent
    held = []
    for i in range(8):  # eight blocks held at once: eight different pieces
        t = torch.full((1 << 20,), i, dtype=torch.uint8)
        tx.put(f"h{i}", {"t": t})
        held.append(rx.get(f"h{i}"))
    assert len(agent._kept) == nixl_agent.KEPT_REQUESTS
    # A payload larger than the staging buffer makes it grow: its old registration goes,
    # and every request kept (which may name it) with it.
    big = torch.full((3 << 20,), 9, dtype=torch.uint8)
    staging = tx._tx.host_staging.nbytes
    tx.put("big", {"t": big})
    assert tx._tx.host_staging.nbytes > staging
    assert torch.equal(rx.get("big")["t"], big)
    assert len(agent._kept) == 1  # only the WRITE made since
    for i, got in enumerate(held):
        assert torch.equal(got["t"], torch.full((1 << 20,), i, dtype=torch.uint8))
    tx.close()
    assert not agent._kept and not agent._posted


def test_staged_writes_keep_no_request_by_default(monkeypatch):
    with nixl_pair(monkeypatch, f"olnx/nokeep-{os.getpid()}", pool_bytes=32 << 20, extent_bytes=8 << 20) as (tx, rx):
        assert nixl_agent.KEPT_REQUESTS > 0 and not nixl_connector.KEEP_STAGED_REQUESTS
        agent = None
        for i in range(4):
            t = torch.full((1 << 20,), i, dtype=torch.uint8)
            tx.put(f"k{i}", {"t": t})
            got = rx.get(f"k{i}")
            assert torch.equal(got["t"], t)
            del got
            agent = tx._tx.agent
        made = count_creates(agent)
        t = torch.full((1 << 20,), 7, dtype=torch.uint8)
        tx.put("again", {"t": t})
        assert torch.equal(rx.get("again")["t"], t)
        assert len(made) == 1 and not agent._kept and not agent._posted  # a request made, released
