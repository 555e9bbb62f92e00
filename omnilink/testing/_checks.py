"""The conformance checks every omnilink backend passes, and ``check_connector``.

Each check receives a ``PairFactory``: given a fresh channel name it returns
``(sender, receiver)``, both open in this process (they may be one ``dual`` object).
The suite calls ``put``/``put_async`` only on the sender and ``get``/``get_nowait`` only
on the receiver; ``discard`` is called on the receiver. It closes every connector it
opened, whatever happens, so backends that create ``/dev/shm`` entries leak nothing.

Portability assumptions (true of every built-in backend):

- Arrival is FIFO per sender: once the receiver has got a key, every key the same
  sender put earlier has arrived too, so ``get_nowait`` and ``discard`` see it. The
  checks rely on this only through a later "marker" key, never on timing.
- The transport buffers what was put: a sender may have several hundred small payloads
  in flight before anyone reads (``many_in_flight``); ``huge_payload`` puts from a
  helper thread while the receiver reads, so a rendezvous transport passes it.

Timing is never asserted tightly: a call that should time out after 0.05 s must return
within 10 s; a call that should succeed gets 30 s.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import random
import secrets
import threading
import time
from typing import Any, Callable, Iterable

from omnilink._errors import (
    BlobEncodeError,
    ClosedError,
    ConfigurationError,
    DuplicateKeyError,
    KeyConsumedError,
    TransferTimeout,
    TransportError,
    WouldBlock,
)
from omnilink.connectors import Connector, ConnectorStats
from omnilink.testing._zoo import ConformanceError, assert_payload_equal, payload_zoo

__all__ = ["CHECKS", "PairFactory", "check_connector"]

PairFactory = Callable[[str], tuple[Connector, Connector]]
"""Given a fresh, unique channel name, return ``(sender, receiver)`` open in this process."""

#: Timeout for calls that should succeed.
WAIT = 30.0
#: Timeout for calls that should time out.
SHORT = 0.05
#: A call with timeout ``SHORT`` must have returned within this many seconds.
BOUND = 10.0
DEFAULT_HUGE_BYTES = 64 << 20

_channel_counter = itertools.count()


# ------------------------------------------------------------------------ machinery


class _Ctx:
    """One check's run: opens pairs through the factory and closes them all at the end."""

    def __init__(self, name: str, open_pair: PairFactory, huge_bytes: int) -> None:
        self.name = name
        self._open_pair = open_pair
        self.huge_bytes = huge_bytes
        self._opened: list[Any] = []
        self._token = secrets.token_hex(3)

    def channel(self) -> str:
        return f"olconf/{self.name.replace('_', '-')}-{os.getpid()}-{self._token}-{next(_channel_counter)}"

    def pair(self) -> tuple[Any, Any, str]:
        """Open a pair on a fresh channel; return ``(sender, receiver, channel)``."""
        channel = self.channel()
        try:
            pair = self._open_pair(channel)
        except Exception as exc:
            raise ConformanceError(
                f"the pair factory raised {type(exc).__name__} for channel {channel!r}: {exc}"
            ) from exc
        if not isinstance(pair, tuple) or len(pair) != 2:
            for obj in pair if isinstance(pair, (tuple, list)) else (pair,):
                self._opened.append(obj)
            raise ConformanceError(
                f"the pair factory must return a (sender, receiver) tuple, got {type(pair).__name__}"
            )
        tx, rx = pair
        # close_all goes in reverse: each receiver closes before the sender that may own
        # the transport.
        self._opened.append(tx)
        if rx is not tx:
            self._opened.append(rx)
        return tx, rx, channel

    def close_all(self) -> list[str]:
        """Close every connector opened; return descriptions of close() failures."""
        problems = []
        for conn in reversed(self._opened):
            close = getattr(conn, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:
                problems.append(f"close() of {conn!r} raised {type(exc).__name__}: {exc}")
        self._opened.clear()
        return problems


class _Check:
    """A named conformance check; call it with a ``PairFactory`` to run it alone."""

    __slots__ = ("name", "func", "__dict__")

    def __init__(self, name: str, func: Callable[[_Ctx], None]) -> None:
        self.name = name
        self.func = func
        self.__doc__ = func.__doc__

    def __call__(self, open_pair: PairFactory, /, *, huge_bytes: int = DEFAULT_HUGE_BYTES) -> None:
        _run(self, open_pair, huge_bytes)

    def __repr__(self) -> str:
        return f"<conformance check {self.name!r}>"


def _run(check: _Check, open_pair: PairFactory, huge_bytes: int) -> None:
    ctx = _Ctx(check.name, open_pair, huge_bytes)
    error: BaseException | None = None
    message = ""
    try:
        check.func(ctx)
    except ConformanceError as exc:
        error, message = exc, str(exc)
    except Exception as exc:
        error, message = exc, f"unexpected {type(exc).__name__}: {exc}"
    finally:
        problems = ctx.close_all()
    if problems:
        message = "; ".join(([message] if message else []) + problems)
    if message:
        failure = ConformanceError(
            f"conformance check {check.name!r} failed: {message}", failures={check.name: message}
        )
        raise failure from error


_REGISTRY: dict[str, _Check] = {}


def _check(func: Callable[[_Ctx], None]) -> Callable[[_Ctx], None]:
    name = func.__name__.removeprefix("check_")
    _REGISTRY[name] = _Check(name, func)
    return func


def _fail(message: str) -> ConformanceError:
    return ConformanceError(message)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _expect(
    exc_types: type[BaseException] | tuple[type[BaseException], ...],
    what: str,
    fn: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> BaseException:
    """Call ``fn``; it must raise ``exc_types``. Return the exception."""
    names = (
        exc_types.__name__
        if isinstance(exc_types, type)
        else " or ".join(t.__name__ for t in exc_types)
    )
    try:
        result = fn(*args, **kwargs)
    except exc_types as exc:
        return exc
    except Exception as exc:
        raise _fail(f"{what}: expected {names}, got {type(exc).__name__}: {exc}") from exc
    raise _fail(f"{what}: expected {names}, but it returned {_short(result)}")


def _call(what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; an exception becomes a ConformanceError that says what was being done."""
    try:
        return fn(*args, **kwargs)
    except ConformanceError:
        raise
    except Exception as exc:
        raise _fail(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _put(tx: Any, key: str, payload: Any) -> int:
    n = _call(f"put({key!r})", tx.put, key, payload, timeout=WAIT)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise _fail(f"put({key!r}) must return the encoded size (a positive int), got {_short(n)}")
    return n


def _get(rx: Any, key: str, **kwargs: Any) -> Any:
    return _call(f"get({key!r}, timeout={WAIT})", rx.get, key, timeout=WAIT, **kwargs)


def _round_trip(tx: Any, rx: Any, key: str, payload: Any, expected: Any, label: str) -> None:
    _put(tx, key, payload)
    got = _get(rx, key)
    try:
        assert_payload_equal(expected, got, path=label)
    except ConformanceError as exc:
        raise _fail(f"round trip of key {key!r} changed the payload: {exc}") from None


def _expect_absent(rx: Any, key: str, why: str) -> None:
    """``key`` must not be deliverable: get_nowait -> WouldBlock, get -> TransferTimeout."""
    _expect(WouldBlock, f"get_nowait({key!r}) {why}", rx.get_nowait, key)
    _expect(TransferTimeout, f"get({key!r}, timeout={SHORT}) {why}", rx.get, key, timeout=SHORT)


def _expect_consumed(rx: Any, key: str, why: str) -> None:
    """``key`` was consumed by ``rx``: get_nowait and get raise ``KeyConsumedError`` naming
    it, at once (a ``get`` that waits for its timeout instead fails the check)."""
    for what, fn, kwargs in (
        (f"get_nowait({key!r}) {why}", rx.get_nowait, {}),
        (f"get({key!r}, timeout={WAIT}) {why}", rx.get, {"timeout": WAIT}),
    ):
        start = time.monotonic()
        exc = _expect(KeyConsumedError, what, fn, key, **kwargs)
        if time.monotonic() - start > BOUND:
            raise _fail(f"{what}: KeyConsumedError came only after {time.monotonic() - start:.1f} s")
        if getattr(exc, "key", None) != key or key not in str(exc):
            raise _fail(f"{what}: KeyConsumedError must name the key (message and .key), got {exc!r}")


def _marker(tx: Any, rx: Any, key: str) -> None:
    """Put and get a marker key: afterwards every earlier put of ``tx`` has arrived."""
    _round_trip(tx, rx, key, {"marker": key}, {"marker": key}, "marker")


class _Thread:
    """A daemon thread that records what its function returned or raised."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.started = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

        def body() -> None:
            self.started.set()
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the checking thread
                self.error = exc

        self.thread = threading.Thread(target=body, name="omnilink-conformance", daemon=True)

    def start(self) -> _Thread:
        self.thread.start()
        self.started.wait(WAIT)
        return self

    def outcome(self, what: str, timeout: float = WAIT) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise _fail(f"{what} was still blocked after {timeout} s")
        if self.error is not None:
            raise _fail(f"{what} raised {type(self.error).__name__}: {self.error}") from self.error
        return self.result


def _stats(conn: Any, who: str) -> ConnectorStats:
    st = _call(f"{who}.stats()", conn.stats)
    if not isinstance(st, ConnectorStats):
        raise _fail(f"{who}.stats() must return a ConnectorStats, got {type(st).__name__}")
    return st


def _small(i: int) -> dict[str, Any]:
    import torch

    return {"i": i, "t": torch.full((3,), i, dtype=torch.int64), "tag": (f"k{i}",)}


# --------------------------------------------------------------------------- checks


@_check
def check_protocol(ctx: _Ctx) -> None:
    """Both ends satisfy the ``Connector`` protocol and describe themselves correctly."""
    tx, rx, channel = ctx.pair()
    for conn, who, roles in ((tx, "sender", ("sender", "dual")), (rx, "receiver", ("receiver", "dual"))):
        if not isinstance(conn, Connector):
            missing = [
                m
                for m in ("backend", "channel", "role", "put", "put_async", "get", "get_nowait",
                          "put_many", "get_many", "discard", "stats", "close", "__enter__", "__exit__")
                if not hasattr(conn, m)
            ]
            raise _fail(f"the {who} is not an omnilink.Connector (missing {missing})")
        if not isinstance(conn.backend, str) or not conn.backend:
            raise _fail(f"{who}.backend must be a non-empty str, got {_short(conn.backend)}")
        if conn.channel != channel:
            raise _fail(f"{who}.channel is {_short(conn.channel)}, but it was opened on {channel!r}")
        if conn.role not in roles:
            raise _fail(f"{who}.role is {_short(conn.role)}; expected one of {roles}")
        st = _stats(conn, who)
        if (st.backend, st.channel, st.role) != (conn.backend, conn.channel, conn.role):
            raise _fail(
                f"{who}.stats() names backend/channel/role {(st.backend, st.channel, st.role)}, "
                f"the connector says {(conn.backend, conn.channel, conn.role)}"
            )
        moved = {f: getattr(st, f) for f in ("puts", "gets", "bytes_put", "bytes_got", "discards",
                                             "timeouts") if getattr(st, f)}
        if moved:
            raise _fail(f"{who}.stats() of a fresh connector has non-zero counters {moved}")


@_check
def check_round_trip_zoo(ctx: _Ctx) -> None:
    """Every payload of ``payload_zoo()`` arrives bit for bit; put returns its encoded size
    and does not modify the caller's payload."""
    from omnilink import encoded_size

    tx, rx, _ = ctx.pair()
    sent = payload_zoo()
    expected = payload_zoo()
    for i, (name, payload) in enumerate(sent.items()):
        key = f"zoo-{i}"
        n = _put(tx, key, payload)
        size = encoded_size(expected[name])
        if n != size:
            raise _fail(f"put of zoo[{name!r}] returned {n}, but omnilink.encoded_size says {size}")
        got = _get(rx, key)
        try:
            assert_payload_equal(expected[name], got, path=f"zoo[{name!r}]")
        except ConformanceError as exc:
            raise _fail(f"round trip changed the payload: {exc}") from None
        del got
    try:
        assert_payload_equal(expected, sent, path="zoo")
    except ConformanceError as exc:
        raise _fail(f"put modified the caller's payload: {exc}") from None


@_check
def check_empty_payloads(ctx: _Ctx) -> None:
    """Empty containers, empty tensors and arrays, None, "" and b"" round-trip."""
    import numpy as np
    import torch

    tx, rx, _ = ctx.pair()
    cases: list[Callable[[], Any]] = [
        lambda: {},
        lambda: [],
        lambda: (),
        lambda: None,
        lambda: "",
        lambda: b"",
        lambda: torch.empty(0),
        lambda: torch.empty(0, 3, dtype=torch.bfloat16),
        lambda: np.empty(0, dtype=np.float32),
        lambda: {"a": {}, "b": [], "c": ()},
        lambda: {"codes.audio": torch.empty(0, dtype=torch.int64), "meta.finished": torch.tensor(True)},
    ]
    for i, make in enumerate(cases):
        _round_trip(tx, rx, f"empty-{i}", make(), make(), f"empty[{i}]")


@_check
def check_put_copies_payload(ctx: _Ctx) -> None:
    """The caller may overwrite its tensors and arrays as soon as ``put`` returns."""
    import numpy as np
    import torch

    tx, rx, _ = ctx.pair()

    def make() -> dict[str, Any]:
        return {
            "t": torch.arange(4096, dtype=torch.float32),
            "bf": torch.arange(64, dtype=torch.float32).to(torch.bfloat16).reshape(8, 8).t(),
            "a": np.arange(100, dtype=np.int64),
            "l": [1, 2],
        }

    payload = make()
    _put(tx, "reuse", payload)
    payload["t"].fill_(-1.0)
    payload["bf"].fill_(-1.0)
    payload["a"][:] = -1
    payload["l"].append(3)
    got = _get(rx, "reuse")
    try:
        assert_payload_equal(make(), got, path="payload")
    except ConformanceError as exc:
        raise _fail(f"changing the payload after put returned changed what arrived: {exc}") from None


@_check
def check_exactly_once(ctx: _Ctx) -> None:
    """A key is delivered once; later gets of it raise ``KeyConsumedError`` at once."""
    tx, rx, _ = ctx.pair()
    _round_trip(tx, rx, "once", _small(1), _small(1), "payload")
    _expect_consumed(rx, "once", "after the key was consumed")
    for k in ("once-a", "once-b"):
        _put(tx, k, _small(2))
    _get(rx, "once-b")
    _get(rx, "once-a")
    _expect_consumed(rx, "once-a", "after the key was consumed")
    _expect_consumed(rx, "once-b", "after the key was consumed")
    _round_trip(tx, rx, "once-c", _small(3), _small(3), "payload")
    _expect_consumed(rx, "once", "after the key was consumed and other traffic passed")


@_check
def check_key_contract(ctx: _Ctx) -> None:
    """One key contract for every backend: a second ``put`` of a key still pending raises
    ``DuplicateKeyError`` (a ``ConfigurationError``) and leaves the first payload
    deliverable; ``get`` of a consumed or discarded key raises ``KeyConsumedError`` at
    once; a consumed key may be put again and is then delivered again."""
    tx, rx, _ = ctx.pair()
    _put(tx, "dup", _small(1))
    exc = _expect(DuplicateKeyError, "second put('dup') while the first is pending", tx.put, "dup", _small(2),
                  timeout=WAIT)
    if not isinstance(exc, ConfigurationError) or getattr(exc, "key", None) != "dup":
        raise _fail(f"DuplicateKeyError must be a ConfigurationError naming the key (.key), got {exc!r}")
    fut = _call("put_async('dup') while the first is pending", tx.put_async, "dup", _small(3), timeout=WAIT)
    try:
        fut.result(timeout=WAIT + BOUND)
    except DuplicateKeyError:
        pass
    except Exception as err:
        raise _fail(f"put_async of a pending key: expected DuplicateKeyError from result(), got {err!r}") from err
    else:
        raise _fail("put_async of a pending key: result() returned instead of raising DuplicateKeyError")
    got = _get(rx, "dup")
    try:
        assert_payload_equal(_small(1), got, path="payload")
    except ConformanceError as err:
        raise _fail(f"the rejected second put changed what the first delivered: {err}") from None
    _expect_consumed(rx, "dup", "after it was consumed")
    # Consumed: the key may be used again, and is delivered again.
    _round_trip(tx, rx, "dup", _small(4), _small(4), "payload of the key put again")
    _expect_consumed(rx, "dup", "after it was consumed a second time")
    _put(tx, "dropped", _small(5))
    _marker(tx, rx, "contract-marker")
    if _call("discard('dropped')", rx.discard, "dropped") is not True:
        raise _fail("discard of a pending key must return True")
    _expect_consumed(rx, "dropped", "after it was discarded")


@_check
def check_out_of_order(ctx: _Ctx) -> None:
    """Keys may be got in any order; pending keys do not stall or disturb each other."""
    tx, rx, _ = ctx.pair()
    for i in range(5):
        _put(tx, f"ooo-{i}", _small(i))
    for i in (4, 2, 0, 3, 1):
        got = _get(rx, f"ooo-{i}")
        try:
            assert_payload_equal(_small(i), got, path=f"key 'ooo-{i}'")
        except ConformanceError as exc:
            raise _fail(f"out-of-order get delivered the wrong payload: {exc}") from None
    order = list(range(20))
    random.Random(7).shuffle(order)
    for i in range(20):
        _put(tx, f"shuf-{i}", _small(100 + i))
    for i in order:
        got = _get(rx, f"shuf-{i}")
        try:
            assert_payload_equal(_small(100 + i), got, path=f"key 'shuf-{i}'")
        except ConformanceError as exc:
            raise _fail(f"shuffled get delivered the wrong payload: {exc}") from None


@_check
def check_many_in_flight(ctx: _Ctx) -> None:
    """200 payloads put before any is read all arrive, read in shuffled order."""
    tx, rx, _ = ctx.pair()
    count = 200
    for i in range(count):
        _put(tx, f"fl-{i}", _small(i))
    order = list(range(count))
    random.Random(11).shuffle(order)
    for i in order:
        got = _get(rx, f"fl-{i}")
        try:
            assert_payload_equal(_small(i), got, path=f"key 'fl-{i}'")
        except ConformanceError as exc:
            raise _fail(f"with {count} keys in flight: {exc}") from None


@_check
def check_get_timeout(ctx: _Ctx) -> None:
    """``get`` of a key that never comes raises ``TransferTimeout`` (a ``TimeoutError``)
    naming channel and key, promptly; ``timeout=0`` too; the ``timeouts`` counter moves."""
    tx, rx, channel = ctx.pair()
    before = _stats(rx, "receiver").timeouts
    for timeout in (SHORT, 0):
        key = f"never-{timeout}"
        start = time.monotonic()
        exc = _expect(TransferTimeout, f"get({key!r}, timeout={timeout}) of a key never put", rx.get, key,
                      timeout=timeout)
        took = time.monotonic() - start
        if took > BOUND:
            raise _fail(f"get(timeout={timeout}) took {took:.1f} s to time out (bound {BOUND} s)")
        if not isinstance(exc, TimeoutError):
            raise _fail("TransferTimeout must also be a TimeoutError")
        text = str(exc)
        if channel not in text or key not in text:
            raise _fail(
                f"the TransferTimeout message must name channel {channel!r} and key {key!r}: {text!r}"
            )
        if getattr(exc, "channel", None) != channel or getattr(exc, "key", None) != key:
            raise _fail(
                f"TransferTimeout.channel/.key are {getattr(exc, 'channel', None)!r}/"
                f"{getattr(exc, 'key', None)!r}, expected {channel!r}/{key!r}"
            )
    after = _stats(rx, "receiver").timeouts
    if after - before != 2:
        raise _fail(f"receiver.stats().timeouts moved by {after - before} over two timeouts, expected 2")
    # The channel still works after timeouts.
    _round_trip(tx, rx, "after-timeout", _small(5), _small(5), "payload")


@_check
def check_get_nowait(ctx: _Ctx) -> None:
    """``get_nowait`` raises ``WouldBlock`` for an absent key without touching other keys,
    and returns a key that has arrived."""
    tx, rx, _ = ctx.pair()
    exc = _expect(WouldBlock, "get_nowait of a key never put", rx.get_nowait, "absent")
    if isinstance(exc, TimeoutError):
        raise _fail("WouldBlock must not be a TimeoutError (a *_nowait call never waits)")
    _put(tx, "present", _small(1))
    _marker(tx, rx, "nowait-marker")
    _expect(WouldBlock, "get_nowait of an absent key while another key is pending", rx.get_nowait, "absent")
    got = _call("get_nowait('present') after a later key arrived", rx.get_nowait, "present")
    try:
        assert_payload_equal(_small(1), got, path="payload")
    except ConformanceError as exc:
        raise _fail(f"get_nowait delivered the wrong payload: {exc}") from None
    _expect_consumed(rx, "present", "after get_nowait consumed it")


@_check
def check_blocking_get_woken(ctx: _Ctx) -> None:
    """A ``get`` blocked in another thread is woken by the matching ``put`` and gets
    the right payload; two waiters on different keys each get their own."""
    tx, rx, _ = ctx.pair()
    waiter = _Thread(rx.get, "wake-1", timeout=WAIT).start()
    time.sleep(0.05)  # let the waiter block; correctness never depends on this
    _put(tx, "wake-1", _small(1))
    got = waiter.outcome("get('wake-1') blocked in another thread")
    try:
        assert_payload_equal(_small(1), got, path="payload")
    except ConformanceError as exc:
        raise _fail(f"woken get delivered the wrong payload: {exc}") from None

    wa = _Thread(rx.get, "wake-a", timeout=WAIT).start()
    wb = _Thread(rx.get, "wake-b", timeout=WAIT).start()
    time.sleep(0.05)
    _put(tx, "wake-b", _small(20))
    _put(tx, "wake-a", _small(10))
    for thread, key, i in ((wb, "wake-b", 20), (wa, "wake-a", 10)):
        got = thread.outcome(f"get({key!r}) blocked in another thread")
        try:
            assert_payload_equal(_small(i), got, path=f"key {key!r}")
        except ConformanceError as exc:
            raise _fail(f"concurrent waiters got the wrong payloads: {exc}") from None


@_check
def check_put_async(ctx: _Ctx) -> None:
    """``put_async`` returns a ``concurrent.futures.Future`` of the encoded size; argument
    errors raise at the call; encode errors surface (at the call or from the future)."""
    from omnilink import encoded_size

    tx, rx, _ = ctx.pair()
    futures = []
    for i in range(5):
        fut = _call(f"put_async('async-{i}')", tx.put_async, f"async-{i}", _small(i), timeout=WAIT)
        if not isinstance(fut, concurrent.futures.Future):
            raise _fail(f"put_async must return a concurrent.futures.Future, got {type(fut).__name__}")
        futures.append(fut)
    for i, fut in enumerate(futures):
        try:
            n = fut.result(timeout=WAIT)
        except concurrent.futures.TimeoutError:
            raise _fail(f"put_async('async-{i}') future not done after {WAIT} s") from None
        except Exception as exc:
            raise _fail(f"put_async('async-{i}') future raised {type(exc).__name__}: {exc}") from exc
        if n != encoded_size(_small(i)):
            raise _fail(f"put_async future resolved to {_short(n)}, expected the encoded size "
                        f"{encoded_size(_small(i))}")
    for i in reversed(range(5)):
        got = _get(rx, f"async-{i}")
        try:
            assert_payload_equal(_small(i), got, path=f"key 'async-{i}'")
        except ConformanceError as exc:
            raise _fail(f"put_async delivered the wrong payload: {exc}") from None
    _expect(ConfigurationError, "put_async with an empty key (must raise at the call)", tx.put_async, "", {})
    try:
        fut = tx.put_async("async-bad", {"x": _NotCarriable()}, timeout=WAIT)
    except BlobEncodeError:
        pass
    except Exception as exc:
        raise _fail(f"put_async of an unsupported payload raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            fut.result(timeout=WAIT)
        except BlobEncodeError:
            pass
        except Exception as exc:
            raise _fail(
                f"put_async of an unsupported payload: the future raised {type(exc).__name__}, "
                "expected BlobEncodeError"
            ) from exc
        else:
            raise _fail("put_async of an unsupported payload: the future resolved instead of raising")
    _round_trip(tx, rx, "async-bad", _small(9), _small(9), "payload")


def _batch(tag: str, n: int) -> dict[str, Any]:
    """A batch of ``n`` payloads of mixed sizes under keys ``<tag>-<i>``: small ones, an
    empty one, a 64 KiB one (the shape of a codec window: ids, meta, a tensor)."""
    import torch

    out: dict[str, Any] = {}
    for i in range(n):
        rows = (0, 1, 25, 1024)[i % 4]
        out[f"{tag}-{i}"] = {
            "codes": torch.arange(rows * 16, dtype=torch.int64).reshape(rows, 16) + i,
            "ids": torch.full((3,), i, dtype=torch.int64),
            "meta": {"i": i, "finished": i == n - 1},
        }
    return out


def _expect_batch_equal(expected: dict[str, Any], got: Any, what: str) -> None:
    if not isinstance(got, dict) or list(got) != list(expected):
        raise _fail(f"{what} must return a dict of every key in the order asked, got keys "
                    f"{_short(list(got) if isinstance(got, dict) else got)}")
    try:
        assert_payload_equal(expected, got, path=what)
    except ConformanceError as exc:
        raise _fail(f"{what} changed a payload: {exc}") from None


@_check
def check_batch(ctx: _Ctx) -> None:
    """``put_many`` / ``get_many``: a batch of mixed sizes round-trips in order (a mapping
    or pairs; sizes as ``put`` returns them); an empty batch is fine; a key twice in a
    batch is refused before anything is sent; a payload that cannot be encoded part way
    leaves exactly the keys the error's ``sent`` names delivered and the others free; a
    ``get_many`` that times out names the missing keys and takes nothing."""
    from omnilink import encoded_size

    tx, rx, _ = ctx.pair()
    t0, r0 = _stats(tx, "sender"), _stats(rx, "receiver")
    batch = _batch("b", 9)
    sizes = _call("put_many of 9 items", tx.put_many, batch, timeout=WAIT)
    want = [encoded_size(p) for p in _batch("b", 9).values()]
    if sizes != want:
        raise _fail(f"put_many must return each item's encoded size in order: got {_short(sizes)}, "
                    f"expected {_short(want)}")
    order = list(reversed(batch))
    got = _call("get_many of 9 keys", rx.get_many, order, timeout=WAIT)
    _expect_batch_equal({k: _batch("b", 9)[k] for k in order}, got, "get_many")
    del got
    pairs = list(_batch("p", 4).items())
    _call("put_many of (key, payload) pairs", tx.put_many, pairs, timeout=WAIT)
    for key in ("p-2", "p-0"):  # single gets of batch-sent keys
        _expect_batch_equal({key: _batch("p", 4)[key]}, {key: _get(rx, key)}, f"get({key!r})")
    _expect_batch_equal({"p-3": _batch("p", 4)["p-3"], "p-1": _batch("p", 4)["p-1"]},
                        _call("get_many", rx.get_many, ["p-3", "p-1"], timeout=WAIT), "get_many")
    t1, r1 = _stats(tx, "sender"), _stats(rx, "receiver")
    moved = {"puts": t1.puts - t0.puts, "gets": r1.gets - r0.gets}
    if tx is not rx and moved != {"puts": 13, "gets": 13}:
        raise _fail(f"a batch counts one put / get per item: 13 each expected, stats moved by {moved}")
    if _call("put_many({})", tx.put_many, {}, timeout=WAIT) != []:
        raise _fail("put_many of an empty batch must return []")
    if _call("get_many([])", rx.get_many, [], timeout=SHORT) != {}:
        raise _fail("get_many of no keys must return {}")

    # Duplicates and bad keys: refused before anything is sent.
    exc = _expect(DuplicateKeyError, "put_many with a key twice", tx.put_many,
                  [("d-0", _small(0)), ("d-1", _small(1)), ("d-0", _small(2))], timeout=WAIT)
    if getattr(exc, "key", None) != "d-0" or getattr(exc, "sent", None) != []:
        raise _fail(f"DuplicateKeyError of a batch must name the key (.key) and send nothing (.sent == []), "
                    f"got key={getattr(exc, 'key', None)!r} sent={getattr(exc, 'sent', None)!r}")
    _expect(ConfigurationError, "put_many with a bad key", tx.put_many, {"d-2": 1, "": 2}, timeout=WAIT)
    _expect(ConfigurationError, "put_many of a str", tx.put_many, "ab", timeout=WAIT)
    _expect(ConfigurationError, "get_many listing a key twice", rx.get_many, ["x", "x"], timeout=SHORT)
    _expect(ConfigurationError, "get_many of a str", rx.get_many, "x", timeout=SHORT)
    _marker(tx, rx, "batch-marker-1")
    for key in ("d-0", "d-1", "d-2"):
        _expect_absent(rx, key, "after a refused put_many")

    # A payload that cannot be encoded, part way: a prefix is sent, the rest is not.
    keys = [f"e-{i}" for i in range(5)]
    items = [(k, {"x": _NotCarriable()} if i == 3 else _small(i)) for i, k in enumerate(keys)]
    exc = _expect(BlobEncodeError, "put_many with an unsupported payload at index 3", tx.put_many, items,
                  timeout=WAIT)
    sent, unsent = getattr(exc, "sent", None), getattr(exc, "unsent", None)
    if not isinstance(sent, list) or sent != keys[: len(sent)] or len(sent) > 3 or unsent != keys[len(sent):]:
        raise _fail(f"a failed put_many must name what it sent: .sent a prefix of the batch before the failed "
                    f"item, .unsent the rest; got sent={_short(sent)} unsent={_short(unsent)}")
    if f"{len(sent)} of 5" not in str(exc):
        raise _fail(f"the error of a failed put_many must say how many items were sent: {str(exc)!r}")
    _marker(tx, rx, "batch-marker-2")
    for key in keys[len(sent):]:
        _expect_absent(rx, key, "after put_many failed before it")
    got = _call("get_many of the keys put_many sent", rx.get_many, sent, timeout=WAIT) if sent else {}
    _expect_batch_equal({k: _small(int(k[2:])) for k in sent}, got, "get_many")
    # The unsent keys are free: the batch can be sent again without them failing.
    _call("put_many of the unsent keys", tx.put_many, [(k, _small(7)) for k in keys[len(sent):]], timeout=WAIT)

    # get_many that times out takes nothing.
    _put(tx, "g-a", _small(1))
    _put(tx, "g-b", _small(2))
    _marker(tx, rx, "batch-marker-3")
    start = time.monotonic()
    exc = _expect(TransferTimeout, "get_many with one key never put", rx.get_many, ["g-a", "g-never", "g-b"],
                  timeout=SHORT)
    if time.monotonic() - start > BOUND:
        raise _fail(f"get_many(timeout={SHORT}) took {time.monotonic() - start:.1f} s to time out")
    if getattr(exc, "missing", None) != ["g-never"] or "g-never" not in str(exc):
        raise _fail(f"get_many's TransferTimeout must name the missing keys (message and .missing): {exc!r}")
    got = _call("get_many of the keys present during a timed-out get_many", rx.get_many, ["g-b", "g-a"],
                timeout=WAIT)
    _expect_batch_equal({"g-b": _small(2), "g-a": _small(1)}, got, "get_many after a timeout")
    got = _call("get_many(device='cpu')", rx.get_many, keys[len(sent):], timeout=WAIT, device="cpu")
    _expect_batch_equal({k: _small(7) for k in keys[len(sent):]}, got, "get_many(device='cpu')")


@_check
def check_discard(ctx: _Ctx) -> None:
    """``discard`` returns True for a pending key, False after; a discarded key is never
    delivered; discarding an unknown key is False; other keys are untouched."""
    tx, rx, _ = ctx.pair()
    if _call("discard of a key never put", rx.discard, "nope") is not False:
        raise _fail("discard of a key never put must return False")
    _put(tx, "drop-me", _small(1))
    _put(tx, "keep-me", _small(2))
    _marker(tx, rx, "discard-marker")
    first = _call("discard('drop-me')", rx.discard, "drop-me")
    if first is not True:
        raise _fail(f"discard of a pending key returned {_short(first)}, expected True")
    second = _call("second discard('drop-me')", rx.discard, "drop-me")
    if second is not False:
        raise _fail(f"second discard of the same key returned {_short(second)}, expected False")
    _expect_consumed(rx, "drop-me", "after it was discarded")
    got = _get(rx, "keep-me")
    try:
        assert_payload_equal(_small(2), got, path="payload")
    except ConformanceError as exc:
        raise _fail(f"discard disturbed another key: {exc}") from None
    if _stats(rx, "receiver").discards != 1:
        raise _fail(f"receiver.stats().discards is {_stats(rx, 'receiver').discards}, expected 1")


_LONG_BAD = "k" * 513
_BAD_KEYS: tuple[Any, ...] = ("", None, 7, b"bytes-key", _LONG_BAD, "\u00e9" * 257, "nul\x00key", ("t",))
_GOOD_KEYS: tuple[str, ...] = ("k" * 512, "\u00e9" * 256, "req-7_0_0", "a/b c:d", "\U0001f50a", "x.y")


@_check
def check_key_rules(ctx: _Ctx) -> None:
    """Bad keys (empty, None, non-str, over 512 UTF-8 bytes, NUL) are a
    ``ConfigurationError`` on every method and send nothing; odd but valid keys,
    including one of exactly 512 bytes, round-trip."""
    tx, rx, _ = ctx.pair()
    for bad in _BAD_KEYS:
        label = f"key {_short(bad)}"
        _expect(ConfigurationError, f"put with {label}", tx.put, bad, {"x": 1}, timeout=WAIT)
        _expect(ConfigurationError, f"put_async with {label}", tx.put_async, bad, {"x": 1}, timeout=WAIT)
        _expect(ConfigurationError, f"get with {label}", rx.get, bad, timeout=SHORT)
        _expect(ConfigurationError, f"get_nowait with {label}", rx.get_nowait, bad)
        _expect(ConfigurationError, f"discard with {label}", rx.discard, bad)
    exc = _expect(ConfigurationError, "put with an empty key", tx.put, "", {})
    if not isinstance(exc, ValueError):
        raise _fail("ConfigurationError must also be a ValueError")
    for i, good in enumerate(_GOOD_KEYS):
        _round_trip(tx, rx, good, _small(i), _small(i), f"key {_short(good)}")
    # A key that differs from a 512-byte key only past a truncation point stays distinct.
    k1, k2 = "p" * 511 + "1", "p" * 511 + "2"
    _put(tx, k1, _small(1))
    _put(tx, k2, _small(2))
    for key, i in ((k2, 2), (k1, 1)):
        got = _get(rx, key)
        try:
            assert_payload_equal(_small(i), got, path="payload")
        except ConformanceError as exc:
            raise _fail(f"long keys that differ only in the last byte were confused: {exc}") from None
    st = _stats(tx, "sender")
    if st.puts != len(_GOOD_KEYS) + 2:
        raise _fail(f"sender.stats().puts is {st.puts}; refused puts must not count (expected "
                    f"{len(_GOOD_KEYS) + 2})")


@_check
def check_bad_timeouts(ctx: _Ctx) -> None:
    """A negative, NaN or non-number timeout is a ``ConfigurationError``."""
    tx, rx, _ = ctx.pair()
    for bad in (-1, -0.5, math.nan, "1", True):
        _expect(ConfigurationError, f"put(timeout={bad!r})", tx.put, "t", {"x": 1}, timeout=bad)
        _expect(ConfigurationError, f"get(timeout={bad!r})", rx.get, "t", timeout=bad)
    _round_trip(tx, rx, "t", _small(1), _small(1), "payload")


class _NotCarriable:
    """An object no tensor_blob can carry."""

    def __repr__(self) -> str:
        return "<_NotCarriable>"


@_check
def check_unsupported_payload(ctx: _Ctx) -> None:
    """An object the format cannot carry is a ``BlobEncodeError`` naming its type; nothing
    is sent, the key stays free and the channel keeps working."""
    import numpy as np

    tx, rx, _ = ctx.pair()
    cases: list[tuple[str, Any, str | None]] = [
        ("object", {"meta": {"x": _NotCarriable()}}, "_NotCarriable"),
        ("set", {"s": {1, 2}}, "set"),
        ("int dict key", {1: "one"}, None),
        ("object array", {"a": np.array([_NotCarriable()], dtype=object)}, None),
        ("int beyond 64 bits", {"n": 2**70}, None),
        ("function", [len], None),
    ]
    for i, (label, payload, type_name) in enumerate(cases):
        key = f"bad-{i}"
        exc = _expect(BlobEncodeError, f"put of a payload holding an unsupported {label}", tx.put, key,
                      payload, timeout=WAIT)
        if type_name is not None and type_name not in str(exc):
            raise _fail(f"BlobEncodeError for an unsupported {label} must name its type {type_name!r}: "
                        f"{str(exc)!r}")
        # The same key must be free and the channel intact.
        _round_trip(tx, rx, key, _small(i), _small(i), f"key {key!r} after a failed put")
    st = _stats(tx, "sender")
    if st.puts != len(cases):
        raise _fail(f"sender.stats().puts is {st.puts}; failed puts must not count (expected {len(cases)})")


@_check
def check_channel_isolation(ctx: _Ctx) -> None:
    """Two channels never see each other's keys."""
    tx1, rx1, _ = ctx.pair()
    tx2, rx2, _ = ctx.pair()
    _put(tx1, "same", _small(1))
    _put(tx2, "same", _small(2))
    for rx, i in ((rx2, 2), (rx1, 1)):
        got = _get(rx, "same")
        try:
            assert_payload_equal(_small(i), got, path="payload")
        except ConformanceError as exc:
            raise _fail(f"a payload crossed channels: {exc}") from None
    _expect_consumed(rx1, "same", "on the first channel after it was consumed")
    _expect_consumed(rx2, "same", "on the second channel after it was consumed")


@_check
def check_views_stay_valid(ctx: _Ctx) -> None:
    """A received payload keeps its values while later traffic reuses the transport."""
    import torch

    tx, rx, _ = ctx.pair()

    def make(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {"h": torch.randn(64, 128, generator=g).to(torch.bfloat16), "i": i}

    held = []
    for i in range(3):
        _put(tx, f"v-{i}", make(i))
        held.append(_get(rx, f"v-{i}"))
    for i in range(3, 40):
        _put(tx, f"v-{i}", make(i))
        _get(rx, f"v-{i}")
    for i, got in enumerate(held):
        try:
            assert_payload_equal(make(i), got, path=f"payload of 'v-{i}'")
        except ConformanceError as exc:
            raise _fail(f"a payload held by the caller changed while later payloads passed: {exc}") from None


@_check
def check_get_device_cpu(ctx: _Ctx) -> None:
    """``get(..., device="cpu")`` returns the payload with its tensors on the CPU."""
    tx, rx, _ = ctx.pair()
    zoo = payload_zoo()
    payload = zoo["vllm.thinker_to_talker"]
    _put(tx, "dev", payload)
    got = _get(rx, "dev", device="cpu")
    try:
        assert_payload_equal(payload_zoo()["vllm.thinker_to_talker"], got, path="payload")
    except ConformanceError as exc:
        raise _fail(f"get(device='cpu') changed the payload: {exc}") from None
    for k, v in got.items():
        if hasattr(v, "device") and v.device.type != "cpu":
            raise _fail(f"payload[{k!r}] is on {v.device}, expected cpu")


@_check
def check_stats(ctx: _Ctx) -> None:
    """Counters move: the sender's ``puts``/``bytes_put``, the receiver's
    ``gets``/``bytes_got``, each by exactly what passed."""
    tx, rx, _ = ctx.pair()
    t0, r0 = _stats(tx, "sender"), _stats(rx, "receiver")
    total = 0
    for i in range(3):
        total += _put(tx, f"st-{i}", _small(i))
    for i in range(3):
        _get(rx, f"st-{i}")
    t1, r1 = _stats(tx, "sender"), _stats(rx, "receiver")
    same = tx is rx
    checks = [
        ("sender", "puts", t1.puts - t0.puts, 3),
        ("sender", "bytes_put", t1.bytes_put - t0.bytes_put, total),
        ("receiver", "gets", r1.gets - r0.gets, 3),
        ("receiver", "bytes_got", r1.bytes_got - r0.bytes_got, total),
    ]
    if not same:
        checks += [
            ("sender", "gets", t1.gets - t0.gets, 0),
            ("receiver", "puts", r1.puts - r0.puts, 0),
        ]
    for who, field, moved, want in checks:
        if moved != want:
            raise _fail(f"{who}.stats().{field} moved by {moved}, expected {want}")
    for who, st in (("sender", t1), ("receiver", r1)):
        for field in ("blocks_in_use", "bytes_in_use", "fallbacks", "timeouts", "discards"):
            value = getattr(st, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _fail(f"{who}.stats().{field} must be an int >= 0, got {_short(value)}")


@_check
def check_context_manager(ctx: _Ctx) -> None:
    """``with`` returns the connector itself and closes it on exit, also on an exception."""
    tx, rx, _ = ctx.pair()
    with tx as entered_tx, rx as entered_rx:
        if entered_tx is not tx or entered_rx is not rx:
            raise _fail("__enter__ must return the connector itself")
        _round_trip(tx, rx, "cm", _small(1), _small(1), "payload")
    _expect(ClosedError, "put after the with-block closed the sender", tx.put, "cm2", {})
    _expect(ClosedError, "get after the with-block closed the receiver", rx.get, "cm2", timeout=SHORT)

    class _Boom(Exception):
        pass

    tx2, rx2, _ = ctx.pair()
    try:
        with rx2, tx2:
            raise _Boom
    except _Boom:
        pass
    else:
        raise _fail("an exception inside the with-block was swallowed by __exit__")
    _expect(ClosedError, "put after a with-block left by an exception", tx2.put, "cm3", {})
    _expect(ClosedError, "get_nowait after a with-block left by an exception", rx2.get_nowait, "cm3")


@_check
def check_use_after_close(ctx: _Ctx) -> None:
    """After ``close()`` (idempotent) every call raises ``ClosedError``, also ``with``."""
    tx, rx, _ = ctx.pair()
    _put(tx, "pending", _small(1))
    for conn, who in ((rx, "receiver"), (tx, "sender")):
        _call(f"{who}.close()", conn.close)
        _call(f"second {who}.close()", conn.close)
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("sender.put", lambda: tx.put("k", {"x": 1}, timeout=SHORT)),
        ("sender.discard", lambda: tx.discard("k")),
        ("sender.stats", tx.stats),
        ("receiver.get", lambda: rx.get("pending", timeout=SHORT)),
        ("receiver.get_nowait", lambda: rx.get_nowait("pending")),
        ("receiver.discard", lambda: rx.discard("pending")),
        ("receiver.stats", rx.stats),
        ("sender.__enter__", tx.__enter__),
        ("receiver.__enter__", rx.__enter__),
    ]
    for what, fn in calls:
        exc = _expect(ClosedError, f"{what} after close()", fn)
        if not isinstance(exc, TransportError):
            raise _fail("ClosedError must be a TransportError")
    try:
        fut = tx.put_async("k", {"x": 1}, timeout=SHORT)
    except ClosedError:
        pass
    except Exception as exc:
        raise _fail(
            f"sender.put_async after close(): expected ClosedError, got {type(exc).__name__}: {exc}"
        ) from exc
    else:
        try:
            fut.result(timeout=WAIT)
        except ClosedError:
            pass
        except Exception as exc:
            raise _fail(f"sender.put_async after close(): the future raised {type(exc).__name__}, "
                        "expected ClosedError") from exc
        else:
            raise _fail("sender.put_async after close() succeeded")


@_check
def check_huge_payload(ctx: _Ctx) -> None:
    """A payload of ``huge_bytes`` (default 64 MiB) arrives intact while the receiver reads
    concurrently with the put."""
    import torch

    n = ctx.huge_bytes
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    data = raw.view(torch.bfloat16) if n % 2 == 0 else raw
    payload = {"hidden_states.output": data, "meta": {"nbytes": n}}
    tx, rx, _ = ctx.pair()
    putter = _Thread(tx.put, "huge", payload, timeout=WAIT).start()
    got = _call(f"get of a {n}-byte payload", rx.get, "huge", timeout=WAIT)
    putter.outcome(f"put of a {n}-byte payload")
    if not isinstance(got, dict) or set(got) != {"hidden_states.output", "meta"}:
        raise _fail(f"a {n}-byte payload arrived as {_short(got)}")
    try:
        assert_payload_equal(payload["meta"], got["meta"], path="payload['meta']")
        t = got["hidden_states.output"]
        if t.dtype != data.dtype or tuple(t.shape) != tuple(data.shape):
            raise _fail(
                f"huge tensor arrived as {t.dtype}{tuple(t.shape)}, expected {data.dtype}{tuple(data.shape)}"
            )
        if not torch.equal(t.reshape(-1).view(torch.uint8), raw):
            raise _fail(f"the {n}-byte tensor arrived with different bytes")
    finally:
        del got


# ---------------------------------------------------------------------- public API

CHECKS: dict[str, Callable[[PairFactory], None]] = dict(_REGISTRY)
"""Every conformance check by name, in a stable order; ``CHECKS[name](open_pair)`` runs
one (closing what it opened) and raises ``ConformanceError`` on failure."""


def _select(only: Iterable[str] | None, skip: Iterable[str]) -> list[str]:
    def names(arg: Iterable[str], what: str) -> list[str]:
        if isinstance(arg, str):
            raise ConfigurationError(f"{what} must be a collection of check names, not a str ({arg!r})")
        picked = list(arg)
        unknown = [n for n in picked if n not in CHECKS]
        if unknown:
            raise ConfigurationError(
                f"unknown conformance check(s) {unknown} in {what}; known: {', '.join(CHECKS)}"
            )
        return picked

    wanted = set(names(only, "only")) if only is not None else set(CHECKS)
    skipped = set(names(skip, "skip"))
    return [n for n in CHECKS if n in wanted and n not in skipped]


def check_connector(
    open_pair: PairFactory,
    /,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    huge_bytes: int = DEFAULT_HUGE_BYTES,
) -> list[str]:
    """Run the conformance checks against the backend ``open_pair`` opens.

    Parameters
    ----------
    open_pair : PairFactory
        ``open_pair(channel) -> (sender, receiver)``: open both ends on the given fresh
        channel name, in this process. Each check calls it one or more times and closes
        everything it returned, pass or fail.
    only : iterable of str, optional
        Run just these checks (names from ``CHECKS``); default all.
    skip : iterable of str
        Checks not to run (e.g. ones a backend documents it cannot meet).
    huge_bytes : int
        Size of the payload of the ``huge_payload`` check (default 64 MiB); lower it for
        backends whose transport is configured smaller.

    Returns
    -------
    list[str]
        Names of the checks run, in ``CHECKS`` order.

    Raises
    ------
    ConformanceError
        One or more checks failed. The message names each failed check and what was
        wrong; ``failures`` maps names to messages; ``__cause__`` is the first failure.
    ConfigurationError
        ``only`` or ``skip`` names an unknown check, or ``huge_bytes`` is not a
        positive int.
    """
    if not callable(open_pair):
        raise ConfigurationError(f"open_pair must be callable, got {type(open_pair).__name__}")
    if isinstance(huge_bytes, bool) or not isinstance(huge_bytes, int) or huge_bytes <= 0:
        raise ConfigurationError(f"huge_bytes must be a positive int, got {huge_bytes!r}")
    selected = _select(only, skip)
    failures: dict[str, str] = {}
    first: ConformanceError | None = None
    for name in selected:
        try:
            _REGISTRY[name](open_pair, huge_bytes=huge_bytes)
        except ConformanceError as exc:
            failures.update(exc.failures or {name: str(exc)})
            first = first or exc
    if first is not None:
        if len(failures) == 1:
            raise ConformanceError(str(first), failures=failures) from first.__cause__
        lines = "\n".join(f"  - {name}: {msg}" for name, msg in failures.items())
        raise ConformanceError(
            f"{len(failures)} of {len(selected)} conformance checks failed:\n{lines}", failures=failures
        ) from first
    return selected
