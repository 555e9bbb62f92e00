"""``CudaIpcConnector``: the ``cuda_ipc`` backend (see the package docstring for the design)."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from omnilink._errors import (
    ClosedError,
    ConfigurationError,
    KeyConsumedError,
    TransferTimeout,
    WouldBlock,
)
from omnilink._util import Deadline, duplicate_key
from omnilink.connectors.base import BaseConnector, Role, check_constructor_options
from omnilink.connectors.devpool import (
    DEFAULT_EVENT_SLOTS,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_POOL_BYTES,
    PoolReceiver,
    PoolSender,
    cuda_ipc_unavailable,
    live_pool_owner,
    round_up,
)
from omnilink.connectors.shm import ShmConnector

__all__ = ["DEFAULT_POOL_BYTES", "CudaIpcConnector", "live_pool_owner"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The inner shm connector carries descriptors and CPU parts only: a small arena.
DEFAULT_ARENA_BYTES = 16 << 20

_Inner = ShmConnector


def _check_values(*, pool_bytes: Any, event_slots: Any, max_blocks: Any, pool_max_bytes: Any = None) -> None:
    """The value checks of ``CudaIpcConnector``'s own options (its constructor and its
    ``check_options`` both call this; ``arena_bytes`` and ``linger`` are the inner shm
    connector's to check).

    Raises
    ------
    ConfigurationError
        ``pool_bytes``, ``event_slots`` or ``max_blocks`` not an int in its range, or
        ``pool_max_bytes`` neither ``None`` nor such an int, named.
    """
    if pool_max_bytes is not None and (isinstance(pool_max_bytes, bool) or not isinstance(pool_max_bytes, int)
                                       or not 1 << 20 <= pool_max_bytes <= 1 << 52):
        raise ConfigurationError(f"pool_max_bytes must be None or an int in [{1 << 20}, {1 << 52}], "
                                 f"got {pool_max_bytes!r}")
    for name, value, lo, hi in (("pool_bytes", pool_bytes, 1 << 20, 1 << 46),
                                ("event_slots", event_slots, 1, 4096),
                                ("max_blocks", max_blocks, 1, 1 << 20)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigurationError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


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
        Receiver: size of the device pool as it opens (default 256 MiB). It grows when
        a payload does not fit (larger than every segment, or the pool full of payloads
        the receiver still views; unread ones never grow it): the receiver allocates another segment as large as the pool already is
        (or as the payload), up to 16 segments and ``pool_max_bytes`` in all.
    pool_max_bytes : int, optional
        Receiver: the most bytes the pool may grow to (default ``None``: ``pool_bytes``
        plus three quarters of the device memory free once the pool is allocated). A
        payload that would need more waits for room, or is a ``CapacityError`` naming
        the sizes when it is larger than every segment.
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
        pool_max_bytes: int | None = None,
        event_slots: int = DEFAULT_EVENT_SLOTS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        linger: float = 5.0,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(pool_bytes=pool_bytes, event_slots=event_slots, max_blocks=max_blocks,
                      pool_max_bytes=pool_max_bytes)
        self.pool_bytes = round_up(pool_bytes)
        self.event_slots = event_slots
        self.max_blocks = max_blocks
        #: device argument of a get -> whether it names the pool's device
        self._pool_devices: dict[Any, bool] = {}
        self._sends = role in ("sender", "dual")
        self._recvs = role in ("receiver", "dual")
        self._ops = self._make_ops()
        #: the two ends of the device pool (``devpool``) this connector is
        self._sender: PoolSender | None = PoolSender(self._ops, channel) if self._sends else None
        if self._sender is not None:
            self._sender.withdraw = self._withdraw_lane
            # Its messages go in the pool's lane as they are (``_put``'s publish), so a
            # stream of same-shaped payloads may go by a send plan.
            self._sender.lane_mark, self._sender.lane_wake = None, self._wake_inner
        self._receiver: PoolReceiver | None = None
        self._inner: _Inner | None = None
        try:
            self._inner = _Inner(channel=f"{channel}/cuda-ipc", role=role, arena_bytes=arena_bytes,
                                 linger=linger)
            if self._recvs:
                rx = self._receiver = PoolReceiver(self._ops, channel, device=device,
                                                   pool_bytes=self.pool_bytes, event_slots=event_slots,
                                                   max_blocks=max_blocks, pool_max_bytes=pool_max_bytes)
                # The sender puts each message in the pool's lane: the inner channel
                # takes them as its own (no arena block, no frame to decode).
                self._inner.attach_lane(rx.lane, lambda key, msg: rx.drop(key or "<lane>", msg))
                self._inner._wait_hook = rx.prebuild
        except BaseException:
            self._close()
            raise

    @staticmethod
    def _make_ops() -> Any:
        """The device operations (``CudaDeviceOps``); the test suite overrides this with
        a host-memory double."""
        from omnilink.connectors.devpool import CudaDeviceOps

        return CudaDeviceOps()

    def _open(self, part: _T | None) -> _T:
        """``part`` (the inner connector, an end of the pool), or ``ClosedError`` once
        close() has dropped it."""
        if part is None:
            raise ClosedError(f"cuda_ipc connector on channel {self.channel!r} is closed")
        return part

    @property
    def pool_device(self) -> int | None:
        """Receiver: the CUDA device index of its pool (``None`` once closed)."""
        rx = self._receiver
        return None if rx is None else rx.index

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
        self._check_open()
        return self._open(self._sender).attach(self._deadline(timeout))

    # ---------------------------------------------------------------- receiver
    def _get(self, key: str, deadline: Deadline, block: bool, to_host: bool = True,
             pooled: list[Any] | None = None) -> Any:
        if not self._recvs:
            raise ConfigurationError(
                f"cuda_ipc connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        inner = self._open(self._inner)
        try:
            # The inner channel's own get, the key already validated and the deadline made.
            obj = inner._get(key, deadline, True) if block else inner.get_nowait(key)
        except TransferTimeout:
            raise self._timeout("get", key, "a sender", deadline.timeout) from None
        return self._land_message(key, obj, to_host, deadline, pooled)

    def _receive(self, key: str, deadline: Deadline, block: bool, device: Any) -> Any:
        """``get``: the payload, its tensors moved to ``device``. A receiver whose gets
        land on a device says so in its pool's directory: the sender then carries the
        payload's small host tensors in the pool block with the device tensors, and they
        arrive as views of the pool instead of being copied to the device one by one
        here (a get without ``device`` turns those back into host tensors); beside
        device tensors of another GPU than the pool's without an MPS server it leaves
        them in the message (``devpool.sender.HOSTS_ACROSS_GPUS``), and they are copied
        here."""
        rx = self._receiver
        landing = device is not None
        if rx is not None and rx.landing != landing:
            rx.set_landing(landing)
        pooled: list[Any] = [False, 0]
        obj = self._get(key, deadline, block, not landing, pooled)
        if landing and not (pooled[0] and self._is_pool_device(device)):
            # (every tensor a view of the pool on that very device: nothing to move)
            from omnilink.cuda import payload_to_device

            obj = payload_to_device(obj, device)
        return obj

    def _is_pool_device(self, device: Any) -> bool:
        """Whether the ``device`` argument of a get names the pool's device with an index
        (looked up once per argument value)."""
        try:
            hit = self._pool_devices.get(device)
        except TypeError:  # unhashable: payload_to_device checks it
            return False
        if hit is None:
            rx = self._receiver
            try:
                import torch

                dev = torch.device(device)
            except (RuntimeError, TypeError, ValueError):
                return False  # payload_to_device names what is wrong with it
            hit = rx is not None and dev.type == "cuda" and dev.index is not None and dev.index == rx.index
            if len(self._pool_devices) < 16:
                self._pool_devices[device] = hit
        return hit

    def _land_message(self, key: str, obj: Any, to_host: bool = True, deadline: Deadline | None = None,
                      pooled: list[Any] | None = None) -> Any:
        """The payload of a message received on the inner channel under ``key``: views of
        the pool put where the manifest's paths say (``PoolReceiver.land``; ``to_host``:
        host tensors the sender carried in the block come back as host tensors), counted."""
        if pooled is None:
            pooled = [False, 0]
        out = self._open(self._receiver).land(key, obj, to_host=to_host, deadline=deadline, pooled=pooled)
        if obj["d"] is None:
            self._count(bytes_got=pooled[1])
        else:
            self._count(bytes_got=pooled[1], device_gets=1)
        return out

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        inner = self._open(self._inner)
        return inner._arrivals(known, timeout)

    def _discard(self, key: str) -> bool:
        inner = self._open(self._inner)
        if not self._recvs:
            tx = self._open(self._sender)
            dropped = inner.discard(key)
            if dropped:
                tx.withdrawn(key)
                return True
            with inner._chan.locked():  # the receiver claims a lane record under it too
                return tx.lane_withdraw(key)
        try:
            obj = inner.get_nowait(key)
        except (WouldBlock, KeyConsumedError):
            return False
        self._open(self._receiver).drop(key, obj)
        return True

    def _withdraw_lane(self, key: str) -> bool:
        """The sender's hook: withdraw ``key``'s unclaimed lane record (its block freed);
        whether it was there unclaimed."""
        inner, tx = self._inner, self._sender
        if inner is None or tx is None:
            return False
        with inner._chan.locked():  # the receiver claims a lane record under it too
            return tx.lane_withdraw(key)

    def release(self, key: str, /) -> bool:
        """Hand the pool blocks (and shm blocks) of a payload received under ``key`` back
        now; its tensors must not be used afterwards. See ``BaseConnector.release``."""
        self._check_open()
        from omnilink._util import validate_key

        validate_key(key)
        done = False
        rx = self._receiver
        if rx is not None:
            done = rx.release(key)
        inner = self._inner
        if inner is not None and self._recvs:
            done = inner.release(key) or done
        return done

    # ------------------------------------------------------------------ sender
    def _put(self, key: str, payload: Any, deadline: Deadline, ctx: Any = None) -> int:
        if not self._sends:
            raise ConfigurationError(
                f"cuda_ipc connector on channel {self.channel!r} was opened with role='receiver' "
                "and cannot put; open it with role='sender' or 'dual'"
            )
        inner = self._open(self._inner)
        tx = self._open(self._sender)

        def publish(msg: Any) -> None:
            if tx.lane_pending(key):
                raise duplicate_key(self.backend, self.channel, key)
            if tx.lane_write(key, msg):  # the pool's lane, then wake the inner channel
                inner.wake_receivers(deadline)
            else:  # not plain, too large, lane full: a message of the inner channel
                inner.put(key, msg, timeout=deadline.remaining())

        return tx.send(key, payload, deadline, ctx, publish, landing=True)

    def _wake_inner(self, deadline: Deadline) -> None:
        """The waiting receivers of the inner channel, after a lane record (a send plan's)."""
        inner = self._inner
        if inner is not None:
            inner.wake_receivers(deadline)

    def _async_context(self, payload: Any) -> Any:
        """``put_async``: the producer's events, recorded in the caller's thread (the put
        thread's current streams are not the caller's)."""
        if not self._sends:
            return None
        return self._ops.producer_events(payload)

    # ----------------------------------------------------------------- common
    def _add_counts(self, counters: dict[str, int]) -> None:
        tx = self._sender
        if tx is not None:
            counters["device_puts"] += tx.device_puts
            counters["timeouts"] += tx.timeouts

    def _arena_stats(self) -> dict[str, Any]:
        """``pool_segments`` and ``pool_bytes_now`` of the receiver's device pool."""
        rx = self._receiver
        if rx is None:
            return {}
        segments, nbytes = rx.segments()
        return {"pool_segments": segments, "pool_bytes_now": nbytes}

    def _in_use(self) -> tuple[int, int]:
        tx = self._sender
        if tx is not None:  # a dual connector's pool holds what its sender has out
            return tx.in_use()
        rx = self._receiver
        return (0, 0) if rx is None else rx.in_use()

    def _wake(self) -> None:
        for part in (self._sender, self._receiver):
            if part is not None:
                part.wake()

    def _close(self) -> None:
        rx = self._receiver
        if rx is not None:
            rx.wake()
        tx = self._sender
        if tx is not None:
            tx.close()
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
        self._receiver = None
        if rx is not None:
            rx.close()
