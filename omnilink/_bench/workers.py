"""Sender and receiver process bodies of ``omnilink bench`` (importable for ``spawn``).

The parent drives both workers over a control pipe; control messages are msgspec JSON
sent with ``send_bytes`` and are never inside a timed region. One command, ``run``,
moves ``count`` messages and is the unit the parent repeats::

    parent                 sender                          receiver
      |-- open ----------->|  backend.open_sender            |
      |-- open --------------------------------------------->|  backend.open_receiver
      |-- run ------------>|                                 |
      |-- run ---------------------------------------------->|
      |                    | t0 = clock                      |
      |                    | for j < count:                  | for j < count:
      |                    |   j >= window: credits.acquire  |   p = recv(j); t = clock
      |                    |   stamp(p, j); send(j, p) ----->|   one_way = t - p.sent_ns
      |                    |                                 |   drop p; credits.release
      |<-- {t0} -----------|                                 |      (if j + window < count)
      |<----------------------------------------------------| {t_end, one_way[]}

``credits`` bounds the messages in flight to ``window`` (one for latency), so a fast
sender cannot pile hundreds of 256 MiB segments into ``/dev/shm``. Clocks are
CLOCK_MONOTONIC, shared by every process of the host, so the parent may subtract the
sender's ``t0`` from the receiver's ``t_end``.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any

import msgspec

from omnilink._bench.backends import Backend, PairContext, get_backend
from omnilink._bench.payload import check_payload, make_payload, now_ns, stamp

__all__ = ["worker_main"]

_enc = msgspec.json.Encoder()


def _reply(conn: Any, **fields: Any) -> None:
    conn.send_bytes(_enc.encode(fields))


def _error_text(exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last


class _Worker:
    def __init__(self, role: str, ctx: PairContext, credits: Any) -> None:
        self.role = role
        self.ctx = ctx
        self.credits = credits
        self.backend: Backend | None = None
        self.payloads: dict[tuple[int, str], dict[str, Any]] = {}
        self.timeout = 30.0
        self.device: str | None = None

    # ------------------------------------------------------------------ commands
    def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.close()
        self.timeout = float(cmd["timeout"])
        self.device = cmd.get("device")
        backend = get_backend(cmd["backend"])
        if self.role == "sender":
            backend.open_sender(self.ctx, timeout=self.timeout, options=cmd.get("options") or {})
        else:
            backend.open_receiver(self.ctx, timeout=self.timeout, options=cmd.get("options") or {})
        self.backend = backend
        return {}

    def close(self, cmd: dict[str, Any] | None = None) -> dict[str, Any]:
        backend, self.backend = self.backend, None
        self.payloads.clear()
        if backend is not None:
            backend.close()
        return {}

    def _payload(self, size: int, device: str) -> dict[str, Any]:
        key = (size, device)
        p = self.payloads.get(key)
        if p is None:
            # One payload size at a time: drop the previous (256 MiB) ones first.
            self.payloads.clear()
            gc.collect()
            p = self.payloads[key] = make_payload(size, device=device)
        return p

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self.backend is None:
            raise RuntimeError("run before open")
        if self.role == "sender":
            return self._send(cmd)
        return self._recv(cmd)

    def _send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        size, count, window, seq0 = cmd["size"], cmd["count"], cmd["window"], cmd["seq0"]
        base = self._payload(size, cmd.get("payload_device") or "cpu")
        if self.backend.fresh_tensors:
            # Made before t0: producing a tensor is the model's work, not the transport's.
            messages = [
                {**base, "hidden_states.output": base["hidden_states.output"].clone(),
                 "ids.output": base["ids.output"].clone(), "meta": dict(base["meta"])}
                for _ in range(count)
            ]
        else:
            messages = [base] * count
        backend, credits, timeout = self.backend, self.credits, self.timeout
        t0 = now_ns()
        for j in range(count):
            if j >= window and not credits.acquire(timeout=timeout):
                raise TimeoutError(f"receiver did not consume message {seq0 + j - window} within {timeout} s")
            p = messages[j]
            stamp(p, seq0 + j)
            backend.send(seq0 + j, p)
        messages.clear()
        return {"t0": t0}

    def _recv(self, cmd: dict[str, Any]) -> dict[str, Any]:
        size, count, window, seq0 = cmd["size"], cmd["count"], cmd["window"], cmd["seq0"]
        device = cmd.get("recv_device")
        backend, credits = self.backend, self.credits
        sync = _cuda_sync(device)
        one_way: list[int] = []
        for j in range(count):
            p = backend.recv(seq0 + j, device=device)
            if sync is not None:
                sync()
            t = now_ns()
            one_way.append(t - p["meta"]["sent_ns"])
            if j == 0 or j == count - 1:
                check_payload(p, seq0 + j, size)
            elif int(p["ids.output"][0]) != seq0 + j:
                raise RuntimeError(f"expected message {seq0 + j}, got {int(p['ids.output'][0])}")
            # Dropping the payload releases its transport block (omnilink) or memory.
            del p
            if j + window < count:
                credits.release()
        return {"t_end": now_ns(), "one_way_ns": one_way}


def _cuda_sync(device: str | None) -> Any:
    """The receiver waits for its device copy to finish before taking the end time."""
    if device is None or not str(device).startswith("cuda"):
        return None
    import torch

    return torch.cuda.synchronize


def worker_main(role: str, conn: Any, ctx: PairContext, credits: Any) -> None:
    """Serve commands from the parent until ``exit`` or the pipe closes.

    Parameters
    ----------
    role : {"sender", "receiver"}
    conn : multiprocessing.connection.Connection
        Control pipe to the parent (msgspec JSON, ``send_bytes`` / ``recv_bytes``).
    ctx : PairContext
        Objects shared with the other worker.
    credits : multiprocessing.Semaphore
        Flow-control credits from receiver to sender.
    """
    import torch

    # Two single-threaded processes: on a small machine intra-op threads of the sender
    # and the receiver would fight for the same cores and measure the scheduler.
    torch.set_num_threads(1)
    worker = _Worker(role, ctx, credits)
    dec = msgspec.json.Decoder()
    try:
        while True:
            try:
                cmd = dec.decode(conn.recv_bytes())
            except EOFError:
                return
            op = cmd.get("op")
            if op == "exit":
                return
            handler = {"open": worker.open, "close": worker.close, "run": worker.run}.get(op)
            try:
                if handler is None:
                    raise ValueError(f"unknown command {op!r}")
                _reply(conn, ok=True, **handler(cmd))
            except BaseException as exc:  # reported to the parent, which decides
                _reply(conn, ok=False, error=_error_text(exc), type=type(exc).__name__)
    finally:
        worker.close()
