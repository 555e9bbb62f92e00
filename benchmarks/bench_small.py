"""Per-message cost of small payloads, and what a polling receiver does to the sender.

Issue 15's acceptance benchmark. One run measures, side by side:

======================================================  ====================  ===========
figure                                                  backends              target
======================================================  ====================  ===========
one process: ``put`` + ``get_nowait`` of a 4 KiB        shm, memory,          shm p50
payload, p50 / p99 per message                          vllm-omni-shm, floor  <= 20 us
two processes: 4 KiB one-way time, one message in       shm, vllm-omni-shm    p50 <= 20 us,
flight, receiver blocking in ``get`` (vLLM-Omni's                             p99 <= 100 us
connector has no blocking get: its receiver polls)
two processes: 8 MiB ``put`` -> consumed, receiver      shm                   polling <=
blocking in ``get`` against polling ``get_nowait`` in                         1.2 x blocking
a tight loop (one-way time, and the sender's ``put``
time alone)
a batch of 16 x 4 KiB per step: ``put_many`` +          shm (memory: one      (issue 15,
``get_many`` against a loop of ``put`` + ``get_nowait``  process)              item 4: does
(``get`` in two processes), per message                                       it pay?)
======================================================  ====================  ===========

What is measured
----------------
- payload: the thinker -> talker dict of ``omnilink._bench.payload`` with a 4 KiB bf16
  hidden state (two tensors: hidden [1, 2048] bf16 and 16 int64 ids, plus shape list,
  ``meta`` dict and a speaker string); 8 MiB for the polling figure.
- one process: one connector pair on one channel; each sample is the time of
  ``put(key, p)`` followed by ``get_nowait(key)`` (the decoded payload is dropped, so
  its block goes back). p50 / p99 over ``--iters`` samples after a warm-up. ``floor``:
  the fewest Python steps over the same libraries that give the receiver typed, shaped
  views of the tensors (``_Floor``: no keys, allocator, lifetime or validation), a lower
  bound for any transport written in Python on this machine.
- two processes (``spawn``): one message in flight. The sender waits for a credit,
  stamps the payload with CLOCK_MONOTONIC and puts it; the receiver takes the time
  when ``get`` (or the polling loop) returned the decoded payload. One-way time =
  receiver's clock - sender's stamp: encode, publication, wake-up, claim and decode
  are inside, one direction only. The sender also records how long ``put`` took.
  The target figure has the sender *sleep* until its credit comes (its CPU idles
  between messages); on a virtual machine an idle vCPU comes back with cold caches and
  the next ``put`` takes 2-3x its hot time. A second row has the sender *watch* for
  its credit (``sched_yield`` between looks), as a stage that computes between
  messages keeps its CPU busy: the same transport, the sender's CPU kept warm.
- batch: a streaming stage sends one window per request for a batch of requests at
  every step. 16 keys of the 4 KiB payload per step. One process: each sample is one
  step, ``put_many`` of the 16 then ``get_many`` of the 16, against ``put`` of each then
  ``get_nowait`` of each; the figure is the step's time / 16. Two processes: one step
  in flight; the sender stamps the payload and sends the step (``put_many``, or 16
  ``put``), the receiver takes the time when it has the whole step (``get_many``, or 16
  blocking ``get``): one-way time of the step / 16, and the sender's send time / 16. A
  third row has the sender ``put_many`` and the receiver ``get`` each key: it reads the
  first payloads while the sender still writes the last, where ``get_many`` waits for all.
- vllm-omni-shm: vLLM-Omni 0.30.0's real ``SharedMemoryConnector`` and its
  ``OmniSerializer`` (msgpack; a fresh ``multiprocessing`` segment per message),
  imported without vLLM: the vLLM modules its imports name (``vllm.outputs``,
  ``vllm_omni.platforms``, ``vllm_omni.config.yaml_util``) are stubbed with empty
  placeholders that the measured code never calls. Its receiver polls ``get``, as
  vLLM-Omni's chunk adapter does. Needs ``pip install --no-deps vllm-omni==0.30.0``
  (``make setup`` does it); skipped with a note otherwise.

Benchmarks are hard: this machine may be shared, and a loaded machine moves these
numbers (p99 first). Run it several times and compare figures of one run only.

Usage::

    python benchmarks/bench_small.py [--iters 5000] [--messages 2000] [--big-messages 40]
                                     [--batches 1000] [--cells one,two,big,batch]
                                     [--json out.jsonl] [--check] [--quick]
    python benchmarks/bench_small.py --cells batch      # the batch figures alone
    python benchmarks/bench_small.py --profile 25 [--iters 20000]   # where the time goes
    python benchmarks/bench_small.py --baseline DIR [--rounds 60]   # against older code:
        # DIR holds an omnilink package, e.g. mkdir DIR && git archive <commit> omnilink | tar -x -C DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
from typing import Any

# The omnilink of this checkout, unless PYTHONPATH names another (``--baseline``'s
# children): appended, so PYTHONPATH still comes first, but before an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

SMALL = 4 << 10
BIG = 8 << 20
#: keys per step of the batch cells (one window per request of a batch)
BATCH = 16
KiB = 1 << 10

TARGETS = {
    "one_process_shm_p50_us": ("<=", 20.0),
    "two_process_shm_p50_us": ("<=", 20.0),
    "two_process_shm_p99_us": ("<=", 100.0),
    "poll_vs_block_ratio": ("<=", 1.2),
}


# ------------------------------------------------------------------ vLLM-Omni's connector
def _load_vllm_omni_shm() -> Any:
    """vLLM-Omni 0.30.0's ``SharedMemoryConnector`` class, loaded without vLLM."""
    import importlib
    import importlib.util

    loaded = sys.modules.get("vllm_omni")
    if loaded is not None:
        root = list(loaded.__path__)[0]
    else:
        spec = importlib.util.find_spec("vllm_omni")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("vllm-omni is not installed: pip install --no-deps vllm-omni==0.30.0")
        root = list(spec.submodule_search_locations)[0]

    def stub(name: str, path: str | None = None, **attrs: Any) -> None:
        if name in sys.modules:
            return
        mod = types.ModuleType(name)
        if path is not None:
            mod.__path__ = [path]  # type: ignore[attr-defined]
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    # Parent packages as namespace stubs: the real submodules load, the package
    # ``__init__`` files (which import vLLM) never run.
    for name in ("vllm_omni", "vllm_omni.distributed", "vllm_omni.distributed.omni_connectors",
                 "vllm_omni.entrypoints", "vllm_omni.config"):
        stub(name, os.path.join(root, *name.split(".")[1:]))
    # Placeholders for what the measured modules import but the measured code never calls.
    stub("vllm", None)
    stub("vllm.outputs", None, CompletionOutput=type("CompletionOutput", (), {}),
         RequestOutput=type("RequestOutput", (), {}))
    stub("vllm_omni.config.yaml_util", None, to_dict=lambda x: x)
    stub("vllm_omni.platforms", None, current_omni_platform=None)
    mod = importlib.import_module("vllm_omni.distributed.omni_connectors.connectors.shm_connector")
    return mod.SharedMemoryConnector


# ------------------------------------------------------------------ backends
class _Omnilink:
    """omnilink's connectors behind one small interface (key-addressed put/get)."""

    def __init__(self, backend: str, channel: str, role: str, **options: Any) -> None:
        import omnilink

        self.conn = omnilink.connect(backend, channel=channel, role=role, timeout=60.0, **options)
        self.WouldBlock = omnilink.WouldBlock

    def put(self, key: str, payload: Any) -> None:
        self.conn.put(key, payload)

    def get(self, key: str) -> Any:
        return self.conn.get(key)

    def poll(self, key: str) -> Any:
        get_nowait, would_block = self.conn.get_nowait, self.WouldBlock
        while True:
            try:
                return get_nowait(key)
            except would_block:
                pass

    def try_get(self, key: str) -> Any:
        return self.conn.get_nowait(key)

    def close(self) -> None:
        self.conn.close()


class _VllmOmni:
    """vLLM-Omni's ``SharedMemoryConnector``: ``put(from, to, key, data)``, polled ``get``."""

    def __init__(self, channel: str, role: str) -> None:
        cls = _load_vllm_omni_shm()
        self.conn = cls({"stage_id": 0})
        self.prefix = "olb" + channel.replace("/", "_") + "_"

    def put(self, key: str, payload: Any) -> None:
        ok, _size, _meta = self.conn.put("0", "1", self.prefix + key, payload)
        if not ok:
            raise RuntimeError("vLLM-Omni SharedMemoryConnector.put failed")

    def poll(self, key: str) -> Any:
        get = self.conn.get
        k = self.prefix + key
        while True:
            got = get("0", "1", k)
            if got is not None:
                return got[0]

    get = poll

    def try_get(self, key: str) -> Any:
        got = self.conn.get("0", "1", self.prefix + key)
        if got is None:
            raise RuntimeError(f"vLLM-Omni: {key} not there right after put")
        return got[0]

    def close(self) -> None:
        self.conn.close()


class _Floor:
    """The fewest Python steps that move the payload between two ends of one process,
    over the same libraries: a msgspec header of ``(key, dtype, shape, offset, count)``
    per tensor plus the other items, one ``ctypes.memmove`` per tensor into a mapping,
    a POSIX semaphore post; then acquire, header decode, one typed ``torch.frombuffer``
    (and a view to its shape) per tensor. No keys, allocator, block lifetime, validation
    or security checks: a lower bound, not a competitor (one process only)."""

    def __init__(self) -> None:
        import ctypes
        import mmap

        import msgspec
        import posix_ipc
        import torch

        self.mm = mmap.mmap(-1, 1 << 20)
        probe = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(probe)
        del probe
        self.memmove = ctypes.memmove
        self.sem = posix_ipc.Semaphore(None, posix_ipc.O_CREX, initial_value=0)
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.tensor, self.frombuffer = torch.Tensor, torch.frombuffer
        self.dtypes = [torch.bfloat16, torch.int64, torch.float32]
        self.codes = {d: i for i, d in enumerate(self.dtypes)}
        self.header = b""

    def put(self, key: str, payload: dict[str, Any]) -> None:
        off = 0
        tensors, rest = [], {}
        for k, v in payload.items():
            if type(v) is self.tensor:
                n = v.nbytes
                self.memmove(self.base + off, v.data_ptr(), n)
                tensors.append((k, self.codes[v.dtype], tuple(v.shape), off, v.numel()))
                off += (n + 63) & ~63
            else:
                rest[k] = v
        self.header = self.enc.encode((tensors, rest))
        self.sem.release()

    def try_get(self, key: str) -> Any:
        self.sem.acquire(0)
        tensors, rest = self.dec.decode(self.header)
        mm, frombuffer, dtypes = self.mm, self.frombuffer, self.dtypes
        for k, code, shape, off, count in tensors:
            t = frombuffer(mm, dtype=dtypes[code], count=count, offset=off)
            rest[k] = t.view(shape) if len(shape) != 1 else t
        return rest

    def close(self) -> None:
        self.sem.unlink()
        self.sem.close()


def _open(backend: str, channel: str, role: str) -> Any:
    if backend == "vllm-omni-shm":
        return _VllmOmni(channel, role)
    return _Omnilink(backend, channel, role)


def _pcts(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3,
        "mean_us": statistics.fmean(s) / 1e3,
        "samples": len(s),
    }


# ------------------------------------------------------------------ one process
def one_process(backend: str, iters: int, warmup: int) -> dict[str, Any]:
    """``put`` + ``get_nowait`` of the 4 KiB payload in one process, per message."""
    from omnilink._bench.payload import check_payload, make_payload

    chan = f"bench-small-{os.getpid()}-{backend}"
    if backend == "vllm-omni-shm":
        tx = rx = _VllmOmni(chan, "dual")
    elif backend == "floor":
        tx = rx = _Floor()
    else:
        tx = rx = _Omnilink(backend, chan, "dual")
    payload = make_payload(SMALL)
    clock = time.perf_counter_ns
    samples = []
    try:
        got = None
        for i in range(warmup + iters):
            key = f"k{i}"
            payload["ids.output"][0] = i
            t0 = clock()
            tx.put(key, payload)
            got = rx.try_get(key)
            t1 = clock()
            if i >= warmup:
                samples.append(t1 - t0)
            if i % 997 == 0:
                check_payload(got, i, SMALL)
            got = None
    finally:
        tx.close()
    return _pcts(samples)


def one_process_batch(backend: str, steps: int, warmup: int, how: str) -> dict[str, Any]:
    """One step of ``BATCH`` 4 KiB payloads in one process: ``put_many`` + ``get_many``
    (``how="batch"``) or ``put`` + ``get_nowait`` of each (``"loop"``); per message."""
    import omnilink
    from omnilink._bench.payload import check_payload, make_payload

    conn = omnilink.connect(backend, channel=f"bench-small-b-{os.getpid()}-{backend}-{how}", role="dual",
                            timeout=60.0)
    payload = make_payload(SMALL)
    clock = time.perf_counter_ns
    samples = []
    try:
        put, get_nowait, put_many, get_many = conn.put, conn.get_nowait, conn.put_many, conn.get_many
        for s in range(warmup + steps):
            keys = [f"s{s}-r{r}" for r in range(BATCH)]
            payload["ids.output"][0] = s
            items = dict.fromkeys(keys, payload)
            t0 = clock()
            if how == "batch":
                put_many(items)
                got = get_many(keys)
            else:
                for k in keys:
                    put(k, payload)
                got = {k: get_nowait(k) for k in keys}
            t1 = clock()
            if s >= warmup:
                samples.append((t1 - t0) / BATCH)
            if s % 97 == 0:
                for g in got.values():
                    check_payload(g, s, SMALL)
            got = None
    finally:
        conn.close()
    return _pcts(samples)


def profile_batch(steps: int, top: int) -> str:
    """cProfile of the shm one-process batch loop (``put_many`` + ``get_many`` of
    ``BATCH`` keys): Python calls per message and the ``top`` functions, as text."""
    import cProfile

    import omnilink
    from omnilink._bench.payload import make_payload

    conn = omnilink.connect("shm", channel=f"bench-small-bprof-{os.getpid()}", role="dual", timeout=60.0)
    payload = make_payload(SMALL)
    try:
        for s in range(max(50, steps // 10)):
            keys = [f"w{s}-{r}" for r in range(BATCH)]
            conn.put_many(dict.fromkeys(keys, payload))
            conn.get_many(keys)
        prof = cProfile.Profile()
        prof.enable()
        for s in range(steps):
            keys = [f"p{s}-{r}" for r in range(BATCH)]
            conn.put_many(dict.fromkeys(keys, payload))
            conn.get_many(keys)
        prof.disable()
    finally:
        conn.close()
    return _profile_text(prof, steps * BATCH, top)


def _profile_text(prof: Any, messages: int, top: int) -> str:
    import io
    import pstats

    stats = pstats.Stats(prof)
    calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return f"Python calls per message: {calls / messages:.1f}\n" + "\n".join(lines[start:])


def profile_one_process(iters: int, top: int) -> str:
    """cProfile of the shm one-process loop (``put`` + ``get_nowait``, payload dropped):
    Python calls per message and the ``top`` functions by own time, as text."""
    import cProfile

    from omnilink._bench.payload import make_payload

    rx = tx = _Omnilink("shm", f"bench-small-prof-{os.getpid()}", "dual")
    payload = make_payload(SMALL)
    put, get = tx.put, rx.try_get
    try:
        for i in range(max(200, iters // 10)):
            put(f"w{i}", payload)
            get(f"w{i}")
        prof = cProfile.Profile()
        prof.enable()
        for i in range(iters):
            put(f"p{i}", payload)
            get(f"p{i}")
        prof.disable()
    finally:
        tx.close()
    return _profile_text(prof, iters, top)


def _burst_child() -> None:
    """``--burst-child``: a shm one-process loop driven over stdin/stdout by
    ``interleaved``; for each line ``N`` it times N ``put`` + ``get_nowait`` and prints
    their p50 in ns. Imports whichever omnilink ``PYTHONPATH`` names."""
    import omnilink
    from omnilink._bench.payload import make_payload

    conn = omnilink.connect("shm", channel=f"bench-small-ab-{os.getpid()}", role="dual", timeout=60.0)
    payload = make_payload(SMALL)
    put, get = conn.put, conn.get_nowait
    clock = time.perf_counter_ns
    n = 0
    try:
        for i in range(2000):
            put(f"w{i}", payload)
            get(f"w{i}")
        print(omnilink.__file__, flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            samples = []
            for _ in range(int(line)):
                key = f"b{n}"
                n += 1
                t0 = clock()
                put(key, payload)
                get(key)
                samples.append(clock() - t0)
            samples.sort()
            print(samples[len(samples) // 2], flush=True)
    finally:
        conn.close()


def interleaved(baseline: str, rounds: int, burst: int) -> dict[str, Any]:
    """The one-process shm figure of this checkout against the omnilink at ``baseline``
    (a directory holding an ``omnilink`` package, e.g. ``git archive <commit> omnilink``
    unpacked), measured in alternating bursts of ``burst`` messages, ``rounds`` each: a
    loaded machine slows both alike, so their ratio means something where two separate
    runs minutes apart do not. Returns per-side burst p50s (min, 10th percentile,
    median) and the ratio of the medians."""
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"this": here, "baseline": os.path.abspath(baseline)}
    procs = {}
    for name, path in sides.items():
        # The chosen package first; what PYTHONPATH held (dependencies installed with
        # --target, say) after it.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p))
        procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--burst-child"], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    out: dict[str, Any] = {}
    try:
        got: dict[str, list[float]] = {name: [] for name in procs}
        for name, pr in procs.items():
            out[f"{name}_module"] = pr.stdout.readline().strip()  # type: ignore[union-attr]
        for r in range(rounds):
            for name in (("this", "baseline") if r % 2 else ("baseline", "this")):
                pr = procs[name]
                pr.stdin.write(f"{burst}\n")  # type: ignore[union-attr]
                pr.stdin.flush()  # type: ignore[union-attr]
                got[name].append(int(pr.stdout.readline()) / 1e3)  # type: ignore[union-attr]
    finally:
        for pr in procs.values():
            try:
                pr.stdin.write("\n")  # type: ignore[union-attr]
                pr.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            pr.wait(60)
    for name, vals in got.items():
        vals.sort()
        out[name] = {"min_us": vals[0], "p10_us": vals[len(vals) // 10], "median_us": statistics.median(vals),
                     "bursts": len(vals)}
    out["ratio_median"] = out["this"]["median_us"] / out["baseline"]["median_us"]
    out["ratio_p10"] = out["this"]["p10_us"] / out["baseline"]["p10_us"]
    return out


# ------------------------------------------------------------------ two processes
def _send_cell(backend: str, chan: str, size: int, n: int, mode: str, credits: Any, ready: Any, ctl: Any) -> None:
    from omnilink._bench.payload import make_payload, now_ns

    if mode.startswith("batch"):
        return _send_batches(backend, chan, n, mode, credits, ready, ctl)
    hot = mode.endswith("-hot")
    tx = _open(backend, chan, "sender")
    try:
        payload = make_payload(size)
        if not ready.wait(120):
            raise RuntimeError("the receiver never opened")
        put_ns = []
        for j in range(n):
            if hot:  # watch for the credit: this CPU never idles between messages
                while not credits.acquire(False):
                    os.sched_yield()
            else:  # sleep until the credit comes (the CPU idles: caches go cold)
                credits.acquire()
            payload["ids.output"][0] = j
            t0 = now_ns()
            payload["meta"]["sent_ns"] = t0
            tx.put(f"m{j}", payload)
            put_ns.append(now_ns() - t0)
        ctl.send(("ok", put_ns))
        ctl.recv()  # stay open until the receiver has everything
    finally:
        tx.close()


def _send_batches(backend: str, chan: str, n: int, mode: str, credits: Any, ready: Any, ctl: Any) -> None:
    """``n`` steps of ``BATCH`` 4 KiB payloads, one step in flight: ``put_many``
    (``mode`` "batch" or "batch-put") or a ``put`` of each ("batch-loop"); the sender's
    CPU idles between steps (it sleeps until its credit comes)."""
    from omnilink._bench.payload import make_payload, now_ns

    tx = _Omnilink(backend, chan, "sender")
    try:
        payload = make_payload(SMALL)
        if not ready.wait(120):
            raise RuntimeError("the receiver never opened")
        put, put_many = tx.conn.put, tx.conn.put_many
        put_ns = []
        for j in range(n):
            credits.acquire()
            keys = [f"s{j}-r{r}" for r in range(BATCH)]
            payload["ids.output"][0] = j
            t0 = now_ns()
            payload["meta"]["sent_ns"] = t0
            if mode != "batch-loop":
                put_many(dict.fromkeys(keys, payload))
            else:
                for k in keys:
                    put(k, payload)
            put_ns.append((now_ns() - t0) // BATCH)
        ctl.send(("ok", put_ns))
        ctl.recv()  # stay open until the receiver has everything
    finally:
        tx.close()


def _recv_batches(backend: str, chan: str, n: int, mode: str, credits: Any, ready: Any, ctl: Any) -> None:
    """Receive ``n`` steps: ``get_many`` of the step's keys (``mode="batch"``), or a
    blocking ``get`` of each; record the step's one-way time / ``BATCH``."""
    from omnilink._bench.payload import check_payload, now_ns

    rx = _Omnilink(backend, chan, "receiver")
    try:
        get, get_many = rx.conn.get, rx.conn.get_many
        gc.disable()
        one_way = []
        ready.set()
        for j in range(n):
            keys = [f"s{j}-r{r}" for r in range(BATCH)]
            got = get_many(keys) if mode == "batch" else {k: get(k) for k in keys}
            t = now_ns()
            one_way.append((t - got[keys[0]]["meta"]["sent_ns"]) // BATCH)
            if j % 97 == 0:
                for p in got.values():
                    check_payload(p, j, SMALL)
            del got
            credits.release()
        gc.enable()
        ctl.send(("ok", one_way))
    finally:
        rx.close()


def _recv_cell(backend: str, chan: str, size: int, n: int, mode: str, credits: Any, ready: Any, ctl: Any) -> None:
    from omnilink._bench.payload import check_payload, now_ns

    if mode.startswith("batch"):
        return _recv_batches(backend, chan, n, mode, credits, ready, ctl)
    rx = _open(backend, chan, "receiver")
    try:
        recv = rx.poll if mode == "poll" else rx.get
        gc.disable()  # a collection inside a timed window measures the collector
        one_way = []
        ready.set()
        for j in range(n):
            p = recv(f"m{j}")
            t = now_ns()
            one_way.append(t - p["meta"]["sent_ns"])
            if j % 97 == 0:
                check_payload(p, j, size)
            del p
            credits.release()
        gc.enable()
        ctl.send(("ok", one_way))
    finally:
        rx.close()


def _worker(role: str, ctl: Any, credits: Any, ready: Any) -> None:
    """A sender or receiver process that runs the two-process cells the parent sends
    (one process each for the whole run: spawning one per cell costs seconds)."""
    while True:
        cell = ctl.recv()
        if cell is None:
            return
        backend, chan, size, n, mode = cell
        try:
            if role == "sender":
                _send_cell(backend, chan, size, n, mode, credits, ready, ctl)
            else:
                _recv_cell(backend, chan, size, n, mode, credits, ready, ctl)
        except BaseException as exc:  # reported to the parent, which fails the cell
            ctl.send(("error", f"{type(exc).__name__}: {exc}"))


class _Pair:
    """The two worker processes (``spawn``) and their control pipes."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.credits = ctx.Semaphore(1)
        self.ready = ctx.Event()
        self.tx_ctl, tx_child = ctx.Pipe()
        self.rx_ctl, rx_child = ctx.Pipe()
        self.procs = [ctx.Process(target=_worker, args=(role, child, self.credits, self.ready), daemon=True)
                      for role, child in (("sender", tx_child), ("receiver", rx_child))]
        for p in self.procs:
            p.start()

    def run(self, backend: str, size: int, n: int, mode: str) -> tuple[list[int], list[int]]:
        chan = f"bench-small-2p-{os.getpid()}-{backend}-{mode}-{size}"
        self.ready.clear()
        cell = (backend, chan, size, n, mode)
        self.rx_ctl.send(cell)
        self.tx_ctl.send(cell)
        limit = 300.0
        if not self.rx_ctl.poll(limit):
            raise RuntimeError(f"{backend} {mode}: the receiver did not finish in {limit} s")
        r_status, one_way = self.rx_ctl.recv()
        if not self.tx_ctl.poll(limit):
            raise RuntimeError(f"{backend} {mode}: the sender did not report")
        s_status, put_ns = self.tx_ctl.recv()
        if s_status == "ok":
            self.tx_ctl.send("close")
        if r_status != "ok" or s_status != "ok":
            raise RuntimeError(f"{backend} {mode}: receiver {r_status} {one_way if r_status != 'ok' else ''} "
                               f"sender {s_status} {put_ns if s_status != 'ok' else ''}")
        return one_way, put_ns

    def close(self) -> None:
        for ctl in (self.tx_ctl, self.rx_ctl):
            try:
                ctl.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def two_process(pair: _Pair, backend: str, size: int, n: int, mode: str, warmup: int) -> dict[str, Any]:
    """One-way time of ``n`` messages of ``size`` bytes, one in flight."""
    one_way, put_ns = pair.run(backend, size, n + warmup, mode)
    res = _pcts(one_way[warmup:])
    put = _pcts(put_ns[warmup:])
    res["put_p50_us"] = put["p50_us"]
    res["put_mean_us"] = put["mean_us"]
    return res


# ------------------------------------------------------------------ main
def _meets(name: str, value: float) -> bool:
    op, bound = TARGETS[name]
    return value >= bound if op == ">=" else value <= bound


def _load() -> str:
    la = os.getloadavg()
    return f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=5000, help="one-process samples per backend (default 5000)")
    ap.add_argument("--messages", type=int, default=2000, help="two-process 4 KiB messages (default 2000)")
    ap.add_argument("--big-messages", type=int, default=40, help="two-process 8 MiB messages per mode (default 40)")
    ap.add_argument("--batches", type=int, default=1000,
                    help=f"steps of {BATCH} x 4 KiB per batch cell (default 1000)")
    ap.add_argument("--backends", default="shm,memory,vllm-omni-shm,floor",
                    help="comma-separated (default all four; floor: the fewest Python steps over the same "
                         "libraries, one process only)")
    ap.add_argument("--cells", default="one,two,big,batch",
                    help="which parts to run: one (one process), two (two processes, 4 KiB), big (8 MiB "
                         f"polling against blocking), batch ({BATCH} x 4 KiB per step, put_many + get_many "
                         "against a loop); default all")
    ap.add_argument("--quick", action="store_true", help="a few messages of each cell (for the test suite)")
    ap.add_argument("--json", metavar="PATH", help="append the result as one JSON line to PATH")
    ap.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    ap.add_argument("--profile", type=int, metavar="N", default=0,
                    help="only profile the shm one-process loop (cProfile) and print its top N lines; with "
                         "--cells batch, the batch loop (put_many + get_many)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="only compare the shm one-process figure with the omnilink package under DIR, in "
                         "alternating bursts (see interleaved())")
    ap.add_argument("--rounds", type=int, default=60, help="bursts per side for --baseline (default 60)")
    ap.add_argument("--burst-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.burst_child:
        _burst_child()
        return 0
    if args.profile:
        if args.cells == "batch":
            print(profile_batch(max(1, args.iters // BATCH), args.profile))
        else:
            print(profile_one_process(args.iters, args.profile))
        return 0
    if args.baseline:
        ab = interleaved(args.baseline, args.rounds, 300)
        print(f"load average {_load()}; one process, shm put + get_nowait 4 KiB, p50 of bursts of 300 "
              f"messages, {args.rounds} alternating bursts each")
        for name in ("this", "baseline"):
            r = ab[name]
            print(f"{name:>8} ({ab[name + '_module']}): min {r['min_us']:.1f} us, 10th percentile "
                  f"{r['p10_us']:.1f}, median {r['median_us']:.1f}")
        print(f"this / baseline: {ab['ratio_median']:.2f} (medians), {ab['ratio_p10']:.2f} (10th percentiles)")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"benchmark": "bench_small_interleaved", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    "load_average": _load(), "args": vars(args), "result": ab}) + "\n")
        return 0
    if args.quick:
        args.iters, args.messages, args.big_messages, args.batches = 200, 50, 4, 20
    warm1 = max(50, args.iters // 10)
    warm2 = max(10, args.messages // 10)
    backends = [b for b in args.backends.split(",") if b]
    notes: list[str] = []
    if "vllm-omni-shm" in backends:
        try:
            _load_vllm_omni_shm()
        except ImportError as exc:
            backends.remove("vllm-omni-shm")
            notes.append(f"vllm-omni-shm skipped: {exc}")

    from omnilink._bench.machine import machine_record

    info = machine_record()
    load_before = _load()
    cells = set(args.cells.split(","))
    res: dict[str, Any] = {"one_process": {}, "two_process": {}, "two_process_hot": {}, "big": {}, "batch": {}}
    warm_b = max(10, args.batches // 10)
    batch_backends = [b for b in ("shm", "memory") if b in backends] if "batch" in cells else []
    for b in batch_backends:
        for how in ("batch", "loop"):
            res["batch"][f"one_process_{b}_{how}"] = one_process_batch(b, args.batches, warm_b, how)
            print(f"one process, {BATCH} x 4 KiB per step, {b} {how}: {res['batch'][f'one_process_{b}_{how}']}",
                  file=sys.stderr)
    for b in backends if "one" in cells else ():
        res["one_process"][b] = one_process(b, args.iters, warm1)
        print(f"one process, {b}: {res['one_process'][b]}", file=sys.stderr)
    pair = _Pair()
    try:
        for b in backends if "two" in cells else ():
            if b in ("memory", "floor"):
                continue  # in-process only
            res["two_process"][b] = two_process(pair, b, SMALL, args.messages, "block", warm2)
            print(f"two processes 4 KiB, {b}: {res['two_process'][b]}", file=sys.stderr)
            res["two_process_hot"][b] = two_process(pair, b, SMALL, args.messages, "block-hot", warm2)
            print(f"two processes 4 KiB, hot sender, {b}: {res['two_process_hot'][b]}", file=sys.stderr)
        if "shm" in batch_backends:
            for how, mode in (("batch", "batch"), ("loop", "batch-loop"), ("put_many", "batch-put")):
                res["batch"][f"two_process_shm_{how}"] = two_process(pair, "shm", SMALL, args.batches, mode, warm_b)
                print(f"two processes, {BATCH} x 4 KiB per step, shm {how}: "
                      f"{res['batch'][f'two_process_shm_{how}']}", file=sys.stderr)
        if "shm" in backends and "big" in cells:
            for mode in ("block", "poll"):
                res["big"][mode] = two_process(pair, "shm", BIG, args.big_messages, mode, 2)
                print(f"two processes 8 MiB, shm {mode}: {res['big'][mode]}", file=sys.stderr)
    finally:
        pair.close()
    load_after = _load()

    figures: dict[str, float] = {}
    if "shm" in res["one_process"]:
        figures["one_process_shm_p50_us"] = res["one_process"]["shm"]["p50_us"]
    if "shm" in res["two_process"]:
        figures["two_process_shm_p50_us"] = res["two_process"]["shm"]["p50_us"]
        figures["two_process_shm_p99_us"] = res["two_process"]["shm"]["p99_us"]
    if "shm" in res["two_process_hot"]:
        figures["two_process_hot_shm_p50_us"] = res["two_process_hot"]["shm"]["p50_us"]
        figures["two_process_hot_shm_p99_us"] = res["two_process_hot"]["shm"]["p99_us"]
    bres = res["batch"]
    for where in ("one_process_shm", "one_process_memory", "two_process_shm"):
        if f"{where}_batch" in bres:
            figures[f"batch_{where}_p50_us"] = bres[f"{where}_batch"]["p50_us"]
            figures[f"batch_{where}_loop_p50_us"] = bres[f"{where}_loop"]["p50_us"]
            figures[f"batch_{where}_ratio"] = bres[f"{where}_batch"]["p50_us"] / bres[f"{where}_loop"]["p50_us"]
    if res["big"]:
        figures["poll_vs_block_ratio"] = res["big"]["poll"]["p50_us"] / res["big"]["block"]["p50_us"]
        figures["poll_vs_block_put_ratio"] = res["big"]["poll"]["put_p50_us"] / res["big"]["block"]["put_p50_us"]

    print(f"machine: {info.get('cpu')}, {info.get('cores')} cores; load average {load_before} before, "
          f"{load_after} after")
    print("benchmarks are hard: a shared or loaded machine moves these numbers; repeat them.\n")
    print("| measurement (us per message)             | " + " | ".join(f"{b:>14}" for b in backends)
          + " | shm ratio |")
    print("|" + "-" * 43 + "|" + "|".join("-" * 16 for _ in backends) + "|-----------|")

    def row(label: str, table: dict[str, Any], field: str) -> None:
        cells = []
        for b in backends:
            v = table.get(b, {}).get(field)
            cells.append(f"{v:14.1f}" if v is not None else f"{'n/a':>14}")
        others = [table[b][field] for b in backends if b != "shm" and b in table]
        ratio = ""
        if "shm" in table and others:
            ratio = " ".join(f"{table['shm'][field] / o:.2f}" for o in others)
        print(f"| {label:41} | " + " | ".join(cells) + f" | {ratio:>9} |")

    row("1 process put+get_nowait 4 KiB, p50", res["one_process"], "p50_us")
    row("1 process put+get_nowait 4 KiB, p99", res["one_process"], "p99_us")
    row("2 processes one-way 4 KiB, p50", res["two_process"], "p50_us")
    row("2 processes one-way 4 KiB, p99", res["two_process"], "p99_us")
    row("same, sender hot between messages, p50", res["two_process_hot"], "p50_us")
    row("same, sender hot between messages, p99", res["two_process_hot"], "p99_us")
    if res["big"]:
        print()
        print("| 8 MiB put -> consumed, shm, 2 processes | receiver blocking get | receiver polling get_nowait | "
              "poll / block |")
        print("|---|---:|---:|---:|")
        for label, field in (("one-way p50 (us)", "p50_us"), ("one-way p99 (us)", "p99_us"),
                             ("sender's put p50 (us)", "put_p50_us")):
            b, p = res["big"]["block"][field], res["big"]["poll"][field]
            print(f"| {label} | {b:.1f} | {p:.1f} | {p / b:.2f} |")
    if bres:
        print()
        print(f"| {BATCH} x 4 KiB per step, us per message | put_many + get_many | loop of put + get_nowait "
              "(2 processes: get) | batch / loop |")
        print("|---|---:|---:|---:|")
        for label, where, field in (
            ("1 process shm, p50", "one_process_shm", "p50_us"),
            ("1 process shm, p99", "one_process_shm", "p99_us"),
            ("1 process memory, p50", "one_process_memory", "p50_us"),
            ("2 processes shm one-way, p50", "two_process_shm", "p50_us"),
            ("2 processes shm one-way, p99", "two_process_shm", "p99_us"),
            ("2 processes shm, sender's send, p50", "two_process_shm", "put_p50_us"),
        ):
            if f"{where}_batch" in bres:
                bv, lv = bres[f"{where}_batch"][field], bres[f"{where}_loop"][field]
                print(f"| {label} | {bv:.1f} | {lv:.1f} | {bv / lv:.2f} |")
        if "two_process_shm_put_many" in bres:
            mixed, lv = bres["two_process_shm_put_many"], bres["two_process_shm_loop"]
            print(f"| 2 processes shm one-way p50, put_many + a get of each | {mixed['p50_us']:.1f} | "
                  f"{lv['p50_us']:.1f} | {mixed['p50_us'] / lv['p50_us']:.2f} |")
    print()
    met_all = True
    for key, (op, bound) in TARGETS.items():
        if key in figures:
            ok = _meets(key, figures[key])
            met_all &= ok
            print(f"target {key} {op} {bound:g}: {figures[key]:.2f} {'met' if ok else 'NOT met'}")
    for note in notes:
        print("note:", note)

    if args.json:
        record = {
            "benchmark": "bench_small",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": info,
            "load_average": {"before": load_before, "after": load_after},
            "args": vars(args),
            "figures": figures,
            "targets": {k: {"op": op, "bound": b, "met": _meets(k, figures[k])}
                        for k, (op, b) in TARGETS.items() if k in figures},
            "results": res,
            "notes": notes,
        }
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 1 if args.check and not met_all else 0


if __name__ == "__main__":
    sys.exit(main())
