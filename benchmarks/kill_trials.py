"""SIGKILL trials: peers that die at a random point and come back are taken back.

Three cases, each repeated ``--trials`` times (20 for the figures in the CHANGELOG; the
default test suite runs 1 of each through ``tests/integration/test_kill_recovery.py``):

``zmq-before``
    A sender streams puts to a receiver process; the receiver is SIGKILLed at a random
    moment and a new receiver starts on the same ipc endpoint at once (well within
    ``peer_timeout``). Recovered when no put raised ``PeerLostError``, every put that
    returned after the new receiver was up is delivered by it bit for bit, and a probe
    put afterwards is too.
``zmq-after``
    The same, but the new receiver starts only after ``peer_timeout`` has passed; puts
    made during the gap may raise ``PeerLostError`` (they are told the receiver is
    gone), and the sender must take the new receiver back: the probe put and every put
    that returned after it was up are delivered.
``shm-replace``
    A receiver consumes a sender process's stream; the sender is SIGKILLed at a random
    moment (the receiver's pending ``get`` then raises ``PeerLostError``), and a new
    sender process joins the channel. Recovered when the receiver's first ``get`` of
    the new sender's key succeeds (no spurious ``PeerLostError``).

After each trial every process is gone and ``omnilink gc`` (``collect_garbage`` and
``collect_ipc_garbage``) must leave no ``/dev/shm`` entry of the run's prefix and no
file in its ipc directory: the "leftovers" column.

Usage::

    python benchmarks/kill_trials.py --trials 20 [--cases zmq-before,zmq-after,shm-replace] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

CTX = mp.get_context("spawn")
WAIT = 30.0
CASES = ("zmq-before", "zmq-after", "shm-replace")


def payload(i: int, nbytes: int = 1 << 16) -> dict[str, Any]:
    import numpy as np

    data = np.random.default_rng(1000 + i).integers(0, 256, nbytes, dtype=np.uint8)
    return {"data": data, "meta": {"i": i}}


def digest(p: dict[str, Any]) -> str:
    return hashlib.sha256(p["data"].tobytes()).hexdigest()


# ------------------------------------------------------------------ child processes
def zmq_receiver(channel: str, ipc_dir: str, peer_timeout: float, ready: Any, cmds: Any, out: Any) -> None:
    """Bind, signal ready; get each key named on ``cmds`` and report its digest."""
    import omnilink

    rx = omnilink.connect("zmq", channel=channel, role="receiver", ipc_dir=ipc_dir, peer_timeout=peer_timeout)
    ready.set()
    while True:
        key = cmds.get()
        if key is None:
            break
        try:
            out.put(("got", key, digest(rx.get(key, timeout=WAIT))))
        except Exception as exc:  # reported to the parent
            out.put(("error", key, f"{type(exc).__name__}: {exc}"))
    rx.close()


def shm_sender(channel: str, first: int, count: int, ready: Any, out: Any) -> None:
    """Join the channel, signal ready, put keys k<first>.. (a few ms apart)."""
    import omnilink

    tx = omnilink.connect("shm", channel=channel, role="sender", arena_bytes=8 << 20)
    ready.set()
    for i in range(first, first + count):
        tx.put(f"k{i}", payload(i, 4096), timeout=WAIT)
        out.put(i)
        time.sleep(0.002)
    tx.close()


def _start(target: Any, *args: Any) -> Any:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _kill(p: Any) -> None:
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(WAIT)


# ------------------------------------------------------------------------- trials
def zmq_trial(trial: int, after: bool, ipc_dir: str, rng: random.Random) -> dict[str, Any]:
    import omnilink

    peer_timeout = 1.0 if after else 15.0
    channel = f"kill/zmq-{trial}-{secrets.token_hex(3)}"
    ready1, cmds1, out1 = CTX.Event(), CTX.Queue(), CTX.Queue()
    r1 = _start(zmq_receiver, channel, ipc_dir, peer_timeout, ready1, cmds1, out1)
    r2 = None
    problems: list[str] = []
    try:
        if not ready1.wait(WAIT):
            return {"recovered": False, "why": "first receiver did not start"}
        tx = omnilink.connect("zmq", channel=channel, role="sender", ipc_dir=ipc_dir, peer_timeout=peer_timeout)
        records: list[tuple[int, str, float]] = []
        stop = threading.Event()

        def stream() -> None:
            i = 0
            while not stop.is_set():
                try:
                    tx.put(f"k{i}", payload(i), timeout=WAIT)
                    records.append((i, "ok", time.monotonic()))
                except omnilink.PeerLostError:
                    records.append((i, "PeerLostError", time.monotonic()))
                except Exception as exc:  # anything else is a failure of the trial
                    records.append((i, f"{type(exc).__name__}: {exc}", time.monotonic()))
                i += 1
                time.sleep(0.001)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        # r1 consumes a few keys, then dies at a random point of the stream.
        for i in range(3):
            cmds1.put(f"k{i}")
        time.sleep(rng.uniform(0.05, 0.5))
        _kill(r1)
        if after:
            time.sleep(peer_timeout + 1.0)
        ready2, cmds2, out2 = CTX.Event(), CTX.Queue(), CTX.Queue()
        r2 = _start(zmq_receiver, channel, ipc_dir, peer_timeout, ready2, cmds2, out2)
        if not ready2.wait(WAIT):
            return {"recovered": False, "why": "second receiver did not start"}
        up = time.monotonic()
        # Let the stream run against the new receiver, then probe.
        deadline = time.monotonic() + WAIT
        while not any(s == "ok" and ts > up for _, s, ts in list(records)) and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        t.join(WAIT)
        try:
            tx.put("probe", payload(-1), timeout=WAIT)
        except Exception as exc:
            problems.append(f"probe put raised {type(exc).__name__}: {exc}")
        expect = {f"k{i}": digest(payload(i)) for i, s, ts in records if s == "ok" and ts > up}
        if not problems:
            expect["probe"] = digest(payload(-1))
        if not expect:
            problems.append("no put succeeded after the new receiver was up")
        for key in expect:
            cmds2.put(key)
        for key in expect:
            try:
                kind, got_key, dig = out2.get(timeout=WAIT)
            except queue.Empty:
                problems.append(f"the new receiver did not deliver {key}")
                break
            if kind != "got" or dig != expect[got_key]:
                problems.append(f"{got_key}: {kind} {dig}")
        bad = [(i, s) for i, s, _ in records if s not in ("ok", "PeerLostError")]
        lost = [i for i, s, _ in records if s == "PeerLostError"]
        if bad:
            problems.append(f"puts raised unexpected errors: {bad[:3]}")
        if lost and not after:
            problems.append(f"{len(lost)} put(s) raised PeerLostError although the receiver came back in time")
        tx.close()
        return {
            "recovered": not problems,
            "why": "; ".join(problems),
            "puts": len(records),
            "peer_lost": len(lost),
            "delivered_after_restart": len(expect),
        }
    finally:
        _kill(r1)
        if r2 is not None:
            _kill(r2)  # SIGKILL the second one too: gc must clean both deaths up


def shm_trial(trial: int, rng: random.Random) -> dict[str, Any]:
    import omnilink

    channel = f"kill/shm-{trial}-{secrets.token_hex(3)}"
    problems: list[str] = []
    rx = omnilink.connect("shm", channel=channel, role="receiver")
    s1 = s2 = None
    try:
        ready1, out1 = CTX.Event(), CTX.Queue()
        s1 = _start(shm_sender, channel, 0, 100000, ready1, out1)
        if not ready1.wait(WAIT):
            return {"recovered": False, "why": "first sender did not start"}
        killer = threading.Timer(rng.uniform(0.05, 0.5), _kill, (s1,))
        killer.start()
        got = 0
        # Consume the stream until the sender's death is reported.
        while True:
            try:
                p = rx.get(f"k{got}", timeout=WAIT)
            except omnilink.PeerLostError:
                break
            except omnilink.TransferTimeout:
                problems.append("a get across the sender's death timed out instead of PeerLostError")
                break
            if digest(p) != digest(payload(got, 4096)):
                problems.append(f"k{got} arrived corrupted")
            del p
            got += 1
        killer.join()
        ready2, out2 = CTX.Event(), CTX.Queue()
        s2 = _start(shm_sender, channel, 10**6, 1, ready2, out2)
        if not ready2.wait(WAIT):
            return {"recovered": False, "why": "second sender did not start"}
        try:
            p = rx.get(f"k{10**6}", timeout=WAIT)  # the first get after the replacement
            if digest(p) != digest(payload(10**6, 4096)):
                problems.append("the new sender's payload arrived corrupted")
            del p
        except Exception as exc:
            problems.append(f"first get after the replacement raised {type(exc).__name__}: {exc}")
        s2.join(WAIT)
        return {"recovered": not problems, "why": "; ".join(problems), "consumed_before_kill": got}
    finally:
        rx.close()
        for p in (s1, s2):
            if p is not None:
                _kill(p)


def leftovers(prefix: str, ipc_dir: str) -> list[str]:
    """Run omnilink gc for this prefix and directory; return what is still there."""
    from omnilink.connectors.shm import collect_garbage
    from omnilink.connectors.zmq import collect_ipc_garbage

    collect_garbage(prefix=prefix)
    collect_ipc_garbage(ipc_dir=ipc_dir, prefix=prefix)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith("sem." + prefix)]
    return left + os.listdir(ipc_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {', '.join(CASES)}")
    prefix = f"olkill{os.getpid()}"
    os.environ["OMNILINK_SHM_PREFIX"] = prefix  # children inherit it
    ipc_dir = tempfile.mkdtemp(prefix="omnilink-kill-")
    os.chmod(ipc_dir, 0o700)
    rng = random.Random(args.seed)
    report: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "trials": args.trials,
        "cases": {},
    }
    try:
        for case in cases:
            rows = []
            start = time.monotonic()
            for trial in range(args.trials):
                if case == "shm-replace":
                    row = shm_trial(trial, rng)
                else:
                    row = zmq_trial(trial, case == "zmq-after", ipc_dir, rng)
                row["leftovers"] = leftovers(prefix, ipc_dir)
                rows.append(row)
                if not args.json:
                    print(f"{case} trial {trial}: {'recovered' if row['recovered'] else 'FAILED ' + row['why']}"
                          f"{'' if not row['leftovers'] else ' leftovers ' + str(row['leftovers'])}", flush=True)
            report["cases"][case] = {
                "recovered": sum(r["recovered"] for r in rows),
                "trials": len(rows),
                "with_leftovers": sum(bool(r["leftovers"]) for r in rows),
                "seconds": round(time.monotonic() - start, 1),
                "failures": [r["why"] for r in rows if not r["recovered"]],
                "rows": rows,
            }
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"machine: {report['machine']}")
        for case, r in report["cases"].items():
            print(f"{case:12s} recovered {r['recovered']}/{r['trials']}, trials with leftovers after gc: "
                  f"{r['with_leftovers']}, {r['seconds']} s")
    ok = all(r["recovered"] == r["trials"] and not r["with_leftovers"] for r in report["cases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
