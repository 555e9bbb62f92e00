"""The ``Connector`` protocol every backend implements, and ``BaseConnector``, the
shared skeleton the built-in backends subclass.

State machine of a connector (the same for every backend)::

              connect(...)            close() (idempotent)
    (new) --------------> OPEN ---------------------------> CLOSED
                           |  put / put_async / get /          |  every call but close()
                           |  get_nowait / discard / stats     |  raises ClosedError
                           +-----------------------------------+

Contract (the same for every backend; ``omnilink.testing`` checks it):

- ``put(key, payload, /, *, timeout=None)`` returns once the payload is in the transport
  and the caller may reuse every tensor it passed; it returns the encoded size in bytes.
- ``put_async`` returns a ``concurrent.futures.Future`` resolving to the same size.
- ``get(key, /, *, timeout=None, device=None)`` blocks until ``key`` arrives (woken by the
  transport, never by sleep-polling) or raises ``TransferTimeout``; ``get_nowait``
  raises ``WouldBlock`` instead of waiting. Each key is consumed exactly once.
- ``timeout=None`` means the connector's ``timeout`` option (itself ``None``: no limit;
  a dead peer is still reported as ``PeerLostError``).
- ``put_many(items)`` / ``get_many(keys)``: a batch under one deadline. ``put_many``
  publishes in order and, on an error part way, keeps what it sent (named by the
  error's ``sent``) and sends nothing of the rest; ``get_many`` returns every key or
  takes none. ``BaseConnector`` loops over ``put`` / ``get``; ``shm`` and ``memory``
  take their locks and wake their readers once per batch.
- ``discard(key)`` drops a payload nobody will read and returns whether one was there.
- ``release(key)`` hands a received payload's transport memory back before its last
  view dies (``shm``); a no-op returning ``False`` where payloads own their memory.
- ``await aput(...)`` / ``await aget(...)``: the same for asyncio. The event loop never
  blocks and no thread is started per call (``aput`` runs on the connector's one put
  thread, ``aget`` waits on its one waiter thread: ``omnilink.connectors._async``). A
  cancelled ``aget`` has taken nothing: the payload stays for the next ``get``.
- ``stats()`` returns ``ConnectorStats``; like every call but ``close()``, it raises
  ``ClosedError`` after close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal, NoReturn, Protocol, TypeVar, runtime_checkable

import msgspec

from omnilink._errors import (
    ClosedError,
    ConfigurationError,
    DuplicateKeyError,
    OmnilinkError,
    TransferTimeout,
    WouldBlock,
)
from omnilink._util import MAX_KEY_BYTES, NO_WAIT, Deadline, timed_out, validate_channel, validate_key

__all__ = ["BaseConnector", "Connector", "ConnectorStats", "Role"]

Role = Literal["sender", "receiver", "dual"]
_ROLES = ("sender", "receiver", "dual")
_Self = TypeVar("_Self", bound="BaseConnector")
#: ``_arrivals`` wait of an unbounded ``get_many`` (it loops; any wake-up ends it sooner)
_ARRIVAL_SLICE_S = 1.0


def check_common_options(*, role: Any, timeout: Any) -> None:
    """``role`` and ``timeout`` as ``BaseConnector.__init__`` checks them.

    Raises
    ------
    ConfigurationError
        ``role`` is not one of ``"sender"``, ``"receiver"``, ``"dual"``, or ``timeout``
        is neither ``None`` nor a number of seconds >= 0.
    """
    if role not in _ROLES:
        raise ConfigurationError(f"role must be one of {_ROLES}, got {role!r}")
    Deadline(timeout)  # validates


def check_constructor_options(
    cls: Callable[..., Any], checks: Callable[..., None], options: Mapping[str, Any], /
) -> dict[str, Any]:
    """Refuse, opening nothing, the option values ``cls(**options)`` would refuse.

    The body of the built-in backends' ``check_options`` hook. ``options`` are laid
    over the defaults of ``cls``'s signature (the values its constructor would see),
    then checked as ``BaseConnector.__init__`` checks ``channel`` (when given), ``role``
    and ``timeout``, and by ``checks``: the backend's own value checks, a function whose
    keyword-only parameters are named as the constructor's options and which the
    constructor calls itself, so both refuse exactly the same values.

    Parameters
    ----------
    cls : type
        The backend's connector class.
    checks : callable
        Its value checks (``_check_values`` of the backend's module).
    options : mapping
        Keyword options as ``connect`` would receive them (``channel`` may be absent).

    Returns
    -------
    dict
        The values checked: ``options`` over the constructor's defaults.

    Raises
    ------
    ConfigurationError
        A value the constructor would refuse before opening anything.
    """
    values = {
        p.name: p.default for p in inspect.signature(cls).parameters.values() if p.default is not p.empty
    }
    values.update(options)
    if "channel" in values:
        validate_channel(values["channel"])
    check_common_options(role=values["role"], timeout=values["timeout"])
    checks(**{name: values[name] for name in inspect.signature(checks).parameters})
    return values


def _check_keys(keys: list[Any]) -> None:
    """``validate_key`` of each key, skipped for the plain ASCII ones it would pass."""
    for key in keys:
        if type(key) is not str or not key.isascii() or not 0 < len(key) <= MAX_KEY_BYTES or "\x00" in key:
            validate_key(key)


def _keys_text(keys: list[str], shown: int = 6) -> str:
    """``keys`` for a message: the first ``shown``, then how many more."""
    if len(keys) <= shown:
        return repr(keys)
    return "[" + ", ".join(map(repr, keys[:shown])) + f", ... and {len(keys) - shown} more]"


def _raise_batch(exc: BaseException, note: str, **attrs: Any) -> NoReturn:
    """Raise ``exc`` told what a batch call did before it failed: ``note`` appended to
    its message and ``attrs`` (``sent``, ``unsent``, ``got``) set as attributes.

    An omnilink error is copied first (the copy is of the same class, with the same
    attributes, and chained to ``exc``): a backend may raise one stored error again
    (a lost link), which must not collect the notes of every batch. Any other exception
    is raised as it is, with the attributes where it takes them.
    """
    if isinstance(exc, OmnilinkError):
        new = type(exc).__new__(type(exc))
        new.__dict__.update(exc.__dict__)
        new.args = (f"{exc}; {note}",)
        for name, value in attrs.items():
            setattr(new, name, value)
        raise new.with_traceback(exc.__traceback__) from exc
    for name, value in attrs.items():
        try:
            setattr(exc, name, value)
        except (AttributeError, TypeError):  # pragma: no cover - an exception with __slots__
            pass
    raise exc


class ConnectorStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of one connector since it was opened."""

    backend: str
    channel: str
    role: str
    puts: int = 0
    gets: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    discards: int = 0
    timeouts: int = 0
    #: payloads that took a slower path (an overflow segment, a copy instead of a view)
    fallbacks: int = 0
    #: payloads whose CUDA tensors this connector copied by DMA straight into the
    #: transport (``device_puts``) or straight out of it onto a GPU (``device_gets``),
    #: instead of a synchronous ``.to()``; ``sliced``: of those, sent or received in
    #: slices (pipelined)
    device_puts: int = 0
    device_gets: int = 0
    sliced: int = 0
    #: payloads whose CUDA tensors went GPU to GPU by device IPC (shm's ``device_ipc``:
    #: a device copy into the receiver's pool, no host bounce)
    ipc_puts: int = 0
    ipc_gets: int = 0
    #: payloads that could have gone by device IPC (a receiver's pool was found and
    #: reachable) but took the host path; ``ipc_fallback_reason`` says why the last did
    #: (the pool full or too small, the pool's owner gone, a CUDA error)
    ipc_fallbacks: int = 0
    ipc_fallback_reason: str = ""
    #: unread payloads the transport dropped by itself because their receiver is gone or
    #: took too long (shm: ``reclaim_after``, ``reclaim_unread``), as opposed to
    #: ``discards`` a caller asked for
    reclaimed: int = 0
    #: transport blocks (arena blocks, frames) currently held by this process
    blocks_in_use: int = 0
    bytes_in_use: int = 0
    #: shared-memory segments of this sender's arena (shm: the arena and its extensions)
    segments: int = 0
    #: bytes of those segments
    bytes_mapped: int = 0
    #: bytes of transport blocks that live views of received payloads still hold
    bytes_held: int = 0
    #: a receiver's device pool (``cuda_ipc``, shm's ``device_ipc``): its segments now
    #: (it grows by a segment when a payload does not fit, and gives idle ones back)
    #: and their bytes; 0 without a pool
    pool_segments: int = 0
    pool_bytes_now: int = 0


@runtime_checkable
class Connector(Protocol):
    """What every omnilink backend provides; third-party backends implement this.

    ``backend``, ``channel`` and ``role`` are read-only here, so a class attribute
    (``backend``) or a narrower type (``role: Role``) satisfies them.
    """

    @property
    def backend(self) -> str: ...

    @property
    def channel(self) -> str: ...

    @property
    def role(self) -> str: ...

    def put(self, key: str, payload: Any, /, *, timeout: float | None = None) -> int: ...

    def put_async(
        self, key: str, payload: Any, /, *, timeout: float | None = None
    ) -> concurrent.futures.Future[int]: ...

    def get(
        self, key: str, /, *, timeout: float | None = None, device: Any = None
    ) -> Any: ...

    def get_nowait(self, key: str, /, *, device: Any = None) -> Any: ...

    def put_many(
        self, items: Mapping[str, Any] | Iterable[tuple[str, Any]], /, *, timeout: float | None = None
    ) -> list[int]: ...

    def get_many(
        self, keys: Iterable[str], /, *, timeout: float | None = None, device: Any = None
    ) -> dict[str, Any]: ...

    async def aput(self, key: str, payload: Any, /, *, timeout: float | None = None) -> int: ...

    async def aget(self, key: str, /, *, timeout: float | None = None, device: Any = None) -> Any: ...

    def discard(self, key: str, /) -> bool: ...

    def release(self, key: str, /) -> bool: ...

    def stats(self) -> ConnectorStats: ...

    def close(self) -> None: ...

    def __enter__(self) -> Connector: ...

    def __exit__(self, *exc_info: object) -> None: ...


class BaseConnector:
    """Skeleton shared by the built-in backends.

    Subclasses set ``backend`` and implement ``_put``, ``_get``, ``_discard`` and
    ``_close``; this class validates arguments, keeps the counters, turns ``timeout``
    into a ``Deadline``, moves results to ``device`` and enforces the closed state.

    Subclass hooks
    --------------
    ``_put(key, payload, deadline) -> int``
        Transport the payload, return the bytes it took. Raise ``TransferTimeout`` via
        ``self._timeout(...)`` when ``deadline`` passes.
    ``_get(key, deadline, block) -> Any``
        Return the payload for ``key`` (consuming it). With ``block=False`` raise
        ``WouldBlock`` at once when it is not there.
    ``_discard(key) -> bool``, ``_close() -> None``.
    """

    backend: ClassVar[str] = "base"

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
    ) -> None:
        self.channel = validate_channel(channel)
        check_common_options(role=role, timeout=timeout)
        self.role = role
        self.timeout = timeout
        self._closed = False
        self._close_lock = threading.Lock()
        self._counter_lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "bytes_put", "bytes_got", "discards", "timeouts", "fallbacks",
             "device_puts", "device_gets", "sliced", "ipc_puts", "ipc_gets", "ipc_fallbacks", "reclaimed"), 0
        )
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._waiter: Any = None  # omnilink.connectors._async.ArrivalWaiter, on first aget

    # ----------------------------------------------------------------- hooks
    def _put(self, key: str, payload: Any, deadline: Deadline) -> int:
        raise NotImplementedError

    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        raise NotImplementedError

    def _discard(self, key: str) -> bool:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        """Wake calls blocked in other threads so they see the closed state.

        Runs in ``close()`` before it waits for pending ``put_async`` calls, so a put
        stuck on backpressure cannot hang ``close()``. Backends override.
        """

    def _add_counts(self, counters: dict[str, int]) -> None:
        """Add the counts a backend keeps apart from ``_counters`` (the shm backend's
        per-message fast path counts under its own locks); default: none."""

    def _in_use(self) -> tuple[int, int]:
        """(blocks, bytes) this process holds in the transport; backends override."""
        return (0, 0)

    def _arena_stats(self) -> dict[str, Any]:
        """``segments``, ``bytes_mapped`` and ``bytes_held`` of ``stats()``; backends with
        an arena override."""
        return {}

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        """The keys available to ``get`` now, without taking any (for ``aget``).

        Return as soon as that set holds a key not in ``known``, or after ``timeout``
        seconds; wait on the backend's own wake-up, never by sleep-polling. Raise the
        backend's error when no key can come any more (``PeerLostError``,
        ``ClosedError``). Runs on the connector's one waiter thread. Backends override;
        without it ``aget`` is refused.
        """
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.backend} connector on channel {self.channel!r} is closed")

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _count_op(self, op: str, nbytes_name: str, nbytes: int) -> None:
        """``_count(**{op: 1, nbytes_name: nbytes})`` without the keyword dict (once per
        message)."""
        with self._counter_lock:
            counters = self._counters
            counters[op] += 1
            counters[nbytes_name] += nbytes

    def _timeout(self, op: str, key: str | None, peer: str | None, waited: float | None) -> TransferTimeout:
        """Build (and count) the ``TransferTimeout`` for an operation that waited too long."""
        self._count(timeouts=1)
        return timed_out(self.backend, self.channel, op, key, peer, waited)

    def _deadline(self, timeout: float | None) -> Deadline:
        if timeout is None:
            return Deadline.after(self.timeout)  # validated when the connector opened
        return Deadline(timeout)

    # ------------------------------------------------------------- public API
    def put(self, key: str, payload: Any, /, *, timeout: float | None = None) -> int:
        """Send ``payload`` under ``key``.

        Parameters
        ----------
        key : str
            Non-empty, at most 512 UTF-8 bytes; consumed exactly once by a receiver.
        payload : Any
            A tree tensor_blob can carry (see ``omnilink.encode``).
        timeout : float, optional
            Seconds to wait for room in the transport; defaults to the connector's.

        Returns
        -------
        int
            Encoded size of the payload in bytes.

        Raises
        ------
        ConfigurationError
            Bad key or timeout.
        BlobEncodeError
            The payload holds something the format cannot carry.
        TransferTimeout
            No room appeared in time (backpressure).
        CapacityError
            The payload can never fit the transport as configured.
        PeerLostError, ClosedError
            The peer died; the connector was closed.
        """
        if self._closed:
            self._check_open()
        validate_key(key)
        n = self._put(key, payload, self._deadline(timeout))
        self._count_op("puts", "bytes_put", n)
        return n

    def put_async(
        self, key: str, payload: Any, /, *, timeout: float | None = None
    ) -> concurrent.futures.Future[int]:
        """Like ``put`` but returns at once with a future of the encoded size.

        The caller must not modify the payload's tensors until the future is done. Errors
        are raised by ``future.result()``; argument errors are raised here.
        """
        self._check_open()
        validate_key(key)
        self._deadline(timeout)
        with self._close_lock:
            self._check_open()
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"omnilink-{self.backend}-put"
                )
            ctx = self._async_context(payload)
            if ctx is None:
                return self._executor.submit(self.put, key, payload, timeout=timeout)
            return self._executor.submit(self._put_with_context, key, payload, timeout, ctx)

    def _async_context(self, payload: Any) -> Any:
        """What ``put_async`` must capture in the caller's thread (the shm backend: the
        producer's CUDA events); ``None``: nothing, ``_put`` runs as for ``put``."""
        return None

    def _put_with_context(self, key: str, payload: Any, timeout: float | None, ctx: Any) -> int:
        self._check_open()
        n = self._put(key, payload, self._deadline(timeout), ctx)  # type: ignore[call-arg]
        self._count(puts=1, bytes_put=n)
        return n

    async def aput(self, key: str, payload: Any, /, *, timeout: float | None = None) -> int:
        """``put`` for asyncio: the event loop keeps running while the payload goes out.

        The put runs on the connector's one put thread (the one ``put_async`` uses), so
        puts keep their order and no thread is started per call.

        Parameters
        ----------
        key, payload, timeout
            As for ``put``.

        Returns
        -------
        int
            Encoded size of the payload in bytes.

        Raises
        ------
        ConfigurationError, BlobEncodeError, TransferTimeout, CapacityError, PeerLostError, ClosedError
            As ``put``. A task cancelled before its put started sends nothing; once the
            put has started it completes (at most once, like a ``put`` that raised).
        """
        return await asyncio.wrap_future(self.put_async(key, payload, timeout=timeout))

    async def aget(self, key: str, /, *, timeout: float | None = None, device: Any = None) -> Any:
        """``get`` for asyncio: wait for ``key`` without blocking the event loop.

        Any number of tasks may wait at once, for different keys or the same one; one
        waiter thread per connector watches the transport for all of them (see
        ``omnilink.connectors._async``). The payload is taken on the event loop thread
        when the task resumes, so a task cancelled while it waits has taken nothing: the
        payload stays for the next ``get`` or ``aget``.

        Parameters
        ----------
        key, timeout, device
            As for ``get``.

        Returns
        -------
        Any
            The payload, as ``get`` returns it.

        Raises
        ------
        TransferTimeout, PeerLostError, BlobDecodeError, ClosedError
            As ``get``.
        ConfigurationError
            Bad arguments; a backend without ``_arrivals`` (a third party's).
        """
        self._check_open()
        validate_key(key)
        deadline = self._deadline(timeout)
        loop = asyncio.get_running_loop()
        waiter = self._arrival_waiter()
        while True:
            ticket = waiter.subscribe(key, loop)
            try:
                try:
                    return self.get_nowait(key, device=device)
                except WouldBlock:
                    pass
                from omnilink.connectors._async import await_ticket

                try:
                    error = await await_ticket(ticket, deadline.remaining())
                except (asyncio.TimeoutError, TimeoutError):
                    raise self._timeout("get", key, None, deadline.timeout) from None
                try:
                    return self.get_nowait(key, device=device)
                except WouldBlock:
                    if error is not None:
                        raise error from None
                    if deadline.expired():
                        raise self._timeout("get", key, None, deadline.timeout) from None
                    # Another reader took it, or it was a wake-up for a key seen earlier.
            finally:
                waiter.unsubscribe(key, ticket)

    def _arrival_waiter(self) -> Any:
        if type(self)._arrivals is BaseConnector._arrivals:
            raise ConfigurationError(
                f"{self.backend}: aget needs the backend to implement _arrivals (see "
                "omnilink.connectors.BaseConnector); use get in a thread instead"
            )
        with self._close_lock:
            self._check_open()
            if self._waiter is None:
                from omnilink.connectors._async import ArrivalWaiter

                self._waiter = ArrivalWaiter(self)
            return self._waiter

    def get(self, key: str, /, *, timeout: float | None = None, device: Any = None) -> Any:
        """Receive the payload stored under ``key``, waiting up to ``timeout`` seconds.

        Parameters
        ----------
        key : str
            The key the sender used.
        timeout : float, optional
            Seconds to wait; defaults to the connector's ``timeout`` (None: no limit).
        device : str or torch.device, optional
            Move every tensor of the payload there (e.g. ``"cuda:0"``).

        Returns
        -------
        Any
            The payload; tensors are zero-copy views of the transport buffer where the
            backend allows it, released when the last view dies.

        Raises
        ------
        TransferTimeout
            ``key`` did not arrive in time (names channel, key and peer).
        PeerLostError
            The sender died before ``key`` arrived.
        BlobDecodeError
            The bytes received are not a valid frame.
        ClosedError
            The connector was closed.
        """
        self._check_open()
        validate_key(key)
        obj = self._receive(key, self._deadline(timeout), True, device)
        self._count(gets=1)
        return obj

    def get_nowait(self, key: str, /, *, device: Any = None) -> Any:
        """Like ``get`` but raise ``WouldBlock`` at once if ``key`` is not there yet."""
        if self._closed:
            self._check_open()
        validate_key(key)
        obj = self._receive(key, NO_WAIT, False, device)
        self._count(gets=1)
        return obj

    def _receive(self, key: str, deadline: Deadline, block: bool, device: Any) -> Any:
        """``_get`` then the move to ``device``; backends with a faster way to land a
        payload on a device (the shm backend's copy controllers) override this."""
        obj = self._get(key, deadline, block)
        if device is not None:
            from omnilink.cuda import payload_to_device

            obj = payload_to_device(obj, device)
        return obj

    # ------------------------------------------------------------------ batches
    def put_many(
        self, items: Mapping[str, Any] | Iterable[tuple[str, Any]], /, *, timeout: float | None = None
    ) -> list[int]:
        """Send a batch of payloads, in order, under one deadline.

        The same as ``put`` of each item in turn, except that every key is checked
        before anything is sent and that ``timeout`` bounds the whole batch. The
        ``shm`` backend writes the items into their blocks first and then publishes
        them under one hold of the channel mutex with one wake-up of the receivers
        (``memory``: one lock, one notification); items holding CUDA tensors or
        larger than its arena take the ordinary per-item path, in their turn.

        Parameters
        ----------
        items : mapping of str to Any, or iterable of (str, Any) pairs
            Keys and payloads, in the order they are to be published.
        timeout : float, optional
            Seconds the whole batch may wait for room in the transport; defaults to the
            connector's.

        Returns
        -------
        list[int]
            Encoded size of each payload in bytes, in the order of ``items``.

        Raises
        ------
        ConfigurationError
            A bad key, bad ``items`` or timeout: nothing was sent.
        DuplicateKeyError
            A key appears twice in ``items``: nothing was sent. (A key still pending
            from an earlier put is refused like ``put`` refuses it.)
        BlobEncodeError, TransferTimeout, CapacityError, PeerLostError, ClosedError
            As ``put``, for one of the items. The items published before it stay
            published (they are sent and will be delivered); nothing of that item and
            the ones after it was published, and every block taken for them was given
            back. The error is of the class ``put`` would raise and says how far the
            batch got, also as the attributes ``sent`` (the keys published, in order)
            and ``unsent`` (the others, the failed one first). ``shm`` and ``memory``
            encode every payload before they send anything, so a payload that cannot
            be encoded there stops the batch with nothing sent.
        """
        if self._closed:
            self._check_open()
        keys, payloads = self._batch_items(items)
        deadline = self._deadline(timeout)
        if not keys:
            return []
        return self._put_many(keys, payloads, deadline)

    def _put_many(self, keys: list[str], payloads: list[Any], deadline: Deadline) -> list[int]:
        """``put_many`` of validated keys: ``_put`` of each in turn (backends with a
        batch path override this)."""
        sizes: list[int] = []
        try:
            for key, payload in zip(keys, payloads):
                n = self._put(key, payload, deadline)
                self._count_op("puts", "bytes_put", n)
                sizes.append(n)
        except Exception as exc:
            self._raise_put_many(exc, keys, len(sizes))
        return sizes

    def get_many(
        self, keys: Iterable[str], /, *, timeout: float | None = None, device: Any = None
    ) -> dict[str, Any]:
        """Receive every key of a batch, waiting up to ``timeout`` for all of them.

        All or nothing: it returns once every key can be taken and then takes them all,
        or raises having taken none, so a key that was there is still there for a later
        ``get`` (of this receiver or another). The ``shm`` backend claims the whole batch
        in one pass under the channel mutex, and while keys are missing it sleeps until a
        sender publishes (one wait for the batch, not one per key); ``memory`` does the
        same under its lock.

        Nothing is taken until the last key is there, so the whole batch must fit the
        transport at once: a batch larger than what the senders can have unread (shm:
        ``arena_bytes``; memory: ``capacity_bytes``) never completes and times out (with
        no timeout it waits for ever). Ask for such a batch in parts.

        Parameters
        ----------
        keys : iterable of str
            The keys to receive, each at most once (validated like ``get``'s).
        timeout : float, optional
            Seconds to wait for the whole batch; defaults to the connector's.
        device : str or torch.device, optional
            As for ``get``: move every tensor there.

        Returns
        -------
        dict[str, Any]
            Every key's payload, in the order of ``keys``.

        Raises
        ------
        ConfigurationError
            A bad key, a key listed twice, ``keys`` given as one ``str``.
        TransferTimeout
            Not every key arrived in time. Nothing was taken; the message lists the
            missing keys, also kept as the attribute ``missing`` (``key`` is the first
            of them).
        KeyConsumedError
            A missing key was already consumed by this receiver (``shm``, ``memory``;
            nothing was taken). Elsewhere such a key cannot arrive again and the call
            times out.
        PeerLostError, BlobDecodeError, ClosedError
            As ``get``. A payload that cannot be decoded is consumed with its batch.

        Notes
        -----
        Backends without a batch path (``zmq``, ``nccl``, ``cuda_ipc``) wait until
        ``_arrivals`` lists every key and then take each. If another reader of the same
        keys takes one in between (two readers asking for one key), the wait goes on for
        it; the error that may then end the call carries what was taken as the attribute
        ``got`` (key -> payload), so nothing is lost. A backend without ``_arrivals``
        (a third party's) gets one key after the other, with the same ``got`` on an
        error: there, keys taken before a timeout are not put back.
        """
        if self._closed:
            self._check_open()
        keys = self._batch_keys(keys)
        deadline = self._deadline(timeout)
        if not keys:
            return {}
        return self._get_many(keys, deadline, device)

    def _get_many(self, keys: list[str], deadline: Deadline, device: Any) -> dict[str, Any]:
        """``get_many`` of validated keys: wait on ``_arrivals`` until every key is
        there, then take each (backends with a batch path override this)."""
        got: dict[str, Any] = {}
        if type(self)._arrivals is BaseConnector._arrivals:
            # No way to look without taking: one get after the other.
            try:
                for key in keys:
                    got[key] = self._receive(key, deadline, True, device)
                    self._count(gets=1)
            except Exception as exc:
                _raise_batch(exc, f"get_many took {len(got)} of {len(keys)} key(s) before this error; "
                             "they are in its attribute 'got'", got=got)
            return got
        known: set[str] = set()
        wait = 0.0
        while True:
            avail = known = self._arrivals(known, wait)
            if all(k in avail for k in keys if k not in got):
                try:
                    for key in keys:
                        if key not in got:
                            got[key] = self.get_nowait(key, device=device)
                    return {k: got[k] for k in keys}
                except WouldBlock:
                    # Another reader took it between the look and the take: wait for it
                    # again (its coming back is news to ``_arrivals``).
                    known = avail - {key}
                except Exception as exc:
                    _raise_batch(exc, f"get_many took {len(got)} of {len(keys)} key(s) before this error; "
                                 "they are in its attribute 'got'", got=got)
            remaining = deadline.remaining()
            if remaining == 0.0:
                left = [k for k in keys if k not in got]
                err = self._many_timeout(keys, [k for k in left if k not in avail] or left, None, deadline.timeout)
                if got:
                    _raise_batch(err, f"{len(got)} key(s) were taken before another reader took one "
                                 "of the batch; they are in its attribute 'got'", got=got)
                raise err
            wait = _ARRIVAL_SLICE_S if remaining is None else remaining

    # ------------------------------------------------------------ batch helpers
    def _batch_items(self, items: Any) -> tuple[list[str], list[Any]]:
        """Keys and payloads of a ``put_many`` batch, every key checked like ``put``'s
        and none twice (``DuplicateKeyError``, before anything is sent)."""
        if isinstance(items, Mapping):
            keys = list(items)
            payloads = list(items.values())
        elif isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise ConfigurationError(
                f"put_many takes a mapping of key -> payload or an iterable of (key, payload) pairs, "
                f"got {type(items).__name__}"
            )
        else:
            keys, payloads = [], []
            for item in items:
                if not isinstance(item, (tuple, list)) or len(item) != 2:
                    raise ConfigurationError(
                        f"put_many: every item must be a (key, payload) pair, got {type(item).__name__}"
                    )
                keys.append(item[0])
                payloads.append(item[1])
        _check_keys(keys)
        if len(set(keys)) != len(keys):
            seen: set[str] = set()
            dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            exc = DuplicateKeyError(
                f"{self.backend}: key {dup!r} appears twice in one put_many batch on channel "
                f"{self.channel!r}; nothing was sent",
                channel=self.channel,
                key=dup,
            )
            exc.sent, exc.unsent = [], keys
            raise exc
        return keys, payloads

    def _batch_keys(self, keys: Any) -> list[str]:
        """The keys of a ``get_many``, checked like ``get``'s, none twice."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise ConfigurationError(
                f"get_many takes a collection of keys, got {type(keys).__name__}: {keys!r:.80}"
            )
        keys = list(keys)
        _check_keys(keys)
        if len(set(keys)) != len(keys):
            seen: set[str] = set()
            dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise ConfigurationError(
                f"{self.backend}: get_many lists key {dup!r} twice; each key is delivered once"
            )
        return keys

    def _raise_put_many(self, exc: Exception, keys: list[str], sent: int) -> NoReturn:
        """Raise ``exc`` (a put of ``keys[sent]`` failed) told which keys were sent."""
        done, rest = keys[:sent], keys[sent:]
        _raise_batch(
            exc,
            f"put_many sent {sent} of {len(keys)} item(s) before this error ({_keys_text(done)}); "
            f"they stay sent, the other {len(rest)} were not ({_keys_text(rest)})",
            sent=done,
            unsent=rest,
        )

    def _many_timeout(self, keys: list[str], missing: list[str], peer: str | None,
                      waited: float | None) -> TransferTimeout:
        """Build (and count) the ``TransferTimeout`` of a ``get_many`` that waited too
        long: it names the missing keys (``missing``; ``key`` is the first)."""
        self._count(timeouts=1)
        exc = TransferTimeout(
            f"{self.backend}: get_many of {len(keys)} key(s) on channel {self.channel!r} timed out after "
            f"{waited if waited is not None else '?'} s waiting for {peer or 'the peer'}; "
            f"{len(missing)} missing ({_keys_text(missing)}); nothing was taken",
            channel=self.channel,
            key=missing[0] if missing else None,
            peer=peer,
        )
        exc.missing = list(missing)
        return exc

    def discard(self, key: str, /) -> bool:
        """Drop the payload under ``key`` if present; return whether one was dropped."""
        self._check_open()
        validate_key(key)
        dropped = self._discard(key)
        if dropped:
            self._count(discards=1)
        return dropped

    def release(self, key: str, /) -> bool:
        """Hand the transport memory of a payload received under ``key`` back now.

        Backends whose received tensors are views of a shared buffer (``shm``: the
        sender's arena) override this: the buffer is otherwise released when the last
        view dies, and after ``release`` the payload's tensors must not be used. Here,
        for backends whose payloads own their memory, there is nothing to hand back.

        Returns
        -------
        bool
            Whether a payload still held under ``key`` was released (always ``False``
            here).

        Raises
        ------
        ClosedError
            The connector was closed.
        """
        self._check_open()
        validate_key(key)
        return False

    def stats(self) -> ConnectorStats:
        """Counters since this connector was opened (see ``ConnectorStats``)."""
        self._check_open()
        blocks, nbytes = self._in_use()
        arena = self._arena_stats()
        with self._counter_lock:
            counters = dict(self._counters)
        self._add_counts(counters)
        return ConnectorStats(
            backend=self.backend,
            channel=self.channel,
            role=self.role,
            blocks_in_use=blocks,
            bytes_in_use=nbytes,
            **arena,
            **counters,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release everything this connector created; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            executor, self._executor = self._executor, None
            waiter, self._waiter = self._waiter, None
        self._wake()
        if waiter is not None:
            waiter.close()  # wakes waiting agets (they raise ClosedError); joins its thread
        if executor is not None:
            executor.shutdown(wait=True)
        self._close()

    def __enter__(self: _Self) -> _Self:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.backend} channel={self.channel!r} role={self.role} {state}>"
