"""``benchmarks/trace_nixl.py`` on the host (UCX over tcp on loopback): the untraced
figure and both processes' functions are reported, and the timeline is on one clock
(the receiver handles a payload after the sender published it, and soon after)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from omnilink.connectors import backend_unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REASON = backend_unavailable("nixl")


@pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")
def test_trace_nixl_host_short():
    env = dict(os.environ, UCX_TLS="tcp")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "trace_nixl.py"), "--n", "40", "--warm", "15",
         "--timeout", "120"],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    m = re.search(r"untraced p50 ([\d.]+) us per message .* traced ([\d.]+) us", out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] in ("sender", "receiver"):
            rows[(parts[0], parts[4])] = (float(parts[1]), float(parts[2]))
    put = rows[("sender", "nixl.connector._Sender.put")]
    send = rows[("sender", "nixl.connector._Sender._send_bell")]
    publish = rows[("receiver", "nixl.connector._Receiver._publish")]
    # One clock: the receiver takes the publish after the sender sent it, within the
    # same few milliseconds (clocks of two processes that differed would put it seconds
    # away, or before). The put itself does not wait for the receiver's answer.
    assert put[0] < send[0] < publish[0] < send[0] + 20_000, (send, publish, put)
    assert ("sender", "blob.prepare") in rows and ("receiver", "blob.decode_parsed") in rows
