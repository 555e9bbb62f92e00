"""The shm defaults work in a default container: ``/dev/shm`` limited to 64 MiB.

Each test runs its program in a private mount namespace (``unshare -m``) whose
``/dev/shm`` is a fresh 64 MiB tmpfs, as in ``docker run`` without ``--shm-size``: the
host's ``/dev/shm`` is not touched, and the tmpfs vanishes with the namespace. Skipped,
with the reason, where mounting is not permitted (not root, no ``unshare``).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _can_mount() -> str | None:
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    if os.geteuid() != 0:
        return "mounting a tmpfs on /dev/shm in a mount namespace needs root"
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"mount in a private namespace is not permitted here: {r.stderr.strip()}"


_WHY = _can_mount()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _in_64mib_shm(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with ``/dev/shm`` a fresh, empty 64 MiB tmpfs; check it is left empty."""
    script = ('mount -t tmpfs -o size=64m tmpfs /dev/shm && "$@"; rc=$?; '
              'left=$(ls -A /dev/shm); [ -z "$left" ] || { echo "left in /dev/shm: $left" >&2; exit 99; }; '
              'exit $rc')
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *argv],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)


def test_the_quickstart_runs_in_a_64mib_dev_shm():
    r = _in_64mib_shm(sys.executable, str(REPO / "examples" / "quickstart.py"))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "quickstart: ok" in r.stdout


_DEFAULTS = textwrap.dedent(
    """
    import os
    import numpy as np
    import omnilink
    from omnilink.connectors.shmem import free_shm_bytes

    MiB = 1 << 20
    assert 60 * MiB < free_shm_bytes() <= 64 * MiB, free_shm_bytes()
    with omnilink.connect("shm", channel="job1/thinker-talker", role="sender") as tx, \\
         omnilink.connect("shm", channel="job1/thinker-talker", role="receiver") as rx:
        # A quarter of the free space, growing up to half of it.
        assert tx.arena_bytes == 16 * MiB and tx.max_bytes == 32 * MiB, (tx.arena_bytes, tx.max_bytes)
        for i, n in enumerate((4096, 8 * MiB, 24 * MiB)):  # the last is larger than the arena
            tx.put(f"req_{i}", {"x": np.full(n, i % 251, dtype=np.uint8)}, timeout=10.0)
            got = rx.get(f"req_{i}", timeout=10.0)
            assert got["x"].shape == (n,) and int(got["x"][-1]) == i % 251
            del got
        # Only a payload /dev/shm cannot hold at all is an error, and it says what to do.
        try:
            tx.put("huge", {"x": np.zeros(80 * MiB, dtype=np.uint8)}, timeout=10.0)
        except omnilink.CapacityError as exc:
            assert "--shm-size" in str(exc), exc
        else:
            raise AssertionError("an 80 MiB payload fitted a 64 MiB /dev/shm")
    print("defaults: ok")
    """
)


def test_default_arena_fits_and_only_an_impossible_payload_fails():
    r = _in_64mib_shm(sys.executable, "-c", _DEFAULTS)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "defaults: ok" in r.stdout


def test_info_warns_that_dev_shm_is_smaller_than_the_default_arena():
    r = _in_64mib_shm(sys.executable, "-m", "omnilink", "info")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "warning: /dev/shm has 64.0 MiB free, less than the default 128 MiB arena" in r.stdout, r.stdout
    assert "--shm-size" in r.stdout
