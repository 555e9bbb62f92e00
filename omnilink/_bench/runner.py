"""Scenarios and the measurement loop of ``omnilink bench``.

A *cell* is one (backend, size, mode). For each cell the runner does one warm-up run,
then measured runs until ``repeat`` runs are done or the cell has used ``max_seconds``
(at least one measured run always happens), and reports medians:

- ``throughput``: a run is a burst of ``count`` messages sent back to back with at most
  ``window`` in flight; GB/s = ``count * size_bytes / (t_end - t0)`` where ``t0`` is the
  sender's clock before its first message and ``t_end`` the receiver's clock after it
  holds (and has checked) the last one. GB is 10**9 bytes. The cell's figure is the
  median over runs (min and max are kept too).
- ``latency``: one message in flight; one-way latency of each message is the
  receiver's clock when ``get`` returned a usable payload minus the sender's stamp taken
  just before it handed the payload to the transport (serialisation included). Both are
  CLOCK_MONOTONIC readings on the same host. p50 / p99 over every measured message.

``size_bytes`` is the size of the bf16 hidden-state tensor; the payload also carries the
small metadata of ``_payload``. Sender and receiver are two processes started with
``spawn`` and kept for the whole run (restarted only after a failure).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from omnilink._bench.backends import BACKENDS, PairContext, get_backend, probe
from omnilink._bench.plan import Plan, plan
from omnilink._bench.scenarios import SCENARIOS, Scenario
from omnilink._bench.units import format_size

__all__ = [
    "DEFAULT_SIZES",
    "SCENARIOS",
    "BenchOptions",
    "Scenario",
    "run_bench",
]

logger = logging.getLogger(__name__)

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
MODES = ("throughput", "latency")


@dataclass
class BenchOptions:
    """Parsed ``omnilink bench`` options (see ``omnilink bench --help``)."""

    scenario: str = "shm-vs-pickle"
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    modes: tuple[str, ...] = MODES
    backends: list[str] | None = None
    repeat: int = 5
    max_seconds: float = 2.0
    timeout: float = 60.0


# --------------------------------------------------------------------------- records
def _base_record(scenario: str, backend: str, mode: str, size: int) -> dict[str, Any]:
    return {"scenario": scenario, "backend": backend, "mode": mode, "size_bytes": size,
            "size": format_size(size)}


def _throughput_record(base: dict[str, Any], size: int, p: Plan, seconds: list[float]) -> dict[str, Any]:
    rates = [p.count * size / s / 1e9 for s in seconds]
    med = statistics.median(rates)
    return {**base, "status": "ok", "gbps": med, "gbps_min": min(rates), "gbps_max": max(rates),
            "msgs_per_s": med * 1e9 / size, "reps": len(seconds), "count": p.count,
            "window": p.window}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: every figure is a measured sample)."""
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 1)) - 1))
    return sorted_values[k]


def _latency_record(base: dict[str, Any], p: Plan, samples_ns: list[int], reps: int) -> dict[str, Any]:
    us = sorted(s / 1e3 for s in samples_ns)
    return {**base, "status": "ok", "p50_us": _percentile(us, 0.50), "p99_us": _percentile(us, 0.99),
            "mean_us": statistics.fmean(us), "min_us": us[0], "max_us": us[-1],
            "samples": len(us), "reps": reps, "count": p.count}


def _failed_record(base: dict[str, Any], status: str, reason: str) -> dict[str, Any]:
    return {**base, "status": status, "reason": reason}


# ----------------------------------------------------------------------- the pair
class WorkerError(RuntimeError):
    """A worker reported an error, died, or did not answer in time."""


class WorkerPair:
    """A sender and a receiver process (spawn), driven over two control pipes."""

    def __init__(self, *, run_id: str, prefix: str) -> None:
        import torch.multiprocessing as tmp

        from omnilink._bench.workers import worker_main

        ctx = multiprocessing.get_context("spawn")
        link_recv, link_send = ctx.Pipe(duplex=False)
        # torch's context so the queue pickles tensors with torch's shared-memory reductions.
        queue = tmp.get_context("spawn").Queue()
        self._shared = PairContext(link_send=link_send, link_recv=link_recv, queue=queue,
                                   prefix=prefix, run_id=run_id)
        # Kept on self: the children attach to the named semaphore while starting, and
        # it would be unlinked if the parent dropped its last reference first.
        self._credits = credits = ctx.Semaphore(0)
        self._conns: dict[str, Any] = {}
        self._procs: dict[str, Any] = {}
        for role in ("sender", "receiver"):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(role, child_end, self._shared, credits),
                               name=f"omnilink-bench-{role}", daemon=True)
            proc.start()
            child_end.close()
            self._conns[role] = parent_end
            self._procs[role] = proc
        self._enc = msgspec.json.Encoder()
        self._dec = msgspec.json.Decoder()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values() if p.pid is not None]

    def command(self, cmd: dict[str, Any], *, roles: tuple[str, ...], timeout: float) -> dict[str, dict[str, Any]]:
        """Send ``cmd`` to ``roles`` and wait for every reply (or the first failure)."""
        from multiprocessing.connection import wait

        payload = self._enc.encode(cmd)
        for role in roles:
            try:
                self._conns[role].send_bytes(payload)
            except OSError as exc:
                raise WorkerError(f"{role} worker is gone ({exc})") from exc
        replies: dict[str, dict[str, Any]] = {}
        pending = {self._conns[r]: r for r in roles}
        end = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, end - time.monotonic()))
            if not ready:
                raise WorkerError(f"{', '.join(pending.values())} did not answer {cmd['op']!r} within {timeout:.0f} s")
            for conn in ready:
                role = pending.pop(conn)
                try:
                    reply = self._dec.decode(conn.recv_bytes())
                except (EOFError, OSError) as exc:
                    code = self._procs[role].exitcode
                    raise WorkerError(f"{role} worker died (exit code {code})") from exc
                if not reply.get("ok"):
                    raise WorkerError(f"{role}: {reply.get('error')}")
                replies[role] = reply
        return replies

    def close(self) -> None:
        """Ask both workers to exit; kill what does not within a few seconds."""
        for conn in self._conns.values():
            try:
                conn.send_bytes(self._enc.encode({"op": "exit"}))
            except OSError:
                pass
        for proc in self._procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns.values():
            conn.close()
        self._shared.queue.close()
        self._shared.queue.join_thread()

    def kill(self) -> None:
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self._procs.values():
            proc.join(timeout=5)
        for conn in self._conns.values():
            conn.close()
        self._shared.queue.close()
        self._shared.queue.cancel_join_thread()


def _sweep_segments(prefix: str, run_id: str) -> None:
    """Remove segments a killed baseline worker may have left (names carry the run id)."""
    mark = f"{prefix}-bench-"
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        if name.startswith(mark) and f"-{run_id}-" in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                logger.warning("removed leftover benchmark segment %s", name)
            except OSError:
                pass


# ------------------------------------------------------------------------ runner
ProgressFn = Callable[[int, int, str], None]


class _Runner:
    def __init__(self, opts: BenchOptions, scenario: Scenario, emit: Callable[[dict[str, Any]], None],
                 progress: ProgressFn | None) -> None:
        self.opts = opts
        self.scenario = scenario
        self.emit = emit
        self.progress = progress or (lambda done, total, label: None)
        self.run_id = uuid.uuid4().hex[:8]
        self.prefix = os.environ.get("OMNILINK_SHM_PREFIX", "omnilink")
        self.pair: WorkerPair | None = None
        self.seq = 0
        self.done = 0
        self.total = len(opts.backends) * len(opts.sizes) * len(opts.modes)

    def _tick(self, label: str) -> None:
        self.progress(self.done, self.total, label)

    def _cell_done(self, record: dict[str, Any]) -> None:
        self.done += 1
        self.emit(record)
        self._tick(f"{record['backend']} {record['size']} {record['mode']}")

    def run(self) -> None:
        try:
            for name in self.opts.backends:
                reason = probe(name)
                if reason is not None:
                    for size in self.opts.sizes:
                        for mode in self.opts.modes:
                            base = _base_record(self.scenario.name, name, mode, size)
                            self._cell_done(_failed_record(base, "unavailable", reason))
                    continue
                backend_cls = BACKENDS[name]
                if backend_cls.local:
                    self._run_local(name)
                else:
                    self._run_pair(name)
        finally:
            self._drop_pair()

    # -- local backends (memcpy and the gpu copies): no processes
    def _run_local(self, name: str) -> None:
        backend = get_backend(name)
        for size in self.opts.sizes:
            try:
                backend.prepare(size, scenario=self.scenario)
            except Exception as exc:  # e.g. out of memory: report, keep going
                for mode in self.opts.modes:
                    base = _base_record(self.scenario.name, name, mode, size)
                    self._cell_done(_failed_record(base, "error", f"{type(exc).__name__}: {exc}"))
                continue
            backend.copy_many(plan(size, "throughput").warmup)
            for mode in self.opts.modes:
                self._tick(f"{name} {format_size(size)} {mode}")
                p = plan(size, mode)
                base = _base_record(self.scenario.name, name, mode, size)
                start = time.monotonic()
                durations: list[float] = []
                samples: list[int] = []
                while len(durations) < self.opts.repeat:
                    if mode == "throughput":
                        durations.append(backend.copy_many(p.count))
                    else:
                        times = backend.copy_each(p.count)
                        samples.extend(times)
                        durations.append(sum(times) / 1e9)
                    if time.monotonic() - start > self.opts.max_seconds:
                        break
                if mode == "throughput":
                    self._cell_done(_throughput_record(base, size, p, durations))
                else:
                    self._cell_done(_latency_record(base, p, samples, len(durations)))
            backend.release()

    # -- two-process backends
    def _ensure_pair(self) -> WorkerPair:
        if self.pair is None:
            self._tick("starting sender and receiver processes")
            self.pair = WorkerPair(run_id=self.run_id, prefix=self.prefix)
        return self.pair

    def _drop_pair(self, *, kill: bool = False) -> None:
        pair, self.pair = self.pair, None
        if pair is not None:
            if kill:
                pair.kill()
            else:
                pair.close()
        _sweep_segments(self.prefix, self.run_id)

    def _open(self, name: str, options: dict[str, Any]) -> None:
        pair = self._ensure_pair()
        cmd = {"op": "open", "backend": name, "timeout": self.opts.timeout, "options": options}
        # The side that creates (shm: the sender's arena; zmq: the receiver's bound
        # socket) opens first, so the other attaches to something that exists.
        order = ("receiver", "sender") if BACKENDS[name].receiver_first else ("sender", "receiver")
        for role in order:
            pair.command(cmd, roles=(role,), timeout=self.opts.timeout)

    def _close(self) -> None:
        if self.pair is None:
            return
        try:
            self.pair.command({"op": "close"}, roles=("receiver",), timeout=self.opts.timeout)
            self.pair.command({"op": "close"}, roles=("sender",), timeout=self.opts.timeout)
        except WorkerError as exc:
            logger.warning("closing the benchmark backend failed: %s", exc)
            self._drop_pair(kill=True)

    def _run_pair(self, name: str) -> None:
        opened = False
        open_error: str | None = None
        options = BACKENDS[name].bench_options(self.opts.sizes, self.opts.modes)
        for size in self.opts.sizes:
            warm = False
            for mode in self.opts.modes:
                base = _base_record(self.scenario.name, name, mode, size)
                if open_error is not None:
                    # Opening failed (e.g. /dev/shm too small for the arena): every cell
                    # of this backend would fail the same way; say so without retrying.
                    self._cell_done(_failed_record(base, "error", open_error))
                    continue
                self._tick(f"{name} {format_size(size)} {mode}")
                try:
                    if not opened:
                        try:
                            self._open(name, options)
                        except WorkerError as exc:
                            open_error = f"opening the backend failed: {exc}"
                            raise
                        opened = True
                    if not warm:
                        # One warm-up per backend and size: first touch of pages, lazy
                        # imports and connection set-up stay out of every measured run.
                        p = plan(size, "throughput")
                        self._run_once(size, p.warmup, min(p.window, p.warmup))
                        warm = True
                    record = self._measure(base, size, mode)
                    if options:
                        record["options"] = options
                except WorkerError as exc:
                    record = _failed_record(base, "error", open_error or str(exc))
                    # A failed run leaves the pair in an unknown state: start afresh.
                    self._drop_pair(kill=True)
                    opened = warm = False
                self._cell_done(record)
        if opened:
            self._close()

    def _run_once(self, size: int, count: int, window: int) -> tuple[int, int, list[int]]:
        cmd = {"op": "run", "size": size, "count": count, "window": window, "seq0": self.seq,
               "payload_device": self.scenario.payload_device,
               "recv_device": self.scenario.recv_device}
        self.seq += count
        # Every message may take up to `timeout`; the workers time out first.
        replies = self.pair.command(cmd, roles=("sender", "receiver"),
                                    timeout=self.opts.timeout * 2 + 30)
        return replies["sender"]["t0"], replies["receiver"]["t_end"], replies["receiver"]["one_way_ns"]

    def _measure(self, base: dict[str, Any], size: int, mode: str) -> dict[str, Any]:
        p = plan(size, mode)
        window = p.window
        start = time.monotonic()
        seconds: list[float] = []
        samples: list[int] = []
        while len(seconds) < self.opts.repeat:
            t0, t_end, one_way = self._run_once(size, p.count, window)
            seconds.append((t_end - t0) / 1e9)
            samples.extend(one_way)
            if time.monotonic() - start > self.opts.max_seconds:
                break
        if mode == "throughput":
            return _throughput_record(base, size, p, seconds)
        return _latency_record(base, p, samples, len(seconds))


def run_bench(opts: BenchOptions, *, emit: Callable[[dict[str, Any]], None],
              progress: ProgressFn | None = None) -> None:
    """Measure every cell of ``opts`` and hand each record to ``emit`` as it completes.

    Parameters
    ----------
    opts : BenchOptions
        Scenario, sizes, modes, backends, repetitions and per-cell budget.
    emit : callable
        Called with one record (a dict) per cell: ``status`` is ``"ok"`` (with ``gbps``
        or ``p50_us`` / ``p99_us``), ``"unavailable"`` or ``"error"`` (with ``reason``).
    progress : callable, optional
        ``progress(done, total, label)`` before and after each cell.
    """
    scenario = SCENARIOS[opts.scenario]
    if opts.backends is None:
        opts.backends = list(scenario.backends)
    _Runner(opts, scenario, emit, progress).run()
