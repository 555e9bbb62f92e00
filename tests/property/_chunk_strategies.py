"""Hypothesis strategies for chunk framing (re-exported by ``tests/property/strategies.py``).

What is here, and what each draws:

``codec_configs()``
    A ``CodecConfig``: chunk ``C`` in 1..24, left context ``L`` in 0..30, and either no
    initial chunk, an ``IC`` in ``[1, C]`` or a ramp of 1..4 sizes in ``[1, 2C]``.
``codec_scenarios(max_frames=300, preemptions=True)``
    A ``CodecScenario``: a config, ``Q`` in 1..4 codebooks, a frame count in
    ``0..max_frames`` (half the time exactly on a chunk boundary, so the finish-only
    path is exercised), the push batch sizes (0 included: empty pushes), the finish
    mode (``"alone"``, ``"with_last"`` or ``"flag"``) and preemption points, each a frame
    position with a replay start (``0``: recompute from the start; ``"watermark"``: the
    engine continues where sending stopped; or a position in between).
``request_ids()``
    Request ids as engines make them (``chatcmpl_ab_12``: ``_`` inside), long ones (up
    to 300 characters) and arbitrary text without NUL.
``stages()``
    Stage ids: ints >= 0 or names of ``[A-Za-z0-9.-]``.

Helpers the property and mutant tests share:

``scenario_frames(scenario)``
    The ``[n, Q]`` int64 frames of a scenario (unique ids, so a lost, duplicated or
    reordered frame is always visible).
``drive_codec_stream(scenario, factory=CodecChunker)``
    Push the scenario through chunkers made by ``factory(**config.kwargs(), **resume)``,
    preempting and resuming as drawn; returns the windows in order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import torch
from hypothesis import strategies as st

from omnilink.chunking import CodecChunker, chunk_schedule, iter_boundaries

__all__ = [
    "CodecConfig",
    "CodecScenario",
    "Preemption",
    "codec_configs",
    "codec_scenarios",
    "drive_codec_stream",
    "request_ids",
    "scenario_frames",
    "stages",
]

FinishMode = Literal["alone", "with_last", "flag"]


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """One codec chunking configuration (what a stage config's ``extra`` holds)."""

    chunk_frames: int
    left_context_frames: int
    initial_chunk_frames: int | None = None
    ramp: tuple[int, ...] | None = None

    def kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ramp": None if self.ramp is None else list(self.ramp)}

    def boundaries(self, up_to: int) -> list[int]:
        """Ends of non-final chunks, ascending, up to ``up_to`` inclusive."""
        sizes = chunk_schedule(self.chunk_frames, self.initial_chunk_frames, self.ramp)
        out = []
        for b in iter_boundaries(sizes, self.chunk_frames):
            if b > up_to:
                return out
            out.append(b)
        return out  # pragma: no cover - iter_boundaries is infinite


@dataclasses.dataclass(frozen=True)
class Preemption:
    """Preempt once ``at`` frames have been pushed; the recomputed request then pushes
    again from frame ``replay_from`` (``"watermark"``: from the first frame not sent)."""

    at: int
    replay_from: int | Literal["watermark", "between"]


@dataclasses.dataclass(frozen=True)
class CodecScenario:
    config: CodecConfig
    num_codebooks: int
    num_frames: int
    batches: tuple[int, ...]
    finish: FinishMode
    preemptions: tuple[Preemption, ...] = ()
    seed: int = 0


@st.composite
def codec_configs(draw: Callable[..., Any]) -> CodecConfig:
    c = draw(st.integers(1, 24))
    left = draw(st.integers(0, 30))
    kind = draw(st.sampled_from(["none", "initial", "ramp"]))
    if kind == "initial":
        return CodecConfig(c, left, initial_chunk_frames=draw(st.integers(1, c)))
    if kind == "ramp":
        ramp = draw(st.lists(st.integers(1, 2 * c), min_size=1, max_size=4))
        return CodecConfig(c, left, ramp=tuple(ramp))
    return CodecConfig(c, left)


@st.composite
def codec_scenarios(draw: Callable[..., Any], max_frames: int = 300, preemptions: bool = True) -> CodecScenario:
    config = draw(codec_configs())
    if draw(st.booleans()):
        bounds = [0, *config.boundaries(max_frames)]
        n = draw(st.sampled_from(bounds))
    else:
        n = draw(st.integers(0, max_frames))
    batch = st.integers(0, 2 * config.chunk_frames + 3)
    batches: list[int] = []
    left = n
    while left > 0:
        b = min(draw(batch), left)
        batches.append(b)
        left -= b
    finish = draw(st.sampled_from(["alone", "with_last", "flag"]))
    pre: list[Preemption] = []
    if preemptions and n:
        for at in sorted(draw(st.lists(st.integers(0, n), max_size=3))):
            how = draw(st.sampled_from([0, "watermark", "between"]))
            pre.append(Preemption(at, how))
    seed = draw(st.integers(0, 2**31 - 1))
    return CodecScenario(config, draw(st.integers(1, 4)), n, tuple(batches), finish, tuple(pre), seed)


def scenario_frames(scenario: CodecScenario) -> torch.Tensor:
    """Unique, shuffled codec ids: no two frames equal, so any loss or repeat shows."""
    n, q = scenario.num_frames, scenario.num_codebooks
    g = torch.Generator().manual_seed(scenario.seed)
    return torch.randperm(max(n * q, 1), generator=g)[: n * q].reshape(n, q).to(torch.int64)


def _replay_start(p: Preemption, emitted: int, seed: int) -> int:
    if p.replay_from == "watermark":
        return emitted
    if p.replay_from == "between":
        # A deterministic point in [0, emitted], from the scenario's seed.
        return (seed + p.at) % (emitted + 1)
    return int(p.replay_from)


def drive_codec_stream(
    scenario: CodecScenario,
    factory: Callable[..., Any] = CodecChunker,
    *,
    on_window: Callable[[Any], None] | None = None,
) -> list[Any]:
    """Run ``scenario`` through chunkers built by ``factory``; return the windows.

    At a preemption the current chunker is dropped (its pending frames are lost, as in a
    recomputed request); a new one is built with ``resume_from=old.watermark()`` and
    ``replay_from``, and the frames from ``replay_from`` are pushed again.
    """
    frames = scenario_frames(scenario)
    cfg = scenario.config.kwargs()
    chunker = factory(**cfg, num_codebooks=scenario.num_codebooks)
    windows: list[Any] = []

    def take(ws: list[Any]) -> None:
        for w in ws:
            windows.append(w)
            if on_window is not None:
                on_window(w)

    pre = list(scenario.preemptions)
    pos = 0

    def preempt_due() -> None:
        nonlocal chunker
        while pre and pre[0].at <= pos:
            p = pre.pop(0)
            wm = chunker.watermark()
            replay = _replay_start(p, wm.frames_emitted, scenario.seed)
            chunker = factory(**cfg, num_codebooks=scenario.num_codebooks, resume_from=wm, replay_from=replay)
            if pos > replay:
                take(chunker.push(frames[replay:pos]))

    batches = list(scenario.batches)
    last = len(batches) - 1
    for i, size in enumerate(batches):
        preempt_due()
        batch = frames[pos : pos + size]
        pos += size
        if i == last and scenario.finish == "with_last":
            take(chunker.finish(batch))
            return windows
        if i == last and scenario.finish == "flag":
            take(chunker.push(batch, finished=True))
            return windows
        take(chunker.push(batch))
    preempt_due()
    take(chunker.finish())
    return windows


@st.composite
def request_ids(draw: Callable[..., Any]) -> str:
    kind = draw(st.sampled_from(["engine", "long", "text"]))
    if kind == "engine":
        parts = draw(st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8), min_size=1, max_size=4))
        return "_".join(["chatcmpl", *parts])
    if kind == "long":
        return draw(st.text("ab_-0", min_size=26, max_size=300))
    return draw(
        st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1, max_size=40)
    )


def stages() -> st.SearchStrategy[int | str]:
    return st.one_of(st.integers(0, 1000), st.text("abcXYZ019.-", min_size=1, max_size=12))
