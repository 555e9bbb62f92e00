"""The bounded CI run of ``benchmarks/fuzz_hostile.py``: 2,000 hostile inputs across the
decoder (deep trees included), the shm segments (descriptors, header, released ring,
control segment, written by a second process), zmq frames, the nccl side-channel header
and cuda_ipc manifests (CPU double), each in a worker process that reports escaped
non-omnilink exceptions, crashes, hangs, calls that overran their timeout and the peak
RSS each input added. The long run (100,000+ inputs) is the same script with
``--inputs 100000``; its figures are in the CHANGELOG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("zmq")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fuzz_hostile.py")


def test_hostile_inputs_raise_only_omnilink_errors():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--inputs", "2000", "--batch", "1000", "--hang-s", "30", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["targets"]) == {"decoder", "shm", "zmq", "nccl", "cuda_ipc"}
    for target, r in report["targets"].items():
        assert r["inputs"] >= 200, (target, r["inputs"])
        assert r["non_omnilink_exceptions"] == 0, (target, r["findings"])
        assert r["crashes"] == 0 and r["hangs"] == 0, (target, r["crash_inputs"], r["hang_inputs"])
        assert r["inputs_over_rss_bound"] == 0, (target, r["worst_over_bound"])
        assert r["overruns"] == 0, (target, r["worst_overruns"])
    assert report["targets"]["shm"]["timed_calls"] >= 400  # the live calls were made
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_fuzzer_reports_a_foreign_exception(tmp_path):
    # The harness itself must be able to fail: a decoder that lets a foreign exception
    # out (here: patched in through a sitecustomize module) is reported as a finding.
    (tmp_path / "sitecustomize.py").write_text(
        "import omnilink, omnilink.blob as b\n"
        "_real = b.decode\n"
        "def _bad(buf, *a, **k):\n"
        "    if len(buf) % 7 == 0:\n"
        "        raise KeyError('planted')\n"
        "    return _real(buf, *a, **k)\n"
        "omnilink.decode = _bad\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--inputs", "100", "--targets", "decoder", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    r = report["targets"]["decoder"]
    assert r["non_omnilink_exceptions"] > 0 and "planted" in r["findings"][0]["error"]
    assert proc.returncode == 1
