"""Checkers of the chunk-framing invariants (listed in ``omnilink.chunking``), one per invariant.

Each takes what a chunker produced (windows, chunk ids, payloads) and what went in
(the frames pushed), recomputes everything it needs from those instead of trusting
the windows' own bookkeeping, and raises ``ChunkInvariantError`` naming the invariant
when it does not hold. They verify any chunker, ours or a third party's, and are what
the property tests run; ``tests/property/test_chunking_mutants.py`` keeps a planted bug
per checker to show each one rejects the bug it is for.

A window, for these checkers, is any object with ``chunk_id``, ``frames`` (``[rows, Q]``),
``left_context_size`` and ``finished`` (``CodecWindow`` or a look-alike); its new frames
are ``frames[left_context_size:]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from omnilink.chunking.codec import chunk_schedule, iter_boundaries
from omnilink._errors import ChunkInvariantError, ConfigurationError

__all__ = [
    "check_boundaries",
    "check_chunk_ids",
    "check_codec_stream",
    "check_finish_only_on_boundary",
    "check_frames_preserved",
    "check_keys_injective",
    "check_left_context",
    "check_meta_nested",
    "check_prefill_chunks",
    "check_single_finish",
]


def _rows(t: Any) -> int:
    return int(t.shape[0])


def _positions(windows: Sequence[Any]) -> list[tuple[int, int]]:
    """``(start, new)`` of each window, from the windows' frames and context sizes only."""
    out, pos = [], 0
    for w in windows:
        new = _rows(w.frames) - int(w.left_context_size)
        out.append((pos, new))
        pos += max(new, 0)
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.to(torch.int64), b.to(torch.int64)))


def check_frames_preserved(windows: Sequence[Any], pushed: Any, /) -> None:
    """Invariant 1: the windows' new frames, concatenated, are exactly the frames pushed.

    Raises
    ------
    ChunkInvariantError
        A frame was lost, duplicated or reordered, or a window claims more context
        than it has rows.
    """
    import torch

    parts = []
    for w in windows:
        lc = int(w.left_context_size)
        if lc < 0 or lc > _rows(w.frames):
            raise ChunkInvariantError(
                1, f"chunk {w.chunk_id}: left_context_size {lc} outside its {_rows(w.frames)} rows"
            )
        parts.append(w.frames[lc:].to(torch.int64))
    q = int(pushed.shape[1]) if pushed.dim() == 2 else 0
    got = torch.cat(parts) if parts else torch.empty((0, q), dtype=torch.int64)
    if got.shape[0] == 0 and _rows(pushed) == 0:
        return
    if got.shape[0] != _rows(pushed):
        raise ChunkInvariantError(
            1, f"the windows carry {got.shape[0]} new frames, {_rows(pushed)} were pushed "
            f"({'lost' if got.shape[0] < _rows(pushed) else 'duplicated'} frames)"
        )
    if not _same(got, pushed):
        bad = int((got != pushed.to(torch.int64)).any(dim=1).nonzero()[0, 0])
        raise ChunkInvariantError(1, f"new frame {bad} differs from frame {bad} pushed (reordered or altered)")


def check_left_context(windows: Sequence[Any], pushed: Any, /, *, left_context_frames: int) -> None:
    """Invariant 2: each window's left context is the real frames just before its new
    frames, at most ``min(L, frames sent before)`` of them.

    Raises
    ------
    ChunkInvariantError
        Context longer than allowed, or not equal to the earlier frames (padding,
        frames from the future, frames of another position).
    """
    for w, (start, _new) in zip(windows, _positions(windows)):
        lc = int(w.left_context_size)
        limit = min(left_context_frames, start)
        if lc < 0 or lc > limit:
            raise ChunkInvariantError(
                2, f"chunk {w.chunk_id}: left context of {lc} frames, at most min(L={left_context_frames}, "
                f"{start} frames sent before) = {limit} allowed"
            )
        if lc and not _same(w.frames[:lc], pushed[start - lc : start]):
            raise ChunkInvariantError(
                2, f"chunk {w.chunk_id}: left context is not frames {start - lc}..{start - 1} of the stream"
            )


def check_boundaries(
    windows: Sequence[Any],
    pushed: Any,
    /,
    *,
    chunk_frames: int,
    initial_chunk_frames: int | None = None,
    ramp: Sequence[int] | None = None,
) -> None:
    """Invariant 3: non-final window k ends at the k-th boundary (``IC, IC + C, ...`` or
    the ramp's cumulative sums, then every ``C``); the final one ends at the end of the
    stream and is no longer than its chunk.

    Raises
    ------
    ChunkInvariantError
        A chunk ends elsewhere, or the final chunk is too long or stops short.
    """
    sizes = chunk_schedule(chunk_frames, initial_chunk_frames, ramp)
    bounds = iter_boundaries(sizes, chunk_frames)
    total = _rows(pushed)
    prev = 0
    for k, (w, (start, new)) in enumerate(zip(windows, _positions(windows))):
        end = start + new
        bound = next(bounds)
        if not w.finished:
            if end != bound:
                raise ChunkInvariantError(
                    3, f"non-final chunk {w.chunk_id} (window {k}) ends at frame {end}, "
                    f"its boundary is {bound}"
                )
        else:
            if end != total:
                raise ChunkInvariantError(
                    3, f"final chunk {w.chunk_id} ends at frame {end}, the stream has {total}"
                )
            if end > bound:
                raise ChunkInvariantError(
                    3, f"final chunk {w.chunk_id} holds {new} new frames, more than its chunk of "
                    f"{bound - prev}"
                )
        prev = bound


def check_single_finish(windows: Sequence[Any], /) -> None:
    """Invariant 4: exactly one window has ``finished`` set, and it is the last.

    Raises
    ------
    ChunkInvariantError
        No window, no finish (the consumer would wait forever), a finish that is not
        last, or several.
    """
    if not windows:
        raise ChunkInvariantError(4, "no window at all: the consumer would wait forever for the finish")
    flags = [bool(w.finished) for w in windows]
    n = sum(flags)
    if n == 0:
        raise ChunkInvariantError(4, "no window carries finished=True: the consumer would wait forever")
    if n > 1:
        raise ChunkInvariantError(4, f"{n} windows carry finished=True (chunks {[w.chunk_id for w in windows if w.finished]})")
    if not flags[-1]:
        raise ChunkInvariantError(
            4, f"the finished window (chunk {windows[flags.index(True)].chunk_id}) is not the last"
        )


def check_finish_only_on_boundary(windows: Sequence[Any], pushed: Any, /) -> None:
    """Invariant 5: when the chunks before the finish already carried every frame (the
    stream ended on a boundary), the finish is a message with no frames at all, never
    the last chunk again; and a finish without new frames carries no frames.

    Raises
    ------
    ChunkInvariantError
        The finish repeats frames, or a finish-only message carries context.
    """
    if not windows:
        return
    *before, last = windows
    sent_before = sum(max(new, 0) for _s, new in _positions(before))
    new_last = _rows(last.frames) - int(last.left_context_size)
    if sent_before >= _rows(pushed) and _rows(last.frames) != 0:
        raise ChunkInvariantError(
            5, f"the stream ended on a boundary after chunk {before[-1].chunk_id if before else '-'}, "
            f"but the finishing chunk {last.chunk_id} carries {_rows(last.frames)} frames "
            f"({new_last} as new): the last chunk was sent again"
        )
    if new_last == 0 and _rows(last.frames) != 0:
        raise ChunkInvariantError(
            5, f"finish-only chunk {last.chunk_id} carries {_rows(last.frames)} frames of context"
        )


def check_chunk_ids(ids: Iterable[int], /, *, first: int = 0) -> None:
    """Invariant 6: the chunk ids sent are ``first, first + 1, ...``: none twice, no gap.

    Apply it to every id put on the transport for one (request, edge), preemptions and
    resends included.

    Raises
    ------
    ChunkInvariantError
        An id was sent twice, skipped or out of order.
    """
    seen: set[int] = set()
    expected = first
    for i in ids:
        if i in seen:
            raise ChunkInvariantError(6, f"chunk id {i} sent twice")
        if i != expected:
            raise ChunkInvariantError(6, f"chunk id {i} sent where {expected} was next (gap or reorder)")
        seen.add(i)
        expected += 1


def check_meta_nested(payloads: Iterable[Any], /, *, require: Sequence[str] = ("finished",)) -> None:
    """Invariant 7: each payload keeps ``meta`` as a nested dict holding ``require``;
    no flat ``"meta.*"`` key.

    Raises
    ------
    ChunkInvariantError
        A payload is not a dict, has a flat ``meta.`` key, or a ``meta`` without a
        required field.
    """
    for i, p in enumerate(payloads):
        if not isinstance(p, dict):
            raise ChunkInvariantError(7, f"payload {i} is a {type(p).__name__}, not a dict")
        flat = sorted(k for k in p if isinstance(k, str) and k.startswith("meta."))
        if flat:
            raise ChunkInvariantError(7, f"payload {i} has flat meta keys {flat}; meta must stay nested")
        meta = p.get("meta")
        if not isinstance(meta, dict):
            raise ChunkInvariantError(7, f"payload {i} has no nested 'meta' dict")
        missing = [f for f in require if f not in meta]
        if missing:
            raise ChunkInvariantError(7, f"payload {i}: meta lacks {missing}")


def check_codec_stream(
    windows: Sequence[Any],
    pushed: Any,
    /,
    *,
    chunk_frames: int,
    left_context_frames: int,
    initial_chunk_frames: int | None = None,
    ramp: Sequence[int] | None = None,
) -> None:
    """Run every codec-window checker (invariants 1 to 7) on one finished stream.

    Raises
    ------
    ChunkInvariantError
        The first invariant that does not hold.
    """
    check_frames_preserved(windows, pushed)
    check_left_context(windows, pushed, left_context_frames=left_context_frames)
    check_boundaries(
        windows, pushed, chunk_frames=chunk_frames, initial_chunk_frames=initial_chunk_frames, ramp=ramp
    )
    check_single_finish(windows)
    check_finish_only_on_boundary(windows, pushed)
    check_chunk_ids([w.chunk_id for w in windows], first=windows[0].chunk_id if windows else 0)
    check_meta_nested([w.to_payload() for w in windows], require=("finished", "left_context_size"))


def check_prefill_chunks(
    chunks: Sequence[Any],
    sequence: Any,
    /,
    *,
    chunk_size: int,
    initial_chunk_size: int | None = None,
    ramp: Sequence[int] | None = None,
) -> None:
    """Prefill slicing: chunks (objects with ``data`` and ``finished``) sit back to back,
    every non-final one has exactly its size, and together they are the sequence.

    Raises
    ------
    ChunkInvariantError
        (invariant ``"prefill"``) repeated, misaligned, missing or extra rows.
    """
    import torch

    sizes = chunk_schedule(chunk_size, initial_chunk_size, ramp)
    bounds = iter_boundaries(sizes, chunk_size)
    pos = 0
    for k, c in enumerate(chunks):
        n = _rows(c.data)
        bound = next(bounds)
        if not c.finished and pos + n != bound:
            raise ChunkInvariantError("prefill", f"non-final chunk {k} ends at row {pos + n}, its boundary is {bound}")
        if hasattr(c, "offset") and int(c.offset) != pos:
            raise ChunkInvariantError("prefill", f"chunk {k} claims offset {c.offset}, it starts at row {pos}")
        if pos + n > _rows(sequence) or not torch.equal(c.data, sequence[pos : pos + n]):
            raise ChunkInvariantError(
                "prefill", f"chunk {k} is not rows {pos}..{pos + n - 1} of the sequence (repeated or misaligned)"
            )
        pos += n
    if pos != _rows(sequence):
        raise ChunkInvariantError("prefill", f"chunks cover {pos} rows, the sequence has {_rows(sequence)}")
    if chunks and (sum(bool(c.finished) for c in chunks) != 1 or not chunks[-1].finished):
        raise ChunkInvariantError("prefill", "exactly the last chunk must be marked finished")


def check_keys_injective(
    key_fn: Callable[[Any, Any, Any], str],
    cases: Iterable[tuple[Any, Any, Any]],
    /,
    *,
    parse: Callable[[str], tuple[Any, Any, Any]] | None = None,
) -> None:
    """Keys: distinct ``(request_id, from_stage, chunk_id)`` give distinct keys, and
    ``parse`` (when given) gives each back exactly.

    ``key_fn`` may refuse a case with ``ConfigurationError`` (a ``None`` request id
    must be refused); any key it returns must be unique.

    Raises
    ------
    ChunkInvariantError
        (invariant ``"keys"``) two cases share a key, or a key does not parse back.
    """
    owner: dict[str, tuple[Any, Any, Any]] = {}
    for case in cases:
        try:
            key = key_fn(*case)
        except ConfigurationError:
            continue
        other = owner.get(key)
        if other is not None and other != case:
            raise ChunkInvariantError("keys", f"{case!r} and {other!r} share the key {key!r}")
        owner[key] = case
        if parse is not None:
            back = parse(key)
            if (back[0], str(back[1]), back[2]) != (case[0], str(case[1]), case[2]):
                raise ChunkInvariantError("keys", f"key {key!r} of {case!r} parses back as {back!r}")
