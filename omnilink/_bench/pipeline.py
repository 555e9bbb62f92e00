"""``omnilink bench pipeline``: a three-process streaming pipeline, time to first audio.

Three processes, as in an omni-modal model served stage by stage::

    thinker ──(hidden_states.output, embed.prefill, ids.*)──> talker ──(codes.audio)──> code2wav
     stage 0      edge 0: prefill chunks, then one chunk        stage 1    edge 1: codec windows   stage 2
                  per decoded token                                        (CodecChunker)

- **thinker**: a small torch module with random weights (embedding table, one FFN
  block, tied output head). It runs each prompt's prefill in chunks of
  ``prefill_chunk`` tokens, then decodes ``decode_tokens`` tokens greedily, and streams
  every chunk to the talker: ``hidden_states.output`` (bf16 ``[n, hidden]``),
  ``hidden_states.output_shape``, ``embed.prefill`` (prefill chunks), ``ids.prompt`` /
  ``ids.output``.
- **talker**: conditions on the prefill hidden states, then for each decoded thinker
  token runs ``frames_per_token`` decode steps, each emitting one codec frame of
  ``codebooks`` (8 or 16) ids; the frames go through ``omnilink.chunking.CodecChunker``
  (initial chunk, chunk, left context) and ``ChunkSender.send_window``.
- **code2wav**: turns each window into audio samples (codebook embeddings, a matmul to
  ``samples_per_frame`` samples per frame, the window's left context dropped).

Every step's compute is sleep-free matmuls sized by the configuration, so the
transport's share of a step is visible. All three stages use the same chunk streams
(``ChunkSender`` / ``ChunkReceiver``) over an adapter per connector:

``omnilink-shm``   ``omnilink.connect("shm")``; with ``--device cuda`` CUDA tensors are put
                   as they are and read with ``get(..., device="cuda:0")`` (the GPU path)
``omnilink-zmq``   ``omnilink.connect("zmq")`` over ``ipc://``
``vllm-omni-shm``  vLLM-Omni 0.30.0's own ``SharedMemoryConnector`` (``vllm_omni_shm``
                   loads it without vLLM), driven as its chunk adapter drives it: the
                   receiver polls the non-blocking ``get`` and backs off 1 ms when a pass
                   found nothing (``recv_loop``'s ``Condition.wait(0.001)``)
``pickle-shm``     BASELINE BEING MEASURED: ``pickle.dumps`` into a fresh
                   ``SharedMemory`` segment per chunk, its name sent over a pipe (the
                   receiver blocks on the pipe, no polling), ``pickle.loads``, unlink

Requests: ``requests`` (plus ``warmup`` unmeasured ones first), at most ``concurrency``
in flight: the thinker admits a request when fewer than K are between admission and
their last audio (closed loop); each stage steps its active requests round robin and,
when none has input, waits on the oldest. The warm-up requests finish before the first
measured one is admitted, so what a connector does once (a device pool opened at the
first get, an IPC mapping, a route found) never lands in a measured request, whatever
the concurrency.

Figures (per connector, all from one run):

- *first audio*: from a request's admission at the thinker to the end of code2wav's
  first window with audio (``time.perf_counter``: CLOCK_MONOTONIC, one clock for all
  processes of the host); *last audio*: to the end of its last window.
- *transport per chunk*: the sender's ``put`` call plus the receiver's get, counted
  from when both the receiver was asking for the chunk and the chunk was published
  (``get_end - max(get_start, put_end)``): polling back-off and wake-up latency count,
  waiting for the producer to compute does not. A ``put`` that returns only after the
  receiver already holds the payload (the receiver it woke ran first on a busy core)
  counts up to that moment: ``min(put_end, get_end) - put_start``. The per-edge
  ``put_ms`` / ``get_ms`` figures are the raw call durations (``get`` from the later of
  its start and the publication). For omnilink's GPU path part of the
  host-to-device copy may still run after ``get`` returns (stream-ordered); it then
  lands in the receiving stage's compute span, which synchronises.
- *transport share*: the stages' transport time over their step time (transport plus
  compute), all stages together.
- *chunks / bytes per edge*, and the SHA-256 of each request's audio: the audio must be
  bit-identical across connectors (same seed, same weights).
- in the result file, each stage's connector counters summed over the rounds (warm-up
  requests included; ``counts``): omnilink's ``stats()`` (which road the payloads took,
  fallbacks) and, on the device-IPC route, the payloads sent by a send plan and the
  landings that found their views made ahead.

Benchmarks are hard: the three processes share the machine's cores with whatever else
runs; on a small machine run it when it is quiet and take the best of a few runs.

PICKLE IS USED HERE ONLY AS A BASELINE BEING MEASURED (the ``pickle-shm`` adapter);
omnilink's data path never pickles. Results travel from the stages to the parent as
msgspec JSON over pipes.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from typing import Any, Callable, Iterator, Sequence, TextIO

import msgspec

__all__ = ["CONNECTORS", "PipelineConfig", "main", "pipeline_main", "run_pipeline"]

CONNECTORS = ("omnilink-shm", "omnilink-zmq", "vllm-omni-shm", "pickle-shm")
STAGES = ("thinker", "talker", "code2wav")
EDGES = ("thinker->talker", "talker->code2wav")
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The pipeline's shape, compute and load (see the module docstring).

    The defaults are the default CPU configuration of ``omnilink bench pipeline``.
    """

    hidden: int = 2048
    # Compute per step sized so the thinker's prefill chunk takes tens of ms on one CPU
    # core, the order of a real thinker's chunk on a GPU, not the seconds a
    # full-size model would take on a CPU: the transport then has the share it has in
    # a served pipeline (raise --ffn for a compute-bound run).
    ffn: int = 512
    vocab: int = 4096
    prompt_tokens: int = 2048
    prefill_chunk: int = 256
    decode_tokens: int = 16
    talker_hidden: int = 512
    codebooks: int = 16
    codebook_size: int = 1024
    frames_per_token: int = 4
    codec_chunk: int = 25
    codec_left_context: int = 25
    codec_initial_chunk: int = 4
    code2wav_dim: int = 512
    samples_per_frame: int = 960
    requests: int = 6
    warmup: int = 1
    concurrency: int = 1
    seed: int = 0
    device: str = "cpu"
    timeout: float = 60.0

    def validate(self) -> None:
        """Raise ``ConfigurationError`` naming the first bad field."""
        from omnilink._errors import ConfigurationError

        for name in ("hidden", "ffn", "vocab", "prompt_tokens", "prefill_chunk", "decode_tokens",
                     "talker_hidden", "codebook_size", "frames_per_token", "codec_chunk",
                     "codec_initial_chunk", "code2wav_dim", "samples_per_frame", "requests",
                     "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.codebooks not in (8, 16):
            raise ConfigurationError(f"codebooks must be 8 or 16, got {self.codebooks!r}")
        if self.codec_left_context < 0 or self.warmup < 0:
            raise ConfigurationError("codec-left-context and warmup must be >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigurationError(f"device must be cpu or cuda, got {self.device!r}")
        if not self.timeout > 0:
            raise ConfigurationError(f"timeout must be > 0, got {self.timeout!r}")


# ------------------------------------------------------------------------ models
def _torch_device(cfg: PipelineConfig) -> str:
    return "cuda:0" if cfg.device == "cuda" else "cpu"


def _sync(cfg: PipelineConfig) -> None:
    if cfg.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _weights(seed: int, *shapes: tuple[int, ...], device: str) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) / math.sqrt(s[0])).to(device) for s in shapes]


class Thinker:
    """Embedding, one FFN block, tied output head; float32 compute, bf16 on the wire."""

    def __init__(self, cfg: PipelineConfig) -> None:
        dev = _torch_device(cfg)
        self.cfg = cfg
        self.emb, self.w1, self.w2 = _weights(cfg.seed + 1, (cfg.vocab, cfg.hidden), (cfg.hidden, cfg.ffn),
                                              (cfg.ffn, cfg.hidden), device=dev)
        self.device = dev

    def prompt(self, index: int) -> Any:
        import torch

        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + index)
        return torch.randint(0, self.cfg.vocab, (self.cfg.prompt_tokens,), generator=g).to(self.device)

    def forward(self, ids: Any) -> tuple[Any, Any]:
        import torch

        x = self.emb[ids]
        return x, x + torch.tanh(x @ self.w1) @ self.w2

    def next_token(self, h_last: Any) -> Any:
        return (h_last @ self.emb.T).argmax(-1).reshape(1)


class Talker:
    """Conditions on the prefill, then ``frames_per_token`` codec frames per text token."""

    def __init__(self, cfg: PipelineConfig) -> None:
        dev = _torch_device(cfg)
        self.cfg = cfg
        th = cfg.talker_hidden
        self.w_in, self.w_step, self.heads = _weights(
            cfg.seed + 2, (cfg.hidden, th), (th, th), (th, cfg.codebooks * cfg.codebook_size), device=dev)
        self.device = dev

    def start(self) -> Any:
        import torch

        return torch.zeros(1, self.cfg.talker_hidden, device=self.device)

    def prefill(self, state: Any, hidden: Any) -> Any:
        import torch

        return torch.tanh(state + torch.tanh(hidden.float() @ self.w_in).mean(0, keepdim=True))

    def frames(self, state: Any, hidden: Any) -> tuple[Any, Any]:
        """One text token's hidden state -> (new state, frames ``[frames_per_token, Q]``)."""
        import torch

        u = torch.tanh(hidden.float() @ self.w_in)
        out = []
        for _ in range(self.cfg.frames_per_token):
            state = torch.tanh(state @ self.w_step + u)
            logits = (state @ self.heads).reshape(self.cfg.codebooks, self.cfg.codebook_size)
            out.append(logits.argmax(-1))
        return state, torch.stack(out)


class Code2Wav:
    """Codebook embeddings summed per frame, each frame and its predecessor -> samples."""

    def __init__(self, cfg: PipelineConfig) -> None:
        import torch

        dev = _torch_device(cfg)
        self.cfg = cfg
        table, self.w_out = _weights(cfg.seed + 3, (cfg.codebooks * cfg.codebook_size, cfg.code2wav_dim),
                                     (cfg.code2wav_dim, cfg.samples_per_frame), device=dev)
        self.table = table
        self.offsets = (torch.arange(cfg.codebooks, device=dev) * cfg.codebook_size).reshape(1, -1)

    def audio(self, frames: Any, left_context: int) -> Any:
        """``frames [n, Q]`` -> the samples of its new frames (left context dropped)."""
        import torch

        e = self.table[frames.to(self.offsets.device) + self.offsets].sum(1)  # [n, E]
        prev = torch.cat((torch.zeros_like(e[:1]), e[:-1]))
        samples = torch.tanh((e + 0.5 * prev) @ self.w_out)  # [n, spf]
        return samples[left_context:].reshape(-1)


# ------------------------------------------------------------------- transports
class _Link:
    """A connector adapter with the surface ``ChunkSender`` / ``ChunkReceiver`` use
    (``put``, ``get``, ``get_nowait``) that records each call's timing."""

    def __init__(self, cfg: PipelineConfig, *, token: str, edge: int, role: str, pipe: Any) -> None:
        self.cfg = cfg
        self.token = token
        self.edge = edge
        self.role = role
        self.pipe = pipe
        self.device = _torch_device(cfg) if cfg.device == "cuda" else None
        self.puts: list[tuple[str, float, float, int]] = []
        self.gets: list[tuple[str, float, float]] = []

    # the three calls the chunk streams make
    def put(self, key: str, payload: Any, /, *, timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        n = self._put(key, payload, self.cfg.timeout if timeout is None else timeout)
        t1 = time.perf_counter()
        self.puts.append((key, t0, t1, n if n >= 0 else self._size(payload)))

    def get(self, key: str, /, *, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        payload = self._get(key, self.cfg.timeout if timeout is None else timeout)
        self.gets.append((key, t0, time.perf_counter()))
        return payload

    def get_nowait(self, key: str, /) -> Any:
        t0 = time.perf_counter()
        payload = self._get_nowait(key)
        self.gets.append((key, t0, time.perf_counter()))
        return payload

    @staticmethod
    def _size(payload: Any) -> int:
        import omnilink

        return omnilink.encoded_size(payload)

    def _put(self, key: str, payload: Any, timeout: float) -> int:
        raise NotImplementedError

    def _get(self, key: str, timeout: float) -> Any:
        raise NotImplementedError

    def _get_nowait(self, key: str) -> Any:
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        """The connector's own counters over the run, where it keeps any (omnilink's
        ``stats()``: which road the payloads took, fallbacks), for the result file."""
        return {}

    def close(self) -> None:
        raise NotImplementedError


#: ``ConnectorStats`` fields that say how things stand now, not how many times something
#: happened (left out of the counts a run adds up)
_GAUGES = frozenset(("blocks_in_use", "bytes_in_use", "segments", "bytes_mapped", "bytes_held", "pool_segments",
                     "pool_bytes_now"))


class _OmnilinkLink(_Link):
    backend = ""

    def open(self) -> None:
        import omnilink

        opts: dict[str, Any] = {}
        if self.backend == "shm" and self.role == "sender":
            opts["arena_bytes"] = _arena_bytes(self.cfg)
        self.conn: Any = omnilink.connect(self.backend, channel=f"olpipe{self.token}/e{self.edge}",  # type: ignore[call-overload]
                                          role=self.role, timeout=self.cfg.timeout, **opts)

    def _put(self, key: str, payload: Any, timeout: float) -> int:
        self.conn.put(key, payload, timeout=timeout)
        return -1

    def _get(self, key: str, timeout: float) -> Any:
        return self.conn.get(key, timeout=timeout, device=self.device)

    def _get_nowait(self, key: str) -> Any:
        return self.conn.get_nowait(key, device=self.device)

    def counts(self) -> dict[str, int]:
        stats = self.conn.stats()
        out = {f: v for f in stats.__struct_fields__
               if f not in _GAUGES and type(v := getattr(stats, f)) is int and v}
        # The device pool's ends, where the payloads went by it: payloads sent by a send
        # plan, landings that found their views made ahead.
        from omnilink._bench.backends import pool_end

        for route, own, name in (("_tx", "_sender", "planned_puts"), ("_rx", "_receiver", "prebuilt_hits")):
            n = getattr(pool_end(self.conn, route, own), name, None)
            if type(n) is int:
                out[name] = n
        return out

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()


class _ShmLink(_OmnilinkLink):
    backend = "shm"


class _ZmqLink(_OmnilinkLink):
    backend = "zmq"


class _VllmOmniLink(_Link):
    """vLLM-Omni's ``SharedMemoryConnector``, polled like its chunk adapter's ``recv_loop``."""

    BACKOFF_S = 0.001  # recv_loop: ``self._recv_cond.wait(timeout=0.001)`` after a fruitless pass

    def open(self) -> None:
        from omnilink._bench.vllm_omni_shm import load_shared_memory_connector

        cls = load_shared_memory_connector()
        self.stages = (str(self.edge), str(self.edge + 1))
        self.conn = cls({"stage_id": self.edge if self.role == "sender" else self.edge + 1, "role": self.role})
        self._cond = threading.Condition()

    def _put(self, key: str, payload: Any, timeout: float) -> int:
        from omnilink._errors import TransportError

        ok, size, _md = self.conn.put(self.stages[0], self.stages[1], key, payload)
        if not ok:
            raise TransportError(f"vllm-omni SharedMemoryConnector.put({key!r}) failed")
        return int(size)

    def _arrived(self, result: Any) -> Any:
        obj = result[0]
        if self.device is not None:
            from omnilink.cuda import payload_to_device

            obj = payload_to_device(obj, self.device)
        return obj

    def _get(self, key: str, timeout: float) -> Any:
        from omnilink._errors import TransferTimeout

        deadline = time.monotonic() + timeout
        while True:
            result = self.conn.get(self.stages[0], self.stages[1], key, None)
            if result is not None:
                return self._arrived(result)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"vllm-omni-shm: {key!r} did not come within {timeout} s")
            with self._cond:
                self._cond.wait(timeout=self.BACKOFF_S)

    def _get_nowait(self, key: str) -> Any:
        from omnilink._errors import WouldBlock

        result = self.conn.get(self.stages[0], self.stages[1], key, None)
        if result is None:
            raise WouldBlock(key)
        return self._arrived(result)

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()


class _PickleLink(_Link):
    """BASELINE BEING MEASURED: pickle into a fresh SharedMemory segment per chunk."""

    def open(self) -> None:
        self._made = 0
        self._announced: dict[str, tuple[str, int]] = {}

    def _put(self, key: str, payload: Any, timeout: float) -> int:
        # BASELINE BEING MEASURED: what serving engines do today. Pickle is never used on
        # omnilink's data path; it lives only in this baseline.
        import pickle
        from multiprocessing import shared_memory

        if self.device is not None:
            from omnilink.cuda import map_tensors

            payload = map_tensors(payload, lambda t: t.cpu())
        data = pickle.dumps(payload, protocol=5)
        self._made += 1
        name = f"olpipepk{self.token}e{self.edge}n{self._made}"
        seg = shared_memory.SharedMemory(name=name, create=True, size=len(data))
        try:
            seg.buf[: len(data)] = data
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        seg.close()
        self.pipe.send_bytes(f"{key} {name} {len(data)}".encode())
        return len(data)

    def _drain(self, wait: float) -> None:
        if self.pipe.poll(wait):
            key, name, n = self.pipe.recv_bytes().decode().split(" ")
            self._announced[key] = (name, int(n))

    def _take(self, key: str) -> Any:
        # BASELINE BEING MEASURED (see _put).
        import pickle
        from multiprocessing import shared_memory

        name, n = self._announced.pop(key)
        seg = shared_memory.SharedMemory(name=name)
        try:
            with seg.buf[:n] as view:
                payload = pickle.loads(view)
        finally:
            seg.close()
            seg.unlink()
        if self.device is not None:
            from omnilink.cuda import payload_to_device

            payload = payload_to_device(payload, self.device)
        return payload

    def _get(self, key: str, timeout: float) -> Any:
        from omnilink._errors import TransferTimeout

        deadline = time.monotonic() + timeout
        while key not in self._announced:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"pickle-shm: {key!r} did not come within {timeout} s")
            self._drain(left)
        return self._take(key)

    def _get_nowait(self, key: str) -> Any:
        from omnilink._errors import WouldBlock

        while key not in self._announced and self.pipe.poll(0):
            self._drain(0)
        if key not in self._announced:
            raise WouldBlock(key)
        return self._take(key)

    def close(self) -> None:
        from multiprocessing import shared_memory

        # Segments announced but never read (a failed run): unlink them.
        for name, _n in self._announced.values():
            try:
                seg = shared_memory.SharedMemory(name=name)
                seg.close()
                seg.unlink()
            except FileNotFoundError:
                pass
        self._announced.clear()


_LINKS: dict[str, type[Any]] = {
    "omnilink-shm": _ShmLink, "omnilink-zmq": _ZmqLink,
    "vllm-omni-shm": _VllmOmniLink, "pickle-shm": _PickleLink,
}


def _arena_bytes(cfg: PipelineConfig) -> int:
    # Room for a window of the largest chunk (hidden + embed, bf16) in flight per request.
    chunk = 2 * cfg.prefill_chunk * cfg.hidden * 2 + (1 << 16)
    return max(32 << 20, 8 * chunk * cfg.concurrency)


def probe(connector: str) -> str | None:
    """``None`` when ``connector`` can run here, else the reason it cannot."""
    if connector in ("omnilink-shm", "omnilink-zmq"):
        from omnilink._errors import OmnilinkError
        from omnilink.connectors import backend_factory

        try:
            backend_factory(connector.split("-")[1])
        except OmnilinkError as exc:
            return str(exc)
        return None
    if connector == "vllm-omni-shm":
        from omnilink._bench.vllm_omni_shm import probe as vllm_probe

        return vllm_probe()
    return None


# ------------------------------------------------------------------------ stages
def _request_id(token: str, index: int) -> str:
    return f"olpipe{token}r{index}"


def _consume(streams: deque[Any], on_chunk: Callable[[Any, Any], None], next_stream: Callable[[], Any],
             *, timeout: float) -> None:
    """Round robin over the active streams' next chunks; wait on the oldest when idle."""
    from omnilink._errors import WouldBlock

    while streams:
        progress = False
        for st in list(streams):
            try:
                payload = st.rx.receive_nowait()
            except WouldBlock:
                continue
            progress = True
            on_chunk(st, payload)
            del payload
            if st.rx.finished:
                streams.remove(st)
                nxt = next_stream()
                if nxt is not None:
                    streams.append(nxt)
        if not progress and streams:
            st = streams[0]
            payload = st.rx.receive(timeout=timeout)
            on_chunk(st, payload)
            del payload
            if st.rx.finished:
                streams.popleft()
                nxt = next_stream()
                if nxt is not None:
                    streams.append(nxt)


class _Span(msgspec.Struct, array_like=True):
    request: int
    kind: str
    t0: float
    t1: float


def _may_admit(admitted: int, completed: int, cfg: PipelineConfig) -> bool:
    """Whether the thinker may admit request ``admitted`` (0-based; the first
    ``cfg.warmup`` are the warm-up) with ``completed`` finished: fewer than
    ``concurrency`` in flight, and a measured request only once every warm-up one has
    finished."""
    if admitted - completed >= cfg.concurrency:
        return False
    return admitted < cfg.warmup or completed >= cfg.warmup


def _thinker(cfg: PipelineConfig, token: str, out_link: Any, done_pipe: Any, spans: list[_Span],
             starts: dict[int, float]) -> None:
    import torch

    from omnilink.chunking import ChunkSender

    model = Thinker(cfg)
    total = cfg.warmup + cfg.requests

    def request(index: int) -> Iterator[None]:
        tx = ChunkSender(out_link, request_id=_request_id(token, index), from_stage=0, timeout=cfg.timeout)
        ids = model.prompt(index)
        last_h = None
        for off in range(0, cfg.prompt_tokens, cfg.prefill_chunk):
            t0 = time.perf_counter()
            chunk = ids[off: off + cfg.prefill_chunk]
            with torch.no_grad():
                x, h = model.forward(chunk)
                hb = h.to(torch.bfloat16)
                payload = {
                    "hidden_states.output": hb,
                    "hidden_states.output_shape": torch.tensor(list(hb.shape), dtype=torch.int64),
                    "embed.prefill": x.to(torch.bfloat16),
                    # Token ids live on the host in engines (and stay there with --device cuda).
                    "ids.prompt": chunk.cpu(),
                    "ids.output": torch.zeros(0, dtype=torch.int64),
                }
                last_h = h[-1]
            _sync(cfg)
            spans.append(_Span(index, "compute", t0, time.perf_counter()))
            tx.send(payload)
            yield
        for step in range(cfg.decode_tokens):
            t0 = time.perf_counter()
            with torch.no_grad():
                tok = model.next_token(last_h)
                _x, h = model.forward(tok)
                hb = h.to(torch.bfloat16)
                last_h = h[-1]
            _sync(cfg)
            spans.append(_Span(index, "compute", t0, time.perf_counter()))
            payload = {
                "hidden_states.output": hb,
                "hidden_states.output_shape": torch.tensor(list(hb.shape), dtype=torch.int64),
                "ids.output": tok.cpu(),
                "meta": {"finished": torch.tensor(step == cfg.decode_tokens - 1)},
            }
            tx.send(payload)
            yield

    admitted = completed = 0
    active: deque[Iterator[None]] = deque()
    while admitted < total or active:
        while done_pipe.poll(0):
            done_pipe.recv_bytes()
            completed += 1
        while admitted < total and _may_admit(admitted, completed, cfg):
            starts[admitted] = time.perf_counter()
            active.append(request(admitted))
            admitted += 1
        if not active:
            if not done_pipe.poll(cfg.timeout):
                raise TimeoutError(f"code2wav reported no finished request within {cfg.timeout} s")
            continue
        for gen in list(active):
            if next(gen, StopIteration) is StopIteration:
                active.remove(gen)
    # Take every request's "done" so none is counted in the next connector's run.
    while completed < total:
        if not done_pipe.poll(cfg.timeout):
            raise TimeoutError(f"code2wav reported no finished request within {cfg.timeout} s")
        done_pipe.recv_bytes()
        completed += 1


def _talker(cfg: PipelineConfig, token: str, in_link: Any, out_link: Any, spans: list[_Span]) -> None:
    import torch

    from omnilink.chunking import ChunkReceiver, ChunkSender, CodecChunker

    model = Talker(cfg)
    total = cfg.warmup + cfg.requests
    order = iter(range(total))

    class _St:
        def __init__(self, index: int) -> None:
            rid = _request_id(token, index)
            self.index = index
            self.rx = ChunkReceiver(in_link, request_id=rid, from_stage=0, timeout=cfg.timeout,
                                    probe_duplicates=False)
            self.tx = ChunkSender(out_link, request_id=rid, from_stage=1, timeout=cfg.timeout)
            self.chunker = CodecChunker(cfg.codec_chunk, cfg.codec_left_context,
                                        initial_chunk_frames=cfg.codec_initial_chunk)
            self.state = model.start()

    def next_stream() -> Any:
        i = next(order, None)
        return None if i is None else _St(i)

    def on_chunk(st: Any, payload: Any) -> None:
        t0 = time.perf_counter()
        finished = st.rx.finished
        with torch.no_grad():
            hidden = payload["hidden_states.output"]
            if "embed.prefill" in payload:
                st.state = model.prefill(st.state, hidden)
                frames = None
            else:
                st.state, frames = model.frames(st.state, hidden)
        _sync(cfg)
        windows = st.chunker.push(frames, finished=finished) if frames is not None else (
            st.chunker.finish() if finished else [])
        spans.append(_Span(st.index, "compute", t0, time.perf_counter()))
        for window in windows:
            st.tx.send_window(window)

    streams: deque[Any] = deque(s for s in (next_stream() for _ in range(cfg.concurrency)) if s is not None)
    _consume(streams, on_chunk, next_stream, timeout=cfg.timeout)


def _code2wav(cfg: PipelineConfig, token: str, in_link: Any, done_pipe: Any, spans: list[_Span],
              audio: dict[int, dict[str, Any]]) -> None:
    import torch

    from omnilink.chunking import ChunkReceiver, codec_frames_from_payload

    model = Code2Wav(cfg)
    total = cfg.warmup + cfg.requests
    order = iter(range(total))

    class _St:
        def __init__(self, index: int) -> None:
            self.index = index
            self.rx = ChunkReceiver(in_link, request_id=_request_id(token, index), from_stage=1,
                                    timeout=cfg.timeout, probe_duplicates=False)
            self.hash = hashlib.sha256()
            self.samples = 0
            self.first: float | None = None
            self.last = 0.0

    def next_stream() -> Any:
        i = next(order, None)
        return None if i is None else _St(i)

    def on_chunk(st: Any, payload: Any) -> None:
        t0 = time.perf_counter()
        frames, lc = codec_frames_from_payload(payload, num_codebooks=cfg.codebooks)
        if frames.shape[0] > lc:
            with torch.no_grad():
                samples = model.audio(frames, lc).cpu()  # the audio leaves the GPU here
            st.hash.update(samples.numpy().tobytes())
            st.samples += samples.numel()
            t1 = time.perf_counter()
            st.last = t1
            if st.first is None:
                st.first = t1
        t1 = time.perf_counter()
        spans.append(_Span(st.index, "compute", t0, t1))
        if st.rx.finished:
            audio[st.index] = {"first": st.first, "last": st.last, "samples": st.samples,
                               "sha256": st.hash.hexdigest()}
            done_pipe.send_bytes(b"d")

    streams: deque[Any] = deque(s for s in (next_stream() for _ in range(cfg.concurrency)) if s is not None)
    _consume(streams, on_chunk, next_stream, timeout=cfg.timeout)


def _stage_main(stage: str, cfg_json: bytes, connectors: list[str], tokens: list[str], pipes: dict[str, Any],
                barrier: Any, result: Any) -> None:
    """Body of one stage process (spawned once for all connectors): per connector, open
    its links, run every request, send the records as JSON, close."""
    links: list[Any] = []
    try:
        import torch

        torch.set_num_threads(1)
        cfg = msgspec.json.decode(cfg_json, type=PipelineConfig)
        if cfg.device == "cuda":
            torch.cuda.set_device(0)
        long_wait = cfg.timeout * (2 + cfg.requests + cfg.warmup)
        for connector, token in zip(connectors, tokens):
            cls = _LINKS[connector]
            spans: list[_Span] = []
            in_link = out_link = None
            # Receivers first, then senders once every stage's receiver is up.
            if stage != "thinker":
                edge = 0 if stage == "talker" else 1
                in_link = cls(cfg, token=token, edge=edge, role="receiver", pipe=pipes.get(f"rx{edge}"))
                in_link.open()
                links.append(in_link)
            barrier.wait(long_wait)
            if stage != "code2wav":
                edge = 0 if stage == "thinker" else 1
                out_link = cls(cfg, token=token, edge=edge, role="sender", pipe=pipes.get(f"tx{edge}"))
                out_link.open()
                links.append(out_link)
            barrier.wait(long_wait)
            rec: dict[str, Any] = {"stage": stage, "connector": connector}
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if stage == "thinker":
                starts: dict[int, float] = {}
                _thinker(cfg, token, out_link, pipes["done_rx"], spans, starts)
                rec["starts"] = starts
            elif stage == "talker":
                _talker(cfg, token, in_link, out_link, spans)
            else:
                audio: dict[int, dict[str, Any]] = {}
                _code2wav(cfg, token, in_link, pipes["done_tx"], spans, audio)
                rec["audio"] = audio
            rec["cpu_s"] = time.process_time() - cpu0
            rec["wall_s"] = time.perf_counter() - wall0
            rec["spans"] = spans
            rec["puts"] = out_link.puts if out_link is not None else []
            rec["gets"] = in_link.gets if in_link is not None else []
            rec["counts"] = {f"{link.role}:e{link.edge}": link.counts() for link in links}
            # Close only once every stage is done: vLLM-Omni's SharedMemoryConnector.close()
            # unlinks the segments its receiver has not read yet.
            barrier.wait(long_wait)
            for link in reversed(links):
                link.close()
            links.clear()
            result.send_bytes(msgspec.json.encode(rec))
    except BaseException as exc:  # the parent reports it; the process exits non-zero
        try:
            result.send_bytes(msgspec.json.encode(
                {"stage": stage, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}))
        except Exception:
            pass
        try:
            barrier.abort()  # the other stages stop waiting for this one
        except Exception:
            pass
        raise SystemExit(1) from None
    finally:
        for link in reversed(links):
            try:
                link.close()
            except Exception:
                pass


# ------------------------------------------------------------------------ running
class PipelineError(RuntimeError):
    """A stage failed or the run timed out (the message names the stage)."""


def _run_all(cfg: PipelineConfig, connectors: list[str], *, rounds: int,
             progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Spawn the three stage processes once and run the pipeline over each connector in
    turn, ``rounds`` times in alternation, rotated (A B C, B C A, C A B: drift in the
    machine's load and the position in a round reach every connector alike), fresh
    channels per run; return one summary per connector, its rounds pooled."""
    import multiprocessing as mp

    # Round r starts at connector r (mod n): with rounds == n every connector runs once in
    # every position, so whatever the position costs (the run after another's close, ...)
    # reaches each connector alike.
    n = len(connectors)
    plan = [connectors[(r + i) % n] for r in range(rounds) for i in range(n)]
    # With several rounds, one unmeasured run first: the processes' first requests after
    # start-up (lazy initialisation, cold caches) would otherwise count against one
    # connector.
    discard = 1 if rounds > 1 else 0
    plan = plan[:discard] + plan

    ctx = mp.get_context("spawn")
    if any(c in ("vllm-omni-shm", "pickle-shm") for c in connectors):
        # One resource tracker for all three processes, so a segment created by one and
        # unlinked by another is neither reported as leaked nor unlinked twice.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    tokens = [uuid.uuid4().hex[:8] for _ in plan]
    cfg_json = msgspec.json.encode(cfg)
    barrier = ctx.Barrier(3)
    done_rx, done_tx = ctx.Pipe(duplex=False)
    rx0, tx0 = ctx.Pipe(duplex=False)
    rx1, tx1 = ctx.Pipe(duplex=False)
    pipes = {
        "thinker": {"done_rx": done_rx, "tx0": tx0},
        "talker": {"rx0": rx0, "tx1": tx1},
        "code2wav": {"rx1": rx1, "done_tx": done_tx},
    }
    summaries: list[dict[str, Any]] = []
    procs = []
    readers = []
    try:
        for stage in STAGES:
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_stage_main, name=f"omnilink-pipeline-{stage}",
                            args=(stage, cfg_json, plan, tokens, pipes[stage], barrier, w), daemon=True)
            p.start()
            w.close()
            procs.append(p)
            readers.append((stage, r))
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in connectors}
        for k, connector in enumerate(plan):
            round_name = "warm-up run" if k < discard else f"round {(k - discard) // n + 1}/{rounds}"
            progress(f"{connector} ({round_name}): running {cfg.warmup} warm-up + "
                     f"{cfg.requests} requests, concurrency {cfg.concurrency}")
            t = time.perf_counter()
            # Long enough for every request's work at a crawl (plus start-up); a hang still ends.
            deadline = time.monotonic() + cfg.timeout * (3 + cfg.requests + cfg.warmup)
            results: dict[str, Any] = {}
            pending = dict(readers)
            while pending:
                for stage, r in list(pending.items()):
                    proc = procs[STAGES.index(stage)]
                    if r.poll(0.05):
                        try:
                            rec = msgspec.json.decode(r.recv_bytes())
                        except EOFError:
                            rec = {"stage": stage, "error": f"the process exited (status {proc.exitcode}) "
                                                            "without a result"}
                        if "error" in rec:
                            raise PipelineError(f"{connector}: stage {stage} failed: {rec['error']}\n"
                                                f"{rec.get('traceback', '')}")
                        results[stage] = rec
                        del pending[stage]
                    elif not proc.is_alive() and not r.poll(0):
                        raise PipelineError(f"{connector}: stage {stage} exited (status {proc.exitcode}) "
                                            "without a result")
                if time.monotonic() > deadline:
                    raise PipelineError(f"{connector}: the pipeline did not finish in time")
            raw = _measure(cfg, results)
            raw["wall_s"] = time.perf_counter() - t
            if k >= discard:
                runs[connector].append(raw)
            one = _combine(connector, [raw])
            progress(f"{connector}: done in {raw['wall_s']:.1f} s; first audio p50 "
                     f"{_fmt(one['first_audio_ms_p50'])} ms, transport/chunk p50 "
                     f"{_fmt(one['transport_ms_p50'], '.3f')} ms")
        for c in connectors:
            summary = _combine(c, runs[c])
            summary["wall_s"] = sum(r["wall_s"] for r in runs[c])
            summaries.append(summary)
        for p in procs:
            p.join(cfg.timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        for _stage, r in readers:
            r.close()
        for c in (done_rx, done_tx, rx0, tx0, rx1, tx1):
            c.close()
        for token in tokens:
            # What a failed run left (a clean run leaves nothing).
            _unlink_prefix(f"olpipepk{token}")
            _unlink_prefix(f"olpipe{token}r")
            _unlink_prefix(f"shm_olpipe{token}r")
    return summaries

def _unlink_prefix(prefix: str) -> None:
    """Remove what a failed baseline run left in /dev/shm (a clean run leaves nothing)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def _pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def _measure(cfg: PipelineConfig, results: dict[str, Any]) -> dict[str, Any]:
    """The raw figures of one run of one connector (measured requests only)."""
    starts = {int(k): v for k, v in results["thinker"]["starts"].items()}
    audio = {int(k): v for k, v in results["code2wav"]["audio"].items()}
    measured = set(range(cfg.warmup, cfg.warmup + cfg.requests))
    raw: dict[str, Any] = {
        "ttfa": [(audio[i]["first"] - starts[i]) * 1e3 for i in sorted(measured) if audio[i]["first"] is not None],
        "ttla": [(audio[i]["last"] - starts[i]) * 1e3 for i in sorted(measured)],
        "edges": [],
        "stage_transport": {s: 0.0 for s in STAGES},
        "stage_compute": {s: sum(sp[3] - sp[2] for sp in results[s]["spans"] if sp[0] in measured)
                          for s in STAGES},
        "audio_sha256": {str(i): audio[i]["sha256"] for i in sorted(audio)},
        "audio_samples": {str(i): audio[i]["samples"] for i in sorted(audio)},
        # CPU each stage process used over the run (all requests, threads included) and
        # the run's wall time: a transport that burns CPU while waiting slows the others.
        "stage_cpu_s": {s: results[s]["cpu_s"] for s in STAGES},
        "stage_wall_s": {s: results[s]["wall_s"] for s in STAGES},
        "counts": {s: results[s].get("counts", {}) for s in STAGES},
    }
    chunk_records: list[dict[str, Any]] = []
    for e, (src, dst) in enumerate((("thinker", "talker"), ("talker", "code2wav"))):
        puts = {k: (t0, t1, n) for k, t0, t1, n in results[src]["puts"]}
        gets = {k: (t0, t1) for k, t0, t1 in results[dst]["gets"]}
        edge: dict[str, Any] = {"transport": [], "put": [], "get": [], "chunks": 0, "bytes": 0, "unread": 0}
        for key, (p0, p1, n) in puts.items():
            request = int(key.rsplit("_", 2)[0].rsplit("r", 1)[1])  # olpipe{token}r{index}_{stage}_{chunk}
            if key not in gets:
                edge["unread"] += 1
                continue
            g0, g1 = gets[key]
            chunk_records.append({"edge": e, "request": request, "put": [p0, p1], "get": [max(g0, p1), g1]})
            if request not in measured:
                continue
            # Until the receiver holds the payload: a put that returns after that (the
            # receiver it woke ran first on a busy core) counts only up to it.
            put_d = max(0.0, min(p1, g1) - p0)
            get_d = max(0.0, g1 - max(g0, p1))
            edge["transport"].append((put_d + get_d) * 1e3)
            edge["put"].append((p1 - p0) * 1e3)
            edge["get"].append(get_d * 1e3)
            edge["chunks"] += 1
            edge["bytes"] += n
            raw["stage_transport"][src] += put_d
            raw["stage_transport"][dst] += get_d
        raw["edges"].append(edge)
    raw["timeline"] = _timeline(cfg, results, starts, audio, chunk_records)
    return raw


def _summed(counts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """``{link: {counter: n}}`` of several rounds, added up."""
    out: dict[str, dict[str, int]] = {}
    for one in counts:
        for link, c in one.items():
            mine = out.setdefault(link, {})
            for k, v in c.items():
                mine[k] = mine.get(k, 0) + v
    return out


def _combine(connector: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One connector's figures over all its rounds (samples pooled)."""
    ttfa = [v for r in runs for v in r["ttfa"]]
    ttla = [v for r in runs for v in r["ttla"]]
    transport = [v for r in runs for e in r["edges"] for v in e["transport"]]
    st = {s: sum(r["stage_transport"][s] for r in runs) for s in STAGES}
    sc = {s: sum(r["stage_compute"][s] for r in runs) for s in STAGES}
    total = sum(st.values()) + sum(sc.values())
    edges = []
    for e, name in enumerate(EDGES):
        pooled = {k: [v for r in runs for v in r["edges"][e][k]] for k in ("transport", "put", "get")}
        first = runs[0]["edges"][e]
        edges.append({
            "edge": name, "chunks": first["chunks"], "bytes": first["bytes"],
            "unread": sum(r["edges"][e]["unread"] for r in runs),
            "transport_ms_p50": _pct(pooled["transport"], 50), "transport_ms_p99": _pct(pooled["transport"], 99),
            "put_ms_p50": _pct(pooled["put"], 50), "put_ms_p99": _pct(pooled["put"], 99),
            "get_ms_p50": _pct(pooled["get"], 50), "get_ms_p99": _pct(pooled["get"], 99),
        })
    hashes = [r["audio_sha256"] for r in runs]
    return {
        "connector": connector,
        "rounds": len(runs),
        "first_audio_ms_p50": _pct(ttfa, 50), "first_audio_ms_p99": _pct(ttfa, 99),
        "last_audio_ms_p50": _pct(ttla, 50), "last_audio_ms_p99": _pct(ttla, 99),
        "transport_ms_p50": _pct(transport, 50), "transport_ms_p99": _pct(transport, 99),
        "transport_share": sum(st.values()) / total if total > 0 else None,
        "stage_transport_share": {s: (st[s] / (st[s] + sc[s]) if st[s] + sc[s] > 0 else None) for s in STAGES},
        "stage_compute_s": sc,
        "stage_cpu_s": {s: sum(r["stage_cpu_s"][s] for r in runs) for s in STAGES},
        "stage_wall_s": {s: sum(r["stage_wall_s"][s] for r in runs) for s in STAGES},
        "edges": edges,
        # each stage's connectors' counters (``stats()``, send plans, views made ahead),
        # summed over the rounds: warm-up requests included
        "counts": {s: _summed([r["counts"][s] for r in runs]) for s in STAGES},
        "audio_sha256": hashes[0],
        "rounds_identical": all(h == hashes[0] for h in hashes[1:]),
        "audio_samples": runs[0]["audio_samples"],
        "timeline": runs[0]["timeline"],
    }


def _timeline(cfg: PipelineConfig, results: dict[str, Any], starts: dict[int, float],
              audio: dict[int, Any], chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's stage activity and transfers, in ms from its admission (for --plot)."""
    index = cfg.warmup
    t0 = starts[index]
    ms = (lambda t: (t - t0) * 1e3)
    return {
        "request": index,
        "compute": {s: [[ms(sp[2]), ms(sp[3])] for sp in results[s]["spans"] if sp[0] == index] for s in STAGES},
        "transfers": [{"edge": c["edge"], "put": [ms(c["put"][0]), ms(c["put"][1])],
                       "get": [ms(c["get"][0]), ms(c["get"][1])]} for c in chunks if c["request"] == index],
        "first_audio_ms": ms(audio[index]["first"]) if audio[index]["first"] is not None else None,
        "last_audio_ms": ms(audio[index]["last"]),
    }


def run_pipeline(cfg: PipelineConfig, connectors: Sequence[str], *, rounds: int = 1,
                 progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run the pipeline once per connector and return the figures (see the module docstring).

    Returns
    -------
    dict
        ``results`` (one dict per connector that ran), ``unavailable`` (connector ->
        reason), ``identical`` (whether every connector's audio had the same SHA-256 per
        request; ``None`` with fewer than two), ``reference`` (the connector compared to).

    Raises
    ------
    ConfigurationError
        A bad configuration.
    PipelineError
        A stage failed or the pipeline did not finish.
    """
    cfg.validate()
    out: dict[str, Any] = {"results": [], "unavailable": {}}
    runnable = []
    for name in connectors:
        reason = probe(name)
        if reason is None:
            runnable.append(name)
        else:
            out["unavailable"][name] = reason
            progress(f"{name}: unavailable ({reason})")
    if runnable:
        out["results"] = _run_all(cfg, runnable, rounds=rounds, progress=progress)
    hashes = [r["audio_sha256"] for r in out["results"]]
    out["identical"] = (all(h == hashes[0] for h in hashes[1:]) and all(r["rounds_identical"] for r in out["results"])
                        if len(hashes) >= 2 else None)
    return out


# ------------------------------------------------------------------------ report
def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _size(n: int) -> str:
    from omnilink._bench.units import format_size

    return format_size(n)


def text_report(out: dict[str, Any], machine_line: str) -> str:
    """The table ``omnilink bench pipeline`` prints."""
    rows = [("connector", "first audio p50/p99 ms", "last audio p50/p99 ms", "transport/chunk p50/p99 ms",
             "transport share", "chunks e0/e1", "bytes e0/e1")]
    for r in out["results"]:
        e0, e1 = r["edges"]
        rows.append((
            r["connector"],
            f"{_fmt(r['first_audio_ms_p50'])} / {_fmt(r['first_audio_ms_p99'])}",
            f"{_fmt(r['last_audio_ms_p50'])} / {_fmt(r['last_audio_ms_p99'])}",
            f"{_fmt(r['transport_ms_p50'], '.3f')} / {_fmt(r['transport_ms_p99'], '.3f')}",
            f"{_fmt(None if r['transport_share'] is None else 100 * r['transport_share'])} %",
            f"{e0['chunks']} / {e1['chunks']}",
            f"{_size(e0['bytes'])} / {_size(e1['bytes'])}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    by = {r["connector"]: r for r in out["results"]}
    ref = by.get("omnilink-shm")
    if ref is not None:
        lines.append("")
        for name in ("vllm-omni-shm", "pickle-shm", "omnilink-zmq"):
            other = by.get(name)
            if other is None:
                continue
            lines.append(
                f"omnilink-shm vs {name}: transport/chunk p50 {_ratio(other['transport_ms_p50'], ref['transport_ms_p50'])} "
                f"lower, first audio p50 {_ratio(other['first_audio_ms_p50'], ref['first_audio_ms_p50'])} lower "
                f"({_fmt(ref['first_audio_ms_p50'])} vs {_fmt(other['first_audio_ms_p50'])} ms)")
    lines.append("")
    if out["identical"] is None:
        lines.append("audio bit-identical across connectors: not checked (fewer than two connectors ran)")
    else:
        first = out["results"][0]["audio_sha256"]
        lines.append(f"audio bit-identical across connectors ({', '.join(by)}): "
                     f"{'yes' if out['identical'] else 'NO'} (sha256 of request {next(iter(first))}: "
                     f"{first[next(iter(first))][:16]}...)")
    for name, reason in out["unavailable"].items():
        lines.append(f"{name}: unavailable: {reason}")
    lines.append("")
    lines.append("transport/chunk: the sender's put (up to the moment the receiver holds the payload) plus the "
                 "receiver's get from the moment the chunk was both published and asked for; share: transport "
                 "over transport + compute of all stages.")
    lines.append(machine_line)
    lines.append("Benchmarks are hard: the stages share the machine's cores with anything else running.")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.1f}x"


def machine_line(record: dict[str, Any]) -> str:
    """One line naming the machine (CPU, cores, load, torch, GPU)."""
    v = record.get("versions", {})
    try:
        load = "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "load average unknown"
    gpus = record.get("cuda_devices") or []
    gpu = ", ".join(f"cuda:{d['index']} {d['name']}" for d in gpus) if gpus else "no GPU used"
    return (f"machine: {record.get('cpu', '?')}, {record.get('cores', os.cpu_count())} cores, {load}; "
            f"{gpu}; python {v.get('python', sys.version.split()[0])}, torch {v.get('torch', '?')}, "
            f"omnilink {v.get('omnilink', '?')}")


def write_plot(path: str, out: dict[str, Any], *, title: str) -> None:
    """A PNG timeline of one request per connector (stage compute, puts, gets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.9 * len(results) + 0.8), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        tl = r["timeline"]
        for lane, stage in enumerate(STAGES):
            y = len(STAGES) - 1 - lane
            ax.broken_barh([(a, b - a) for a, b in tl["compute"][stage]], (y - 0.3, 0.6), color="tab:blue")
        for tr in tl["transfers"]:
            ys = len(STAGES) - 1 - tr["edge"]
            yr = ys - 1
            ax.broken_barh([(tr["put"][0], max(tr["put"][1] - tr["put"][0], 1e-3))], (ys - 0.45, 0.15),
                           color="tab:orange")
            ax.broken_barh([(tr["get"][0], max(tr["get"][1] - tr["get"][0], 1e-3))], (yr + 0.3, 0.15),
                           color="tab:red")
        if tl["first_audio_ms"] is not None:
            ax.axvline(tl["first_audio_ms"], color="tab:green", lw=1.2)
        ax.set_yticks(range(len(STAGES)))
        ax.set_yticklabels(list(reversed(STAGES)))
        ax.set_title(f"{r['connector']}: first audio {_fmt(tl['first_audio_ms'])} ms (green), "
                     "compute (blue), put (orange), get (red)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"ms since request {results[0]['timeline']['request']} was admitted")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def build_parser(prog: str = "omnilink bench pipeline") -> argparse.ArgumentParser:
    """The options of ``omnilink bench pipeline``."""
    d = PipelineConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description=("Run a three-process streaming pipeline (thinker -> talker -> code2wav, stand-in models "
                     "with random weights) once per connector and print time to first audio, transport time "
                     "per chunk and its share of the step time, chunks and bytes per edge, and whether the "
                     "audio is bit-identical across connectors."),
    )
    p.add_argument("--connector", default=",".join(CONNECTORS),
                   help=f"comma list of {', '.join(CONNECTORS)} (default: all; pickle-shm is a baseline)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the stages' tensors live (cuda: on cuda:0 end to end)")
    p.add_argument("--requests", type=int, default=d.requests, help=f"measured requests (default {d.requests})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"unmeasured requests first (default {d.warmup})")
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help=f"requests in flight at once (default {d.concurrency})")
    p.add_argument("--rounds", type=int, default=4,
                   help="runs per connector, connectors alternating (each round rotated by one), "
                        "samples pooled (default 4)")
    for name, help_ in (("hidden", "thinker hidden size"), ("ffn", "thinker FFN width (compute per token)"),
                        ("prompt-tokens", "prompt length"), ("prefill-chunk", "tokens per prefill chunk"),
                        ("decode-tokens", "thinker tokens decoded per request"),
                        ("talker-hidden", "talker hidden size"), ("frames-per-token", "codec frames per text token"),
                        ("codec-chunk", "codec frames per window"), ("codec-left-context", "left context frames"),
                        ("codec-initial-chunk", "frames of the first window"),
                        ("samples-per-frame", "audio samples per codec frame"), ("seed", "weights and prompts")):
        attr = name.replace("-", "_")
        p.add_argument(f"--{name}", type=int, default=getattr(d, attr),
                       help=f"{help_} (default {getattr(d, attr)})")
    p.add_argument("--codebooks", type=int, choices=(8, 16), default=d.codebooks,
                   help=f"codebooks per codec frame (default {d.codebooks})")
    p.add_argument("--timeout", type=float, default=d.timeout, help=f"seconds per chunk wait (default {d.timeout:g})")
    p.add_argument("--json", metavar="FILE", help="write the figures, configuration and machine as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="write a timeline of one request per connector (matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = "omnilink bench pipeline",
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``omnilink bench pipeline``; return the exit status (0 ok, 1 failed, 2 usage)."""
    from omnilink._errors import ConfigurationError

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    connectors = list(dict.fromkeys(c.strip() for c in args.connector.split(",") if c.strip()))
    unknown = [c for c in connectors if c not in CONNECTORS]
    if not connectors or unknown:
        print(f"{prog}: error: --connector: unknown {', '.join(unknown) or '(none given)'}; "
              f"choose from {','.join(CONNECTORS)}", file=err)
        return EXIT_USAGE
    fields = {f: getattr(args, f) for f in ("requests", "warmup", "concurrency", "hidden", "ffn", "prompt_tokens",
                                             "prefill_chunk", "decode_tokens", "talker_hidden", "frames_per_token",
                                             "codec_chunk", "codec_left_context", "codec_initial_chunk",
                                             "samples_per_frame", "seed", "codebooks", "timeout", "device")}
    cfg = PipelineConfig(**fields)
    try:
        cfg.validate()
    except ConfigurationError as exc:
        print(f"{prog}: error: {exc}", file=err)
        return EXIT_USAGE
    if args.rounds < 1:
        print(f"{prog}: error: rounds must be an int >= 1, got {args.rounds}", file=err)
        return EXIT_USAGE
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{prog}: error: --plot needs matplotlib: pip install matplotlib "
                  "(or the plot extra: pip install 'pyomnilink[plot]')", file=err)
            return EXIT_USAGE
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"{prog}: --device cuda: CUDA is not available on this machine "
                  "(torch.cuda.is_available() is False); run with --device cpu.", file=err)
            return EXIT_FAIL
    json_fh = None
    if args.json:
        try:
            json_fh = open(args.json, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        except OSError as exc:
            print(f"{prog}: error: --json: cannot write {args.json}: {exc}", file=err)
            return EXIT_USAGE
    from omnilink._bench.machine import machine_record

    record = machine_record(include_cuda=cfg.device == "cuda")
    mline = machine_line(record)

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[pipeline] {line}", file=err, flush=True)

    progress(mline)
    try:
        result = run_pipeline(cfg, connectors, rounds=args.rounds, progress=progress)
    except PipelineError as exc:
        if json_fh is not None:
            json_fh.close()
        print(f"{prog}: {exc}", file=err)
        return EXIT_FAIL
    print(f"omnilink bench pipeline: device {cfg.device}, {cfg.requests} requests (+{cfg.warmup} warm-up), "
          f"concurrency {cfg.concurrency}, {args.rounds} round(s) per connector, prompt {cfg.prompt_tokens} tokens x hidden {cfg.hidden} "
          f"(prefill chunks of {cfg.prefill_chunk}), {cfg.decode_tokens} decoded tokens, "
          f"{cfg.codebooks} codebooks", file=out)
    print(file=out)
    print(text_report(result, mline), file=out)
    if json_fh is not None:
        with json_fh:
            json_fh.write(msgspec.json.encode({"config": cfg, "machine": record, "machine_line": mline,
                                                **result}).decode() + "\n")
        progress(f"wrote {args.json}")
    if args.plot and result["results"]:
        write_plot(args.plot, result, title=f"omnilink bench pipeline ({cfg.device}); {mline}")
        progress(f"wrote plot to {args.plot}")
    if result["identical"] is False:
        print(f"{prog}: the audio differs across connectors", file=err)
        return EXIT_FAIL
    if not result["results"]:
        print(f"{prog}: no connector could run here", file=err)
        return EXIT_FAIL
    return EXIT_OK


#: The name the CLI imports through ``omnilink._bench``.
pipeline_main = main
