"""Chunk streams over any Connector: ``ChunkSender``, ``ChunkReceiver``, ``accumulate``.

One stream = one (request, edge): the chunks of ``request_id`` sent by ``from_stage``,
put under ``chunk_key(request_id, from_stage, k)`` for k = 0, 1, 2, ... Each payload
also carries its id in band as ``meta.chunk_id``, so a payload found under the wrong
key is caught. The chunk with ``meta.finished`` true ends the stream.

Sender state machine (the watermark is ``next_chunk_id``)::

              send(p) [meta.finished false]: put key k, k += 1
             +-------+
             v       |
    (new) -> OPEN ---+--- send(p) [meta.finished true] / finish([p]) ---> FINISHED
      ^                   put key k, k += 1                                send/finish:
      |                                                                    StreamFinishedError
      +-- ChunkSender(..., next_chunk_id=old.next_chunk_id) after a preemption:
          ids continue above the watermark, never reused

Receiver state machine::

    (new) -> EXPECT k --- get key k (in-band id k) ---> yield, EXPECT k+1
                 |     \\-- in-band id < k: DuplicateChunkError; > k: ChunkGapError
                 |      \\- timed out, key k+1 present: ChunkGapError (k+1 kept, not lost)
                 +-- payload with meta.finished ---> FINISHED (then: ids 0..k and k+1
                     are probed once; a straggler is a resend: DuplicateChunkError /
                     StreamFinishedError)
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from typing import Any

from omnilink._errors import ChunkGapError, DuplicateChunkError, StreamFinishedError
from omnilink.chunking.keys import chunk_key, validate_request_id, validate_stage
from omnilink._errors import ConfigurationError, KeyConsumedError, TransferTimeout, WouldBlock
from omnilink._util import Deadline

__all__ = ["ChunkReceiver", "ChunkSender", "accumulate", "is_finished"]

logger = logging.getLogger(__name__)


def _truth(value: Any) -> bool:
    """``bool`` of a finished flag given as bool, int, 0-d / 1-element tensor or array."""
    numel = getattr(value, "numel", None)
    if callable(numel):  # torch.Tensor
        if value.numel() != 1:
            raise ConfigurationError(f"meta.finished must hold one value, got shape {tuple(value.shape)}")
        return bool(value.reshape(-1)[0].item())
    size = getattr(value, "size", None)
    if isinstance(size, int) and hasattr(value, "reshape"):  # numpy
        if size != 1:
            raise ConfigurationError(f"meta.finished must hold one value, got shape {value.shape}")
        return bool(value.reshape(-1)[0])
    if isinstance(value, (bool, int)) or value is None:
        return bool(value)
    raise ConfigurationError(f"meta.finished must be a bool or a one-element tensor, got {type(value).__name__}")


def _meta_of(payload: Any) -> dict[str, Any] | None:
    if not isinstance(payload, dict):
        return None
    flat = [k for k in payload if isinstance(k, str) and k.startswith("meta.")]
    if flat:
        raise ConfigurationError(
            f"payload has flat meta keys {sorted(flat)}: meta must be a nested dict "
            "(payload['meta']['finished'], chunking invariant 7)"
        )
    meta = payload.get("meta")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise ConfigurationError(f"payload['meta'] must be a dict, got {type(meta).__name__}")
    return meta


def is_finished(payload: Any, /) -> bool:
    """Whether ``payload`` ends its stream (``payload["meta"]["finished"]`` is true).

    Raises
    ------
    ConfigurationError
        ``meta`` is flat (``"meta.finished"`` keys) or not a dict, or ``finished`` is
        not a bool / one-element tensor.
    """
    meta = _meta_of(payload)
    return meta is not None and _truth(meta.get("finished", False))


class _ChunkStream:
    """What a sender and a receiver of one (request, edge) stream share: its identity,
    the next chunk id and whether the finishing chunk went by."""

    def __init__(
        self,
        connector: Any,
        request_id: str,
        from_stage: int | str,
        next_chunk_id: int,
        timeout: float | None,
    ) -> None:
        self.connector = connector
        self.request_id = validate_request_id(request_id)
        validate_stage(from_stage)
        self.from_stage = from_stage
        if isinstance(next_chunk_id, bool) or not isinstance(next_chunk_id, int) or next_chunk_id < 0:
            raise ConfigurationError(f"next_chunk_id must be an int >= 0, got {next_chunk_id!r}")
        Deadline(timeout)
        self.timeout = timeout
        self._next = next_chunk_id
        self._finished = False

    @property
    def next_chunk_id(self) -> int:
        """The id of the next chunk: a sender's watermark (a resumed sender starts
        here), a receiver's next read."""
        return self._next

    @property
    def finished(self) -> bool:
        """Whether the finishing chunk was sent (sender) or received (receiver)."""
        return self._finished

    def key(self, chunk_id: int, /) -> str:
        """The transport key of chunk ``chunk_id`` of this stream."""
        return chunk_key(self.request_id, self.from_stage, chunk_id)


class ChunkSender(_ChunkStream):
    """Send the chunks of one (request, edge) with ids 0, 1, 2, ... and one finish.

    One sender per stream and thread; several streams may share a connector.

    Parameters
    ----------
    connector : Connector
        Any omnilink connector (``omnilink.connect(...)``); not closed by the sender.
    request_id : str
        The request's id (whole; ``_`` allowed).
    from_stage : int or str
        The sending stage.
    next_chunk_id : int
        The watermark to resume from after a preemption (``old_sender.next_chunk_id``).
    timeout : float, optional
        Default timeout of each put.

    Raises
    ------
    ConfigurationError
        Bad request id, stage or watermark.
    """

    def __init__(
        self,
        connector: Any,
        /,
        *,
        request_id: str,
        from_stage: int | str,
        next_chunk_id: int = 0,
        timeout: float | None = None,
    ) -> None:
        super().__init__(connector, request_id, from_stage, next_chunk_id, timeout)

    def send(self, payload: dict[str, Any], /, *, timeout: float | None = None) -> int:
        """Put ``payload`` as the next chunk; it finishes the stream if ``meta.finished``.

        The payload is not modified: the sender puts a shallow copy whose nested ``meta``
        also holds ``chunk_id``.

        Returns
        -------
        int
            The chunk id used.

        Raises
        ------
        StreamFinishedError
            The stream was finished already.
        ConfigurationError
            ``payload`` is not a dict, or has flat ``meta.*`` keys.
        TransferTimeout, CapacityError, BlobEncodeError, PeerLostError, ClosedError
            From the connector; the id is not consumed then, so a retry reuses it.
        """
        if not isinstance(payload, dict):
            raise ConfigurationError(f"a chunk payload must be a dict, got {type(payload).__name__}")
        finished = is_finished(payload)
        return self._put(payload, finished, timeout)

    def finish(self, payload: dict[str, Any] | None = None, /, *, timeout: float | None = None) -> int:
        """Put the last chunk: ``payload`` (or a finish-only ``{"meta": {}}``) with
        ``meta.finished`` set to a 0-d bool tensor ``True``.

        Returns
        -------
        int
            The chunk id used.

        Raises
        ------
        StreamFinishedError, ConfigurationError
            As ``send``; and from the connector as ``send``.
        """
        if payload is None:
            payload = {"meta": {}}
        elif not isinstance(payload, dict):
            raise ConfigurationError(f"a chunk payload must be a dict, got {type(payload).__name__}")
        _meta_of(payload)
        return self._put(payload, True, timeout)

    def send_window(self, window: Any, /, *, timeout: float | None = None) -> int:
        """Send a ``CodecWindow`` (its ``to_payload()``), checking its id is the next one.

        Raises
        ------
        DuplicateChunkError
            ``window.chunk_id`` is below the watermark (it was sent already).
        ChunkGapError
            ``window.chunk_id`` is above the watermark (a chunk would be missing).
        StreamFinishedError
            As ``send``.
        """
        self._check_open()
        if window.chunk_id < self._next:
            raise DuplicateChunkError(
                f"window {window.chunk_id} of {self.request_id!r} is below the watermark "
                f"{self._next}: it was sent already",
                request_id=self.request_id, from_stage=self.from_stage, chunk_id=window.chunk_id,
            )
        if window.chunk_id > self._next:
            raise ChunkGapError(
                f"window {window.chunk_id} of {self.request_id!r} skips chunk {self._next}",
                request_id=self.request_id, from_stage=self.from_stage, chunk_id=self._next,
            )
        return self._put(window.to_payload(), bool(window.finished), timeout)

    def _check_open(self) -> None:
        if self._finished:
            raise StreamFinishedError(
                f"stream {self.request_id!r} from stage {self.from_stage!r} is finished "
                f"(last chunk {self._next - 1}); nothing may be sent after the finish",
                request_id=self.request_id, from_stage=self.from_stage, chunk_id=self._next,
            )

    def _put(self, payload: dict[str, Any], finished: bool, timeout: float | None) -> int:
        self._check_open()
        cid = self._next
        out = dict(payload)
        meta = dict(_meta_of(payload) or {})
        meta["chunk_id"] = cid
        if finished:
            import torch

            if not _truth(meta.get("finished", False)):
                meta["finished"] = torch.tensor(True, dtype=torch.bool)
        elif "finished" not in meta:
            meta["finished"] = False
        out["meta"] = meta
        self.connector.put(self.key(cid), out, timeout=self.timeout if timeout is None else timeout)
        # Only a completed put consumes the id (a failed one may be retried under it).
        self._next = cid + 1
        self._finished = finished
        return cid


class ChunkReceiver(_ChunkStream):
    """Read the chunks of one (request, edge) in order until ``meta.finished``.

    Gaps and duplicates are errors, never silently skipped or counted:
    ``ChunkGapError`` when chunk k does not come in time while chunk k+1 is there (k+1
    is kept and delivered after k if k shows up later), or when an in-band id is
    ahead; ``DuplicateChunkError`` when an in-band id is behind, or when, at the finish,
    a chunk id already consumed turns up again (a resend that reused ids; it is taken
    off the transport so nothing leaks). What the probe at the finish finds is raised
    after the finishing payload has been delivered: by iteration once it has yielded
    the last chunk, by ``verify()``, or by the next ``receive``. A resend arriving after
    that probe cannot be seen by the receiver; ``ChunkSender`` makes it impossible on
    the sending side.

    Parameters
    ----------
    connector : Connector
        Any omnilink connector; not closed by the receiver.
    request_id, from_stage
        The stream to read.
    next_chunk_id : int
        First id to read (a receiver resuming after its own restart).
    timeout : float, optional
        Default wait per chunk.
    probe_duplicates : bool
        Probe consumed ids once at the finish (see above). Costs one ``get_nowait`` per
        chunk of the stream.
    """

    def __init__(
        self,
        connector: Any,
        /,
        *,
        request_id: str,
        from_stage: int | str,
        next_chunk_id: int = 0,
        timeout: float | None = None,
        probe_duplicates: bool = True,
    ) -> None:
        super().__init__(connector, request_id, from_stage, next_chunk_id, timeout)
        self.probe_duplicates = probe_duplicates
        self._first = next_chunk_id
        self._ahead: dict[int, Any] = {}
        self._deferred: Exception | None = None

    def _err(self, cls: type, msg: str, cid: int) -> Exception:
        return cls(
            f"stream {self.request_id!r} from stage {self.from_stage!r}: {msg}",
            request_id=self.request_id, from_stage=self.from_stage, chunk_id=cid,
        )

    def _check_open(self) -> None:
        if self._finished:
            self.verify()
            raise self._err(StreamFinishedError, f"finished at chunk {self._next - 1}; nothing follows", self._next)

    def verify(self) -> None:
        """Raise what the probe at the finish found, once (iteration calls this last).

        Raises
        ------
        DuplicateChunkError
            Chunk ids already consumed were sent again.
        StreamFinishedError
            Chunks were sent after the finish.
        """
        err, self._deferred = self._deferred, None
        if err is not None:
            raise err

    def receive(self, *, timeout: float | None = None) -> Any:
        """Wait for the next chunk and return its payload.

        Raises
        ------
        StreamFinishedError
            The stream already finished (or a chunk followed the finish).
        ChunkGapError, DuplicateChunkError
            See the class docstring.
        TransferTimeout
            The chunk did not come in time and no later chunk is there either.
        PeerLostError, BlobDecodeError, ClosedError
            From the connector.
        """
        self._check_open()
        cid = self._next
        if cid in self._ahead:
            return self._accept(cid, self._ahead.pop(cid))
        t = self.timeout if timeout is None else timeout
        try:
            payload = self.connector.get(self.key(cid), timeout=t)
        except TransferTimeout as exc:
            self._probe_gap(cid, exc)
            raise
        return self._accept(cid, payload)

    def receive_nowait(self) -> Any:
        """Return the next chunk if it is there.

        Raises
        ------
        WouldBlock
            It is not there yet.
        StreamFinishedError, ChunkGapError, DuplicateChunkError
            As ``receive``.
        """
        self._check_open()
        cid = self._next
        if cid in self._ahead:
            return self._accept(cid, self._ahead.pop(cid))
        return self._accept(cid, self.connector.get_nowait(self.key(cid)))

    def __iter__(self) -> Iterator[Any]:
        """Yield each chunk's payload in order; the last one yielded is the finish."""
        while not self._finished:
            yield self.receive()
        self.verify()

    def _probe_gap(self, cid: int, exc: TransferTimeout) -> None:
        nxt = cid + 1
        if nxt in self._ahead:
            later = True
        else:
            try:
                self._ahead[nxt] = self.connector.get_nowait(self.key(nxt))
                later = True
            except (WouldBlock, KeyConsumedError):
                later = False
        if later:
            raise self._err(
                ChunkGapError, f"chunk {cid} did not arrive but chunk {nxt} did (kept; delivered if {cid} comes)", cid
            ) from exc

    def _accept(self, cid: int, payload: Any) -> Any:
        meta = _meta_of(payload)
        if meta is not None and "chunk_id" in meta:
            inband = meta["chunk_id"]
            if not isinstance(inband, int) or isinstance(inband, bool):
                raise ConfigurationError(
                    f"stream {self.request_id!r}: chunk {cid} has meta.chunk_id {inband!r}, not an int"
                )
            if inband < cid:
                raise self._err(DuplicateChunkError, f"under key {cid} came chunk {inband} again", cid)
            if inband > cid:
                raise self._err(ChunkGapError, f"under key {cid} came chunk {inband}: chunks in between are missing", cid)
        self._next = cid + 1
        if meta is not None and _truth(meta.get("finished", False)):
            self._finished = True
            if self.probe_duplicates:
                # Deferred, so the finishing payload is still delivered (nothing lost).
                self._deferred = self._probe_stragglers(cid)
        return payload

    def _probe_stragglers(self, last: int) -> Exception | None:
        dups = []
        for i in range(self._first, last + 1):
            try:
                self.connector.get_nowait(self.key(i))
            except (WouldBlock, KeyConsumedError):  # not resent (consumed, or never there)
                continue
            dups.append(i)
        after = sorted(i for i in self._ahead if i > last)
        try:
            self.connector.get_nowait(self.key(last + 1))
            after.append(last + 1)
        except (WouldBlock, KeyConsumedError):
            pass
        self._ahead.clear()
        if dups or after:
            logger.warning(
                "stream %r from stage %r: after the finish (chunk %d) found resent ids %s and "
                "chunks sent after the finish %s; removed them from the transport",
                self.request_id, self.from_stage, last, dups, after,
            )
        if dups:
            return self._err(DuplicateChunkError, f"chunk ids {dups} were sent again (a resend reused ids)", dups[0])
        if after:
            return self._err(StreamFinishedError, f"chunks {after} were sent after the finish (chunk {last})", after[0])
        return None


def _path(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def accumulate(
    acc: dict[str, Any] | None,
    payload: dict[str, Any],
    /,
    *,
    replace_keys: Collection[str] = (),
) -> dict[str, Any]:
    """Merge a chunk's payload into the payload accumulated so far, as engines do.

    Rules, per key of ``payload`` (recursively for nested dicts):

    - a key whose name or dotted path (``"embed.prefill"``, ``"speaker"``) is in
      ``replace_keys`` is replaced;
    - everything under ``meta`` is replaced: ``meta`` describes the latest chunk
      (``meta.finished`` is overwritten, and stays nested);
    - tensors (of dimension >= 1) are concatenated on dim 0, numpy arrays too;
    - lists are extended (a new list; neither input is modified);
    - dicts are merged by these rules;
    - ``None`` never erases: a ``None`` value keeps what was there, and a value
      replaces a ``None``;
    - anything else (str, int, 0-d tensors) is replaced.

    Parameters
    ----------
    acc : dict or None
        What was accumulated so far (``None`` for the first chunk). Not modified.
    payload : dict
        The new chunk.
    replace_keys : collection of str
        Names or dotted paths replaced instead of concatenated.

    Returns
    -------
    dict
        A new merged payload.

    Raises
    ------
    ConfigurationError
        Flat ``meta.*`` keys, or two values of a key that cannot be merged (a tensor
        and a list, tensors whose trailing shapes differ).
    """
    if not isinstance(payload, dict):
        raise ConfigurationError(f"payload must be a dict, got {type(payload).__name__}")
    _meta_of(payload)
    if acc is None:
        acc = {}
    elif not isinstance(acc, dict):
        raise ConfigurationError(f"acc must be a dict or None, got {type(acc).__name__}")
    return _merge(acc, payload, "", frozenset(replace_keys), in_meta=False)


def _merge(acc: dict, new: dict, prefix: str, replace: frozenset, *, in_meta: bool) -> dict:
    out = dict(acc)
    for k, v in new.items():
        path = _path(prefix, k)
        meta_here = in_meta or (prefix == "" and k == "meta")
        if k not in out or k in replace or path in replace:
            out[k] = _copy_tree(v)
            continue
        old = out[k]
        if isinstance(old, dict) and isinstance(v, dict):
            out[k] = _merge(old, v, path, replace, in_meta=meta_here)
        elif meta_here:
            out[k] = v
        else:
            out[k] = _combine(old, v, path)
    return out


def _copy_tree(v: Any) -> Any:
    # Lists are copied so that a later extend never writes into the caller's list.
    if isinstance(v, dict):
        return {k: _copy_tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return list(v)
    return v


def _combine(old: Any, new: Any, path: str) -> Any:
    import sys

    if old is None:
        return new
    if new is None:
        return old
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if old.dim() == 0 or new.dim() == 0:
            return new
        if old.shape[1:] != new.shape[1:]:
            raise ConfigurationError(
                f"cannot concatenate {path!r}: shapes {tuple(old.shape)} and {tuple(new.shape)} differ after dim 0"
            )
        if old.device != new.device:
            new = new.to(old.device)
        return torch.cat((old, new.to(old.dtype) if new.dtype != old.dtype else new), dim=0)
    if np is not None and isinstance(old, np.ndarray) and isinstance(new, np.ndarray):
        if old.ndim == 0 or new.ndim == 0:
            return new
        if old.shape[1:] != new.shape[1:]:
            raise ConfigurationError(
                f"cannot concatenate {path!r}: shapes {old.shape} and {new.shape} differ after dim 0"
            )
        return np.concatenate((old, new), axis=0)
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    kinds = {type(old).__name__, type(new).__name__}
    mergeable = ("Tensor", "ndarray", "list")
    if type(old) is not type(new) and any(k in mergeable for k in kinds):
        raise ConfigurationError(f"cannot merge {path!r}: {type(old).__name__} then {type(new).__name__}")
    return new
