"""The ``shm`` backend: same-host transfer through a pre-faulted shared-memory arena.

How a payload travels::

    sender process                                        receiver process(es)
    --------------                                        --------------------
    prepare(payload) -> n bytes
    allocate a 64-byte aligned block in OUR arena
    (full? wait on our "space" semaphore: backpressure)
    encode_into(block)            -- the one copy --
    mutex: descriptor WRITTEN, log += (seq -> desc),
           post the wake semaphore once per waiter  ---->  woken; mutex: read the log,
                                                           claim the key (WRITTEN -> CLAIMED)
                                                           decode(lease): zero-copy views
                                                           ... last view dies (or release(key))
    next put: mutex: drain the released ring     <-----   mutex: CLAIMED -> RELEASED,
              blocks back to the allocator                  push on the released ring

See ``omnilink.connectors.shm.segments`` for the byte layouts of the arena and the
control segment and the descriptor state machine, and ``omnilink.connectors.shmem``
for the names.

Guarantees
----------
- Key contract: a second ``put`` of a key this sender still has unclaimed raises
  ``DuplicateKeyError``; a ``get`` of a key this receiver consumed or discarded (the
  last 65,536) raises ``KeyConsumedError``. Two sender processes that put one key both
  deliver (one per ``get``): no sender sees the other's keys.
- Each key is delivered to exactly one receiver, whichever process it runs in; keys are
  consumed in any order and a missing key never stalls the others.
- A payload published before its sender died stays readable by a receiver that had
  already mapped that sender's arena; a key that was never published becomes
  ``PeerLostError`` once no live sender remains on the channel (checked every
  ``HEARTBEAT_S`` while waiting), never a hang.
- Blocks claimed by a receiver that died are reclaimed by the sender once the
  claimer's pid is gone. ``close()`` removes every segment and semaphore the process
  created; ``collect_garbage`` (``omnilink gc``, and every connector's start-up) removes
  what dead processes left behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from threading import get_ident
from time import monotonic as _monotonic
from time import perf_counter_ns as _clock
from typing import Any

from omnilink._errors import (
    CapacityError,
    ClosedError,
    ConfigurationError,
    KeyConsumedError,
    PeerLostError,
    TransportError,
    WouldBlock,
)
from omnilink._util import (
    MAX_KEY_BYTES,
    NO_WAIT,
    SPIN_GROWTH,
    ConsumedKeys,
    Deadline,
    duplicate_key,
    next_spin,
    validate_key,
)
from omnilink.blob import _MISS, _decode_fast, _device_views
from omnilink.blob import decode as _decode
from omnilink.blob import prepare as _prepare
from omnilink.connectors.base import BaseConnector, Role, _keys_text, check_constructor_options
from omnilink.connectors.shm.gc import collect_garbage
from omnilink.connectors.shm.gpu import SMALL_DEVICE_BYTES
from omnilink.connectors.shm.ipc import FELL_BACK, IPC_MARK, IPC_MIN_BYTES, DeviceIpcRoute
from omnilink.connectors.shm.ipc import MODES as IPC_MODES
from omnilink.connectors.shm.slices import SLICED_MARK
from omnilink.connectors.shm.segments import (
    FLAG_EXTENSION,
    FLAG_OVERFLOW,
    MUTEX_GRACE_S,
    ROLE_RECV,
    ROLE_SEND,
    ArenaReader,
    ArenaWriter,
    Channel,
    _LockTimeout,
    _OutRec,
    out_rec,
)
from omnilink.connectors.shmem import (
    PAGE,
    create_segment,
    free_shm_bytes,
    new_token,
    overflow_name,
    pid_alive,
    read_prefix,
    round_up,
    unlink_segment,
)
from omnilink.cuda import StagePayloadHandle

__all__ = ["DEFAULT_ARENA_BYTES", "ShmConnector"]

logger = logging.getLogger(__name__)

#: Default size of a sender's arena. Big enough to keep several 16-32 MiB hidden-state
#: chunks in flight. Where ``/dev/shm`` is small (Docker's default is 64 MB) a sender
#: that was not given ``arena_bytes`` starts smaller instead (see ``_auto_arena_bytes``).
DEFAULT_ARENA_BYTES = 128 << 20
DEFAULT_MAX_INFLIGHT = 1024
DEFAULT_LINGER_S = 5.0
#: Microseconds a receiver watches the wake semaphore before it sleeps on it (see
#: ``spin_us``): long enough to cover a sender that encodes and publishes right after the
#: receiver started waiting, short enough to cost little CPU when nothing comes.
DEFAULT_SPIN_US = 200
#: CUDA payloads with at least this many device bytes travel in slices (see gpu.py).
DEFAULT_PIPELINE_BYTES = 16 << 20
DEFAULT_SLICE_BYTES = 16 << 20
#: Device IPC (ipc.py): the receiver's device pool, and the least CUDA bytes of a
#: payload that take that route in "auto" where device IPC is not faster at every size
#: (``ipc_min_bytes=None``, the default, picks it or 0: see ``DeviceIpcRoute.min_bytes_for``).
#: Below it the host path was faster on one H100 shared by two processes without MPS
#: (8 MiB: 32.5 GB/s host-staged, 23.4 by device IPC; 16 MiB: 27.5 against 45.4; each
#: device-IPC message makes both processes' contexts take a turn on the GPU).
DEFAULT_IPC_POOL_BYTES = 256 << 20
DEFAULT_IPC_MIN_BYTES = IPC_MIN_BYTES
#: A device-IPC message's frame names IPC_MARK in its header, within this many bytes.
_IPC_PEEK = 512
_IPC_MARK_BYTES = IPC_MARK.encode("ascii")
#: Seconds between liveness checks of the peers while waiting (a heartbeat, not polling:
#: the data path is always woken by a semaphore).
HEARTBEAT_S = 0.25
_MIN_ARENA_BYTES = 1 << 20
#: Seconds an extension segment of the arena stays empty before it is given back.
DEFAULT_SHRINK_AFTER_S = 10.0
#: Default ``max_bytes``: this many times ``arena_bytes`` at most, and at most this share
#: of the free space of ``/dev/shm`` when the sender opens (never below ``arena_bytes``).
_DEFAULT_GROWTH = 8
_DEFAULT_SHM_SHARE = 4


#: An arena sized automatically starts at most at this share of the free space of
#: ``/dev/shm`` and may grow up to ``_AUTO_MAX_SHARE`` of it: a default container (64 MiB)
#: gets a 16 MiB arena growing to 32 MiB, and a second sender on the host still fits.
_AUTO_SHM_SHARE = 4
_AUTO_MAX_SHARE = 2


def _auto_arena_bytes() -> int:
    """The arena of a sender not given ``arena_bytes``: ``DEFAULT_ARENA_BYTES``, or a
    quarter of the free space of ``/dev/shm`` in whole MiB where that is less (never
    below the 1 MiB minimum: the arena's creation then says how to give it room)."""
    fit = (free_shm_bytes() // _AUTO_SHM_SHARE) >> 20 << 20
    return max(_MIN_ARENA_BYTES, min(DEFAULT_ARENA_BYTES, fit))


def _max_bytes(arena_bytes: int, max_bytes: int | None, *, auto: bool = False) -> int:
    """The arena's ceiling: ``max_bytes`` as given (warning when ``/dev/shm`` cannot hold
    it now: ``put`` then waits for receivers instead of growing), or the default; for an
    arena sized automatically, the default of ``DEFAULT_ARENA_BYTES`` within half of
    what is free."""
    free = free_shm_bytes()
    if max_bytes is None and auto:
        return max(arena_bytes, min(_DEFAULT_GROWTH * DEFAULT_ARENA_BYTES, free // _AUTO_MAX_SHARE))
    if max_bytes is None:
        return max(arena_bytes, min(_DEFAULT_GROWTH * arena_bytes, free // _DEFAULT_SHM_SHARE))
    if max_bytes > free:
        logger.warning(
            "shm: max_bytes=%d but /dev/shm has only %d bytes free; the arena grows only as far "
            "as /dev/shm allows, then put waits for receivers", max_bytes, free,
        )
    return max_bytes

try:  # numpy arrays support weak references and make a cheap per-message exporter
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is a dependency
    _np = None


#: ``_land``: no payload decoded yet (``None`` is a payload)
_UNSET = object()


def _grace(deadline: Deadline) -> Deadline | None:
    """How long to wait for the channel mutex in a call bounded by ``deadline`` (see
    ``Channel.lock_within``)."""
    left = deadline.remaining()
    if left is None:
        return None
    return Deadline(max(left, MUTEX_GRACE_S))


def _make_lease(mm: Any, offset: int, length: int) -> Any:
    """A fresh exporter object over ``mm[offset:offset+length]`` (an overflow segment):
    decode's views keep it alive, so a weak reference to it dies with the last view.
    ``length`` comes from a descriptor another process can write: cut to the mapping
    (the decoder then reports a frame longer than its bytes)."""
    return _np.frombuffer(mm, dtype=_np.uint8, count=max(0, min(length, len(mm) - offset)), offset=offset)


class _LaneHit(tuple):
    """A claim record of a message read from a device pool's lane (``devpool.lane``):
    ``(None, -1, -1, 0, record bytes, message)``, in the shape of an arena claim (its
    byte count at ``[4]``); the message is already decoded."""

    __slots__ = ()


class _Lease(weakref.ref):
    """A weak reference to the exporter object of one received payload, carrying what
    releasing its block takes. Its callback (the connector's ``_Releaser``) runs when the
    last view of the payload dies; ``release(key)`` runs it early. One small object per
    message: no closure, no ``weakref.finalize`` registry."""

    __slots__ = ("reader", "idx", "seq", "nbytes", "key", "since")


class _Releaser:
    """Hands blocks back to their sender (CLAIMED -> RELEASED under the channel mutex).

    Shared by all leases of one connector; it holds only what a release needs (not the
    connector), so views may outlive ``close()``.
    """

    __slots__ = ("chan", "pid", "live", "nbytes", "callback", "__weakref__")

    def __init__(self, chan: Channel, pid: int) -> None:
        self.chan = chan
        self.pid = pid
        #: the leases' weakref callback: a bound method is called faster than an
        #: instance's ``__call__``
        self.callback = self.release
        #: ``id(lease) -> lease`` of the payloads this process still views (a lease
        #: leaves when it is released, so its id is never reused while listed)
        self.live: dict[int, _Lease] = {}
        self.nbytes = 0  # bytes of those payloads

    def track(self, lease_obj: Any, reader: ArenaReader, idx: int, seq: int, nbytes: int, key: str) -> _Lease:
        ref = _Lease(lease_obj, self.callback)
        ref.reader = reader
        ref.idx = idx
        ref.seq = seq
        ref.nbytes = nbytes
        ref.key = key
        ref.since = _monotonic()
        self.live[id(ref)] = ref
        self.nbytes += nbytes
        return ref

    def held(self, key: str | None = None) -> list[_Lease]:
        """The leases still viewed (of ``key`` only, when given)."""
        refs = list(self.live.values())
        return refs if key is None else [r for r in refs if r.key == key]

    def __call__(self, ref: _Lease) -> None:
        self.release(ref)

    def release(self, ref: _Lease) -> None:
        """Release ``ref``'s block (its weakref callback, or an early ``release``)."""
        if self.live.pop(id(ref), None) is None:
            return  # released already
        self.nbytes -= ref.nbytes
        chan = self.chan
        reader, idx, seq, pid = ref.reader, ref.idx, ref.seq, self.pid
        if chan.owner_tid and chan.owner_tid == get_ident():
            # The garbage collector ran this inside our own critical section: the mutex
            # is not reentrant, so finish the release just before this thread unlocks.
            chan.defer(lambda: reader.mark_released(idx, seq, pid))
            return
        try:
            chan.lock()
            try:
                reader.mark_released(idx, seq, pid)
            finally:
                chan.unlock()
        except Exception:  # a finalizer must not raise; the sender still reclaims at our exit
            logger.exception("shm: releasing block %d of %s failed", idx, reader.name)


def _trim_loop(ref: weakref.ref, stop: threading.Event, shrink_after: float) -> None:
    """Body of a sender's trimmer thread: while its arena has extension segments, give
    back those that have been empty for ``shrink_after`` seconds. Holds the connector
    only weakly (and only during a round), so it never keeps it alive."""
    step = min(max(shrink_after / 4, 0.02), 1.0)
    while not stop.wait(step):
        conn = ref()
        if conn is None:
            return
        try:
            more = conn._trim()
        except Exception:  # a background thread must not die silently
            logger.exception("shm: giving back idle arena extensions failed")
            more = True
        del conn
        if not more:
            return


def _cleanup(writer: ArenaWriter | None, chan: Channel) -> None:
    """Remove what this connector created (also run if it is garbage-collected unclosed)."""
    try:
        if writer is not None:
            try:
                with chan.locked():
                    writer.mark_closed()
            except Exception:  # pragma: no cover - best effort on a broken channel
                logger.exception("shm: marking arena %s closed failed", writer.name)
        chan.leave()
    finally:
        if writer is not None:
            writer.close()


_gpu_ok: bool | None = None


def _is_cuda(device: Any) -> bool:
    """Whether ``device`` names a CUDA device (``"cuda"``, ``"cuda:1"``, a torch.device)."""
    return str(getattr(device, "type", device)).split(":", 1)[0] == "cuda"


#: A ``get_nowait`` miss gives the CPU away (``sched_yield``): a receiver polling in a
#: tight loop, as vLLM-Omni's stage runners do, then lets the sender run first when the
#: host has more runnable threads than cores (measured by benchmarks/bench_small.py:
#: with ten runnable threads on two cores, 8 MiB put -> consumed took 1.6-2.1x as long
#: with a polling receiver as with a blocking one without the yield, 0.7-1.0x with it).
_yield = getattr(os, "sched_yield", lambda: None)


def _gpu_path_available() -> bool:
    """Whether the GPU path can run (cuda-python importable); says once when it cannot."""
    global _gpu_ok
    if _gpu_ok is None:
        from omnilink.cuda import have_cuda_ops
        from omnilink.cuda import CUDA_INSTALL_HINT

        _gpu_ok = have_cuda_ops()
        if not _gpu_ok:
            logger.warning("shm: CUDA tensors take the host path (a synchronous copy at each end); "
                           "for DMA straight into the arena: %s", CUDA_INSTALL_HINT)
    return _gpu_ok


def _check_values(
    *,
    arena_bytes: Any,
    max_inflight: Any,
    overflow: Any,
    linger: Any,
    spin_us: Any,
    pipeline_bytes: Any,
    slice_bytes: Any,
    max_bytes: Any,
    shrink_after: Any,
    reclaim_after: Any,
    device_ipc: Any,
    ipc_pool_bytes: Any,
    ipc_min_bytes: Any,
    ipc_pool_max_bytes: Any = None,
) -> None:
    """The value checks of ``ShmConnector``'s options (its constructor and its
    ``check_options`` both call this): what holds on any machine, opening nothing.

    ``arena_bytes=None`` (sized from the free ``/dev/shm`` when the sender opens) is
    never below the minimum nor above a given ``max_bytes``, so ``max_bytes`` is then
    held to the minimum arena only.

    Raises
    ------
    ConfigurationError
        The first option out of its range or of the wrong type, named.
    """
    if device_ipc not in IPC_MODES:
        raise ConfigurationError(f"device_ipc must be one of {IPC_MODES}, got {device_ipc!r}")
    for name, value, lo in (("ipc_pool_bytes", ipc_pool_bytes, 1 << 20), ("ipc_min_bytes", ipc_min_bytes, 0)):
        if name == "ipc_min_bytes" and value is None:
            continue  # automatic (see DeviceIpcRoute.min_bytes_for)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ConfigurationError(f"{name} must be an int >= {lo}, got {value!r}")
    if ipc_pool_max_bytes is not None and (isinstance(ipc_pool_max_bytes, bool)
                                           or not isinstance(ipc_pool_max_bytes, int)
                                           or ipc_pool_max_bytes < 1 << 20):
        raise ConfigurationError(f"ipc_pool_max_bytes must be None or an int >= {1 << 20}, "
                                 f"got {ipc_pool_max_bytes!r}")
    if arena_bytes is not None and (
        isinstance(arena_bytes, bool) or not isinstance(arena_bytes, int) or arena_bytes < _MIN_ARENA_BYTES
    ):
        raise ConfigurationError(f"arena_bytes must be an int >= {_MIN_ARENA_BYTES}, got {arena_bytes!r}")
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or not 1 <= max_inflight <= 65536:
        raise ConfigurationError(f"max_inflight must be an int in [1, 65536], got {max_inflight!r}")
    if overflow not in ("segment", "error"):
        raise ConfigurationError(f"overflow must be 'segment' or 'error', got {overflow!r}")
    if isinstance(spin_us, bool) or not isinstance(spin_us, int) or not 0 <= spin_us <= 100_000:
        raise ConfigurationError(f"spin_us must be an int in [0, 100000], got {spin_us!r}")
    for name, value in (("pipeline_bytes", pipeline_bytes), ("slice_bytes", slice_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 4096:
            raise ConfigurationError(f"{name} must be an int >= 4096, got {value!r}")
    for name, value in (("linger", linger), ("shrink_after", shrink_after)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigurationError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if reclaim_after is not None and (
        isinstance(reclaim_after, bool) or not isinstance(reclaim_after, (int, float)) or not reclaim_after >= 0
    ):
        raise ConfigurationError(f"reclaim_after must be a number of seconds >= 0 or None, got {reclaim_after!r}")
    floor = _MIN_ARENA_BYTES if arena_bytes is None else arena_bytes
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < floor):
        bound = "the smallest arena" if arena_bytes is None else "arena_bytes"
        raise ConfigurationError(f"max_bytes must be an int >= {bound} ({floor}) or None, got {max_bytes!r}")


class ShmConnector(BaseConnector):
    """Same-host connector over POSIX shared memory (backend ``"shm"``).

    Parameters
    ----------
    channel : str
        Channel name (``job1/thinker-talker``); senders and receivers of one channel
        find each other through it, in any start order.
    role : {"sender", "receiver", "dual"}
        A sender owns an arena; a receiver maps the arenas of every sender of the
        channel; ``"dual"`` does both (and receives its own puts too).
    timeout : float, optional
        Default timeout of blocking calls (``None``: no limit).
    arena_bytes : int, optional
        Size of this sender's arena in ``/dev/shm``, reserved and pre-faulted at
        creation; ``/dev/shm`` free space is checked first. Default: 128 MiB, or a
        quarter of the free space of ``/dev/shm`` (whole MiB, at least 1 MiB) where
        that is less, so a sender fits a default container's 64 MiB; such an arena may
        grow up to 1 GiB within half of the free space (see ``max_bytes``), and a
        payload larger than the arena takes an overflow segment. Only a payload that
        ``/dev/shm`` cannot hold at all is an error (``CapacityError``).
    max_inflight : int
        Descriptors in the arena (default 1024): payloads published and not yet
        released; a sender with none left waits like one with a full arena.
    overflow : {"segment", "error"}
        What ``put`` does with a payload larger than the arena: send it through a
        dedicated segment created for it (counted in ``stats().fallbacks``), or raise
        ``CapacityError``.
    linger : float
        Seconds ``close()`` of a sender waits for live receivers to claim what it
        published (default 5.0). Payloads still unclaimed then are dropped, except for
        receivers that already mapped this sender's arena.
    spin_us : int
        Microseconds a waiting ``get`` watches the wake semaphore before sleeping on it
        (default 200; 0 sleeps at once). Waking a sleeping process costs tens to hundreds
        of microseconds on virtual machines; a payload published within the spin is
        picked up in about one. The spin adapts: when payloads have lately arrived a
        little after it ended, it grows to twice their typical wait, up to
        ``SPIN_GROWTH`` (10) x ``spin_us``; when they come later than that, or not at
        all, it falls back to ``spin_us``. Past the first ``spin_us`` the spinning
        thread yields the CPU at every look (``sched_yield``), so the extension only
        takes time no other runnable thread wants. The cost is up to the current spin of
        CPU per ``get`` that has to wait.
    device_ipc : {"auto", "on", "off"}
        CUDA payloads device to device when both ends are GPU processes of this host
        (a device pool the receiver owns, as the ``cuda_ipc`` backend's, opened by this
        connector itself with no other channel; see "GPU payloads").
        ``"auto"`` (default): a receiver opens a device pool (``ipc_pool_bytes``) at
        its first ``get(device="cuda:k")`` if it is the channel's only receiver; a
        sender then sends payloads with at least ``ipc_min_bytes`` of CUDA tensors into
        it when its devices can reach the pool's, and everything else (and whatever the
        route cannot take at once: a full pool, a second sender) by the host path.
        ``"on"``: the receiver opens its pool now (``ipc_device``; ``CudaError`` if it
        cannot) and senders route CUDA payloads of any size. ``"off"``: the host path
        only. ``stats()`` counts ``ipc_puts`` / ``ipc_gets`` apart from
        ``device_puts`` / ``device_gets`` (host-staged DMA).
    ipc_pool_bytes : int
        Receiver: size of the device pool as it opens (default 256 MiB of GPU memory). It
        grows by segments for a payload larger than it, or when the payloads the
        receiver still views fill it, and gives idle segments back.
    ipc_pool_max_bytes : int, optional
        Receiver: the most the device pool may grow to (default ``None``:
        ``ipc_pool_bytes`` plus 3/4 of the GPU memory free when it opens). A payload that
        would need more takes the host path (``stats().ipc_fallbacks``, with the sizes in
        ``ipc_fallback_reason``).
    ipc_min_bytes : int, optional
        Sender, ``"auto"``: least CUDA bytes of a payload for device IPC. Default
        ``None``: every size while an MPS server serves the host (device IPC is faster
        there, on the pool's GPU and across two GPUs) or the sender is on another GPU
        than the pool's, else 16 MiB (below it the host path was faster on one GPU that
        two processes time-slice).
    ipc_device : str, optional
        Receiver, ``"on"``: the pool's device (default: the current CUDA device).
    pipeline_bytes : int
        Payloads holding at least this many bytes of CUDA tensors (default 16 MiB) are
        sent in slices, so the receiver copies early slices to its device while later
        ones are still coming off the sender's (see "GPU payloads" below).
    slice_bytes : int
        Size of one slice (default 16 MiB).
    max_bytes : int, optional
        Ceiling of the arena with its extension segments. Receivers may keep the views
        of what they got (engines keep a request's inputs for its lifetime); when those
        fill the arena, ``put`` adds a pre-faulted extension segment (as large as the
        arena) instead of waiting, up to ``max_bytes`` in all, and waits only beyond it
        (backpressure). Payloads nobody has claimed yet never grow the arena: a slow
        reader still meets backpressure at ``arena_bytes``. Default: 8 x
        ``arena_bytes``, at most a quarter of the free space of ``/dev/shm`` when the
        sender opens, never below ``arena_bytes``. Pass ``max_bytes=arena_bytes`` for a
        fixed arena.
    shrink_after : float
        Seconds an extension segment stays empty before it is given back (default 10).
        ``stats()`` shows ``segments``, ``bytes_mapped`` and ``bytes_held``.
    reclaim_after : float, optional
        Seconds after which an unread payload may be reclaimed (default ``None``: never).
        When a ``put`` finds the arena full, before it grows the arena or waits it drops
        payloads of this sender that no receiver has claimed, that were published more
        than ``reclaim_after`` seconds ago and that the receivers have read past (a
        payload published after them was claimed), oldest first, only as many as the new
        payload needs. Each is logged (key and age) and counted in ``stats().reclaimed``.
        Set it to how long a live receiver may take to read a payload at most (an
        engine's input wait timeout): payloads left behind that long belong to abandoned
        requests. A receiver that is stalled, or behind and reading in publication order,
        has read past none of what it still has to read, so it loses nothing. One that
        catches up on a backlog out of order (many streams side by side) must do so
        within ``reclaim_after``.

    Raises
    ------
    ConfigurationError
        Invalid channel, role, timeout or option, or a bad ``OMNILINK_SHM_PREFIX``.
    CapacityError
        ``/dev/shm`` has too little free space for the arena (the message says how to
        give it more), or the channel already has 64 participants.

    Notes
    -----
    Payloads received are zero-copy views of the sender's arena. The block is handed
    back when the last view dies, or at once by ``release(key)``. A ``get_nowait`` of a
    key that is not there takes no lock: it compares each sender's publication counter
    with what this receiver has read, and yields the CPU before it raises
    ``WouldBlock``, so a receiver polling in a tight loop does not slow the senders
    down.

    A ``put`` that has to wait for space while every receiver it has known on the
    channel has died raises ``PeerLostError`` instead of waiting out its timeout; the
    unread payloads stay in the arena (a receiver that joins later may still claim them)
    until ``reclaim_unread`` or ``reclaim_after`` drops them.
    """

    backend = "shm"

    @classmethod
    def check_options(cls, options: dict[str, Any], /) -> None:
        """Refuse, opening nothing, the option values the constructor would refuse.

        The hook ``omnilink.connectors.check_backend_options`` calls (so does the
        vLLM-Omni adapter at construction, for either role). What depends on the
        machine (the free space of ``/dev/shm``, a CUDA device) is left to the
        constructor and to ``omnilink check``.

        Parameters
        ----------
        options : dict
            Keyword options as ``connect`` would receive them.

        Raises
        ------
        ConfigurationError
            ``role`` or ``timeout`` invalid; ``arena_bytes`` below 1 MiB; ``max_inflight``
            outside [1, 65536]; ``overflow`` not ``"segment"``/``"error"``; ``spin_us``
            outside [0, 100000]; ``pipeline_bytes`` or ``slice_bytes`` below 4096;
            ``linger``, ``shrink_after`` or ``reclaim_after`` not a number >= 0;
            ``max_bytes`` below ``arena_bytes`` (or below 1 MiB); ``device_ipc`` not one
            of ``"auto"``, ``"on"``, ``"off"``; ``ipc_pool_bytes`` below 1 MiB,
            ``ipc_pool_max_bytes`` neither ``None`` nor an int >= 1 MiB, or
            ``ipc_min_bytes`` below 0.
        """
        check_constructor_options(cls, _check_values, options)

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
        arena_bytes: int | None = None,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        overflow: str = "segment",
        linger: float = DEFAULT_LINGER_S,
        spin_us: int = DEFAULT_SPIN_US,
        pipeline_bytes: int = DEFAULT_PIPELINE_BYTES,
        slice_bytes: int = DEFAULT_SLICE_BYTES,
        max_bytes: int | None = None,
        shrink_after: float = DEFAULT_SHRINK_AFTER_S,
        reclaim_after: float | None = None,
        device_ipc: str = "auto",
        ipc_pool_bytes: int = DEFAULT_IPC_POOL_BYTES,
        ipc_min_bytes: int | None = None,
        ipc_device: Any = None,
        ipc_pool_max_bytes: int | None = None,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(
            arena_bytes=arena_bytes, max_inflight=max_inflight, overflow=overflow, linger=linger,
            spin_us=spin_us, pipeline_bytes=pipeline_bytes, slice_bytes=slice_bytes, max_bytes=max_bytes,
            shrink_after=shrink_after, reclaim_after=reclaim_after, device_ipc=device_ipc,
            ipc_pool_bytes=ipc_pool_bytes, ipc_min_bytes=ipc_min_bytes, ipc_pool_max_bytes=ipc_pool_max_bytes,
        )
        auto_arena = arena_bytes is None
        if arena_bytes is None:
            arena_bytes = _auto_arena_bytes() if role in ("sender", "dual") else DEFAULT_ARENA_BYTES
            if max_bytes is not None:
                arena_bytes = min(arena_bytes, max_bytes)  # a given ceiling bounds the start too
        self.reclaim_after = None if reclaim_after is None else float(reclaim_after)
        if role in ("sender", "dual"):
            max_bytes = _max_bytes(arena_bytes, max_bytes, auto=auto_arena)
        self.max_bytes = max_bytes if max_bytes is not None else arena_bytes
        self.shrink_after = float(shrink_after)
        self.arena_bytes = arena_bytes
        self.overflow = overflow
        self.linger = linger
        self.spin_us = spin_us
        self._spin_ns = spin_us * 1000  # the spin now (adaptive, see _adapt_spin)
        self._spin_min_ns = spin_us * 1000
        self._spin_max_ns = spin_us * 1000 * SPIN_GROWTH
        self._arrival_ns = spin_us * 1000  # typical wait until a wake-up (EWMA)
        self._prefix = read_prefix()
        self._pid = os.getpid()
        self._token = new_token()
        self._sends = role in ("sender", "dual")
        self._recvs = role in ("receiver", "dual")
        # Start-up garbage collection: leftovers of dead processes under our prefix.
        try:
            collect_garbage(prefix=self._prefix)
        except OSError as exc:  # pragma: no cover - /dev/shm unreadable: not fatal here
            logger.warning("shm: start-up garbage collection failed: %s", exc)
        self._writer = (
            ArenaWriter(self._prefix, self._pid, self._token, arena_bytes, max_inflight, channel=self.channel)
            if self._sends
            else None
        )
        self._chan = Channel(self._prefix, self.channel)
        try:
            self._chan.join((ROLE_SEND if self._sends else 0) | (ROLE_RECV if self._recvs else 0), self._token)
        except BaseException:
            if self._writer is not None:
                self._writer.close()
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._writer, self._chan)
        self._slock = threading.Lock()  # sender-local state: allocator, descriptors
        self._rlock = threading.Lock()  # receiver-local state: readers, index
        self._index: dict[str, list[Any]] = {}
        #: the receiving end of a device pool's lane whose messages this channel's
        #: receiver takes as its own (``attach_lane``), and what it read from it not yet
        #: claimed: key -> (message, record bytes)
        self._lane: Any = None
        self._lane_drop: Any = None
        self._lane_index: dict[str, tuple[Any, int]] = {}
        # Sender: key -> descriptor of our latest put of it (duplicate-put check).
        self._sent: dict[str, int] = {}
        self._sent_limit = 2 * max_inflight + 64
        #: puts, bytes put by ``_put``'s arena path (counted under ``_slock``), and
        #: gets, bytes got by ``_get`` (under ``_rlock``): see ``_add_counts``
        self._sc = [0, 0]
        self._rc = [0, 0]
        # Receiver: keys this connector consumed or discarded (KeyConsumedError).
        self._consumed = ConsumedKeys()
        self._readers: dict[tuple[int, str], ArenaReader] = {}
        self._departed: list[ArenaReader] = []
        self._known_gen = -1
        self._index_limit = 4096
        self._releaser = _Releaser(self._chan, self._pid)
        self._last_beat = time.monotonic()
        self._peer_lost: str | None = None
        self._gpu: Any = None  # the CUDA path (gpu.py), made on first use
        self.pipeline_bytes = pipeline_bytes
        self.slice_bytes = slice_bytes
        self._grow_failed = False
        self._trimmer: threading.Thread | None = None
        self._trim_event = threading.Event()
        #: the readers, as a tuple the lock-free miss check can iterate while
        #: ``_refresh_locked`` replaces it
        self._reader_list: tuple[ArenaReader, ...] = ()
        #: pids of other receivers this sender has seen alive / seen reaped as dead
        self._receivers_seen: set[int] = set()
        self._receivers_dead: set[int] = set()
        #: the device-IPC route (ipc.py): CUDA payloads GPU to GPU when both ends can
        self._ipc: DeviceIpcRoute | None = None
        if device_ipc != "off":
            try:
                self._ipc = DeviceIpcRoute(self, device_ipc, ipc_pool_bytes, ipc_min_bytes, ipc_device,
                                           pool_max_bytes=ipc_pool_max_bytes)
            except BaseException:
                self.close()
                raise

    # ================================================================= sending
    def put(self, key: str, payload: Any, /, *, timeout: float | None = None) -> int:
        if self._closed:
            self._check_open()
        if type(key) is not str or not key.isascii() or not 0 < len(key) <= MAX_KEY_BYTES or "\x00" in key:
            validate_key(key)  # the general check (raises, or passes a non-ASCII key)
        return self._put(key, payload, None if timeout is None else Deadline(timeout), count=True)

    put.__doc__ = BaseConnector.put.__doc__

    def _put(self, key: str, payload: Any, deadline: Deadline | None, events: Any = None, *,
             count: bool = False) -> int:
        """Send ``payload``; ``deadline`` ``None``: the connector's timeout, from now.
        With ``count`` the put is counted (``puts``, ``bytes_put``) too."""
        w = self._writer
        if w is None:
            raise self._cannot_put()
        ipc = self._ipc
        host_only = False
        if ipc is not None and ipc.routes_first():
            # Device IPC takes every payload on one GPU (the pool's, or one that reaches
            # it): it walks the payload once and sizes it after the copy is queued, no
            # tensor_blob walk first.
            if deadline is None:
                deadline = Deadline.after(self.timeout)
            sent = ipc.put_first(key, payload, deadline, events)
            if sent is not None and sent is not FELL_BACK:
                if count:
                    self._count_op("puts", "bytes_put", sent)
                return sent
            host_only = sent is FELL_BACK
        blob = _prepare(payload)
        n = blob.nbytes
        if blob._on_device or self._gpu is not None or n > w.data_bytes:
            if deadline is None:
                deadline = Deadline.after(self.timeout)
            n = self._put_other(key, payload, blob, deadline, events, host_only)
            if count:
                self._count_op("puts", "bytes_put", n)
            return n
        return self._put_arena(key, key.encode("utf-8"), blob, deadline, count=count)

    def _put_other(self, key: str, payload: Any, blob: Any, deadline: Deadline, events: Any,
                   host_only: bool = False) -> int:
        """``_put`` of a payload holding CUDA tensors (the GPU path), or larger than the
        arena (an overflow segment). ``host_only``: device IPC already could not take it."""
        w = self._writer
        n = blob.nbytes
        dev_bytes = blob.device_bytes()
        if (dev_bytes and _gpu_path_available()) or (self._gpu is not None and self._gpu.cpu_mode):
            ipc = self._ipc
            if ipc is not None and dev_bytes and not host_only:
                # Both ends GPU processes of this host: device to device, if it can.
                sent = ipc.put(key, payload, blob, deadline, events)
                if sent is not None:
                    return sent
            gpu = self._gpu_path()
            if dev_bytes >= self.pipeline_bytes or gpu.cpu_mode or n > w.data_bytes:
                # Large CUDA payloads: DMA straight into the arena in slices.
                return gpu.put(key, payload, blob, deadline, events)
            # One copy per tensor straight into the page-locked block (on the current
            # stream for put, the copy stream for put_async), one wait for them.
            return gpu.put_direct(key, blob, deadline, events)
        key_bytes = key.encode("utf-8")
        if n > w.data_bytes:
            return self._put_overflow(key, key_bytes, blob, deadline)
        return self._put_arena(key, key_bytes, blob, deadline)

    def _put_arena(self, key: str, key_bytes: bytes, blob: Any, deadline: Deadline | None, *,
                   count: bool = False) -> int:
        """A host payload into a block of the arena (or an extension). ``deadline``
        ``None``: the connector's timeout, from when a wait begins. With ``count`` the
        put is counted (``puts``, ``bytes_put``) too."""
        slock = self._slock
        slock.acquire()
        try:
            if self._closed:
                self._check_open()
            if key in self._sent:
                self._check_not_pending(key)
            block = self._fill(key, key_bytes, blob, deadline)
            self._publish((block,), deadline)
            written = block[5]
            if count:
                c = self._sc
                c[0] += 1
                c[1] += written
        finally:
            slock.release()
        return written

    def _fill(self, key: str, key_bytes: bytes, blob: Any, deadline: Deadline | None,
              before_wait: Any = None) -> tuple[Any, ...]:
        """Take a block for ``blob`` and write it there (holds ``_slock``): ``(key,
        key_bytes, space, offset, descriptor, bytes written)``, for ``_publish``.

        Fast path: a descriptor and a block of the arena are free without waiting.
        Otherwise ``before_wait()`` runs first (a batch publishes what it has filled, so
        that receivers can free room), then ``_reserve`` finds room or waits for it
        (backpressure)."""
        w = self._writer
        n = blob.nbytes
        space = w.primary
        free_desc = w.free_desc
        alloc = space.alloc
        off = alloc.alloc(n) if free_desc else None
        if off is None:
            if before_wait is not None:
                before_wait()
            space, off, idx = self._reserve(key, n, deadline or Deadline.after(self.timeout))
            alloc = space.alloc
        else:
            idx = free_desc.pop()
        try:
            written = blob.write_at(space.view, space.base + off, space.addr)
        except BaseException:
            alloc.free(off)
            free_desc.append(idx)
            raise
        return (key, key_bytes, space, off, idx, written)

    def _publish(self, blocks: Any, deadline: Deadline | None) -> None:
        """Publish filled blocks (``_fill``'s records; holds ``_slock``) in order under
        one hold of the channel mutex, and wake the receivers once. If the mutex cannot
        be had in time, every block goes back and ``TransferTimeout`` is raised: none of
        them is published."""
        w, chan = self._writer, self._chan
        if not chan.try_lock():
            if deadline is None:
                deadline = Deadline.after(self.timeout)
            if not chan.lock_within(deadline):
                self._unstage(blocks)
                raise self._timeout("put", blocks[0][0], "the channel mutex", deadline.timeout)
        sent = self._sent
        try:
            publish = w.publish
            for key, key_bytes, space, off, idx, written in blocks:
                publish(idx, key_bytes, out_rec(key, off, space.alloc.size_of(off), space), written,
                        space.flags, space.token)
                sent[key] = idx  # ``_remember_sent``
            chan.notify_all()
            w.drain()
        finally:
            chan.unlock()
        if len(sent) > self._sent_limit:
            self._prune_sent()

    def _unstage(self, blocks: Any) -> None:
        """Give filled blocks that were not published back (holds ``_slock``)."""
        free_desc = self._writer.free_desc
        for _key, _key_bytes, space, off, idx, _written in blocks:
            space.alloc.free(off)
            free_desc.append(idx)

    def _put_many(self, keys: list[str], payloads: list[Any], deadline: Deadline) -> list[int]:
        """The batch path: every payload is encoded (planned) first; then each run of
        host payloads that fit the arena is written into its blocks and published
        together (``_put_run``: one hold of the channel mutex, one wake-up), and a
        payload holding CUDA tensors or larger than the arena takes ``put``'s path in
        its turn."""
        w = self._writer
        sizes: list[int] = []
        try:
            if w is None:
                raise self._cannot_put()
            blobs = [_prepare(p) for p in payloads]
            with self._slock:
                self._check_open()
                sent = self._sent
                for key in keys:  # every pending key is refused before anything is sent
                    if key in sent:
                        self._check_not_pending(key)
            limit = w.data_bytes
            i, end = 0, len(keys)
            while i < end:
                # A run of host payloads that fit the arena (none in the GPU path's test
                # mode, where every payload takes put's own path).
                j = i
                gpu = self._gpu
                if gpu is None or not gpu.cpu_mode:
                    while j < end and not blobs[j]._on_device and blobs[j].nbytes <= limit:
                        j += 1
                if j > i:
                    self._put_run(keys, blobs, i, j, deadline, sizes)
                    i = j
                    continue
                n = self._put_other(keys[i], payloads[i], blobs[i], deadline, None)
                self._count_op("puts", "bytes_put", n)
                sizes.append(n)
                i += 1
        except Exception as exc:
            self._raise_put_many(exc, keys, len(sizes))
        return sizes

    def _put_run(self, keys: list[str], blobs: list[Any], lo: int, hi: int, deadline: Deadline,
                 sizes: list[int]) -> None:
        """Items ``lo:hi`` of a batch (host payloads that fit the arena) into arena
        blocks, published together (one hold of the channel mutex, one wake-up; again
        before each wait for room); appends each one's size to ``sizes`` once it is
        published. A failure gives back the blocks not published yet."""
        slock = self._slock
        staged: list[tuple[Any, ...]] = []

        def flush() -> None:
            if staged:
                try:
                    self._publish(staged, deadline)  # or it gives them back
                    sizes.extend([block[5] for block in staged])
                finally:
                    staged.clear()

        before = len(sizes)
        slock.acquire()
        try:
            if self._closed:
                self._check_open()
            sent = self._sent
            fill = self._fill
            for i in range(lo, hi):
                key = keys[i]
                if key in sent:
                    self._check_not_pending(key)
                staged.append(fill(key, key.encode("utf-8"), blobs[i], deadline, flush))
            flush()
        finally:
            if staged:
                self._unstage(staged)
            c = self._sc
            c[0] += len(sizes) - before
            c[1] += sum(sizes[before:])
            slock.release()

    # -- block primitives of the GPU path (``gpu.py``): take a block, fill it outside
    #    any lock (a DMA), publish it or give it back.
    def _take_block(self, key: str, n: int, deadline: Deadline, *, block: bool) -> tuple[int, int] | None:
        """``(offset, descriptor)`` of a free block of ``n`` bytes; waits for room when
        ``block`` (backpressure), else returns ``None`` when there is none now."""
        w = self._writer
        with self._slock:
            self._check_open()
            if key in self._sent:
                self._check_not_pending(key)
            off = w.alloc.alloc(n) if w.free_desc else None
            if off is not None:
                return off, w.free_desc.pop()
            if not block:
                return None
            # Only the arena itself is page-locked for DMA: device payloads never go to
            # an extension segment (they wait for room in the arena instead).
            return self._reserve(key, n, deadline, primary_only=True)[1:]

    def _give_back_block(self, off: int, idx: int) -> None:
        w = self._writer
        with self._slock:
            w.alloc.free(off)
            w.free_desc.append(idx)

    def _publish_block(self, key: str, off: int, idx: int, written: int, deadline: Deadline) -> None:
        """Publish a filled block of the arena under ``key`` (the key's bytes are
        checked by the caller); gives the block back if the mutex cannot be had."""
        with self._slock:
            self._publish(((key, key.encode("utf-8"), self._writer.primary, off, idx, written),), deadline)

    def _block_view(self, off: int, n: int) -> memoryview:
        w = self._writer
        start = w.data_offset + off
        return w.view[start : start + n]

    def _gpu_path(self) -> Any:
        gpu = self._gpu
        if gpu is None:
            from omnilink.connectors.shm.gpu import ShmGpuPath

            with self._slock:
                if self._gpu is None:
                    self._gpu = ShmGpuPath(self)
                gpu = self._gpu
        return gpu

    def _async_context(self, payload: Any) -> Any:
        # A put_async of CUDA tensors: the copy must follow what the caller queued on its
        # current stream *now*, so the event is recorded here, in the caller's thread.
        torch = sys.modules.get("torch")
        if torch is None or not self._sends or not torch.cuda.is_initialized():
            return None
        from omnilink.cuda import cuda_devices_of, record_producer_events

        devices = cuda_devices_of(payload)
        return record_producer_events(devices) if devices else None

    def _cannot_put(self) -> ConfigurationError:
        return ConfigurationError(
            f"shm connector on channel {self.channel!r} was opened with role='receiver' "
            "and cannot put; open it with role='sender' or 'dual'"
        )

    def _check_not_pending(self, key: str) -> None:
        """Raise ``DuplicateKeyError`` if our last put of ``key`` is still unclaimed.
        Holds ``_slock``."""
        if self._writer.pending(self._sent[key], key):
            raise duplicate_key(self.backend, self.channel, key)
        del self._sent[key]

    def _remember_sent(self, key: str, idx: int) -> None:
        """Holds ``_slock``. Entries whose descriptor moved on are pruned once the map
        outgrows the descriptors, so it stays bounded by ``max_inflight``."""
        sent = self._sent
        sent[key] = idx
        if len(sent) > self._sent_limit:
            self._prune_sent()

    def _prune_sent(self) -> None:
        """Forget the keys whose descriptor moved on (holds ``_slock``)."""
        sent = self._sent
        w = self._writer
        for k, i in list(sent.items()):
            rec = w.out.get(i)
            if rec is None or rec.key != k:
                del sent[k]

    def _put_overflow(self, key: str, key_bytes: bytes, blob: Any, deadline: Deadline) -> int:
        w = self._writer
        n = blob.nbytes
        if self.overflow == "error":
            raise CapacityError(
                f"shm: payload of {n} bytes is larger than the {w.data_bytes}-byte data area of "
                f"the arena on channel {self.channel!r}; pass a larger arena_bytes= or "
                "overflow='segment'"
            )
        chan = self._chan
        with self._slock:
            self._check_open()
            if key in self._sent:
                self._check_not_pending(key)
            idx = self._reserve_descriptor(key, deadline)
            token = new_token()
            name = overflow_name(self._prefix, self._pid, token)
            try:
                mm = create_segment(name, round_up(n, 4096), f"an overflow segment for key {key!r}")
                try:
                    with memoryview(mm) as mv:
                        written = blob.write_into(mv)
                finally:
                    mm.close()
                rec = _OutRec(0, key, 0, round_up(n, 4096), name)
                with chan.locked(_grace(deadline)):
                    w.publish(idx, key_bytes, rec, written, FLAG_OVERFLOW, token.encode("ascii"))
                    w.overflow_bytes += rec.reserved
                    chan.notify_all()
                    w.drain()
                self._remember_sent(key, idx)
            except BaseException as exc:
                if idx not in w.out:
                    w.free_desc.append(idx)
                    unlink_segment(name)
                if isinstance(exc, _LockTimeout):
                    raise self._timeout("put", key, "the channel mutex", deadline.timeout) from None
                raise
        self._count(fallbacks=1)
        return written

    def _reserve_descriptor(self, key: str, deadline: Deadline) -> int:
        """A free descriptor (for an overflow segment); waits like ``_reserve``."""
        return self._reserve(key, 0, deadline, block=False)[2]

    def _reserve(
        self, key: str, n: int, deadline: Deadline, *, block: bool = True, primary_only: bool = False
    ) -> tuple[Any, int, int]:
        """``(space, offset, descriptor)``: a block of ``n`` bytes (if ``block``) and a
        descriptor. Tries the arena and its extensions, then takes back what receivers
        released (or dead receivers held), then grows the arena by an extension segment
        (``_grow``), and only then waits (backpressure), woken by receivers releasing
        blocks. ``primary_only``: a block of the arena itself, never an extension.
        Holds ``_slock``."""
        w = self._writer
        chan = self._chan
        tried_abandoned = False
        force_abandoned = False  # after a wait that timed out: look for dead claimers now
        # Rounds that took blocks back and found no room yet: each frees a descriptor, so
        # more than n_desc of them in a row means released-ring entries forged by another
        # process; from then on a round that frees something waits like a full arena.
        freeing_rounds = 0
        max_freeing = w.layout.n_desc + 1
        while True:
            if self._closed:  # close() posts our space semaphore to get us here
                raise ClosedError(f"shm connector on channel {self.channel!r} was closed while put waited for space")
            if w.free_desc:
                if not block:
                    return None, 0, w.free_desc.pop()
                if primary_only:
                    off = w.primary.alloc.alloc(n)
                    got = None if off is None else (w.primary, off)
                else:
                    got = w.alloc_any(n)
                if got is not None:
                    return got[0], got[1], w.free_desc.pop()
            expired = False
            grow = False
            reclaimed: list[tuple[str, float, int]] = []
            try:
                with chan.locked(_grace(deadline)):
                    freed = w.drain()
                    if not freed and not tried_abandoned and (force_abandoned or w.abandoned_check_due()):
                        freed = w.reclaim_abandoned()
                        tried_abandoned = True
                        force_abandoned = False
                    if freed and freeing_rounds < max_freeing:
                        freeing_rounds += 1
                        continue
                    if self.reclaim_after is not None:
                        # Abandoned payloads (old, read past) go before the arena grows
                        # or anyone waits.
                        need = round_up(max(n, 1)) if block else 0
                        spaces = (w.primary,) if primary_only else tuple(w.spaces)
                        reclaimed = w.reclaim_unread(
                            self.reclaim_after,
                            time.monotonic(),
                            lambda: bool(w.free_desc) and any(sp.alloc.largest_free() >= need for sp in spaces),
                            overtaken_only=True,
                        )
                    if reclaimed:
                        pass
                    elif block and not primary_only and w.free_desc and self._may_grow(n):
                        grow = True
                    elif deadline.remaining() == 0:
                        expired = True  # raised below: building the error takes the mutex
                    else:
                        w.set_waiting()
            except _LockTimeout:
                expired = True
            if reclaimed:
                self._log_reclaimed(reclaimed, f"the arena was full (put of {key!r})")
                continue
            if grow:
                self._grow(n)  # on failure the next round waits: _may_grow says no now
                continue
            if expired:
                raise self._full_timeout(key, n, deadline)
            woke = w.wait_space(deadline.slice(HEARTBEAT_S))
            freeing_rounds = 0
            if not woke:
                tried_abandoned = False  # heartbeat: look for dead claimers again
                force_abandoned = True
                self._heartbeat()
                lost = self._receivers_lost()
                if lost is not None:
                    raise PeerLostError(
                        f"shm: put of key {key!r} on channel {self.channel!r} waits for arena space, but "
                        f"{lost} and no live receiver is left; {w.unclaimed()} unread payload(s) stay in "
                        "the arena until reclaim_unread() (or reclaim_after) drops them"
                    )

    def _log_reclaimed(self, reclaimed: list[tuple[str, float, int]], why: str) -> None:
        self._count(reclaimed=len(reclaimed))
        for key, age, nbytes in reclaimed:
            logger.info(
                "shm: reclaimed unread payload %r on channel %r: published %.1f s ago, %d bytes (%s)",
                key, self.channel, age, nbytes, why,
            )

    def _receivers_lost(self) -> str | None:
        """Which receivers died, if every receiver this sender has known is gone.

        Receivers are seen alive while a put waits (here) and seen dead when a heartbeat
        reaps them. ``None`` while one is alive, or when none was ever known (a sender
        may start before its receivers). Reporting forgets them: the next wait starts
        afresh, so a restarted receiver is waited for again.
        """
        try:
            with self._chan.locked(Deadline(1.0)):
                parts = self._chan.participants()
        except _LockTimeout:
            return None
        live = {pid for pid, role, _ in parts if role & ROLE_RECV and pid != self._pid and pid_alive(pid)}
        if live:
            self._receivers_seen |= live
            self._receivers_dead -= live
            return None
        dead = self._receivers_seen | self._receivers_dead
        if not dead:
            return None
        self._receivers_seen.clear()
        self._receivers_dead.clear()
        return f"receiver pid(s) {sorted(dead)} died"

    # ------------------------------------------------------------ elastic arena
    def _extension_size(self, n: int) -> int:
        """Size of the next extension segment for a block of ``n`` bytes: as large as the
        arena's data area (or the block), within what ``max_bytes`` leaves; 0 if none fits."""
        w = self._writer
        room = self.max_bytes - w.mapped_bytes
        size = max(w.data_bytes, round_up(n, PAGE))
        size = min(size, room // PAGE * PAGE)
        return size if size >= round_up(n, PAGE) else 0

    def _may_grow(self, n: int) -> bool:
        """Whether a full arena should grow for a block of ``n`` bytes (mutex held).

        Only for blocks receivers hold: if the payloads nobody has claimed yet, with this
        one, would not fit in the arena alone, a reader is slow and ``put`` waits
        (backpressure) instead."""
        w = self._writer
        if self._grow_failed or w.free_slot() < 0 or not self._extension_size(n):
            return False
        _held, unread = w.held_bytes()
        return unread + round_up(n) <= w.data_bytes

    def _grow(self, n: int) -> bool:
        """Add an extension segment that fits ``n`` bytes; ``False`` if ``/dev/shm`` is
        full (then ``put`` falls back to waiting, and stops trying to grow until an
        extension is given back)."""
        w = self._writer
        size = self._extension_size(n)
        slot = w.free_slot()
        if not size or slot < 0:
            return False
        try:
            sp = w.new_extension(size, slot)
        except (CapacityError, TransportError) as exc:
            self._grow_failed = True
            logger.warning("shm channel %r: cannot grow the arena (%s); put waits for receivers instead",
                           self.channel, exc)
            return False
        try:
            with self._chan.locked():
                w.add_extension(sp)
        except BaseException:
            w.drop_extension(sp)
            raise
        logger.info(
            "shm channel %r: receivers hold %d blocks; arena grown by %.1f MiB to %.1f MiB in %d segments",
            self.channel, len(w.out), size / 2**20, w.mapped_bytes / 2**20, len(w.spaces),
        )
        self._start_trimmer()
        return True

    def _start_trimmer(self) -> None:
        """Start the thread that gives idle extensions back (holds ``_slock``)."""
        if self._trimmer is None:
            t = threading.Thread(
                target=_trim_loop, args=(weakref.ref(self), self._trim_event, self.shrink_after),
                name=f"omnilink-shm-trim-{self.channel}", daemon=True,
            )
            self._trimmer = t
            t.start()

    def _trim(self) -> bool:
        """Give back extension segments empty for ``shrink_after`` seconds. Returns whether
        extensions remain (the trimmer thread stops when none do)."""
        w = self._writer
        if not self._slock.acquire(timeout=HEARTBEAT_S):
            return True  # a put is busy (or waiting): try again next round
        try:
            if self._closed or w is None:
                return False
            try:
                with self._chan.locked(Deadline(HEARTBEAT_S)):
                    w.drain()
                    w.reclaim_abandoned()  # a receiver killed while holding blocks
                    gone = w.retire_idle(self.shrink_after, time.monotonic())
            except _LockTimeout:
                return True
            for sp in gone:
                w.drop_extension(sp)
            if gone:
                self._grow_failed = False
                logger.info("shm channel %r: gave back %d idle arena extension(s); %.1f MiB mapped",
                            self.channel, len(gone), w.mapped_bytes / 2**20)
            if len(w.spaces) > 1:
                return True
            self._trimmer = None  # under _slock: the next _grow starts a new one
            return False
        finally:
            self._slock.release()

    def _full_timeout(self, key: str, n: int, deadline: Deadline) -> TransportError:
        w = self._writer
        receivers = self._live_receivers()
        return self._timeout(
            "put",
            key,
            f"receivers to release arena space ({n} bytes needed, {w.alloc.largest_free()} free in "
            f"one piece, {len(w.free_desc)} descriptors free; {receivers} live receiver(s))",
            deadline.timeout,
        )

    def _live_receivers(self) -> int:
        try:
            with self._chan.locked(Deadline(1.0)):
                parts = self._chan.participants()
        except _LockTimeout:
            return -1
        return sum(1 for pid, role, _ in parts if role & ROLE_RECV and pid != self._pid and pid_alive(pid))

    # =============================================================== receiving
    # ``get``/``get_nowait`` are BaseConnector's, except that the payload is counted
    # (``gets``, ``bytes_got``) where it is opened, in one step.
    def get(self, key: str, /, *, timeout: float | None = None, device: Any = None) -> Any:
        if self._closed:
            self._check_open()
        if type(key) is not str or not key.isascii() or not 0 < len(key) <= MAX_KEY_BYTES or "\x00" in key:
            validate_key(key)  # the general check (raises, or passes a non-ASCII key)
        deadline = None if timeout is None else Deadline(timeout)
        if device is None:
            return self._get(key, deadline, True)
        return self._receive(key, deadline or Deadline.after(self.timeout), True, device)

    def get_nowait(self, key: str, /, *, device: Any = None) -> Any:
        if self._closed:
            self._check_open()
        if type(key) is not str or not key.isascii() or not 0 < len(key) <= MAX_KEY_BYTES or "\x00" in key:
            validate_key(key)
        if device is not None:
            return self._receive(key, NO_WAIT, False, device)
        # ``_get``, inline (the per-message path of a polling receiver)
        payload = self._open_payload(key, self._claim_wait(key, NO_WAIT, False, count=True), counted=True)
        if type(payload) is dict and (IPC_MARK in payload or SLICED_MARK in payload):
            return self._unmark(key, payload, NO_WAIT)
        return payload

    get.__doc__ = BaseConnector.get.__doc__
    get_nowait.__doc__ = BaseConnector.get_nowait.__doc__

    def _get(self, key: str, deadline: Deadline | None, block: bool) -> Any:
        """Claim, decode and count ``key`` (``deadline`` ``None``: the connector's
        timeout, from now)."""
        payload = self._open_payload(key, self._claim_wait(key, deadline, block, count=True), counted=True)
        if type(payload) is dict and (IPC_MARK in payload or SLICED_MARK in payload):
            return self._unmark(key, payload, deadline)
        return payload

    def _unmark(self, key: str, marker: dict, deadline: Deadline | None) -> Any:
        """The payload behind a marker claimed under ``key``, on the host: one sent by
        device IPC, or one sent in slices (CUDA tensors), gathered."""
        if deadline is None:
            deadline = Deadline.after(self.timeout)
        if IPC_MARK in marker:
            return self._take_ipc(key, marker, None, deadline)
        return self._gpu_path().gather(marker, deadline, None).synchronize()

    def _get_many(self, keys: list[str], deadline: Deadline, device: Any) -> dict[str, Any]:
        """The batch path: every key claimed in one pass under the channel mutex once all
        are there (``_claim_wait`` with ``keys``), then each decoded (zero-copy views, as
        ``get``), or landed on a CUDA ``device`` one after the other."""
        cuda = device is not None and _is_cuda(device) and _gpu_path_available()
        if cuda:
            self._want_pool(device)
        gots = self._claim_wait(keys[0], deadline, True, count=not cuda, keys=keys)
        out: dict[str, Any] = {}
        i = 0
        try:
            if cuda:
                handles = []
                for i, key in enumerate(keys):
                    handles.append(self._land(key, gots[i], deadline, device))
                i = len(keys)
                return {key: h.wait() for key, h in zip(keys, handles)}
            for i, key in enumerate(keys):
                payload = self._open_payload(key, gots[i], counted=True)
                if type(payload) is dict and (IPC_MARK in payload or SLICED_MARK in payload):
                    payload = self._unmark(key, payload, deadline)
                out[key] = payload
            i = len(keys)
        finally:
            if i + 1 < len(keys):
                # A payload could not be opened: the ones after it go back unread (the
                # batch is consumed, as a get of a broken payload consumes its key).
                self._drop_claimed(gots[i + 1 :], counted=not cuda)
        if device is not None:
            from omnilink.cuda import payload_to_device

            out = {key: payload_to_device(obj, device) for key, obj in out.items()}
        return out

    def _drop_claimed(self, gots: list[tuple[Any, ...]], *, counted: bool) -> None:
        """Release claimed payloads that will not be opened (and take back their counts)."""
        with self._chan.locked():
            for got in gots:
                if type(got) is _LaneHit:
                    self._drop_lane_message(None, got[5])
                    continue
                reader, idx, seq, *_rest = got
                reader.mark_released(idx, seq, self._pid)
        if counted:
            with self._rlock:
                c = self._rc
                c[0] -= len(gots)
                c[1] -= sum(g[4] for g in gots)

    def _receive(self, key: str, deadline: Deadline, block: bool, device: Any) -> Any:
        if device is None:
            return self._get(key, deadline, block)
        if not _is_cuda(device):
            from omnilink.cuda import payload_to_device

            return payload_to_device(self._get(key, deadline, block), device)
        return self._receive_handle(key, deadline, block, device, now=True).wait()

    def _receive_handle(self, key: str, deadline: Deadline, block: bool, device: Any, *,
                        now: bool = False) -> Any:
        """Claim ``key`` and start landing it on ``device``: a ``StagePayloadHandle``.
        ``now``: the caller waits on it at once, on the current stream (``get``)."""
        if _is_cuda(device) and not _gpu_path_available():
            from omnilink.cuda import payload_to_device

            obj = payload_to_device(self._get(key, deadline, block), device)
            return StagePayloadHandle(obj, None, device, [])
        self._want_pool(device)
        return self._land(key, self._claim_wait(key, deadline, block), deadline, device, now=now)

    def _want_pool(self, device: Any) -> None:
        """Open the device-IPC pool at a first ``get`` onto a CUDA device, if wanted."""
        ipc = self._ipc
        if ipc is not None and ipc.wants_pool() and _is_cuda(device):
            ipc.open_pool(self._gpu_path().device_of(device))

    def _land(self, key: str, got: tuple[Any, ...], deadline: Deadline, device: Any, *,
              now: bool = False) -> Any:
        """Open a payload claimed under ``key`` and start its copy to ``device``: a
        ``StagePayloadHandle``. ``now``: it is waited on at once on the current stream
        (a device-IPC payload is ordered there already: no event to record)."""
        gpu = self._gpu_path()
        payload: Any = _UNSET
        if got[5] is None and not gpu.cpu_mode:
            dev = gpu.device_of(device)
            if dev.type == "cuda" and not self._is_ipc_message(got):
                landed = self._land_frame(key, got, gpu, dev)  # counts the get
                if type(landed) is StagePayloadHandle:
                    payload = landed._payload
                    if type(payload) is not dict or (IPC_MARK not in payload and SLICED_MARK not in payload):
                        self._count(device_gets=1)
                        return landed
                else:
                    payload = landed  # decoded by the general path: host views
        if payload is _UNSET:
            payload = self._open_payload(key, got, count_get=True)
        if type(payload) is dict and IPC_MARK in payload:
            dev = self._gpu_path().device_of(device)
            out = self._take_ipc(key, payload, dev, deadline)
            if now:  # get: the current stream already waits for the sender's copy
                return StagePayloadHandle(out, None, dev, [])
            from omnilink.cuda import Event, current_raw_stream

            # The current stream waits for the sender's copy (and any move): a handle
            # whose wait(stream) orders another stream after that point.
            raw = current_raw_stream(dev.index)
            return StagePayloadHandle(out, Event(dev.index).record(raw), dev, [], stream=raw)
        return gpu.land(payload, got[0], deadline, device, got[4])

    def _is_ipc_message(self, got: tuple[Any, ...]) -> bool:
        """Whether the arena payload claimed in ``got`` looks like a device-IPC message
        (its header names ``IPC_MARK``): such a frame holds no tensor to land on the
        device, so the one-copy landing is not tried. Only picks the road; the decoder
        validates the frame either way."""
        ipc = self._ipc
        if ipc is None or not ipc.has_pool():
            return False
        reader, _idx, _seq, off, length, _ = got
        start = reader.data_offset + off
        head = reader.mm[start : start + min(length, _IPC_PEEK)]
        return _IPC_MARK_BYTES in head

    def _land_frame(self, key: str, got: tuple[Any, ...], gpu: Any, dev: Any) -> Any:
        """Land an arena payload on CUDA ``dev`` with one copy of its frame's data region
        into one device buffer whose views are its tensors (``submit_frame``): no host
        views, one allocation and one DMA per message. Returns the handle, or the host
        payload (zero-copy views, as ``get``) when the frame needs the general path
        (numpy arrays in it, a frame the caches do not know how to decode). Counts the
        get. The block goes back once the copy has completed."""
        reader, idx, seq, off, length, _ = got
        lease = reader.lease(off, length)
        rel = self._releaser
        ref = rel.track(lease, reader, idx, seq, length, key)
        try:
            gpu._register_reader(reader)
            addr = reader.data_address() + off
            raw = memoryview(lease)

            def decode(fetch: Any, empty: Any) -> Any:
                def views(buf: Any, plan: Any, base: int) -> Any:
                    return _device_views(buf, plan, base, lambda o, n: fetch(addr + o, n), empty)

                out = _decode_fast(raw, raw.nbytes, views)  # the descriptor's length is not trusted
                return None if out is _MISS else out

            landed = gpu._h2d_for(dev).submit_frame(decode, on_current_stream=length < SMALL_DEVICE_BYTES,
                                                    keep=lease)
            del raw
            if landed is None:
                landed = _decode(lease)  # the general path: host views, as ``get``
        except BaseException:
            rel.release(ref)
            raise
        self._count_op("gets", "bytes_got", length)
        return landed

    def _take_ipc(self, key: str, marker: dict, device: Any, deadline: Deadline | None = None) -> Any:
        """The payload of the device-IPC message ``marker`` claimed under ``key`` (its
        copy waited for until ``deadline``)."""
        ipc = self._ipc
        if ipc is None:
            raise TransportError(
                f"shm: key {key!r} on channel {self.channel!r} was sent by device IPC, but this "
                "receiver was opened with device_ipc='off'"
            )
        out = ipc.take(key, marker, device, deadline)
        self._count(ipc_gets=1)
        return out

    def get_handle(self, key: str, /, *, device: Any, timeout: float | None = None) -> Any:
        """Receive ``key`` and start copying it to ``device``; return a handle at once.

        Like ``get(key, device=device)``, but the caller decides when and on which stream
        to wait: ``handle.wait(stream)`` orders ``stream`` after the copy (the host does not
        block) and returns the payload; ``handle.done()`` says whether it has finished.
        The arena block goes back to the sender once the copy has completed.

        Parameters
        ----------
        key : str
            The key the sender used.
        device : str or torch.device
            Where the tensors land (``"cuda:0"``; ``"cpu"`` gives host copies).
        timeout : float, optional
            Seconds to wait for the key (and for every slice of a sliced payload).

        Returns
        -------
        omnilink.cuda.StagePayloadHandle

        Raises
        ------
        TransferTimeout, PeerLostError, BlobDecodeError, ClosedError
            As ``get``.
        CudaError
            ``device`` is a CUDA device and CUDA is unavailable, or a copy failed.
        """
        self._check_open()
        validate_key(key)
        return self._receive_handle(key, self._deadline(timeout), True, device)

    #: Called (no argument, must not raise) by a get that found nothing yet, once, before
    #: it waits: the device pool's receiver (the device-IPC route's, or that of a
    #: ``cuda_ipc`` connector built on this one) prepares the next landing then
    #: (``PoolReceiver.prebuild``).
    _wait_hook: Any = None

    def _claim_wait(self, key: str, deadline: Deadline | None, block: bool, *, count: bool = False,
                    keys: list[str] | None = None) -> Any:
        """Claim ``key`` (waiting up to ``deadline`` when ``block``; ``None``: the
        connector's timeout, from now): the claim record. With ``count`` the get and its
        bytes are counted under ``_rlock`` (``_open_payload`` takes them back if the
        payload cannot be decoded).

        With ``keys`` (``key`` is the first of them, named by a timeout of the mutex),
        claim all of them in one pass once every one is there, none before
        (``_claim_all_locked``): their claim records, in order. Until then each wake-up
        looks at the whole batch again."""
        if not self._recvs:
            raise ConfigurationError(
                f"shm connector on channel {self.channel!r} was opened with role='sender' "
                "and cannot get; open it with role='receiver' or 'dual'"
            )
        chan = self._chan
        if not block and key not in self._index and self._nothing_new(key):
            if key in self._consumed:
                raise self._consumed.error(self.backend, self.channel, key)
            if _monotonic() - self._last_beat >= HEARTBEAT_S:
                self._heartbeat()  # a polling receiver still learns that its senders died
            if self._peer_lost is None:
                if self._closed:
                    self._check_open()
                _yield()
                raise WouldBlock(f"shm: key {key!r} is not on channel {self.channel!r} yet")
        rlock = self._rlock
        idle = block
        while True:
            rlock.acquire()
            try:
                if self._closed:
                    self._check_open()
                # One mutex round trip: map new senders, index what they published, claim.
                if not chan.try_lock():
                    if deadline is None:
                        deadline = Deadline.after(self.timeout)
                    if not chan.lock_within(deadline):
                        raise self._timeout("get", key, "the channel mutex", deadline.timeout)
                try:
                    if chan._gen[0] != self._known_gen:  # ``senders_gen()``
                        self._refresh_locked()
                    self._scan_locked()
                    got: Any = self._claim_locked(key) if keys is None else self._claim_all_locked(keys)
                    if got is None:
                        if deadline is None:
                            deadline = Deadline.after(self.timeout)
                        self._missed(key, keys, block, deadline)
                        gen = chan.register_waiter()
                    elif count:
                        c = self._rc
                        if keys is None:
                            c[0] += 1
                            c[1] += got[4]
                        else:
                            c[0] += len(got)
                            c[1] += sum(g[4] for g in got)
                finally:
                    chan.unlock()
            finally:
                rlock.release()
            if got is not None:
                return got
            if idle:  # the first miss of a get: the wait may do a device pool's part
                idle = False
                hook = self._wait_hook
                if hook is not None:
                    hook()
            self._sleep_until_published(gen, deadline)

    def _missed(self, key: str, keys: list[str] | None, block: bool, deadline: Deadline) -> None:
        """Raise what a claim that found nothing means (holds ``_rlock`` and the mutex):
        a key consumed already, a lost sender, a ``get_nowait``'s miss, the deadline
        passed. Returns when the caller is to wait."""
        missing = [key] if keys is None else [k for k in keys if not self._claimable(k)]
        consumed = self._consumed
        for k in missing:
            if k in consumed:
                raise consumed.error(self.backend, self.channel, k)
        if self._peer_lost is not None:
            what = f"key {key!r}" if keys is None else f"get_many: key(s) {_keys_text(missing)}"
            raise PeerLostError(
                f"shm: {what} on channel {self.channel!r} can no longer arrive: {self._peer_lost} "
                "and no live sender is left"
            )
        if not block:
            raise WouldBlock(f"shm: key {key!r} is not on channel {self.channel!r} yet")
        if deadline.remaining() == 0:
            if keys is None:
                raise self._timeout("get", key, self._sender_names(), deadline.timeout)
            raise self._many_timeout(keys, missing, self._sender_names(), deadline.timeout)

    def _sleep_until_published(self, gen: int, deadline: Deadline) -> None:
        """Sleep until a sender publishes (or a heartbeat's worth of time passes), having
        registered as waiter ``gen``; withdraw if not woken; beat when it is time."""
        chan = self._chan
        spin = self._spin_ns
        t0 = _clock()
        woke = chan.wait(deadline.slice(HEARTBEAT_S), spin, self._spin_min_ns)
        if spin:
            self._adapt_spin(_clock() - t0 if woke else self._spin_max_ns * 4)
        if not woke:
            try:
                with chan.locked(_grace(deadline)):
                    chan.withdraw_waiter(gen)
            except _LockTimeout:
                pass
        if time.monotonic() - self._last_beat >= HEARTBEAT_S:
            self._heartbeat()

    def _adapt_spin(self, waited_ns: int) -> None:
        """Fold one wait (``waited_ns`` until the wake-up) into the typical wait and set
        the next spin, by ``next_spin``'s rule (within [``spin_us``, ``SPIN_GROWTH`` x
        ``spin_us``])."""
        self._arrival_ns, self._spin_ns = next_spin(self._arrival_ns, waited_ns, self._spin_min_ns,
                                                    self._spin_max_ns)

    def _nothing_new(self, key: str) -> bool:
        """Whether ``key`` certainly is not claimable now, decided without any lock: it is
        not indexed, no sender joined or left, and no sender published since this
        receiver last read its log. Every value read is one a sender writes with a single
        aligned store; a stale one only makes this answer ``False`` (take the slow path)
        or report a miss of a payload published a moment ago, which any receiver may."""
        if key in self._index or self._departed:
            return False
        if self._chan._gen[0] != self._known_gen:  # ``senders_gen()``
            return False
        lane = self._lane
        if lane is not None and (key in self._lane_index or lane.unread()):
            return False
        for r in self._reader_list:
            if r.pub[0] != r.cursor:  # ``r.published()``, inlined
                return False
        return True

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        """Keys published on the channel and not yet claimed (for ``aget``): the same
        mutex round trip and semaphore wait as ``_get``, without claiming anything."""
        if not self._recvs:
            raise ConfigurationError(
                f"shm connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        chan = self._chan
        deadline = Deadline(timeout)
        while True:
            gen = None
            with self._rlock:
                self._check_open()
                if not chan.lock_within(deadline):
                    return set(known)  # the mutex stayed busy all along: nothing new seen
                try:
                    if chan.senders_gen() != self._known_gen:
                        self._refresh_locked()
                    self._scan_locked()
                    avail = set(self._index)
                    avail.update(self._lane_index)
                    lost = self._peer_lost
                    if avail <= known and lost is None and deadline.remaining() != 0:
                        gen = chan.register_waiter()
                finally:
                    chan.unlock()
            if gen is None:
                if avail <= known and lost is not None:
                    raise PeerLostError(
                        f"shm: nothing more can arrive on channel {self.channel!r}: {lost} and no "
                        "live sender is left"
                    )
                return avail
            self._sleep_until_published(gen, deadline)

    def _sender_names(self) -> str:
        pids = sorted({r.pid for r in self._readers.values()})
        return f"sender pid(s) {pids}" if pids else "a sender to join the channel"

    def _refresh_locked(self) -> None:
        """Map new senders' arenas, retire departed ones. Holds ``_rlock`` and the mutex
        (so no sender can join or leave meanwhile; this runs only when one did)."""
        chan = self._chan
        gen = chan.senders_gen()
        parts = chan.participants()
        live = {(pid, token) for pid, role, token in parts if role & ROLE_SEND}
        for ident in list(self._readers):
            if ident not in live:
                # Its published payloads stay claimable: one last scan indexes them, and the
                # index entries keep the mapping alive until they are claimed.
                self._departed.append(self._readers.pop(ident))
        for ident in live:
            if ident not in self._readers:
                try:
                    self._readers[ident] = ArenaReader(self._prefix, *ident)
                except Exception as exc:  # gone already (closed or died): nothing to map
                    logger.debug("shm: cannot map arena of sender %s: %s", ident, exc)
                    continue
                if self._peer_lost is not None and pid_alive(ident[0]):
                    # A new sender replaced the one that died: keys may arrive again.
                    # (The heartbeat used to clear this only up to HEARTBEAT_S later, so
                    # the first get after the replacement raised PeerLostError.)
                    self._peer_lost = None
        self._known_gen = gen
        self._reader_list = tuple(self._readers.values())
        self._index_limit = 4096 + 2 * sum(r.layout.n_desc for r in self._readers.values())

    def _scan_locked(self) -> None:
        lane = self._lane
        if lane is not None:
            lane.poll(self._lane_index)
        index = self._index
        for r in self._reader_list:  # ``_readers``' values (set with it)
            r.scan(index)
        if self._departed:
            for r in self._departed:
                r.scan(index)
            self._departed.clear()
        if len(index) > self._index_limit:
            # Entries for keys another receiver consumed: drop them.
            for k in list(index):
                refs = [ref for ref in index[k] if ref[0].still_written(ref[1], ref[2])]
                if refs:
                    index[k] = refs
                else:
                    del index[k]

    def _claimable(self, key: str) -> bool:
        """Whether ``key`` can be claimed now (mutex held); drops the index entries of it
        that went stale (claimed by another receiver, discarded, reclaimed)."""
        refs = self._index.get(key)
        if refs is None:
            hit = self._lane_index.get(key)
            if hit is None:
                return False
            if self._lane is not None and self._lane.claimable(hit[2]):
                return True
            del self._lane_index[key]  # withdrawn by its sender
            return False
        while refs:
            reader, idx, seq = refs[0]
            if reader.still_written(idx, seq):
                return True
            refs.pop(0)
        del self._index[key]
        return False

    def _claim_all_locked(self, keys: list[str]) -> list[tuple[Any, ...]] | None:
        """Claim every key of ``keys`` if each can be claimed now, else none (mutex
        held): the claim records, in order, or ``None``."""
        claimable = self._claimable
        for key in keys:
            if not claimable(key):
                return None
        claim = self._claim_locked
        gots: list[tuple[Any, ...]] = []
        try:
            for key in keys:
                gots.append(claim(key))  # type: ignore[arg-type]  # claimable: never None
        except BaseException:
            # A segment of the sender is gone (PeerLostError): hand back what was claimed.
            for got in gots:
                if type(got) is _LaneHit:
                    self._drop_lane_message(None, got[5])
                    continue
                reader, idx, seq, *_rest = got
                reader.mark_released(idx, seq, self._pid)
            raise
        return gots

    def _claim_locked(self, key: str) -> tuple[Any, ...] | None:
        refs = self._index.get(key)
        if refs is None:
            hit = self._lane_index.pop(key, None) if self._lane_index else None
            if hit is None or self._lane is None or not self._lane.claim(hit[2]):
                return None  # not there, or withdrawn by its sender (its block freed there)
            self._consumed.add(key)
            return _LaneHit((None, -1, -1, 0, hit[1], hit[0]))
        while refs:
            reader, idx, seq = refs.pop(0)
            res = reader.claim(idx, seq, self._pid)
            if res is not None:
                self._consumed.add(key)
                if not refs:
                    del self._index[key]
                off, length, flags, otoken = res
                mm = None
                if flags & FLAG_EXTENSION:
                    try:
                        reader.map_extension(otoken)
                    except Exception as exc:
                        reader.mark_released(idx, seq, self._pid)
                        raise PeerLostError(
                            f"shm: the arena extension holding key {key!r} from sender pid "
                            f"{reader.pid} is gone ({exc})"
                        ) from exc
                    mm = otoken
                elif flags & FLAG_OVERFLOW:
                    try:
                        mm = reader.open_overflow(otoken)
                    except Exception as exc:
                        reader.mark_released(idx, seq, self._pid)
                        raise PeerLostError(
                            f"shm: the overflow segment of key {key!r} from sender pid {reader.pid} "
                            f"is gone ({exc})"
                        ) from exc
                return reader, idx, seq, off, length, mm
        del self._index[key]
        return None

    def _open_payload(self, key: str, got: tuple[Any, ...], *, count_get: bool = False,
                      counted: bool = False) -> Any:
        """Decode a claimed payload (zero-copy views, tracked by a lease); counts its
        bytes, and with ``count_get`` the ``get`` too (a slice of a sliced payload is
        not one). ``counted``: ``_claim_wait`` counted both already (taken back here if
        the payload cannot be decoded)."""
        # ``where``: None (the arena), an extension's token (bytes) or an overflow mapping
        reader, idx, seq, off, length, overflow_mm = got
        if type(got) is _LaneHit:  # decoded as it was read
            if not counted:
                if count_get:
                    self._count_op("gets", "bytes_got", length)
                else:
                    self._count(bytes_got=length)
            return overflow_mm
        if overflow_mm is None:
            whole = reader._bytes
            if whole is None:
                lease = reader.lease(off, length)
            else:
                start = reader.data_offset + off
                lease = whole[start : start + length]
        elif type(overflow_mm) is bytes:
            lease = reader.lease_extension(overflow_mm, off, length)
        else:
            lease = _make_lease(overflow_mm, 0, length)
            self._count(fallbacks=1)
        rel = self._releaser
        ref = rel.track(lease, reader, idx, seq, length, key)
        try:
            # Views are made through a memoryview *of the lease* (torch and numpy make
            # them faster from a memoryview than from an array); it references the lease,
            # so every view still keeps the lease alive. (A slice of a memoryview of the
            # whole mapping would not: views made from it would reference the mapping.)
            raw = memoryview(lease)
            payload = _decode_fast(raw, raw.nbytes)  # the descriptor's length is not trusted
            del raw
            if payload is _MISS:
                payload = _decode(lease)
        except BaseException:
            rel.release(ref)
            if counted:
                with self._rlock:
                    c = self._rc
                    c[0] -= 1
                    c[1] -= length
            raise
        if counted:
            return payload
        if count_get:
            self._count_op("gets", "bytes_got", length)
        else:
            self._count(bytes_got=length)
        return payload
        # ``lease`` goes out of scope here: from now on only the payload's views keep it.

    def _add_counts(self, counters: dict[str, int]) -> None:
        puts, bytes_put = self._sc
        gets, bytes_got = self._rc
        counters["puts"] += puts
        counters["bytes_put"] += bytes_put
        counters["gets"] += gets
        counters["bytes_got"] += bytes_got

    def _heartbeat(self) -> None:
        """Liveness of the peers: reap dead participants, note lost senders."""
        self._last_beat = time.monotonic()
        chan = self._chan
        try:
            with chan.locked(Deadline(HEARTBEAT_S)):
                reaped = chan.reap()
                parts = chan.participants()
                lost = chan.lost_senders()
                last_exit_dead = chan.last_sender_exit_dead()
        except _LockTimeout:
            return
        chan.remove_reaped(reaped)
        if self._sends:
            self._receivers_dead.update(pid for pid, role, _ in reaped if role & ROLE_RECV)
        live_senders = [pid for pid, role, _ in parts if role & ROLE_SEND]
        if not live_senders and last_exit_dead and lost > chan.lost_baseline:
            if self._peer_lost is None:
                dead = [pid for pid, role, _ in reaped if role & ROLE_SEND]
                self._peer_lost = f"sender pid(s) {dead} died" if dead else "the channel's last sender died"
        else:
            self._peer_lost = None

    # ====================================================== discard / release
    # ================================================================ lane
    def attach_lane(self, lane: Any, drop: Any) -> None:
        """Take the messages of a device pool's lane (``devpool.LaneReader``) as this
        receiver's own: a key published there is claimed, consumed, discarded and counted
        like one published on the channel; ``drop(key, message)`` gives back the pool
        block of a message discarded unread (``key`` ``None`` when not known). ``None`` detaches (the pool is closing). The pool's
        sender wakes this channel's waiters after each record (``wake_receivers``)."""
        with self._rlock:
            self._lane = lane
            self._lane_drop = drop

    def _drop_lane_message(self, key: str | None, message: Any) -> None:
        drop = self._lane_drop
        if drop is not None:
            try:
                drop(key, message)
            except Exception:  # pragma: no cover - best effort (the pool may be closing)
                logger.debug("shm: dropping a lane message failed", exc_info=True)

    def wake_receivers(self, deadline: Deadline | None = None) -> None:
        """Wake this channel's waiting receivers (a device pool's sender, after a record
        of its lane: the receiver waits in one place, the channel's semaphore). If the
        mutex cannot be had in time the record is still there: a receiver finds it at
        its next look (its heartbeat at the latest)."""
        chan = self._chan
        if not chan.try_lock():
            if not chan.lock_within(deadline or Deadline(MUTEX_GRACE_S)):
                logger.debug("shm: channel %r: no wake-up for a lane record (mutex busy)", self.channel)
                return
        try:
            chan.notify_all()
        finally:
            chan.unlock()

    def _discard(self, key: str) -> bool:
        ipc = self._ipc
        if ipc is not None and self._recvs and ipc.has_pool():
            # A payload sent by device IPC holds a block of this receiver's pool, named in
            # its message: open the message (not its tensors) to give that block back.
            try:
                got = self._claim_wait(key, NO_WAIT, False)
            except (WouldBlock, KeyConsumedError):
                got = None
            if got is not None:
                payload = self._open_payload(key, got)
                if type(payload) is dict and IPC_MARK in payload:
                    ipc.drop(key, payload)
                with self._rlock:
                    self._consumed.add(key, "discarded")
                return True
        dropped = self._discard_shm(key)
        if dropped and ipc is not None:
            ipc.discard(key)  # a sender's device part of a payload it withdrew
        return dropped

    def _discard_shm(self, key: str) -> bool:
        chan = self._chan
        w = self._writer
        if w is not None:
            ipc = self._ipc
            with self._slock:
                with chan.locked():
                    # A payload of ours in a device pool's lane (ours: the route's sender)
                    # is withdrawn under the same mutex as the receiver's claim.
                    if w.discard(key) or (ipc is not None and ipc.lane_withdraw(key)):
                        if self._recvs:
                            with self._rlock:
                                self._consumed.add(key, "discarded")
                        return True
        if self._recvs:
            with self._rlock:
                with chan.locked():
                    if chan.senders_gen() != self._known_gen:
                        self._refresh_locked()
                    self._scan_locked()
                    hit = self._lane_index.pop(key, None)
                    if hit is not None and self._lane is not None and self._lane.claim(hit[2]):
                        self._drop_lane_message(key, hit[0])
                        self._consumed.add(key, "discarded")
                        return True
                    refs = self._index.get(key)
                    while refs:
                        reader, idx, seq = refs.pop(0)
                        if reader.claim(idx, seq, self._pid) is not None:
                            reader.mark_released(idx, seq, self._pid)
                            if not refs:
                                del self._index[key]
                            self._consumed.add(key, "discarded")
                            return True
                    self._index.pop(key, None)
        return False

    def release(self, key: str, /) -> bool:
        """Hand the blocks of payloads received under ``key`` back to their sender now.

        Normally a block is released when the last view of its payload dies. Call this
        to release earlier; the payload's tensors and arrays must not be used afterwards
        (the sender will write new payloads into that memory).

        Parameters
        ----------
        key : str
            A key this connector received with ``get`` or ``get_nowait``.

        Returns
        -------
        bool
            Whether a payload still held under ``key`` was released.

        Raises
        ------
        ClosedError
            The connector was closed.
        """
        self._check_open()
        refs = self._releaser.held(key)
        if not refs:
            return False
        for ref in refs:
            self._releaser(ref)
        return True

    def held(self) -> list[tuple[str, int, float]]:
        """The payloads this receiver still views: ``(key, bytes, seconds held)`` each.

        A received payload's block goes back to its sender when the last view dies (or
        on ``release(key)``); this says which ones are still alive, for diagnostics
        (the vLLM-Omni adapter logs requests that hold theirs for long).

        Raises
        ------
        ClosedError
            The connector was closed.
        """
        self._check_open()
        now = time.monotonic()
        return [(ref.key, ref.nbytes, now - ref.since) for ref in self._releaser.held()]

    def reclaim_unread(self, older_than: float, /) -> list[tuple[str, float]]:
        """Drop this sender's payloads that no receiver has claimed and that were
        published more than ``older_than`` seconds ago, oldest first.

        For payloads of abandoned requests (their receiver gave up or died); pass ``0``
        to drop every unread payload, e.g. after ``put`` raised ``PeerLostError``. A
        payload a receiver has claimed is never touched. Each one dropped is logged with
        its key and age and counted in ``stats().reclaimed``.

        Parameters
        ----------
        older_than : float
            Minimum age in seconds since publication.

        Returns
        -------
        list of (str, float)
            ``(key, age in seconds)`` of each payload dropped, oldest first.

        Raises
        ------
        ConfigurationError
            ``older_than`` is not a number >= 0, or this connector cannot send.
        ClosedError
            The connector was closed.
        """
        self._check_open()
        if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
            raise ConfigurationError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        w = self._writer
        if w is None:
            raise ConfigurationError(
                f"shm connector on channel {self.channel!r} was opened with role='receiver' and has no arena"
            )
        ipc = self._ipc
        with self._slock:
            with self._chan.locked():
                w.drain()
                now = time.monotonic()
                dropped = w.reclaim_unread(float(older_than), now)
                if ipc is not None:
                    # Payloads sent by device IPC whose message is in the pool's lane.
                    lane = ipc.lane_reclaim(float(older_than), now)
                    if lane:
                        dropped = sorted(dropped + lane, key=lambda d: -d[1])
        if dropped:
            self._log_reclaimed(dropped, "reclaim_unread")
        return [(key, age) for key, age, _ in dropped]

    def pending_keys(self) -> list[str]:
        """Keys this sender published that no receiver has claimed yet.

        Lets a caller that indexes its keys (the vLLM-Omni adapter) forget the ones
        already taken. Empty for a connector that cannot send.

        Raises
        ------
        ClosedError
            The connector was closed.
        """
        self._check_open()
        w = self._writer
        if w is None:
            return []
        # The channel mutex alone: every change to the descriptors is made under it, and
        # a put waiting for room holds ``_slock`` (this must not wait for that put).
        with self._chan.locked():
            keys = w.unread_keys()
        ipc = self._ipc
        if ipc is not None:
            keys += ipc.lane_pending_keys()
        return keys

    # =================================================================== misc

    def _in_use(self) -> tuple[int, int]:
        """Arena blocks (and overflow segments) this sender has not got back yet, plus
        the payloads this receiver still views: ``stats().blocks_in_use``/``bytes_in_use``."""
        rel = self._releaser
        blocks, nbytes = len(rel.live), rel.nbytes
        w = self._writer
        if w is not None:
            blocks += len(w.out)
            nbytes += sum(sp.alloc.used_bytes for sp in list(w.spaces)) + w.overflow_bytes
        return blocks, nbytes

    def _arena_stats(self) -> dict[str, Any]:
        """``segments`` and ``bytes_mapped`` of this sender's arena (with its extensions),
        and ``bytes_held``: bytes of its blocks that receivers claimed and still view,
        plus, for a receiver, the payloads this process still views; the device-IPC
        route's last fallback reason."""
        ipc = self._ipc
        why = {"ipc_fallback_reason": ipc.fallback_reason} if ipc is not None and ipc.fallback_reason else {}
        rx = ipc._rx if ipc is not None else None
        if rx is not None:
            why["pool_segments"], why["pool_bytes_now"] = rx.segments()
        w = self._writer
        held = self._releaser.nbytes if self._recvs else 0
        if w is None:
            return {"segments": 0, "bytes_mapped": 0, "bytes_held": held, **why}
        # No lock: a put waiting for room holds ``_slock``, and stats() must not wait
        # for it. The lists are copied whole (atomic under the GIL); a descriptor's state
        # read a moment early or late only moves a block between held and not held.
        spaces = list(w.spaces)
        try:
            arena_held, _unread = w.held_bytes()
        except ValueError:  # closed by another thread meanwhile: nothing is held
            arena_held = 0
        if self._recvs:
            # A dual connector's own views of its own arena are counted once.
            own = sum(ref.nbytes for ref in self._releaser.held()
                      if ref.reader.pid == self._pid and ref.reader.token == self._token)
            held -= own
        return {"segments": len(spaces), "bytes_mapped": sum(sp.size for sp in spaces),
                "bytes_held": arena_held + held, **why}

    def _wake(self) -> None:
        """Wake a put waiting for arena space in another thread so it sees the close."""
        self._trim_event.set()
        w = self._writer
        if w is not None:
            try:
                w.sem.release()
            except Exception:  # pragma: no cover - the semaphore is ours and open
                logger.debug("shm: waking a blocked put failed", exc_info=True)

    def _close(self) -> None:
        w = self._writer
        if w is not None and self.linger > 0:
            self._linger()
        with self._rlock:
            self._lane = None  # before the pool (and its directory) goes: it goes whole
            self._lane_drop = None
            self._lane_index = {}
        if self._ipc is not None:
            self._ipc.close()
        if self._gpu is not None:
            # Copies finish and registrations go before any mapping is unmapped.
            self._gpu.close()
        t = self._trimmer
        if t is not None:
            t.join(5.0)
        with self._rlock:
            self._readers.clear()
            self._reader_list = ()
            self._departed.clear()
            self._index.clear()
        self._finalizer()

    def _linger(self) -> None:
        """Wait up to ``linger`` s for live receivers to claim what this sender published."""
        w, chan = self._writer, self._chan
        deadline = Deadline(self.linger)
        with self._slock:
            while True:
                try:
                    with chan.locked(deadline):
                        w.drain()
                        if not w.unclaimed():
                            return
                        receivers = [
                            pid for pid, role, _ in chan.participants()
                            if role & ROLE_RECV and pid != self._pid and pid_alive(pid)
                        ]
                        if not receivers or deadline.expired():
                            logger.info(
                                "shm: closing sender on %r with %d unclaimed payload(s)",
                                self.channel, w.unclaimed(),
                            )
                            return
                        w.set_waiting()
                except _LockTimeout:
                    return
                w.wait_space(deadline.slice(HEARTBEAT_S))

    def mapping_of(self, payload_ptr: int) -> tuple[str, int, int] | None:
        """Which of this receiver's arena mappings (extensions included) holds address
        ``payload_ptr``.

        Returns ``(arena name, mapping start, mapping length)`` or ``None``. For tests and
        diagnostics (proving a received tensor is a view of the sender's arena).
        """
        with self._rlock:
            readers = list(self._readers.values())
        for r in readers:
            for name, start, length in r.mappings():
                if start <= payload_ptr < start + length:
                    return name, start, length
        return None


# Keys longer than this cannot be published (the descriptor's key field).
if MAX_KEY_BYTES > 512:  # pragma: no cover - guards a layout change in _util
    raise ImportError("shm descriptors hold keys of at most 512 bytes; update segments.py")
