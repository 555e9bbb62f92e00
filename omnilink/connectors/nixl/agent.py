"""NIXL, loaded on first use, and the one agent wrapper the backend uses.

The backend talks to NIXL's pybind11 bindings (``nixl._bindings``, the module the
``nixl`` meta package or a ``nixl-cu12`` / ``nixl-cu13`` wheel installs) rather than to
``nixl._api.nixl_agent``, for one reason: that wrapper starts the UCX progress thread
with ``pthrDelay = 0``, a thread that polls its worker without ever sleeping and burns
a whole core per agent (measured: 1.94 s of CPU per 2 s idle on the 2-core CI machine).
With a delay, the same thread blocks in ``poll()`` on the UCX worker's event fd and
wakes when something arrives (0.0002 s of CPU over the same test, and 4 KiB writes over
``UCX_TLS=tcp`` went from 8 ms p50, starved by the spinning peer, to 26 us). The
receiver's agent needs that thread: over tcp the bytes of a WRITE are placed by the
target's CPU. ``PROGRESS_WAKE_US`` is the poll timeout (a safety net, not a period).
A sender's agent runs without it (``progress_thread=False``): the sender drives its
worker itself as it posts a WRITE and asks for its state, and nothing needs it in
between; a second thread taking the agent's lock on every wake-up only competed with
it (64 MiB over tcp on the 2-core machine: 11.6-12.0 ms one-way without it, 13.2-14.6
ms with it; 4 KiB and cma unchanged).

Completion of a WRITE has no blocking wait in NIXL: ``Agent.wait`` asks for the
transfer's state in a tight loop for ``SPIN_S`` (a 4 KiB write completes in 3-30 us,
inside the spin, and over ``cma`` it is complete when posted), then with a
``sched_yield`` between looks until ``YIELD_SPIN_S`` (a 256 MiB GPU write over NVLink
takes ~0.8 ms; a sleep of tens of microseconds lasts 70 us and more, the kernel's timer
slack), then sleeps between looks, doubling from ``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S``
but never past an eighth of the time waited so far, so a late look costs at most that
(a 64 MiB write over tcp takes ~10 ms on the 2-core machine). Past the first spin it
asks whether the peer is lost, or the deadline passed, at most every ``CHECK_EVERY_S``.
The receiver never waits on NIXL: the sender's "done" (its ``publish``, or ``written``
for a payload published ahead) reaches it on the doorbell, a plain socket that a
waiting ``get`` or the receiver's loop thread reads.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import time
from typing import Any, Callable

from omnilink._errors import ConfigurationError, PeerLostError, TransportError
from omnilink._util import Deadline

__all__ = ["Agent", "NIXL_INSTALL", "load_bindings", "nixl_unavailable"]

logger = logging.getLogger(__name__)

NIXL_INSTALL = 'pip install "pyomnilink[nixl]"'
#: Modules tried in turn: the ``nixl`` meta package (it picks the CUDA 12 or 13 build
#: from torch), then the builds themselves.
_CANDIDATES = ("nixl._bindings", "nixl_cu13._bindings", "nixl_cu12._bindings")
#: Poll timeout of the UCX progress thread, in microseconds (see the module docstring).
PROGRESS_WAKE_US = 100_000
SPIN_S = 0.0002
#: Past ``SPIN_S``, looks go on with a ``sched_yield`` between them until this long
#: (a 256 MiB GPU WRITE over NVLink takes ~0.8 ms), then sleep between them.
YIELD_SPIN_S = 0.002
BACKOFF_MIN_S = 0.00002
BACKOFF_MAX_S = 0.001
#: Past ``SPIN_S``, whether the peer is lost and the deadline passed is asked at most
#: this often while the looks go on (each question reads the connection's events).
CHECK_EVERY_S = 0.0001
#: Most transfer requests kept after they completed, by their pieces and peer, to be
#: posted again for a WRITE of the same pieces (``write(keep=True)``: the connector asks
#: for it on its WRITEs from a tensor's own memory, where one payload at a time writes
#: the same tensor memory into the same block again and again) instead of building
#: descriptor lists and a request each time; least recently used released first, all of
#: them when memory is deregistered or a peer removed. 0: none kept.
KEPT_REQUESTS = 64

_bindings: Any = None
_load_error: str | None = None


def load_bindings() -> Any:
    """NIXL's bindings module.

    Raises
    ------
    ConfigurationError
        NIXL is not installed (the message says what to install) or does not load.
    """
    global _bindings, _load_error
    if _bindings is not None:
        return _bindings
    if _load_error is None:
        errors = []
        for name in _CANDIDATES:
            try:
                mod = importlib.import_module(name)
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
                continue
            except Exception as exc:  # a broken build: report, never crash the caller
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if not hasattr(mod, "nixlAgent"):
                errors.append(f"{name}: no nixlAgent")
                continue
            _bindings = mod
            return mod
        _load_error = "; ".join(errors)
    raise ConfigurationError(
        f"the nixl backend needs NIXL, which does not import here ({_load_error}); "
        f"install it with `{NIXL_INSTALL}`"
    )


def nixl_unavailable() -> str | None:
    """Why NIXL cannot be used in this process, or ``None``. Never initialises CUDA."""
    try:
        load_bindings()
    except ConfigurationError as exc:
        return str(exc)
    return None


def _nbytes(pieces: list[tuple[int, int, int]]) -> int:
    """Bytes of a WRITE's ``(address, length, device)`` pieces."""
    return sum(p[1] for p in pieces)


def _nixl_error(exc: BaseException, what: str) -> TransportError:
    """NIXL's exception as omnilink's: ``PeerLostError`` when UCX says the peer went away
    (a SIGKILLed receiver surfaces as ``NIXL_ERR_REMOTE_DISCONNECT`` on the next
    transfer, before the control channel notices), ``TransportError`` otherwise."""
    text = f"nixl: {what} failed: {type(exc).__name__}: {exc}"
    if "RemoteDisconnect" in type(exc).__name__ or "REMOTE_DISCONNECT" in str(exc):
        return PeerLostError(text)
    return TransportError(text)


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU device node (no CUDA call, no torch)."""
    return any(os.path.exists(f"/dev/nvidia{i}") for i in range(8))


def _tls_hint() -> str:
    """Why NIXL may have refused UCX here: on a machine with an NVIDIA GPU, NIXL's UCX
    backend refuses a ``UCX_TLS`` that names no CUDA transport (its reason goes to the
    log only). Empty when that is not the case."""
    tls = os.environ.get("UCX_TLS", "").strip()
    if not tls or tls.startswith("^") or "cuda" in tls or tls == "all":
        return ""
    if not nvidia_gpu_present():
        return ""
    return (
        f"UCX_TLS={tls} names no CUDA transport, which NIXL refuses on a machine with an "
        "NVIDIA GPU: add cuda_copy (host and device memory) or cuda (also NVLink)"
    )


class Agent:
    """One NIXL agent with its UCX backend and, unless ``progress_thread`` is false, an
    event-driven progress thread (see the module docstring).

    Memory types are ``"DRAM"`` and ``"VRAM"``; a region is ``(address, nbytes,
    device_id)`` (``device_id`` 0 for host memory).

    Raises
    ------
    ConfigurationError
        NIXL is missing.
    TransportError
        NIXL or UCX refused to start (no usable transport: see ``UCX_TLS``).
    """

    def __init__(self, name: str, progress_thread: bool = True) -> None:
        b = load_bindings()
        self._b = b
        self.name = name
        try:
            cfg = b.nixlAgentConfig()
            cfg.useProgThread = progress_thread
            cfg.useListenThread = False
            cfg.listenPort = 0
            # The progress thread and the caller's threads share the agent.
            cfg.syncMode = b.NIXL_THREAD_SYNC_STRICT
            cfg.pthrDelay = PROGRESS_WAKE_US
            cfg.lthrDelay = 100_000
            cfg.captureTelemetry = False
            self._agent = b.nixlAgent(name, cfg)
            if "UCX" not in self._agent.getAvailPlugins():
                raise TransportError("nixl: this NIXL build has no UCX plugin")
            self._ucx = self._agent.createBackend("UCX", {})
        except TransportError:
            raise
        except Exception as exc:
            err = _nixl_error(exc, "starting an agent with the UCX backend")
            hint = _tls_hint()
            if hint:
                err = TransportError(f"{err} ({hint})")
            raise err from exc
        self._mems = {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG}
        #: transfer handles NIXL refused to release (still active): retried at close
        self._stuck: list[Any] = []
        #: completed requests kept for a WRITE of the same pieces (``KEPT_REQUESTS``)
        self._kept: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        #: id(request) -> its key, for a posted request to be kept once complete
        self._posted: dict[int, Any] = {}

    # -------------------------------------------------------------- memory
    def register(self, addr: int, nbytes: int, mem: str, dev: int) -> Any:
        """Register ``[addr, addr + nbytes)`` once; returns what ``deregister`` takes."""
        b = self._b
        try:
            descs = b.nixlRegDList(self._mems[mem], [(addr, nbytes, dev, "")])
            self._agent.registerMem(descs, [self._ucx])
        except Exception as exc:
            raise _nixl_error(exc, f"registering {nbytes} bytes of {mem}") from exc
        return descs

    def deregister(self, descs: Any) -> None:
        self._release_kept()  # a kept request may name this memory
        try:
            self._agent.deregisterMem(descs, [self._ucx])
        except Exception:  # teardown: log, go on
            logger.debug("nixl: deregistering memory failed", exc_info=True)

    # ------------------------------------------------------------ metadata
    def metadata(self) -> bytes:
        return bytes(self._agent.getLocalMD())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name.

        Raises
        ------
        TransportError
            NIXL refused the metadata (malformed, or no common transport).
        """
        try:
            name = self._agent.loadRemoteMD(metadata)
        except Exception as exc:
            raise _nixl_error(exc, "loading a peer's agent metadata") from exc
        return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        self._release_kept()
        try:
            self._agent.invalidateRemoteMD(name)
        except Exception:  # already gone, or never loaded
            logger.debug("nixl: removing remote agent %r failed", name, exc_info=True)

    # ----------------------------------------------------------- transfers
    def write(self, local: list[tuple[int, int, int]], local_mem: str, remote: list[tuple[int, int, int]],
              remote_mem: str, peer: str, *, keep: bool = False) -> Any:
        """Post one WRITE of the ``local`` pieces (``(address, length, device)``) into the
        peer's ``remote`` ones, piece by piece; returns the request (``None`` when it
        completed while being posted). ``keep``: once complete the request is kept, and
        one kept from a WRITE of the same pieces is posted again (``KEPT_REQUESTS``)."""
        b = self._b
        key = (local_mem, tuple(local), remote_mem, tuple(remote), peer) if keep and KEPT_REQUESTS > 0 else None
        req = self._kept.pop(key, None) if key is not None else None
        if req is None:
            try:
                ld = b.nixlXferDList(self._mems[local_mem], local)
                rd = b.nixlXferDList(self._mems[remote_mem], remote)
                req = self._agent.createXferReq(b.NIXL_WRITE, ld, rd, peer, b"", [self._ucx])
            except Exception as exc:
                raise _nixl_error(exc, f"preparing a WRITE of {_nbytes(local)} bytes to {peer}") from exc
        try:
            status = self._agent.postXferReq(req, b"")
        except Exception as exc:
            self.release(req)
            raise _nixl_error(exc, f"posting a WRITE of {_nbytes(local)} bytes to {peer}") from exc
        if status == b.NIXL_SUCCESS:
            self._done(req, key)
            return None
        if status != b.NIXL_IN_PROG:
            self.release(req)
            raise TransportError(f"nixl: a WRITE of {_nbytes(local)} bytes to {peer} failed when posted ({status})")
        if key is not None:
            self._posted[id(req)] = key
        return req

    def _done(self, req: Any, key: Any) -> None:
        """A request that completed: kept under ``key`` for the next WRITE of the same
        pieces (the least recently used released past ``KEPT_REQUESTS``), or released."""
        if key is None:
            self.release(req)
            return
        kept = self._kept
        old = kept.pop(key, None)
        if old is not None:  # (one WRITE of these pieces at a time: not expected)
            self.release(old)
        kept[key] = req
        while len(kept) > max(KEPT_REQUESTS, 0):
            self.release(kept.popitem(last=False)[1])

    def _release_kept(self) -> None:
        kept = list(self._kept.values())
        self._kept.clear()
        for req in kept:
            self.release(req)

    def wait(self, req: Any, deadline: Deadline, lost: Callable[[], str | None]) -> str | None:
        """Wait for ``req`` to complete (see the module docstring for how).

        Returns ``None`` when it completed; otherwise why it did not (``"timeout"``,
        or ``lost()``'s answer: the peer went away), the request released or parked.

        Raises
        ------
        TransportError
            The transfer failed.
        """
        b = self._b
        get = self._agent.getXferStatus
        in_prog = b.NIXL_IN_PROG
        start = time.monotonic()
        spin_until = check_at = start + SPIN_S
        pause = BACKOFF_MIN_S
        while True:
            try:
                status = get(req)
            except Exception as exc:
                self.release(req)
                raise _nixl_error(exc, "a WRITE") from exc
            if status != in_prog:
                key = self._posted.pop(id(req), None)
                if status != b.NIXL_SUCCESS:
                    self.release(req)
                    raise TransportError(f"nixl: a WRITE failed ({status})")
                self._done(req, key)
                return None
            now = time.monotonic()
            if now < spin_until:
                continue
            if now >= check_at:
                check_at = now + CHECK_EVERY_S
                why = lost()
                if why is None and deadline.expired():
                    why = "timeout"
                if why is not None:
                    self.release(req)
                    return why
            if now < start + YIELD_SPIN_S:
                # Still looking at once, the core given to whoever is ready between
                # looks: a sleep of tens of microseconds lasts 70 us and more (the
                # kernel's timer slack), a large part of a WRITE of a millisecond.
                os.sched_yield()
                continue
            time.sleep(pause)
            # Doubling, but never more than an eighth of the time waited so far: a look
            # that comes late costs at most that (a 256 MiB GPU WRITE of ~0.8 ms found
            # complete up to 0.6 ms late with plain doubling to BACKOFF_MAX_S).
            pause = max(BACKOFF_MIN_S, min(pause * 2, BACKOFF_MAX_S, (now - start) / 8))

    def release(self, req: Any) -> None:
        self._posted.pop(id(req), None)
        try:
            self._agent.releaseXferReq(req)
        except Exception:
            # Still active (a dead peer's transfer NIXL cannot cancel yet): keep it
            # referenced and try again at close, never free memory it may touch.
            self._stuck.append(req)

    def close(self) -> None:
        self._release_kept()
        for req in self._stuck:
            try:
                self._agent.releaseXferReq(req)
            except Exception:
                logger.debug("nixl: a transfer request could not be released at close", exc_info=True)
        self._stuck.clear()
        # The agent (its progress thread, UCX workers) goes with the last reference.
        self._agent = None
