"""Suite-wide fixtures.

Every shared-memory object omnilink creates is named with the prefix in
``OMNILINK_SHM_PREFIX`` (default ``omnilink``). This suite sets a prefix of its own, so
that the leak check below sees only what this test run made, even when other runs share
``/dev/shm``, and fails any test that leaves such an entry behind (torch's leak checker
does the same for its tests).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Property tests: ``make test`` (and so ``.ci/run``) draws the same examples every run
# (``derandomize``: a seed from each test's name), so a change that breaks one fails
# every time and an unchanged tree never fails by the draw; ``HYPOTHESIS_PROFILE=explore``
# draws new examples each run, to go looking for bugs (a failure found that way is kept
# as an ``@example``).
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("gate", derandomize=True)
    _hypothesis_settings.register_profile("explore", derandomize=False)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gate"))
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass

os.environ.setdefault("OMNILINK_SHM_PREFIX", f"omnilink-t{os.getpid()}")
SHM_PREFIX = os.environ["OMNILINK_SHM_PREFIX"]
SHM_DIR = "/dev/shm"


def shm_entries() -> set[str]:
    """Names in /dev/shm (segments and ``sem.`` semaphores) made by this test run."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return set()
    return {n for n in names if n.startswith(SHM_PREFIX) or n.startswith("sem." + SHM_PREFIX)}


@pytest.fixture(autouse=True)
def no_shm_leak():
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    if leaked:
        # Clean up so one leak does not cascade into every later test, then fail.
        for name in leaked:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        pytest.fail(f"test left shared-memory entries in {SHM_DIR}: {sorted(leaked)}")


@pytest.fixture
def procs():
    """Child processes a test started (``tests.procs.start_process``); any still alive
    at teardown are killed, so a failing test cannot leave one running."""
    started: list = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


@pytest.fixture
def ipc_dir():
    """A short private (0700) folder for ipc:// sockets (paths are limited to 107
    bytes); fails the test if a connector left a file in it."""
    path = tempfile.mkdtemp(prefix="olz-")
    try:
        yield path
        left = os.listdir(path)
        assert not left, f"zmq connectors left files behind: {left}"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        two = False
        try:
            import torch

            two = torch.cuda.device_count() >= 2
        except Exception:  # pragma: no cover - defensive
            two = False
        if two:
            return
        skip2 = pytest.mark.skip(reason="needs two CUDA devices; this machine has fewer")
        for item in items:
            if item.get_closest_marker("multigpu") is not None:
                item.add_marker(skip2)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        # Markers, not keywords: a keyword match would also catch a directory named "gpu".
        if item.get_closest_marker("gpu") is not None or item.get_closest_marker("multigpu") is not None:
            item.add_marker(skip)


def _current_cuda_device() -> int | None:
    """This thread's current CUDA device, or None where CUDA was not started (a CPU test
    never starts it here)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


@pytest.fixture(autouse=True)
def cuda_device_given_back():
    """omnilink gives the caller's current CUDA device back after every call (it makes a
    link's device current only for its own CUDA calls): a test that ends with another
    device current than it began with fails, and the device is restored so later tests
    (which default to the current device) are not misled."""
    before = _current_cuda_device()
    yield
    after = _current_cuda_device()
    if before is None:
        before = 0  # CUDA started during the test: a fresh process has cuda:0 current
    if after is not None and after != before:
        import torch

        torch.cuda.set_device(before)
        pytest.fail(f"the test ended with cuda:{after} current, not cuda:{before}")
