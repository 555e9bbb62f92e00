"""Shared-memory segments in ``/dev/shm``: create (0600, space reserved and pre-faulted),
open, unlink, and the free-space check with its advice.

What every segment omnilink creates goes through: the ``shm`` backend's arenas, overflow
and extension segments, and the device pool's directory. Python's
``multiprocessing.resource_tracker`` is never involved (``posix_ipc``).
"""

from __future__ import annotations

import mmap
import os

import posix_ipc

from omnilink._errors import CapacityError, TransportError
from omnilink.connectors.shmem.names import SHM_DIR, free_shm_bytes

__all__ = [
    "MAP_FLAGS",
    "MODE",
    "PAGE",
    "PROT",
    "create_segment",
    "open_segment",
    "preflight",
    "shm_error",
    "shm_size_advice",
    "unlink_segment",
    "unlink_semaphore",
]

PAGE = mmap.PAGESIZE
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
PROT = mmap.PROT_READ | mmap.PROT_WRITE
#: Every segment and semaphore is the creating user's alone.
MODE = 0o600


def shm_error(what: str, exc: BaseException) -> TransportError:
    """A ``posix_ipc`` or OS error of ``what``, as omnilink's ``TransportError``."""
    return TransportError(f"shm: {what} failed: {exc}")


def _nice_size(nbytes: int) -> tuple[str, str, str]:
    """``nbytes`` rounded up to a size people type: (docker, mount, Kubernetes) spellings."""
    if nbytes <= 1 << 30:
        mib = -(-nbytes // (64 << 20)) * 64
        return f"{mib}m", f"{mib}M", f"{mib}Mi"
    gib = -(-nbytes // (1 << 30))
    return f"{gib}g", f"{gib}G", f"{gib}Gi"


def shm_size_advice(nbytes: int, free: int) -> str:
    """How to make room for ``nbytes`` more in ``/dev/shm``, sized from what was asked.

    The suggested size is what ``/dev/shm`` holds now plus ``nbytes``, with a quarter of
    headroom, rounded up (to 64 MiB steps below 1 GiB, whole GiB above); the smaller
    ``arena_bytes=`` is the largest power of two that fits in what is free now.
    """
    try:
        st = os.statvfs(SHM_DIR)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:  # pragma: no cover - /dev/shm unreadable; size from the request alone
        used = 0
    docker, mount, k8s = _nice_size((used + nbytes) * 5 // 4)
    advice = (
        f"Give /dev/shm room for it: docker run --shm-size={docker}; Kubernetes: an emptyDir "
        f"with medium: Memory and sizeLimit: {k8s}; on a host: mount -o remount,size={mount} "
        "/dev/shm"
    )
    fit_mib = (free * 9 // 10) >> 20
    if fit_mib >= 1:
        fits = 1 << (fit_mib.bit_length() - 1)  # MiB, a power of two
        return f"{advice}; or pass arena_bytes={fits << 20} ({fits} MiB) or less to omnilink.connect('shm', ...)"
    return f"{advice}; or pass a smaller arena_bytes= to omnilink.connect('shm', ...)"


def preflight(nbytes: int, what: str) -> None:
    """Fail with an actionable error when ``/dev/shm`` cannot hold ``nbytes`` more."""
    free = free_shm_bytes()
    if free < nbytes:
        raise CapacityError(
            f"shm: {what} needs {nbytes / 2**20:.1f} MiB but /dev/shm has only "
            f"{free / 2**20:.1f} MiB free. {shm_size_advice(nbytes, free)}"
        )


def create_segment(name: str, size: int, what: str) -> mmap.mmap:
    """Create segment ``name`` (mode 0600), reserve and pre-fault its pages, map it.

    ``posix_fallocate`` makes tmpfs allocate every page now: a full ``/dev/shm`` is a
    clean ``CapacityError`` here instead of a SIGBUS on some later write, and the first
    ``put`` does not pay page faults. ``MAP_POPULATE`` also fills the page tables.
    """
    preflight(size, what)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, MODE, size)
    except posix_ipc.Error as exc:
        raise shm_error(f"creating {name}", exc) from exc
    try:
        try:
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as exc:
            raise CapacityError(
                f"shm: reserving {size / 2**20:.1f} MiB for {what} in /dev/shm failed "
                f"({exc}). {shm_size_advice(size, free_shm_bytes())}"
            ) from exc
        return mmap.mmap(shm.fd, size, flags=MAP_FLAGS, prot=PROT)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        shm.close_fd()


def open_segment(name: str) -> mmap.mmap:
    """Map an existing segment (raises ``posix_ipc.ExistentialError`` if it is gone)."""
    shm = posix_ipc.SharedMemory(name)
    try:
        return mmap.mmap(shm.fd, shm.size, flags=MAP_FLAGS, prot=PROT)
    finally:
        shm.close_fd()


def unlink_segment(name: str) -> bool:
    """Remove shared-memory segment ``name``; ``False`` if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def unlink_semaphore(name: str) -> bool:
    """Remove named semaphore ``name``; ``False`` if it was already gone."""
    try:
        posix_ipc.unlink_semaphore(name)
        return True
    except posix_ipc.ExistentialError:
        return False
