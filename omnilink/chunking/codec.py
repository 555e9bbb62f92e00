"""Window arithmetic of streaming stages: ``CodecChunker`` and ``PrefillChunker``.

Codec stream (talker -> code2wav), chunk ``C`` frames, left context ``L``, initial chunk
``IC`` (or a ramp of first chunk sizes). Frames are rows of ``Q`` codebook ids::

    frames pushed:  f0 f1 f2 f3 | f4 f5 f6 f7 f8 f9 | f10 f11 f12 f13 f14 f15 | f16 f17
    boundaries:     0         IC=4               IC+C=10                    IC+2C=16   finish
    chunk 0:        [f0..f3]                                    left context 0, new 4
    chunk 1:        [f1..f3 | f4..f9]           (L=3)           left context 3, new 6
    chunk 2:                 [f7..f9 | f10..f15]                left context 3, new 6
    chunk 3 (fin):                     [f13..f15 | f16 f17]     left context 3, new 2

Non-final chunk k ends at the k-th cumulative sum of the sizes ``ramp + [C, C, ...]``
(``IC`` is the ramp ``[IC]``); a chunk goes out as soon as its last frame is pushed. On
the finish the frames after the last boundary go out as the final, partial chunk; if
none are left, the finish rides on the chunk just completed by the same call, or, when
that chunk went out earlier (the stream ended exactly on a boundary and the finish came
alone), as a *finish-only* window: no new frames, no left context, a ``[0, Q]`` frames
tensor. Code2wav thus decodes no audio twice and never gets audio-less context to
decode.

State of a ``CodecChunker``::

              push(frames) -> windows of the boundaries reached
             +--------+
             v        |
    (new) -> OPEN ----+---- finish([frames]) / push(frames, finished=True) ----> FINISHED
                                  -> windows, the last one finished=True          push/finish:
                                                                                  StreamFinishedError
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from omnilink._errors import StreamFinishedError
from omnilink._errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CodecChunker",
    "CodecWatermark",
    "CodecWindow",
    "PrefillChunk",
    "PrefillChunker",
    "chunk_schedule",
    "codec_frames_from_payload",
    "iter_boundaries",
    "join_codec_payloads",
]


def _positive_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}")
    return value


def chunk_schedule(
    chunk_frames: int,
    initial_chunk_frames: int | None = None,
    ramp: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Validate a chunk configuration and return its ramp: the sizes before ``C`` repeats.

    Chunk ``k`` has size ``ramp[k]`` for ``k < len(ramp)`` and ``chunk_frames`` after.

    Parameters
    ----------
    chunk_frames : int
        ``C >= 1``.
    initial_chunk_frames : int, optional
        ``IC >= 1``: shorthand for ``ramp=[IC]`` (a smaller first chunk so the first
        audio plays sooner). ``None`` or ``0`` (vLLM-Omni's "unset") means no initial chunk.
    ramp : sequence of int, optional
        Sizes (each ``>= 1``) of the first chunks.

    Raises
    ------
    ConfigurationError
        A size is not an int of the allowed range, or both ``initial_chunk_frames`` and
        ``ramp`` are given.
    """
    _positive_int("chunk_frames", chunk_frames, minimum=1)
    if initial_chunk_frames is not None and not (
        isinstance(initial_chunk_frames, int) and not isinstance(initial_chunk_frames, bool)
        and initial_chunk_frames == 0
    ):
        _positive_int("initial_chunk_frames", initial_chunk_frames, minimum=1)
        if ramp is not None:
            raise ConfigurationError("give either initial_chunk_frames or ramp, not both")
        return (initial_chunk_frames,)
    if ramp is None:
        return ()
    if isinstance(ramp, (str, bytes)) or not isinstance(ramp, Iterable):
        raise ConfigurationError(f"ramp must be a sequence of ints, got {ramp!r}")
    return tuple(_positive_int(f"ramp[{i}]", s, minimum=1) for i, s in enumerate(ramp))


class CodecWindow(msgspec.Struct, frozen=True, kw_only=True, eq=False):
    """One message of a codec stream: left context plus new frames.

    Attributes
    ----------
    chunk_id : int
        0, 1, 2, ... within the stream.
    frames : torch.Tensor
        ``[left_context_size + new_frames, Q]`` int64: the left context (real frames
        sent before) followed by the new frames. A finish-only window has shape ``[0, Q]``.
    left_context_size : int
        Rows of ``frames`` that are context, to be decoded and dropped by code2wav.
    new_frames : int
        Rows of ``frames`` never sent before.
    start : int
        Index in the stream of the first new frame.
    finished : bool
        True on the last window of the stream, and only there.
    """

    chunk_id: int
    frames: torch.Tensor
    left_context_size: int
    new_frames: int
    start: int
    finished: bool

    @property
    def codes_audio(self) -> torch.Tensor:
        """The window codebook-major and flattened: ``frames.T.reshape(-1)``, int64.

        This is the 1-D ``codes.audio`` engines send: codebook 0 of every frame, then
        codebook 1, and so on.
        """
        return self.frames.T.reshape(-1)

    @property
    def new(self) -> torch.Tensor:
        """The new frames only (``frames[left_context_size:]``)."""
        return self.frames[self.left_context_size :]

    def to_payload(self) -> dict[str, Any]:
        """The vLLM-Omni talker -> code2wav payload of this window.

        Returns
        -------
        dict
            ``{"codes.audio": 1-D int64, "meta": {"finished": 0-d bool tensor,
            "left_context_size": int}}``, ``meta`` nested (invariant 7).
        """
        import torch

        return {
            "codes.audio": self.codes_audio,
            "meta": {
                "finished": torch.tensor(self.finished, dtype=torch.bool),
                "left_context_size": self.left_context_size,
            },
        }


class CodecWatermark(msgspec.Struct, frozen=True, kw_only=True, eq=False):
    """What a preempted codec stream needs to resume without resending anything.

    Attributes
    ----------
    next_chunk_id : int
        The id the next window gets.
    frames_emitted : int
        Frames already sent as new frames (the frame watermark).
    context : torch.Tensor
        The last ``min(L, frames_emitted)`` frames sent, ``[n, Q]`` (left context of
        the next window).
    num_codebooks : int or None
        ``Q``, once known.
    """

    next_chunk_id: int
    frames_emitted: int
    context: torch.Tensor | None
    num_codebooks: int | None


def _int_frames(frames: Any, q: int | None) -> torch.Tensor:
    """``frames`` as an owned ``[n, Q]`` int64 tensor (one frame ``[Q]`` becomes ``[1, Q]``)."""
    import torch

    if isinstance(frames, torch.Tensor):
        t = frames.detach()
    else:
        try:
            t = torch.as_tensor(frames)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigurationError(f"frames must be an integer tensor, got {type(frames).__name__}") from exc
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise ConfigurationError(f"frames must hold integer codec ids, got dtype {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    elif t.dim() != 2:
        raise ConfigurationError(f"frames must be [Q] or [n, Q], got shape {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise ConfigurationError("a frame must have at least one codebook (Q >= 1)")
    if q is not None and t.shape[1] != q:
        raise ConfigurationError(f"frames have {t.shape[1]} codebooks, the stream has {q}")
    # An owned copy: the caller may reuse its buffer while we hold pending frames.
    return t.to(torch.int64, copy=True)


class CodecChunker:
    """Cut a stream of codec frames into windows with left context (see module diagram).

    Every output keeps the invariants ``omnilink.chunking`` lists (checked by
    ``omnilink.chunking.check_*``).
    Memory stays ``O(L + C)`` frames however long the stream. Not thread-safe: one
    producer per chunker.

    Parameters
    ----------
    chunk_frames : int
        ``C >= 1``, new frames per chunk after the ramp.
    left_context_frames : int
        ``L >= 0``, frames of context before each chunk's new frames (fewer at the start
        of the stream: context is only ever real, earlier frames).
    initial_chunk_frames : int, optional
        ``IC >= 1``, size of chunk 0 (``None`` or ``0``: no initial chunk).
    ramp : sequence of int, optional
        Sizes of the first chunks (instead of ``initial_chunk_frames``).
    num_codebooks : int, optional
        ``Q``; otherwise learnt from the first push (needed only to shape the finish-only
        window of a stream that had no frames at all: ``[0, Q]``, or ``[0, 0]`` unknown).
    resume_from : CodecWatermark, optional
        Continue a preempted stream: ids continue at ``next_chunk_id`` and frames with an
        index below ``frames_emitted`` are not sent again.
    replay_from : int
        With ``resume_from``: index in the stream of the first frame the caller will push
        (``0`` when the preempted request is recomputed from the start). Frames from
        there up to the watermark are dropped.

    Raises
    ------
    ConfigurationError
        A size out of range, both ``initial_chunk_frames`` and ``ramp``, or a watermark
        that does not fit this configuration.
    """

    def __init__(
        self,
        chunk_frames: int,
        left_context_frames: int,
        initial_chunk_frames: int | None = None,
        ramp: Sequence[int] | None = None,
        *,
        num_codebooks: int | None = None,
        resume_from: CodecWatermark | None = None,
        replay_from: int = 0,
    ) -> None:
        import torch

        self._ramp = chunk_schedule(chunk_frames, initial_chunk_frames, ramp)
        self.chunk_frames = chunk_frames
        self.left_context_frames = _positive_int("left_context_frames", left_context_frames, minimum=0)
        self._q = None if num_codebooks is None else _positive_int("num_codebooks", num_codebooks, minimum=1)
        self._next_id = 0
        self._emitted = 0
        self._context: torch.Tensor | None = None
        self._pending: list[torch.Tensor] = []
        self._pending_n = 0
        self._skip = 0
        self._finished = False
        self._device: Any = None
        _positive_int("replay_from", replay_from, minimum=0)
        if resume_from is not None:
            self._resume(resume_from, replay_from)
        elif replay_from:
            raise ConfigurationError("replay_from is only meaningful with resume_from")

    def _resume(self, wm: CodecWatermark, replay_from: int) -> None:
        if not isinstance(wm, CodecWatermark):
            raise ConfigurationError(f"resume_from must be a CodecWatermark, got {type(wm).__name__}")
        _positive_int("watermark.next_chunk_id", wm.next_chunk_id, minimum=0)
        _positive_int("watermark.frames_emitted", wm.frames_emitted, minimum=0)
        if wm.num_codebooks is not None:
            if self._q is not None and self._q != wm.num_codebooks:
                raise ConfigurationError(
                    f"watermark has {wm.num_codebooks} codebooks, num_codebooks is {self._q}"
                )
            self._q = wm.num_codebooks
        want = min(self.left_context_frames, wm.frames_emitted)
        have = 0 if wm.context is None else int(wm.context.shape[0])
        if have != want:
            raise ConfigurationError(
                f"watermark carries {have} context frames, this chunker needs {want} "
                f"(L={self.left_context_frames}, {wm.frames_emitted} frames emitted)"
            )
        if replay_from > wm.frames_emitted:
            raise ConfigurationError(
                f"replay_from={replay_from} is past the watermark ({wm.frames_emitted} frames "
                "emitted): frames in between would be lost"
            )
        self._next_id = wm.next_chunk_id
        self._emitted = wm.frames_emitted
        if wm.context is not None and have:
            self._context = _int_frames(wm.context, self._q)
            self._q = int(self._context.shape[1])
        self._skip = wm.frames_emitted - replay_from

    # ----------------------------------------------------------------- state
    @property
    def finished(self) -> bool:
        """Whether the finish has been pushed (no more frames accepted)."""
        return self._finished

    @property
    def next_chunk_id(self) -> int:
        """The id the next window gets."""
        return self._next_id

    @property
    def frames_emitted(self) -> int:
        """Frames sent so far as new frames."""
        return self._emitted

    @property
    def pending_frames(self) -> int:
        """Frames pushed but not yet in a window (waiting for their boundary)."""
        return self._pending_n

    def chunk_size(self, chunk_id: int, /) -> int:
        """New frames of non-final chunk ``chunk_id``."""
        return self._ramp[chunk_id] if chunk_id < len(self._ramp) else self.chunk_frames

    def watermark(self) -> CodecWatermark:
        """The state a resumed chunker needs after a preemption (see ``resume_from``).

        Frames pushed but not yet in a window are not part of it: a preempted request
        replays them (``replay_from <= frames_emitted`` makes sure of that).

        Raises
        ------
        StreamFinishedError
            The stream is finished; there is nothing to resume.
        """
        if self._finished:
            raise StreamFinishedError("the codec stream is finished; there is nothing to resume")
        ctx = None if self._context is None else self._context.clone()
        return CodecWatermark(
            next_chunk_id=self._next_id,
            frames_emitted=self._emitted,
            context=ctx,
            num_codebooks=self._q,
        )

    # ------------------------------------------------------------------ push
    def push(self, frames: Any, /, *, finished: bool = False) -> list[CodecWindow]:
        """Add one frame (``[Q]``) or many (``[n, Q]``, ``n >= 0``) integer frames.

        Parameters
        ----------
        frames : torch.Tensor or array-like of int
            The next frames of the stream (copied; the caller may reuse its buffer).
        finished : bool
            These are the last frames: same as ``finish(frames)``.

        Returns
        -------
        list of CodecWindow
            The windows whose boundary these frames reached, in order (often none).

        Raises
        ------
        ConfigurationError
            Not integer frames of shape ``[Q]`` / ``[n, Q]``, or ``Q`` changed.
        StreamFinishedError
            The stream was already finished.
        """
        if finished:
            return self.finish(frames)
        self._check_open()
        self._append(frames)
        return self._drain()

    def finish(self, frames: Any = None, /) -> list[CodecWindow]:
        """End the stream, optionally with its last frames.

        Returns
        -------
        list of CodecWindow
            At least one window; the last one, and only it, has ``finished=True``. If no
            frame is left after the last boundary and that boundary's window went out
            before this call, it is a finish-only window (no frames, no context).

        Raises
        ------
        ConfigurationError
            Bad frames (as ``push``).
        StreamFinishedError
            The stream was already finished.
        """
        self._check_open()
        if frames is not None:
            self._append(frames)
        if self._skip:
            # A resumed stream whose replay ended before the watermark: the recomputed
            # stream is shorter than what was already sent, so its end is unknowable.
            raise ConfigurationError(
                f"finish came {self._skip} frames before the resume watermark "
                f"({self._emitted} frames were already sent)"
            )
        out = self._drain()
        self._finished = True
        if self._pending_n:
            out.append(self._emit(self._pending_n, finished=True))
        elif out:
            out[-1] = msgspec.structs.replace(out[-1], finished=True)
        else:
            import torch

            empty = torch.empty((0, self._q or 0), dtype=torch.int64, device=self._device)
            out.append(
                CodecWindow(
                    chunk_id=self._next_id,
                    frames=empty,
                    left_context_size=0,
                    new_frames=0,
                    start=self._emitted,
                    finished=True,
                )
            )
            self._next_id += 1
        self._context = None
        return out

    def _check_open(self) -> None:
        if self._finished:
            raise StreamFinishedError(
                f"codec stream already finished after chunk {self._next_id - 1}; "
                "no frames may follow the finish",
                chunk_id=self._next_id,
            )

    def _append(self, frames: Any) -> None:
        t = _int_frames(frames, self._q)
        self._q = int(t.shape[1])
        self._device = t.device
        if self._skip:
            drop = min(self._skip, int(t.shape[0]))
            self._skip -= drop
            t = t[drop:]
        if t.shape[0]:
            self._pending.append(t)
            self._pending_n += int(t.shape[0])

    def _drain(self) -> list[CodecWindow]:
        out = []
        while self._pending_n and self._pending_n >= self.chunk_size(self._next_id):
            out.append(self._emit(self.chunk_size(self._next_id), finished=False))
        return out

    def _emit(self, n: int, *, finished: bool) -> CodecWindow:
        import torch

        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        new, rest = pending[:n], pending[n:]
        self._pending = [rest] if rest.shape[0] else []
        self._pending_n -= n
        ctx = self._context
        lc = 0 if ctx is None else int(ctx.shape[0])
        frames = new if lc == 0 else torch.cat((ctx, new))
        window = CodecWindow(
            chunk_id=self._next_id,
            frames=frames,
            left_context_size=lc,
            new_frames=n,
            start=self._emitted,
            finished=finished,
        )
        self._next_id += 1
        self._emitted += n
        L = self.left_context_frames
        # Keep only the last L frames sent: memory stays O(L + C) however long the stream.
        self._context = frames[-L:].clone() if L else None
        return window


def codec_frames_from_payload(payload: Any, /, *, num_codebooks: int) -> tuple[torch.Tensor, int]:
    """Undo ``CodecWindow.to_payload``: ``(frames [n, Q], left_context_size)``.

    Raises
    ------
    ConfigurationError
        ``payload`` lacks ``codes.audio`` or a nested ``meta``, or ``codes.audio`` is not
        a 1-D tensor whose length is a multiple of ``num_codebooks``.
    """
    import torch

    q = _positive_int("num_codebooks", num_codebooks, minimum=1)
    if not isinstance(payload, dict) or "codes.audio" not in payload:
        raise ConfigurationError("payload has no 'codes.audio'")
    meta = payload.get("meta")
    if not isinstance(meta, dict):
        raise ConfigurationError("payload has no nested 'meta' dict")
    codes = payload["codes.audio"]
    if not isinstance(codes, torch.Tensor):
        codes = torch.as_tensor(codes, dtype=torch.int64)
    if codes.dim() != 1 or codes.numel() % q:
        raise ConfigurationError(
            f"codes.audio must be 1-D with a multiple of {q} ids, got shape {tuple(codes.shape)}"
        )
    lc = int(meta.get("left_context_size", 0) or 0)
    frames = codes.reshape(q, -1).T
    if not 0 <= lc <= frames.shape[0]:
        raise ConfigurationError(f"left_context_size {lc} outside the window of {frames.shape[0]} frames")
    return frames, lc


def join_codec_payloads(payloads: Iterable[Any], /, *, num_codebooks: int) -> torch.Tensor:
    """Reassemble the frames ``[T, Q]`` of a stream from its payloads, context dropped.

    Raises
    ------
    ConfigurationError
        A payload is not a codec window payload (see ``codec_frames_from_payload``).
    """
    import torch

    parts = []
    for p in payloads:
        frames, lc = codec_frames_from_payload(p, num_codebooks=num_codebooks)
        parts.append(frames[lc:])
    if not parts:
        return torch.empty((0, num_codebooks), dtype=torch.int64)
    return torch.cat(parts)


class PrefillChunk(msgspec.Struct, frozen=True, kw_only=True, eq=False):
    """One slice of a growing sequence: ``data == sequence[offset : offset + len(data)]``."""

    chunk_id: int
    offset: int
    data: torch.Tensor
    finished: bool


class PrefillChunker:
    """Slice a growing sequence (hidden states, embeddings) into chunks along dim 0.

    The caller passes the *whole* sequence so far each time; the chunker keeps the
    offset and returns ``sequence[offset : offset + size]`` for every complete chunk,
    so the chunks concatenate to the sequence (an engine that sliced ``[:chunk_size]``
    repeated the first rows in every chunk).

    Parameters
    ----------
    chunk_size : int
        Rows per chunk after the ramp, ``>= 1``.
    initial_chunk_size : int, optional
        Rows of chunk 0.
    ramp : sequence of int, optional
        Rows of the first chunks (instead of ``initial_chunk_size``).
    """

    def __init__(
        self,
        chunk_size: int,
        initial_chunk_size: int | None = None,
        ramp: Sequence[int] | None = None,
    ) -> None:
        self._ramp = chunk_schedule(chunk_size, initial_chunk_size, ramp)
        self.chunk_size = chunk_size
        self._offset = 0
        self._next_id = 0
        self._finished = False

    @property
    def offset(self) -> int:
        """Rows of the sequence already handed out."""
        return self._offset

    @property
    def finished(self) -> bool:
        """Whether ``finish`` was called (no more rows accepted)."""
        return self._finished

    def _size(self, chunk_id: int) -> int:
        return self._ramp[chunk_id] if chunk_id < len(self._ramp) else self.chunk_size

    def _check(self, sequence: Any) -> int:
        if self._finished:
            raise StreamFinishedError("prefill stream already finished", chunk_id=self._next_id)
        shape = getattr(sequence, "shape", None)
        if shape is None or len(shape) == 0:
            raise ConfigurationError(
                f"sequence must be a tensor or array with a leading dim, got {type(sequence).__name__}"
            )
        n = int(shape[0])
        if n < self._offset:
            raise ConfigurationError(
                f"sequence shrank to {n} rows; {self._offset} rows were already handed out"
            )
        return n

    def update(self, sequence: Any, /) -> list[PrefillChunk]:
        """Return the complete chunks the sequence (grown since the last call) now holds.

        Raises
        ------
        ConfigurationError
            ``sequence`` has no leading dimension or is shorter than before.
        StreamFinishedError
            After ``finish``.
        """
        n = self._check(sequence)
        out = []
        while n - self._offset >= self._size(self._next_id):
            out.append(self._take(sequence, self._size(self._next_id), finished=False))
        return out

    def finish(self, sequence: Any, /) -> list[PrefillChunk]:
        """Return the remaining chunks; the last (possibly shorter, possibly empty) one
        has ``finished=True`` so the receiver knows the sequence is complete.

        Raises
        ------
        ConfigurationError, StreamFinishedError
            As ``update``.
        """
        n = self._check(sequence)
        out = self.update(sequence)
        if n > self._offset or not out:
            out.append(self._take(sequence, n - self._offset, finished=True))
        else:
            out[-1] = msgspec.structs.replace(out[-1], finished=True)
        self._finished = True
        return out

    def _take(self, sequence: Any, size: int, *, finished: bool) -> PrefillChunk:
        start = self._offset
        chunk = PrefillChunk(
            chunk_id=self._next_id, offset=start, data=sequence[start : start + size], finished=finished
        )
        self._offset += size
        self._next_id += 1
        return chunk


def iter_boundaries(ramp: Sequence[int], chunk_frames: int) -> Iterable[int]:
    """Cumulative ends of non-final chunks: ``ramp`` sums, then every ``chunk_frames``."""
    total = 0
    for size in itertools.chain(ramp, itertools.repeat(chunk_frames)):
        total += size
        yield total
