"""``OmnilinkConnector``: the adapter proper (edges, put / get, cleanup, health).

See the package docstring for the contract and the options.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from omnilink.chunking import chunk_key
from omnilink._errors import (
    ClosedError,
    ConfigurationError,
    KeyConsumedError,
    OmnilinkError,
    PeerLostError,
    TransferTimeout,
    WouldBlock,
)
from omnilink._util import validate_channel
from omnilink.blob import encoded_size
from omnilink.integrations.vllm_omni.config import (
    _BASE_MODULE,
    _REAP_INTERVAL,
    CONNECTOR_NAME,
    check_extra,
)
from omnilink.integrations.vllm_omni.holds import _HoldWatch
from omnilink.integrations.vllm_omni.index import _Entry, _request_of, _stage_of, _Tracked
from omnilink.integrations.vllm_omni.payloads import _owned, _to_wire

__all__: list[str] = []  # the package re-exports what is public

logger = logging.getLogger(__name__)

def _load_base() -> type:
    """vLLM-Omni's ``OmniConnectorBase``, or ``object`` when vLLM-Omni is not importable."""
    import importlib

    try:
        return importlib.import_module(_BASE_MODULE).OmniConnectorBase
    except ImportError as exc:
        logger.debug("vllm-omni not importable (%s): OmnilinkConnector subclasses object", exc)
        return object


# ------------------------------------------------------------------ the connector
class _OmnilinkConnectorImpl:
    """The whole adapter; ``OmnilinkConnector`` adds vLLM-Omni's base class to it."""

    #: vLLM-Omni may hand over raw tensors and bytes: tensor_blob carries them as they are.
    supports_raw_data = True

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        # Set first: close() (also reached from a failed __init__) relies on them.
        self._lock = threading.Lock()
        self._closed = False
        self._edges: dict[tuple[str, str], Any] = {}
        self._edge_from: dict[str, str] = {}
        self._entries: OrderedDict[_Entry, _Tracked] = OrderedDict()
        self._by_rid: dict[str, set[_Entry]] = {}
        self._by_key: dict[str, set[_Entry]] = {}
        self._by_edge: dict[tuple[str, str], set[str]] = {}
        self._lost_logged: set[str] = set()
        self._overflow_warned = False
        self._counters = {"puts": 0, "gets": 0, "put_failures": 0, "bytes_put": 0, "bytes_got": 0,
                          "cleanups": 0, "discarded": 0, "expired": 0, "peer_lost": 0}
        self._next_reap = time.monotonic() + _REAP_INTERVAL
        self._reclaim_after: float | None = None

        if config is None:
            config = {}
        # Every key and backend option is checked here, for every role: a receiver
        # whose configuration is wrong fails at start-up, never at each get.
        settings = check_extra(config)
        self.config = config
        self.stage_id = config.get("stage_id", -1)
        self.role: str = settings.role
        self.backend = settings.backend
        self.channel_prefix: str = settings.channel
        self._options = settings.options
        self._put_timeout = settings.put_timeout
        self._pending_ttl = settings.pending_ttl
        self._holds = _HoldWatch(settings.hold_warn_s)
        self._reclaim_after = settings.reclaim_after
        self._zero_copy = settings.zero_copy
        self._device = settings.device
        self._max_tracked = settings.max_tracked_keys

        # Open the configured edge now, so a bad backend option or a too small /dev/shm
        # fails at start-up (the factory reports it) instead of at the first request.
        src, dst = config.get("from_stage"), config.get("to_stage")
        if src is not None and dst is not None and self.role != "dual":
            try:
                self._edge(self._channel(str(src), str(dst)), self.role, str(src))
            except BaseException:
                self.close()
                raise

    # ----------------------------------------------------------------- edges
    def _channel(self, from_stage: str, to_stage: str) -> str:
        return validate_channel(f"{self.channel_prefix}/{from_stage}-{to_stage}")

    def _edge(self, channel: str, side: str, from_stage: str | None) -> Any:
        """The omnilink connector of ``side`` ("sender"/"receiver") on ``channel``."""
        conn = self._edges.get((side, channel))
        if conn is not None:
            return conn
        from omnilink.connectors import connect_backend

        with self._lock:
            if self._closed:
                raise ClosedError(f"OmnilinkConnector (stage {self.stage_id}) is closed")
            conn = self._edges.get((side, channel))
            if conn is None:
                conn = connect_backend(self.backend, channel=channel, role=side, **self._options)
                self._edges[(side, channel)] = conn
                if from_stage is not None:
                    self._edge_from.setdefault(channel, from_stage)
                logger.debug("OmnilinkConnector: opened %s %s on %r", self.backend, side, channel)
        return conn

    def edge(self, from_stage: str, to_stage: str, /, *, side: str) -> Any:
        """The omnilink connector this adapter uses for one side of a stage edge.

        For diagnostics and tests (``stats()``, ``mapping_of``); opened if need be.

        Parameters
        ----------
        from_stage, to_stage : str
            The edge, as vLLM-Omni names it (``"0"``, ``"1"``).
        side : {"sender", "receiver"}
            The sending side (used by ``put``) or the receiving side (used by ``get``).

        Returns
        -------
        omnilink.Connector

        Raises
        ------
        ConfigurationError
            Bad side or stage names, or the backend refused its options.
        ClosedError
            The adapter was closed.
        """
        if side not in ("sender", "receiver"):
            raise ConfigurationError(f"side must be 'sender' or 'receiver', got {side!r}")
        return self._edge(self._channel(str(from_stage), str(to_stage)), side, str(from_stage))

    # ----------------------------------------------------------------- index
    def _track(self, side: str, channel: str, key: str, from_stage: str, *, busy: bool = False) -> _Entry:
        entry = (side, channel, key)
        rid, stage, chunk = _request_of(key, from_stage)
        with self._lock:
            old = self._entries.get(entry)
            if old is not None:
                if busy:
                    old.settled = None
                return entry  # polled (or sent) again: keep its age
            rec = _Tracked(rid, stage, chunk, time.monotonic())
            if busy:
                rec.settled = None
            self._entries[entry] = rec
            self._by_rid.setdefault(rid, set()).add(entry)
            self._by_key.setdefault(key, set()).add(entry)
            self._by_edge.setdefault((side, channel), set()).add(key)
            overflow = len(self._entries) - self._max_tracked
            if overflow > 0:
                for _ in range(overflow):
                    old_entry, old_rec = self._entries.popitem(last=False)
                    self._unindex_locked(old_entry, old_rec)
                # Without a backend that reports its pending keys (see reap_consumed) the
                # index also holds consumed keys, so this can be routine: say it once.
                log = logger.debug if self._overflow_warned else logger.warning
                self._overflow_warned = True
                log(
                    "OmnilinkConnector: more than %d keys tracked; forgot the %d oldest "
                    "(cleanup() can no longer free them; raise extra['max_tracked_keys'])",
                    self._max_tracked, overflow,
                )
        return entry

    def _settle(self, entry: _Entry) -> None:
        """The put of ``entry`` returned: from now on it may be pruned as consumed."""
        with self._lock:
            rec = self._entries.get(entry)
            if rec is not None:
                rec.settled = time.monotonic()

    def _untrack(self, entry: _Entry) -> None:
        with self._lock:
            rec = self._entries.pop(entry, None)
            if rec is not None:
                self._unindex_locked(entry, rec)

    def _unindex_locked(self, entry: _Entry, rec: _Tracked) -> None:
        for table, name in ((self._by_rid, rec.rid), (self._by_key, entry[2]), (self._by_edge, entry[:2])):
            entries = table.get(name)
            if entries is not None:
                entries.discard(entry)
                if not entries:
                    del table[name]

    def _maybe_reap(self) -> None:
        if time.monotonic() >= self._next_reap:
            self.reap_consumed()
            self.check_holds()

    def check_holds(self) -> int:
        """Log (once per request) requests that have held a received payload's views
        longer than ``extra['hold_warn_s']``; ``put`` and ``get`` call it about once a
        second. Returns how many requests were reported now."""
        with self._lock:
            edges = [(channel, self._edge_from.get(channel, ""), conn)
                     for (side, channel), conn in self._edges.items() if side == "receiver"]
        return self._holds.check(edges)

    def reap_consumed(self) -> None:
        """Sweep the per-request index: drop what outlived ``pending_ttl``.

        vLLM-Omni calls this from its save loop; ``put`` and ``get`` also call it about
        once a second. Sent payloads still unread after ``pending_ttl`` seconds are
        discarded (their consumer was failed long ago: vLLM-Omni gives up on a request
        after 600 s without input); keys polled but never read are forgotten.
        """
        now = time.monotonic()
        self._next_reap = now + _REAP_INTERVAL
        self._prune_consumed()
        if self._pending_ttl is None:
            return
        cutoff = now - self._pending_ttl
        stale: list[_Entry] = []
        with self._lock:
            if self._closed:
                return
            while self._entries:
                entry, rec = next(iter(self._entries.items()))
                if rec.since > cutoff:
                    break
                self._entries.popitem(last=False)
                self._unindex_locked(entry, rec)
                if entry[0] == "sender":
                    stale.append(entry)
        dropped = sum(self._discard(side, channel, key) for side, channel, key in stale)
        if dropped:
            self._count(expired=dropped)
            logger.warning(
                "OmnilinkConnector: dropped %d payload(s) unread for more than %.0f s (extra['pending_ttl'])",
                dropped, self._pending_ttl,
            )

    def _prune_consumed(self) -> None:
        """Forget sent keys a receiver already took, where the backend can tell.

        A sender cannot see a receiver's reads; a backend that offers
        ``pending_keys() -> Iterable[str]`` (keys published and not yet claimed) lets the
        index keep only what ``cleanup`` could still free. Without it the index holds
        sent keys until ``pending_ttl`` or the ``max_tracked_keys`` bound.
        """
        with self._lock:
            edges = [(ch, conn) for (side, ch), conn in self._edges.items() if side == "sender"]
        for channel, conn in edges:
            pending_keys = getattr(conn, "pending_keys", None)
            if pending_keys is None:
                continue
            # Only keys whose put returned before this snapshot began can be judged by it.
            snapshot = time.monotonic()
            try:
                pending = set(pending_keys())
            except OmnilinkError as exc:
                logger.debug("OmnilinkConnector: pending_keys() on %r failed: %s", channel, exc)
                continue
            with self._lock:
                for key in list(self._by_edge.get(("sender", channel), ())):
                    if key in pending:
                        continue
                    entry = ("sender", channel, key)
                    rec = self._entries.get(entry)
                    if rec is not None and rec.settled is not None and rec.settled < snapshot:
                        del self._entries[entry]
                        self._unindex_locked(entry, rec)

    def _discard(self, side: str, channel: str, key: str) -> bool:
        conn = self._edges.get((side, channel))
        if conn is None:
            return False
        try:
            return bool(conn.discard(key))
        except ClosedError:
            return False
        except OmnilinkError as exc:
            logger.warning("OmnilinkConnector: discarding %r on %r failed: %s", key, channel, exc)
            return False

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    # ------------------------------------------------------------------- put
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Send ``data`` from ``from_stage`` to ``to_stage`` under ``put_key``.

        Parameters
        ----------
        from_stage, to_stage : str
            The stage edge; it names the omnilink channel (``{channel}/{from}-{to}``).
        put_key : str
            The key the receiving stage asks for (``{request_id}_{from_stage}_{chunk}``
            for chunks); read exactly once.
        data : Any
            A tensor_blob payload, a ``msgspec.Struct`` or a dataclass (sent as a dict),
            or a raw tensor / bytes.

        Returns
        -------
        tuple of (bool, int, dict or None)
            ``(True, encoded size in bytes, metadata)`` where metadata is
            ``{"omnilink": {"backend", "channel", "key"}, "size": n}``; or
            ``(False, 0, None)`` when the payload could not be sent (an object tensor_blob
            cannot carry, no room within ``put_timeout``, a closed adapter, ...). The
            failure is logged; nothing is raised, as vLLM-Omni expects.
        """
        try:
            if self._closed:
                raise ClosedError(f"OmnilinkConnector (stage {self.stage_id}) is closed")
            self._maybe_reap()
            src = str(from_stage)
            channel = self._channel(src, str(to_stage))
            conn = self._edge(channel, "sender", src)
            payload = _to_wire(data)
            # Indexed before the put, so a cleanup() racing with it still finds the key.
            entry = self._track("sender", channel, put_key, src, busy=True)
            try:
                n = conn.put(put_key, payload, timeout=self._put_timeout)
            except PeerLostError as exc:
                self._untrack(entry)
                self._receivers_gone(channel, conn, exc)
                raise
            except BaseException:
                self._untrack(entry)
                raise
            self._settle(entry)
        except OmnilinkError as exc:
            self._count(put_failures=1)
            logger.error("OmnilinkConnector: put of %r (%s -> %s) failed: %s", put_key, from_stage, to_stage, exc)
            return False, 0, None
        except Exception:
            self._count(put_failures=1)
            logger.exception("OmnilinkConnector: put of %r (%s -> %s) failed", put_key, from_stage, to_stage)
            return False, 0, None
        self._count(puts=1, bytes_put=n)
        return True, n, {"omnilink": {"backend": self.backend, "channel": channel, "key": put_key}, "size": n}

    def _receivers_gone(self, channel: str, conn: Any, exc: PeerLostError) -> None:
        """Every receiver of ``channel`` died: what waits for them in the arena is garbage.

        The requests they were reading are failed by the engine; a receiver started
        afterwards reads only new requests. So every unread payload of this edge is
        reclaimed now, and the next ``put`` finds room for it.
        """
        self._count(peer_lost=1)
        reclaim = getattr(conn, "reclaim_unread", None)
        dropped = 0
        if reclaim is not None:
            try:
                dropped = len(reclaim(0))
            except OmnilinkError as err:
                logger.warning("OmnilinkConnector: reclaiming the arena of %r failed: %s", channel, err)
        logger.warning(
            "OmnilinkConnector: edge %r lost its receivers (%s); reclaimed %d unread payload(s)",
            channel, exc, dropped,
        )

    # ------------------------------------------------------------------- get
    def _get_channel(self, from_stage: str, to_stage: str, get_key: str, metadata: Any) -> str:
        """The channel to read ``get_key`` from: the one ``put``'s metadata names, if it
        is ours and on this backend, else the edge's."""
        md = metadata
        if isinstance(md, dict) and "omnilink" not in md and isinstance(md.get(get_key), dict):
            md = md[get_key]
        ours = md.get("omnilink") if isinstance(md, dict) else None
        if isinstance(ours, dict) and ours.get("backend") == self.backend:
            channel = ours.get("channel")
            if isinstance(channel, str):
                if ours.get("key") not in (None, get_key):
                    logger.warning(
                        "OmnilinkConnector: metadata of key %r is for key %r; reading %r",
                        get_key, ours.get("key"), get_key,
                    )
                return validate_channel(channel)
        # Foreign or missing metadata (the chunk adapter forwards none): by key alone.
        return self._channel(from_stage, to_stage)

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        """Take the payload under ``get_key`` if it is there; never waits.

        Parameters
        ----------
        from_stage, to_stage : str
            The stage edge the payload travels on.
        get_key : str
            The key the sender used.
        metadata : dict, optional
            What ``put`` returned, or a dict mapping ``get_key`` to it, or ``None``
            (look the payload up by key alone). Foreign metadata is ignored.

        Returns
        -------
        tuple of (payload, int) or None
            The payload and its encoded size, consumed (no other reader gets it); or
            ``None`` when it is not there yet (poll again) or can never arrive (its
            sender died: logged once per key).

        Raises
        ------
        ClosedError
            The adapter was closed.
        ConfigurationError
            Invalid key or stage names.
        BlobDecodeError
            The bytes under ``get_key`` are not a valid frame (they are consumed).
        """
        return self._receive(from_stage, to_stage, get_key, metadata, None)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """Like ``get`` but wait until ``deadline`` (a ``time.monotonic()`` value).

        The wait is woken by the transport (a semaphore or socket), not by polling.
        Returns ``None`` if the payload did not arrive by then. Raises as ``get``.
        """
        return self._receive(from_stage, to_stage, get_key, metadata, deadline)

    def _receive(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None,
        deadline: float | None,
    ) -> tuple[Any, int] | None:
        """``get`` (``deadline`` None: never wait) and ``get_with_deadline``."""
        if self._closed:
            raise ClosedError(f"OmnilinkConnector (stage {self.stage_id}) is closed")
        remaining = None if deadline is None else deadline - time.monotonic()
        self._maybe_reap()
        src = str(from_stage)
        channel = self._get_channel(src, str(to_stage), get_key, metadata)
        conn = self._edge(channel, "receiver", src)
        try:
            # device=: the backend lands the payload there itself (the shm backend through
            # its copy controllers: stream-ordered, the host not blocked on the copy).
            if remaining is None or remaining <= 0:
                data = conn.get_nowait(get_key, device=self._device)
            else:
                data = conn.get(get_key, timeout=remaining, device=self._device)
        except (WouldBlock, TransferTimeout):
            self._track("receiver", channel, get_key, src)
            return None
        except KeyConsumedError:
            # Read already (vLLM-Omni's reads consume): "not there" for this poller.
            return None
        except PeerLostError as exc:
            self._lost(channel, get_key, src, exc)
            return None
        return self._delivered(channel, get_key, data)

    def _lost(self, channel: str, key: str, from_stage: str, exc: Exception) -> None:
        self._track("receiver", channel, key, from_stage)
        with self._lock:
            first = key not in self._lost_logged
            if first:
                if len(self._lost_logged) >= self._max_tracked:
                    self._lost_logged.clear()
                self._lost_logged.add(key)
        if first:
            logger.warning("OmnilinkConnector: key %r can no longer arrive: %s", key, exc)

    def _delivered(self, channel: str, key: str, data: Any) -> tuple[Any, int]:
        self._untrack(("receiver", channel, key))
        size = encoded_size(data)
        if self._device is None and not self._zero_copy:
            data = _owned(data)
        self._count(gets=1, bytes_got=size)
        return data, size

    # --------------------------------------------------------------- cleanup
    def cleanup(self, request_id: str) -> None:
        """Free the one payload stored under the exact key ``request_id``.

        vLLM-Omni 0.30.0's contract (``OmniConnectorBase.cleanup``, as
        ``SharedMemoryConnector`` implements it): the argument is the exact key given to
        ``put``, never a request-id prefix, so ``cleanup("req")`` leaves ``req_0_0``
        readable. The chunk adapter calls it once per chunk key of an aborted request
        (``{external_req_id}_{stage}_{chunk}``). To free every chunk of a request, call
        ``cleanup_request``.

        The key is discarded on every edge this adapter has open where it is still
        unread (a payload this stage sent, or one waiting for this stage). Payloads
        already read are not touched: their blocks go back when the caller drops the last
        view. Idempotent; a no-op after ``close()``; never raises for an unknown key.

        Parameters
        ----------
        request_id : str
            The exact key (the name is vLLM-Omni's).
        """
        if self._closed or not isinstance(request_id, str) or not request_id:
            return
        key = request_id
        stage = _stage_of(key)
        with self._lock:
            for entry in set(self._by_key.get(key, ())):
                rec = self._entries.pop(entry, None)
                if rec is not None:
                    self._unindex_locked(entry, rec)
            edges = list(self._edges)
            if stage is not None and stage in self._edge_from.values():
                # A chunk key names its sending stage: only that stage's edges hold it.
                edges = [(side, ch) for side, ch in edges if self._edge_from.get(ch) in (None, stage)]
        freed = sum(self._discard(side, channel, key) for side, channel in edges)
        self._count(cleanups=1, discarded=freed)
        if freed:
            logger.debug("OmnilinkConnector: cleanup(%r) discarded %d payload(s)", key, freed)

    def cleanup_request(self, request_id: str, /) -> int:
        """Free every payload of request ``request_id`` still pending on this adapter.

        The sweep that ``cleanup`` is not: it discards (a) each key indexed for the
        request, sent and not read yet or polled and not read yet; (b) the key
        ``request_id`` itself (a whole-request payload); (c) on each receiving edge, the
        chunks ``{request_id}_{from}_{c}`` that arrived after the last one polled. Call it
        only where every chunk of the request is garbage (the request was aborted on
        both sides): a receiver that still has chunks to read loses them.

        Payloads already read are not touched. Idempotent; a no-op after ``close()``.

        Parameters
        ----------
        request_id : str
            The request id (``external_req_id`` in vLLM-Omni), not a chunk key.

        Returns
        -------
        int
            How many payloads were discarded.
        """
        if self._closed or not isinstance(request_id, str) or not request_id:
            return 0
        with self._lock:
            entries = set(self._by_rid.get(request_id, ())) | set(self._by_key.get(request_id, ()))
            records = []
            for entry in entries:
                rec = self._entries.pop(entry, None)
                if rec is not None:
                    self._unindex_locked(entry, rec)
                    records.append((entry, rec))
            receivers = [(channel, self._edge_from.get(channel)) for side, channel in self._edges if side == "receiver"]
        freed = 0
        next_chunk: dict[str, int] = {}
        for (side, channel, key), rec in records:
            if self._discard(side, channel, key):
                freed += 1
            if side == "receiver" and rec.chunk is not None and rec.rid == request_id:
                next_chunk[channel] = max(next_chunk.get(channel, 0), rec.chunk + 1)
        for channel, src in receivers:
            if self._discard("receiver", channel, request_id):
                freed += 1
            if src is None:
                continue
            chunk = next_chunk.get(channel, 0)
            while True:
                try:
                    key = chunk_key(request_id, src, chunk)
                except ConfigurationError:
                    break
                if not self._discard("receiver", channel, key):
                    break
                freed += 1
                chunk += 1
        self._count(cleanups=1, discarded=freed)
        if freed:
            logger.debug("OmnilinkConnector: cleanup_request(%r) discarded %d payload(s)", request_id, freed)
        return freed

    def abandon_get(self, get_key: str) -> None:
        """Forget that this stage polled ``get_key``; the payload itself is left alone.

        vLLM-Omni calls this when it gives up waiting for a payload (its base class's
        "retire unresolved discovery attempts"). Without it the polled key would stay in
        the per-request index until ``pending_ttl``.
        """
        if self._closed or not isinstance(get_key, str):
            return
        with self._lock:
            for entry in [e for e in self._by_key.get(get_key, ()) if e[0] == "receiver"]:
                rec = self._entries.pop(entry, None)
                if rec is not None:
                    self._unindex_locked(entry, rec)

    # ---------------------------------------------------------------- health
    def health(self) -> dict[str, Any]:
        """Status and counters: ``status`` (``"healthy"`` or ``"closed"``), ``backend``,
        ``role``, ``stage_id``, ``puts``, ``gets``, ``put_failures``, ``bytes_put``,
        ``bytes_got``, ``pending_keys`` (size of the per-request index), ``cleanups``,
        ``discarded``, ``expired``, ``reclaimed`` (unread payloads the backend reclaimed
        by itself, summed over the edges: see ``reclaim_after``), ``reclaim_after``,
        ``peer_lost`` (puts that found every receiver of their edge dead) and ``edges``
        (``"side:channel"`` -> the omnilink connector's ``stats()`` as a dict)."""
        import msgspec

        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["pending_keys"] = len(self._entries)
            edges = list(self._edges.items())
            closed = self._closed
        out.update(status="closed" if closed else "healthy", backend=self.backend, role=self.role,
                   stage_id=self.stage_id, bytes_transferred=out["bytes_put"] + out["bytes_got"],
                   reclaim_after=self._reclaim_after)
        stats: dict[str, Any] = {}
        for (side, channel), conn in edges:
            try:
                stats[f"{side}:{channel}"] = msgspec.structs.asdict(conn.stats())
            except ClosedError:
                continue
        out["edges"] = stats
        out["reclaimed"] = sum(int(st.get("reclaimed", 0)) for st in stats.values())
        return out

    # ----------------------------------------------------------------- close
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every omnilink connector this adapter opened; idempotent.

        A sending ``shm`` edge waits up to its ``linger`` option for live receivers to
        claim what it published. Afterwards ``put`` reports failure, ``get`` raises
        ``ClosedError`` and ``cleanup`` does nothing.
        """
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before anything was opened
            return
        with lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._edges.values())
            self._edges.clear()
            self._entries.clear()
            self._by_rid.clear()
            self._by_key.clear()
            self._by_edge.clear()
        for conn in conns:
            try:
                conn.close()
            except Exception:
                logger.exception("OmnilinkConnector: closing %r failed", conn)

    def __enter__(self) -> _OmnilinkConnectorImpl:
        if self._closed:
            raise ClosedError(f"OmnilinkConnector (stage {self.stage_id}) is closed")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # OmniConnectorBase.__del__ calls close(), which may linger for seconds inside
        # the garbage collector. Not needed: every omnilink connector releases its shared
        # memory through its own weakref.finalize when it is collected.
        pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<OmnilinkConnector {self.backend} stage={self.stage_id} role={self.role} "
                f"channel={self.channel_prefix!r} {state}>")


# ------------------------------------------------------------------ class and registration
_SHM_CONNECTOR_MODULE = "vllm_omni.distributed.omni_connectors.connectors.shm_connector"


def _wire_abort_cleanup(cls: type) -> bool:
    """Let vLLM-Omni's chunk adapter clean up aborted requests on ``cls`` too.

    vLLM-Omni 0.30.0's ``OmniChunkTransferAdapter`` frees the unread chunks of an aborted
    request only ``if isinstance(self.connector, SharedMemoryConnector)``: it then queues,
    on its save thread, ``connector.cleanup(f"{external_req_id}_{stage_id}_{chunk}")`` for
    every chunk it put. ``cls`` keeps that exact-key contract, so it is registered as a
    virtual subclass of ``SharedMemoryConnector`` (``ABCMeta.register``: no code of that
    class is inherited or run; ``isinstance`` answers True, which in 0.30.0 only these two
    places ask). Returns whether it was wired; without vLLM (the module imports it) there
    is no adapter to wire.
    """
    import importlib

    try:
        shm_cls = importlib.import_module(_SHM_CONNECTOR_MODULE).SharedMemoryConnector
    except Exception as exc:  # ImportError without vLLM; anything a foreign import raises
        logger.debug("OmnilinkConnector: vLLM-Omni's abort cleanup not wired (%s)", exc)
        return False
    register = getattr(shm_cls, "register", None)
    if register is None:  # not an ABC in this vLLM-Omni version
        return False
    register(cls)
    return True


_class: type | None = None
_class_lock = threading.Lock()


def _connector_class() -> type:
    """Build ``OmnilinkConnector`` once: the adapter on top of vLLM-Omni's base class
    (``object`` when vLLM-Omni cannot be imported)."""
    global _class
    with _class_lock:
        if _class is None:
            base = _load_base()
            bases = (_OmnilinkConnectorImpl,) if base is object else (_OmnilinkConnectorImpl, base)
            _class = type(
                CONNECTOR_NAME,
                bases,
                {
                    "__module__": "omnilink.integrations.vllm_omni",
                    "__qualname__": CONNECTOR_NAME,
                    "__doc__": _CLASS_DOC,
                },
            )
        return _class


_CLASS_DOC = """vLLM-Omni connector over an omnilink backend (see the module docstring).

Parameters
----------
config : dict
    The stage config's ``extra`` (with ``stage_id`` and ``role`` injected by vLLM-Omni);
    kept as ``self.config``.

Raises
------
ConfigurationError
    Unknown backend, bad option, or the configured edge could not be opened (for
    ``shm``: ``CapacityError`` when ``/dev/shm`` is too small).
"""
