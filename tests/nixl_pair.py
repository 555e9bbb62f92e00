"""A nixl receiver and sender in this process, for the backend's one-process tests."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import omnilink
from omnilink.connectors.nixl.agent import nvidia_gpu_present


def ucx_tls(tls: str) -> str:
    """``tls`` plus ``cuda_copy`` on a machine with an NVIDIA GPU: NIXL's UCX backend
    refuses a transport list without a CUDA transport there."""
    return tls + ",cuda_copy" if nvidia_gpu_present() else tls


@contextlib.contextmanager
def nixl_pair(monkeypatch: Any, channel: str, tls: str = "tcp", **rx_options: Any) -> Iterator[tuple[Any, Any]]:
    """``(sender, receiver)`` over UCX's ``tls`` on loopback (``UCX_TLS`` set through
    ``monkeypatch``: UCX reads it when an agent starts), both closed after."""
    monkeypatch.setenv("UCX_TLS", ucx_tls(tls))
    rx = omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", timeout=30.0,
                          **rx_options)
    tx = omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=30.0)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


def answered(tx: Any, timeout: float = 20.0) -> None:
    """Wait until a nixl sender has the receiver's answer to every payload it put (a put
    returns once its payload is published; the answer says it was indexed, or refused)."""
    import time

    s = tx._tx
    end = time.monotonic() + timeout
    while True:
        with s.lock:
            if not s.unacked:
                return
            s._look(s._open_sock("test"), "test")
        if time.monotonic() > end:
            raise AssertionError(f"no answer to {len(s.unacked)} payloads in {timeout} s")
        time.sleep(0.001)


def record_bell(tx: Any) -> list[Any]:
    """The messages a nixl sender puts on its doorbell from now on, in order (a list that
    fills as it sends)."""
    sent: list[Any] = []
    s = tx._tx
    real = s._send_bell

    def send_bell(msg: Any, deadline: Any, key: Any) -> None:
        sent.append(msg)
        real(msg, deadline, key)

    s._send_bell = send_bell
    return sent


def count_creates(agent: Any) -> list[Any]:
    """The arguments of every ``createXferReq`` the nixl ``agent`` makes from now on
    (its NIXL agent wrapped: every other call goes through as it is)."""
    made: list[Any] = []
    real = agent._agent.createXferReq

    class _Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real.__self__, name)

        def createXferReq(self, *args: Any) -> Any:
            made.append(args)
            return real(*args)

    agent._agent = _Counting()
    return made
