"""``CudaIpcConnector``: the ``cuda_ipc`` backend (see the package docstring for the design)."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, TypeVar

import numpy as np

from omnilink._errors import (
    BlobDecodeError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    KeyConsumedError,
    OmnilinkError,
    PeerLostError,
    TransferTimeout,
    WouldBlock,
)
from omnilink._util import Deadline, PeerWatch
from omnilink.blob import DTYPE_CODES, MAX_TREE_DEPTH, MAX_TREE_ITEMS, _contiguous_strides, encoded_size
from omnilink.connectors.base import BaseConnector, Role, check_constructor_options
from omnilink.connectors.cuda_ipc.blocks import ALIGN, BlockAllocator, round_up
from omnilink.connectors.cuda_ipc.directory import (
    ACK_GEN,
    CLEAN_GEN,
    EVENTS_GEN,
    GEN,
    RECV_PID,
    RING_HEAD,
    RING_TAIL,
    SENDER_PID,
    SNAP_HEAD,
    STATE,
    STATE_CLOSED,
    STATE_OPEN,
    WANT_GEN,
    POOL_BYTES,
    DEVICE,
    Directory,
    find_directories,
)
from omnilink.connectors.shm import HostLock, ShmConnector, pid_alive, read_prefix, unlink_segment
from omnilink.cuda import map_tensors

__all__ = ["DEFAULT_POOL_BYTES", "CudaIpcConnector", "live_pool_owner"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Default size of the receiver's device pool.
DEFAULT_POOL_BYTES = 256 << 20
DEFAULT_EVENT_SLOTS = 128
DEFAULT_MAX_BLOCKS = 4096
#: The inner shm connector carries descriptors and CPU parts only: a small arena.
DEFAULT_ARENA_BYTES = 16 << 20
#: Seconds between liveness checks of the other side.
HEARTBEAT_S = 0.25
#: Most dimensions and tensors a manifest may name (bounded before use).
MAX_NDIM = 64
MAX_TENSORS = 1 << 16
_INT64_MAX = (1 << 63) - 1

#: Same-process shortcuts: a process cannot open its own IPC handles, so a sender whose
#: receiver lives in the same process (``role="dual"``, or two connectors of one
#: process) uses the pointer and events directly.
_LOCAL_POOLS: dict[str, int] = {}
_LOCAL_EVENTS: dict[tuple[str, int], list[Any]] = {}
#: directories a connector of this process is attached to as the sender
_LOCAL_SENDERS: set[str] = set()
_local_lock = threading.Lock()


def _dtype_tables() -> tuple[dict[Any, int], dict[int, Any]]:
    import torch

    by_dtype: dict[Any, int] = {}
    by_code: dict[int, Any] = {}
    for name, (code, _) in DTYPE_CODES.items():
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            by_dtype[dt] = code
            by_code[code] = dt
    return by_dtype, by_code


_tables: tuple[dict[Any, int], dict[int, Any]] | None = None
_ITEMSIZE = {code: size for code, size in DTYPE_CODES.values()}


#: what the payload walks pass through as they are (no container, no tensor)
_LEAVES = (str, int, float, bool, type(None), bytes)


def _split(payload: Any, is_device: Any, tensor_type: Any) -> tuple[Any, list[tuple[tuple[Any, ...], Any]]]:
    """One walk of ``payload``: the host part (each device tensor replaced by ``None``)
    and ``[(path, tensor)]`` of the device tensors, ``path`` the dict keys and list or
    tuple indices that lead to it (``()``: the payload is the tensor)."""
    found: list[tuple[tuple[Any, ...], Any]] = []

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(x, tensor_type):
            if is_device(x):
                found.append((path, x))
                return None
            return x
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                out[k] = v if type(v) in _LEAVES else walk(v, (*path, k))
            return out
        if isinstance(x, (list, tuple)):
            items = [v if type(v) in _LEAVES else walk(v, (*path, i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x

    return walk(payload, ()), found


class _BadPath(Exception):
    """A manifest path that does not lead to a ``None`` of the host part."""


def _place(node: Any, path: tuple[Any, ...], depth: int, value: Any) -> Any:
    """``node`` with ``value`` at ``path[depth:]`` in place of the ``None`` there (dicts
    and lists changed in place, a tuple on the way rebuilt); ``_BadPath`` otherwise."""
    step = path[depth]
    t = type(node)
    if t is dict:
        if type(step) is not str or step not in node:
            raise _BadPath
    elif t is list or t is tuple:
        if type(step) is not int or not 0 <= step < len(node):
            raise _BadPath
    else:
        raise _BadPath
    child = node[step]
    if depth + 1 == len(path):
        if child is not None:
            raise _BadPath
        new = value
    else:
        new = _place(child, path, depth + 1, value)
    if t is tuple:
        items = list(node)
        items[step] = new
        return tuple(items)
    node[step] = new
    return node


def _tensor_type() -> Any:
    import torch

    return torch.Tensor


def _dtypes() -> tuple[dict[Any, int], dict[int, Any]]:
    global _tables
    if _tables is None:
        _tables = _dtype_tables()
    return _tables


_Inner = ShmConnector


def _check_values(*, pool_bytes: Any, event_slots: Any, max_blocks: Any) -> None:
    """The value checks of ``CudaIpcConnector``'s own options (its constructor and its
    ``check_options`` both call this; ``arena_bytes`` and ``linger`` are the inner shm
    connector's to check).

    Raises
    ------
    ConfigurationError
        ``pool_bytes``, ``event_slots`` or ``max_blocks`` not an int in its range, named.
    """
    for name, value, lo, hi in (("pool_bytes", pool_bytes, 1 << 20, 1 << 46),
                                ("event_slots", event_slots, 1, 4096),
                                ("max_blocks", max_blocks, 1, 1 << 20)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigurationError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


# --------------------------------------------------------------------- receiver side
class _Pool:
    """The receiver's pool: its memory, its directory, and the blocks live views hold.

    Shared by the leases of one connector; it holds only what a free takes (not the
    connector), so views may outlive ``close()``: the pool memory is freed when the
    connector is closed and the last view is gone, whichever comes last.
    """

    def __init__(self, ops: Any, directory: Directory, index: int, ptr: int, nbytes: int) -> None:
        self.ops = ops
        self.dir = directory
        self.index = index
        self.ptr = ptr
        self.nbytes = nbytes
        # Reentrant: a lease may die (and its finalizer run) in a thread that holds it.
        self.lock = threading.RLock()
        #: offset -> length of blocks this process holds (views alive, or their last
        #: reader's stream not yet past them)
        self.held: dict[int, int] = {}
        self.by_key: dict[str, list[Any]] = {}
        self.closed = False
        self.freed = False

    def track(self, lease: Any, key: str, offset: int, length: int) -> Any:
        with self.lock:
            self.held[offset] = length
            fin = weakref.finalize(lease, self.release, key, offset, length)
            self.by_key.setdefault(key, []).append(fin)
        return fin

    def hold(self, offset: int, length: int) -> None:
        with self.lock:
            self.held[offset] = length

    def release(self, key: str | None, offset: int, length: int) -> None:
        """The last view of a block died (or ``release(key)``): hand it back once the
        work queued on this thread's stream (its last reader) is past it."""
        if key is not None:
            with self.lock:
                fins = self.by_key.get(key)
                if fins is not None:
                    fins[:] = [f for f in fins if f.alive]
                    if not fins:
                        del self.by_key[key]
        try:
            self.ops.after_use(self.index, lambda: self.push(offset, length))
        except Exception:  # pragma: no cover - interpreter teardown
            logger.debug("cuda_ipc: deferred free failed; freeing now", exc_info=True)
            self.push(offset, length)

    def push(self, offset: int, length: int) -> None:
        with self.lock:
            if self.held.pop(offset, None) is None:
                return
            if not self.closed:
                if not self.dir.push_free(offset, length):  # pragma: no cover - bounded by the sender
                    logger.error("cuda_ipc: released ring full; block at %d lost until the sender restarts", offset)
            elif not self.held:
                self._free_locked()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if not self.held:
                self._free_locked()

    def _free_locked(self) -> None:
        if self.freed:
            return
        self.freed = True
        try:
            self.ops.free_pool(self.index, self.ptr)
        except Exception:  # pragma: no cover - driver teardown
            logger.warning("cuda_ipc: freeing the device pool failed", exc_info=True)
        self.dir.close()


# ----------------------------------------------------------------------- sender side
#: Event slots a put looks at for one already waited on before it takes the next in turn.
SLOT_SCAN = 4


class _Attachment:
    """A sender's view of one receiver's pool: the mapped memory, its events, the
    allocator, the slots in use."""

    __slots__ = ("dir", "gen", "alloc", "ptr", "opened", "index", "events", "rec", "next_slot",
                 "seq", "sent", "by_block", "receiver_pid", "pool_bytes", "ring_cap")

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int, int]] = {}
        self.by_block: dict[int, str] = {}
        self.next_slot = 0
        self.seq = 0


class CudaIpcConnector(BaseConnector):
    """Same-host transfer of CUDA tensors through a device pool the receiver owns.

    Parameters
    ----------
    channel : str
        Channel name; one receiver and one sender at a time per channel.
    role : {"sender", "receiver", "dual"}
        ``dual`` is both ends in one connector.
    timeout : float, optional
        Default seconds for blocking calls (``None``: no limit).
    device : str or torch.device, optional
        Receiver: the device of its pool (default: the current CUDA device).
    pool_bytes : int
        Receiver: size of the device pool (default 256 MiB); the most device bytes one
        payload may hold, and what all payloads in flight and still viewed share.
    event_slots : int
        Receiver: how many interprocess events the sender creates (once, on attach).
        With more payloads unread than this, slots are recorded again: still correct,
        but a late reader may then also wait for newer copies.
    max_blocks : int
        Receiver: the most payloads in flight or viewed at once (released ring size).
    arena_bytes : int
        Size of the shm arena that carries descriptors and CPU tensors.
    linger : float
        Sender: seconds ``close()`` waits for unread descriptors (as shm's ``linger``).

    Raises
    ------
    CudaError
        This process has no CUDA device or no cuda-python (the message says which).
    ConfigurationError
        Bad options; a second live receiver (or sender) on the channel.
    """

    backend = "cuda_ipc"

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this process cannot use the backend (no CUDA, no cuda-python), or ``None``."""
        from omnilink.connectors.cuda_ipc.ops import cuda_ipc_unavailable

        return cuda_ipc_unavailable()

    @classmethod
    def check_options(cls, options: dict[str, Any], /) -> None:
        """Refuse, opening nothing, the option values the constructor would refuse.

        The hook ``omnilink.connectors.check_backend_options`` calls. Whether this
        process has a CUDA device and cuda-python (``unavailable_reason``) and whether
        ``device`` exists are left to the constructor and to ``omnilink check``.

        Parameters
        ----------
        options : dict
            Keyword options as ``connect`` would receive them.

        Raises
        ------
        ConfigurationError
            ``role`` or ``timeout`` invalid; ``pool_bytes`` outside [1 MiB, 64 TiB],
            ``event_slots`` outside [1, 4096], ``max_blocks`` outside [1, 2**20]; or what
            ``ShmConnector.check_options`` refuses of the inner connector's options
            (``arena_bytes`` below 1 MiB, ``linger`` not a number >= 0, a channel too
            long for its ``/cuda-ipc`` suffix).
        """
        values = check_constructor_options(cls, _check_values, options)
        # Descriptors and host tensors travel through an inner shm connector: its own
        # checks of exactly what the constructor hands it.
        inner = {"role": values["role"], "arena_bytes": values["arena_bytes"], "linger": values["linger"]}
        if "channel" in values:
            inner["channel"] = f"{values['channel']}/cuda-ipc"
        _Inner.check_options(inner)

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
        device: Any = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        event_slots: int = DEFAULT_EVENT_SLOTS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        linger: float = 5.0,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(pool_bytes=pool_bytes, event_slots=event_slots, max_blocks=max_blocks)
        self.pool_bytes = round_up(pool_bytes)
        self.event_slots = event_slots
        self.max_blocks = max_blocks
        self._sends = role in ("sender", "dual")
        self._recvs = role in ("receiver", "dual")
        self._prefix = read_prefix()
        self._pid = os.getpid()
        #: the peer's liveness, looked up on every put and get (a pidfd poll)
        self._peers = PeerWatch()
        self._ops = self._make_ops()
        self._tx: _Attachment | None = None
        self._tx_lock = threading.RLock()
        #: why the last receiver went away (until a new one is found): put raises it
        #: instead of waiting for a receiver
        self._lost_reason: str | None = None
        self._pool: _Pool | None = None
        self._rx_events: tuple[int, list[Any], bool] | None = None  # (gen, events, opened)
        #: (tensor entries, their end, parsed) of the last valid manifest (``_parse``)
        self._parsed: tuple[list[Any], int, list[Any]] | None = None
        self._rx_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._inner: _Inner | None = None
        try:
            self._inner = _Inner(channel=f"{channel}/cuda-ipc", role=role, arena_bytes=arena_bytes,
                                 linger=linger)
            if self._recvs:
                self._open_pool(device)
        except BaseException:
            self._close()
            raise

    @staticmethod
    def _make_ops() -> Any:
        """The device operations (``CudaDeviceOps``); the test suite overrides this with
        a host-memory double."""
        from omnilink.connectors.cuda_ipc.ops import CudaDeviceOps

        return CudaDeviceOps()

    def _open(self, part: _T | None) -> _T:
        """``part`` (the inner connector, the pool), or ``ClosedError`` once close() has
        dropped it."""
        if part is None:
            raise ClosedError(f"cuda_ipc connector on channel {self.channel!r} is closed")
        return part

    def _start_thread(self, name: str, period: float, beat: str) -> None:
        """A heartbeat thread calling ``self.<beat>()`` every ``period`` s until close."""
        ref = weakref.ref(self)
        t = threading.Thread(target=_heartbeat_loop, args=(ref, self._stop, period, beat), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # ---------------------------------------------------------------- receiver
    def _open_pool(self, device: Any) -> None:
        ops = self._ops
        index = ops.device_index(device)
        with HostLock():
            for pid, name in find_directories(self._prefix, self.channel):
                if pid_alive(pid):
                    raise ConfigurationError(
                        f"cuda_ipc: channel {self.channel!r} already has a receiver (pid {pid}); "
                        "one receiver per channel"
                    )
                unlink_segment(name)
            ptr, handle = ops.alloc_pool(index, self.pool_bytes)
            try:
                d = Directory.create(self._prefix, self.channel, device=index, uuid=ops.device_uuid(index),
                                     pool_bytes=self.pool_bytes, nslots=self.event_slots,
                                     ring_cap=self.max_blocks, mem_handle=handle)
            except BaseException:
                ops.free_pool(index, ptr)
                raise
        with _local_lock:
            _LOCAL_POOLS[d.name] = ptr
        self._pool = _Pool(ops, d, index, ptr, self.pool_bytes)
        self._start_thread(f"omnilink-cuda-ipc-rx-{self.channel}", 0.02, "_answer_attach")

    def _answer_attach(self) -> None:
        """A new sender asked what this receiver still holds (its allocator starts from
        that); runs on the receiver's heartbeat thread."""
        pool = self._pool
        if pool is None:
            return
        d = pool.dir
        want = d.get(WANT_GEN)
        if want == d.get(ACK_GEN):
            return
        with pool.lock:
            d.write_held(sorted(pool.held.items()))
            d.set(SNAP_HEAD, d.get(RING_HEAD))
        d.set(ACK_GEN, want)

    def _slot_events(self, gen: int) -> list[Any]:
        pool = self._open(self._pool)
        with self._rx_lock:
            cached = self._rx_events
            if cached is not None and cached[0] == gen:
                return cached[1]
            if cached is not None and cached[2]:
                self._ops.destroy_events(pool.index, cached[1])
            self._rx_events = None
            d = pool.dir
            if d.get(EVENTS_GEN) != gen:
                raise PeerLostError(f"cuda_ipc: the sender on channel {self.channel!r} has not published "
                                    "its events")
            with _local_lock:
                local = _LOCAL_EVENTS.get((d.name, gen))
            if local is not None:
                events, opened = local, False
            else:
                events = self._ops.open_events(pool.index, [d.slot_handle(i) for i in range(d.nslots)])
                opened = True
            self._rx_events = (gen, events, opened)
            return events

    def _parse(self, key: str, m: Any) -> tuple[int, int, int, int, int, list[tuple[Any, ...]]]:
        """Validate a manifest before anything of it is used (a hostile sender cannot
        make the receiver read outside its pool or build a view that lies about its size).

        ``m`` is ``[gen, seq, slot, block, total, tensors]``, each tensor ``[dtype code,
        offset in block, nbytes, shape, path]``. Returns ``(gen, seq, slot, block, total,
        tensors)``, each tensor ``(dtype, offset, nbytes, shape, contiguous strides,
        offset in elements, path)``. The tensor list of the last valid manifest is
        remembered: a stream of same-shaped payloads checks only its extent again."""
        pool = self._open(self._pool)

        def bad(why: str) -> BlobDecodeError:
            return BlobDecodeError(f"cuda_ipc: key {key!r}: invalid device manifest: {why}")

        def is_int(x: Any, lo: int = 0, hi: int = _INT64_MAX) -> bool:
            return type(x) is int and lo <= x <= hi

        if type(m) is not list or len(m) != 6:
            raise bad("not [generation, sequence, slot, block, size, tensors]")
        gen, seq, slot, block, total, entries = m
        if not (is_int(gen, 1) and is_int(seq, 1) and is_int(slot, 0, pool.dir.nslots - 1)):
            raise bad("generation, sequence or event slot out of range")
        if not (is_int(block) and is_int(total, 1) and block % ALIGN == 0 and block + total <= pool.nbytes):
            raise bad(f"block [{block!r}, +{total!r}) is not inside the {pool.nbytes}-byte pool")
        if total % ALIGN:
            raise bad(f"block size {total} is not a multiple of {ALIGN}")
        if type(entries) is not list or not 1 <= len(entries) <= MAX_TENSORS:
            raise bad("tensor list missing or too long")
        last = self._parsed
        if last is not None and entries == last[0]:
            # The tensors of the last valid manifest (a stream repeats them): only their
            # extent against this block's size is new. ``==`` may also match floats or
            # bools equal to those ints; what is used is the validated copy.
            if last[1] > total:
                raise bad(f"tensors end at {last[1]}, past the block's {total} bytes")
            return gen, seq, slot, block, total, last[2]
        _, by_code = _dtypes()
        out = []
        end = 0
        for i, e in enumerate(entries):
            if type(e) is not list or len(e) != 5:
                raise bad(f"tensor {i} is not [dtype, offset, nbytes, shape, path]")
            code, off, nbytes, shape, path = e
            dt = by_code.get(code) if type(code) is int else None
            if dt is None:
                raise bad(f"tensor {i}: unknown dtype code {code!r}")
            if type(shape) is not list or len(shape) > MAX_NDIM or not all(is_int(x) for x in shape):
                raise bad(f"tensor {i}: shape {shape!r} is not a list of at most {MAX_NDIM} dims >= 0")
            if (type(path) is not list or len(path) > MAX_TREE_DEPTH
                    or not all(type(x) is str or is_int(x, 0, MAX_TREE_ITEMS) for x in path)):
                raise bad(f"tensor {i}: path {path!r} is not a list of at most {MAX_TREE_DEPTH} keys or indices")
            if not (is_int(off) and is_int(nbytes) and off + nbytes <= total):
                raise bad(f"tensor {i}: region [{off!r}, +{nbytes!r}) is not inside the block")
            shape = tuple(shape)
            itemsize = _ITEMSIZE[code]
            numel = 1
            # Bytes the non-zero dims address: every contiguous stride is a product of
            # later dims (a 0 counts as 1) and every extent stride * (dim - 1), so all
            # of them fit in int64 when this does, and torch counts numel over these
            # dims before any 0 can zero it. An empty tensor with a 2**40 x 2**40 rest
            # would otherwise reach as_strided (TypeError, or numel overflow).
            span = itemsize
            for x in shape:
                numel *= x
                if x:
                    span *= x
            if span > _INT64_MAX:
                raise bad(f"tensor {i}: shape {shape} overflows int64 (its non-zero dims "
                          f"times itemsize {itemsize} exceed 2**63 - 1 bytes)")
            if numel * itemsize != nbytes:
                raise bad(f"tensor {i}: {nbytes} bytes for shape {shape} of {dt}")
            if off % itemsize:
                raise bad(f"tensor {i}: offset {off} not aligned to its dtype")
            out.append((dt, off, nbytes, shape, _contiguous_strides(shape), off // itemsize, tuple(path)))
            end = max(end, off + nbytes)
        if len(out) > 1 and any(not t[6] for t in out):
            raise bad("the payload itself is a tensor, yet the manifest names more than one")
        self._parsed = (entries, end, out)
        return gen, seq, slot, block, total, out

    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        if not self._recvs:
            raise ConfigurationError(
                f"cuda_ipc connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        inner = self._open(self._inner)
        try:
            obj = inner.get(key, timeout=deadline.remaining()) if block else inner.get_nowait(key)
        except TransferTimeout:
            raise self._timeout("get", key, "a sender", deadline.timeout) from None
        return self._land_message(key, obj)

    def _land_message(self, key: str, obj: Any) -> Any:
        """The payload of a message ``_send`` made, received under ``key`` (here from the
        inner channel; the shm backend's device-IPC route hands over the one it claimed
        on its own channel): views of the pool put where the manifest's paths say, the
        current stream ordered after the sender's copy (host not blocked)."""
        if type(obj) is not dict or len(obj) != 3 or type(obj.get("n")) is not int or "d" not in obj or "h" not in obj:
            raise BlobDecodeError(f"cuda_ipc: key {key!r}: not a cuda_ipc message")
        m, out, size = obj["d"], obj["h"], obj["n"]
        if m is None:
            self._count(bytes_got=size)
            return out
        pool = self._open(self._pool)
        gen, seq, slot, blk, total, entries = self._parse(key, m)
        d = pool.dir
        pool.hold(blk, total)
        try:
            base, lease = self._ops.view(pool.ptr + blk, total, pool.index)
            views = []
            typed: dict[Any, Any] = {}
            for dt, off, nbytes, shape, stride, first, path in entries:
                # One view of the block per dtype, one as_strided per tensor (a slice and
                # two views per tensor cost twice as much).
                tv = typed.get(dt)
                if tv is None:
                    t = base.view(dt)  # the block's size is a multiple of ALIGN (_parse)
                    tv = typed[dt] = (t, t.storage_offset())
                views.append(tv[0].as_strided(shape, stride, tv[1] + first))
            del base, typed
            fin = pool.track(lease, key, blk, total)
            del lease
        except BaseException:
            views = []
            pool.release(None, blk, total)
            raise
        try:
            try:
                for (*_, path), v in zip(entries, views):
                    if not path:
                        if out is not None:
                            raise _BadPath
                        out = v
                    else:
                        out = _place(out, path, 0, v)
            except _BadPath:
                raise BlobDecodeError(f"cuda_ipc: key {key!r}: a manifest path does not lead to a free "
                                      "place of the payload") from None
            finally:
                del views
            if d.get(CLEAN_GEN) != gen:  # the sender's copies may still run: order after them
                sp = d.get(SENDER_PID)
                if d.get(GEN) != gen or (sp != self._pid and (sp == 0 or not self._peers.alive(sp))):
                    raise PeerLostError(
                        f"cuda_ipc: the sender that put key {key!r} on channel {self.channel!r} died before "
                        "its device copy could be confirmed; the payload is lost"
                    )
                self._ops.wait(pool.index, self._slot_events(gen)[slot])
                if seq > d.done_seq(slot):  # the wait is queued: the sender may record the slot again
                    d.set_done_seq(slot, seq)
        except BaseException:
            out = None
            fin()  # no view was handed out: free the block now (after this stream)
            raise
        self._count(bytes_got=size, device_gets=1)
        return out

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        inner = self._open(self._inner)
        return inner._arrivals(known, timeout)

    def _discard(self, key: str) -> bool:
        inner = self._open(self._inner)
        if not self._recvs:
            dropped = inner.discard(key)
            if dropped:
                self._withdrawn(key)
            return dropped
        try:
            obj = inner.get_nowait(key)
        except (WouldBlock, KeyConsumedError):
            return False
        return self._drop_message(key, obj)

    def _withdrawn(self, key: str) -> None:
        """Sender: the message of ``key`` was withdrawn unread: its block is free again."""
        with self._tx_lock:
            tx = self._tx
            got = tx.sent.pop(key, None) if tx is not None else None
            if tx is not None and got is not None:
                blk, slot, seq = got
                tx.by_block.pop(blk, None)
                tx.alloc.free(blk)
                tx.dir.set_done_seq(slot, seq)

    def _drop_message(self, key: str, obj: Any) -> bool:
        """Receiver: a message of ``_send`` discarded unread: its block goes back."""
        m = obj.get("d") if isinstance(obj, dict) else None
        pool = self._pool
        if m is not None and pool is not None:
            try:
                gen, seq, slot, blk, total, _ = self._parse(key, m)
            except BlobDecodeError:
                logger.warning("cuda_ipc: discarded key %r carried an invalid manifest", key)
                return True
            pool.hold(blk, total)
            if pool.dir.get(GEN) == gen and seq > pool.dir.done_seq(slot):
                pool.dir.set_done_seq(slot, seq)
            pool.push(blk, total)  # never viewed: no reader to wait for
        return True

    def release(self, key: str, /) -> bool:
        """Hand the pool blocks (and shm blocks) of a payload received under ``key`` back
        now; its tensors must not be used afterwards. See ``BaseConnector.release``."""
        self._check_open()
        from omnilink._util import validate_key

        validate_key(key)
        done = False
        pool = self._pool
        if pool is not None:
            with pool.lock:
                fins = pool.by_key.pop(key, [])
            for fin in fins:
                if fin.alive:
                    fin()
                    done = True
        inner = self._inner
        if inner is not None and self._recvs:
            done = inner.release(key) or done
        return done

    # ------------------------------------------------------------------ sender
    def _put(self, key: str, payload: Any, deadline: Deadline, ctx: Any = None) -> int:
        inner = self._open(self._inner)
        return self._send(key, payload, deadline, ctx,
                          lambda msg: inner.put(key, msg, timeout=deadline.remaining()))

    def _send(self, key: str, payload: Any, deadline: Deadline, ctx: Any, publish: Any, *,
              size: int | None = None, room: Deadline | None = None) -> int:
        """Copy the CUDA tensors of ``payload`` into a block of the receiver's pool and
        hand ``publish`` the message that describes it (``{"d": manifest, "h": host
        part, "n": size}``, what ``_land_message`` opens; the host part is the payload
        with ``None`` where each CUDA tensor was). If ``publish`` raises, the
        block and its event slot are taken back and the error goes on. ``size``: the
        payload's tensor_blob size when the caller knows it; ``room``: the deadline of
        the wait for room in the pool (default ``deadline``)."""
        if not self._sends:
            raise ConfigurationError(
                f"cuda_ipc connector on channel {self.channel!r} was opened with role='receiver' "
                "and cannot put; open it with role='sender' or 'dual'"
            )
        ops = self._ops
        # What put returns (the Connector contract): the payload's tensor_blob size.
        if size is None:
            size = encoded_size(payload)
        host, chosen = _split(payload, ops.is_device_tensor, _tensor_type())
        if not chosen:
            publish({"d": None, "h": host, "n": size})
            return size
        by_dtype, _ = _dtypes()
        entries: list[list[Any]] = []
        items: list[tuple[int, Any]] = []
        off = 0
        for path, t in chosen:
            code = by_dtype.get(t.dtype)
            if code is None:
                from omnilink._errors import BlobEncodeError

                raise BlobEncodeError(f"cuda_ipc: the tensor at {list(path)} has dtype {t.dtype}, which omnilink "
                                      "cannot carry")
            if t.requires_grad:
                t = t.detach()
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()
            n = t.numel() * t.element_size()
            off = (off + ALIGN - 1) & -ALIGN
            entries.append([code, off, n, list(t.shape), list(path)])
            items.append((off, t))
            off += n
        total = max((off + ALIGN - 1) & -ALIGN, ALIGN)
        with self._tx_lock:
            self._check_open()
            tx = self._attached(deadline)
            if total > tx.pool_bytes:
                raise CapacityError(
                    f"cuda_ipc: payload {key!r} holds {total} device bytes; the receiver's pool is "
                    f"{tx.pool_bytes} bytes (raise the receiver's pool_bytes)"
                )
            blk = self._alloc(tx, key, total, room or deadline)
            slot = self._take_slot(tx)
            tx.seq += 1
            seq = tx.seq
            try:
                ops.copy_in(tx.index, [(tx.ptr + blk + o, t) for o, t in items], tx.events[slot], ctx)
            except BaseException:
                tx.alloc.free(blk)
                raise
            tx.rec[slot] = seq
            tx.dir.set_rec_seq(slot, seq)
            try:
                publish({"d": [tx.gen, seq, slot, blk, total, entries], "h": host, "n": size})
            except BaseException:
                # Never published: nobody will wait on the slot or read the block; a later
                # copy into it runs after this one (same copy stream).
                tx.dir.set_done_seq(slot, seq)
                tx.alloc.free(blk)
                raise
            tx.sent[key] = (blk, slot, seq)
            tx.by_block[blk] = key
        self._count(device_puts=1)
        return size

    def _async_context(self, payload: Any) -> Any:
        """``put_async``: the producer's events, recorded in the caller's thread (the put
        thread's current streams are not the caller's)."""
        if not self._sends:
            return None
        return self._ops.producer_events(payload)

    def _lost(self, tx: _Attachment) -> str | None:
        d = tx.dir
        if d.get(STATE) != STATE_OPEN:
            return "closed"
        if tx.receiver_pid != self._pid and not self._peers.alive(tx.receiver_pid):
            return "died"
        return None

    def _peer_lost(self, why: str, key: str | None) -> PeerLostError:
        with self._tx_lock:
            tx, self._tx = self._tx, None
            pid = tx.receiver_pid if tx is not None else 0
            if tx is not None:
                self._detach(tx, clean=False)
        msg = (f"cuda_ipc: the receiver (pid {pid}) on channel {self.channel!r} {why}; this sender closed "
               "its handles to its pool")
        self._lost_reason = msg
        return PeerLostError(msg)

    @property
    def pool_device(self) -> int | None:
        """Receiver: the CUDA device index of its pool (``None`` once closed)."""
        pool = self._pool
        return None if pool is None else pool.index

    def attach(self, timeout: float | None = None) -> int:
        """Sender: find the channel's receiver and map its pool now (``put`` does it on
        first use); return the pool's device index in this process.

        Raises
        ------
        TransferTimeout
            No receiver opened its pool within ``timeout``.
        PeerLostError, ConfigurationError
            The receiver is gone; the channel already has a sender.
        """
        if not self._sends:
            raise ConfigurationError(f"cuda_ipc connector on channel {self.channel!r} is not a sender")
        with self._tx_lock:
            self._check_open()
            return self._attached(self._deadline(timeout)).index

    def _attached(self, deadline: Deadline) -> _Attachment:
        tx = self._tx
        if tx is not None:
            why = self._lost(tx)
            if why is None:
                return tx
            raise self._peer_lost(why, None)
        return self._attach(deadline)

    def _attach(self, deadline: Deadline) -> _Attachment:
        """Find the channel's receiver, map its pool, create and publish the events."""
        ops = self._ops
        delay = 0.001
        while True:
            found = [(pid, name) for pid, name in find_directories(self._prefix, self.channel)
                     if pid == self._pid or pid_alive(pid)]
            if found:
                try:
                    d = Directory.open(found[0][1])
                except Exception:  # gone meanwhile, or not yet complete
                    d = None
                if d is not None and d.get(STATE) == STATE_OPEN:
                    break
                if d is not None:
                    d.close()
            if self._lost_reason is not None:
                raise PeerLostError(self._lost_reason)
            if deadline.expired():
                raise self._timeout("put (waiting for a cuda_ipc receiver to open its pool)", None,
                                    "a receiver", deadline.timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        tx = _Attachment()
        try:
            with HostLock():
                sp = d.get(SENDER_PID)
                with _local_lock:
                    mine = d.name in _LOCAL_SENDERS
                if (sp and sp != self._pid and pid_alive(sp)) or (sp == self._pid and mine):
                    raise ConfigurationError(
                        f"cuda_ipc: channel {self.channel!r} already has a sender (pid {sp}); one sender per channel"
                    )
                with _local_lock:
                    _LOCAL_SENDERS.add(d.name)
                old = d.get(GEN)
                gen = old + 1
                d.set(SENDER_PID, self._pid)
                d.set(GEN, gen)
                if old:
                    d.set(WANT_GEN, gen)
            tx.dir, tx.gen = d, gen
            tx.receiver_pid = d.get(RECV_PID)
            tx.pool_bytes = d.get(POOL_BYTES)
            tx.ring_cap = d.ring_cap
            tx.alloc = BlockAllocator(tx.pool_bytes)
            if old:  # a sender was here before: start from what the receiver still holds
                while d.get(ACK_GEN) != gen:
                    if self._lost(tx) is not None:
                        raise PeerLostError(f"cuda_ipc: the receiver on channel {self.channel!r} is gone")
                    if deadline.expired():
                        raise self._timeout("put (waiting for the receiver to list the blocks it holds)",
                                            None, "the receiver", deadline.timeout)
                    time.sleep(0.001)
                for off, length in d.read_held():
                    if not tx.alloc.reserve(off, length):
                        logger.warning("cuda_ipc: receiver holds an invalid block [%d, +%d)", off, length)
                d.set(RING_TAIL, d.get(SNAP_HEAD))
            else:
                d.set(RING_TAIL, d.get(RING_HEAD))
            tx.index = ops.index_of_uuid(d.uuid(), d.get(DEVICE))
            with _local_lock:
                local = _LOCAL_POOLS.get(d.name) if tx.receiver_pid == self._pid else None
            if local is not None:
                tx.ptr, tx.opened = local, False
            else:
                tx.ptr, tx.opened = ops.open_pool(tx.index, d.mem_handle()), True
            created = ops.create_events(tx.index, d.nslots)
            tx.events = [ev for ev, _ in created]
            tx.rec = [0] * d.nslots
            for i, (_, handle) in enumerate(created):
                d.set_slot_handle(i, handle)
                d.set_done_seq(i, 0)
                d.set_rec_seq(i, 0)
            with _local_lock:
                _LOCAL_EVENTS[(d.name, gen)] = tx.events
            d.set(EVENTS_GEN, gen)
        except BaseException:
            if getattr(tx, "ptr", None) is not None and tx.opened:
                try:
                    ops.close_pool(tx.index, tx.ptr)
                except Exception:  # pragma: no cover
                    logger.debug("cuda_ipc: close_pool failed", exc_info=True)
            if d.get(SENDER_PID) == self._pid and d.get(GEN) == getattr(tx, "gen", -1):
                d.set(SENDER_PID, 0)
                with _local_lock:
                    _LOCAL_SENDERS.discard(d.name)
            d.close()
            raise
        self._tx = tx
        self._lost_reason = None
        if not any(t.name.startswith("omnilink-cuda-ipc-tx") for t in self._threads):
            self._start_thread(f"omnilink-cuda-ipc-tx-{self.channel}", HEARTBEAT_S, "_watch_receiver")
        logger.debug("cuda_ipc: sender attached to %s (generation %d)", d.name, gen)
        return tx

    def _drain(self, tx: _Attachment) -> None:
        for off, _length in tx.dir.drain_frees():
            key = tx.by_block.pop(off, None)
            if key is not None:
                tx.sent.pop(key, None)
            try:
                tx.alloc.free(off)
            except KeyError:
                logger.warning("cuda_ipc: the receiver freed an unknown block at %d", off)

    def _wait_room(self, tx: _Attachment, key: str, deadline: Deadline, what: str, rounds: int) -> None:
        """One round of waiting for the receiver to free pool blocks. The first rounds
        only yield (a free usually arrives within microseconds of the receiver's next
        get: a 0.5 ms sleep per round cost large payloads a third of their speed), then
        sleeps grow to 0.5 ms."""
        why = self._lost(tx)
        if why is not None:
            raise self._peer_lost(why, key)
        self._check_open()
        if deadline.expired():
            raise self._timeout(f"put ({what})", key, "the receiver", deadline.timeout)
        time.sleep(0 if rounds < 200 else min(0.0005, 0.00002 * (rounds - 199)))

    def _alloc(self, tx: _Attachment, key: str, total: int, deadline: Deadline) -> int:
        rounds = 0
        while True:
            self._drain(tx)
            if tx.alloc.blocks < tx.ring_cap:
                blk = tx.alloc.alloc(total)
                if blk is not None:
                    return blk
            self._wait_room(tx, key, deadline, "the receiver's pool is full", rounds)
            rounds += 1

    def _take_slot(self, tx: _Attachment) -> int:
        """A slot whose last record the receiver has already waited on (or discarded);
        when every slot is still awaited, the next one in turn. Recording a slot again
        is always correct: all records are on one copy stream, so a receiver whose wait
        comes after the new record waits for a later point of that stream (its own copy
        is done by then); it may only wait longer. Free slots keep that from happening
        while fewer than ``event_slots`` payloads are unread.

        Slots are taken in turn, so the oldest record is the next one: only the next
        ``SLOT_SCAN`` are looked at (a sender far ahead of its receiver found every slot
        awaited after scanning all of them: 100 us per put on an H100 host)."""
        n = len(tx.events)
        d = tx.dir
        start = tx.next_slot
        for k in range(min(n, SLOT_SCAN)):
            i = (start + k) % n
            if d.done_seq(i) >= tx.rec[i]:
                tx.next_slot = (i + 1) % n
                return i
        tx.next_slot = (start + 1) % n
        return start

    def _detach(self, tx: _Attachment, *, clean: bool) -> None:
        ops = self._ops
        d = tx.dir
        try:
            if clean:
                ops.synchronize(tx.index)
                if d.get(GEN) == tx.gen:
                    d.set(CLEAN_GEN, tx.gen)
            ops.drain()
            if tx.opened:
                ops.close_pool(tx.index, tx.ptr)
        except OmnilinkError:
            logger.warning("cuda_ipc: closing the pool handle failed", exc_info=True)
        finally:
            with _local_lock:
                _LOCAL_EVENTS.pop((d.name, tx.gen), None)
            ops.destroy_events(tx.index, tx.events)
            if d.get(SENDER_PID) == self._pid and d.get(GEN) == tx.gen:
                d.set(SENDER_PID, 0)
            with _local_lock:
                _LOCAL_SENDERS.discard(d.name)
            d.close()

    def _watch_receiver(self) -> None:
        """Heartbeat of a sender: a receiver that died takes its pool with it; close our
        handle to it now, not at the next put."""
        with self._tx_lock:
            tx = self._tx
            if tx is None:
                return
            why = self._lost(tx)
        if why is not None:
            logger.warning("cuda_ipc: receiver (pid %d) on channel %r %s; closing its pool handle",
                           tx.receiver_pid, self.channel, why)
            self._peer_lost(why, None)

    # ----------------------------------------------------------------- common
    def _in_use(self) -> tuple[int, int]:
        blocks = nbytes = 0
        tx = self._tx
        if tx is not None:
            blocks += tx.alloc.blocks
            nbytes += tx.alloc.used_bytes
        pool = self._pool
        if pool is not None and not self._sends:
            with pool.lock:
                blocks += len(pool.held)
                nbytes += sum(pool.held.values())
        return blocks, nbytes

    def _wake(self) -> None:
        self._stop.set()

    def _close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        self._threads.clear()
        with self._tx_lock:
            tx, self._tx = self._tx, None
        if tx is not None:
            self._detach(tx, clean=True)
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            d = pool.dir
            d.set(STATE, STATE_CLOSED)
            unlink_segment(d.name)
            with _local_lock:
                _LOCAL_POOLS.pop(d.name, None)
            with self._rx_lock:
                cached, self._rx_events = self._rx_events, None
            if cached is not None and cached[2]:
                self._ops.destroy_events(pool.index, cached[1])
            pool.close()
        self._peers.close()


def _heartbeat_loop(ref: Any, stop: threading.Event, period: float, beat: str) -> None:
    """Call ``beat`` on the connector every ``period`` s until ``stop``; holds it only
    weakly (and only during a beat), so the thread never keeps it alive."""
    while not stop.wait(period):
        conn = ref()
        if conn is None:
            return
        try:
            getattr(conn, beat)()
        except Exception:  # pragma: no cover - keep the heartbeat alive
            logger.debug("cuda_ipc: heartbeat %s failed", beat, exc_info=True)
        del conn


def live_pool_owner(channel: str) -> int | None:
    """The pid of the live receiver whose open device pool serves ``channel``, or ``None``.

    A cheap look at ``/dev/shm`` (no CUDA call): what a transport that may send by device
    IPC checks before it opens a sender.
    """
    for pid, name in find_directories(read_prefix(), channel):
        if not pid_alive(pid):
            continue
        try:
            d = Directory.open(name)
        except Exception:  # gone meanwhile, or not complete yet
            continue
        try:
            if d.get(STATE) == STATE_OPEN:
                return pid
        finally:
            d.close()
    return None
