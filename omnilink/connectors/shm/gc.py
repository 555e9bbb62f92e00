"""``omnilink gc`` for the shm backend: remove what dead processes left in ``/dev/shm``.

Arenas, their semaphores and overflow segments carry their owner's pid in the name
(see ``names``) and go once that pid is dead; a channel's control segment and its
semaphores go once no live process is registered in it. Runs under the host lock, so
no process joins or leaves a channel meanwhile.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from typing import Any

import posix_ipc

from omnilink._errors import ConfigurationError
from omnilink.connectors.shmem import (
    SHM_DIR,
    HostLock,
    parse_channel_name,
    parse_owned_name,
    pid_alive,
    read_prefix,
)
from omnilink.connectors.shm.segments import CTRL_MAGIC, CTRL_SIZE, MAX_PARTICIPANTS, _C_PART, _PART

__all__ = ["collect_cuda_event_files", "collect_garbage"]

logger = logging.getLogger(__name__)


def collect_garbage(*, prefix: str | None = None, dry_run: bool = False) -> list[str]:
    """Remove omnilink shared-memory objects whose owners died.

    Looks at every ``/dev/shm`` entry whose name starts with ``prefix``: arenas, their
    semaphores and overflow segments are removed when the pid in their name is dead;
    a channel's control segment and semaphores when no live process is registered on
    the channel.

    Parameters
    ----------
    prefix : str, optional
        Name prefix; default ``OMNILINK_SHM_PREFIX`` or ``omnilink``.
    dry_run : bool
        Only report what would be removed.

    Returns
    -------
    list of str
        The ``/dev/shm`` entry names removed (or that would be), sorted.

    Raises
    ------
    ConfigurationError
        ``prefix`` is not a valid name prefix.
    """
    if prefix is None:
        prefix = read_prefix()
    elif not isinstance(prefix, str) or not prefix or "/" in prefix or "\0" in prefix:
        raise ConfigurationError(f"prefix must be a non-empty file-name prefix, got {prefix!r}")
    removed: list[str] = []
    alive: dict[int, bool] = {}

    def is_alive(pid: int) -> bool:
        ok = alive.get(pid)
        if ok is None:
            ok = alive[pid] = pid_alive(pid)
        return ok

    def remove(entry: str) -> None:
        removed.append(entry)
        if not dry_run:
            _unlink(entry)

    with HostLock():
        try:
            entries = os.listdir(SHM_DIR)
        except FileNotFoundError:
            return []
        channels: dict[str, list[str]] = {}
        for entry in entries:
            owned = parse_owned_name(entry, prefix)
            if owned is not None:
                if not is_alive(owned[1]):
                    remove(entry)
                continue
            ch = parse_channel_name(entry, prefix)
            if ch is not None:
                channels.setdefault(ch[0], []).append(entry)
        for ctrl_name, group in channels.items():
            if ctrl_name[1:] in group and _channel_has_live(ctrl_name, is_alive):
                continue
            for entry in group:
                remove(entry)
    if removed:
        logger.info("shm gc: %s %d entr%s: %s", "would remove" if dry_run else "removed",
                    len(removed), "y" if len(removed) == 1 else "ies", ", ".join(sorted(removed)))
    return sorted(removed)


def _channel_has_live(ctrl_name: str, is_alive: Any) -> bool:
    """Whether any live process is registered in control segment ``ctrl_name``.

    Read without the channel mutex (its holder may be the dead one); under the host lock
    no one joins or leaves meanwhile, and a live participant's own entry never vanishes
    while it runs.
    """
    try:
        shm = posix_ipc.SharedMemory(ctrl_name)
    except posix_ipc.Error:
        return False
    try:
        if shm.size < CTRL_SIZE:
            return False
        mm = mmap.mmap(shm.fd, CTRL_SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        shm.close_fd()
    try:
        if bytes(mm[0:8]) != CTRL_MAGIC:
            return False
        for i in range(MAX_PARTICIPANTS):
            pid = _PART.unpack_from(mm, _C_PART + i * _PART.size)[0]
            if pid and is_alive(pid):
                return True
        return False
    finally:
        mm.close()


#: ``/dev/shm`` files of the CUDA driver's interprocess events: ``cuda.shm.<n>.<pid in
#: hex>.<n>``. The driver makes one for a process that creates an interprocess event
#: (the ``cuda_ipc`` backend and the shm connector's device IPC do) and leaves it behind
#: when that process exits, cleanly or not.
_CUDA_EVENT_FILE = re.compile(r"cuda\.shm\.[0-9]+\.([0-9a-f]+)\.[0-9]+")


def collect_cuda_event_files(*, dry_run: bool = False) -> list[str]:
    """Remove the CUDA driver's interprocess-event files of processes that are gone.

    The driver names each ``/dev/shm/cuda.shm.<n>.<pid in hex>.<n>`` after the process
    that created interprocess events and never removes it, not even at a clean exit.
    A file is removed only when it is ours (same uid) and no process with its pid runs;
    a pid that was reused by a live process keeps its file.

    Parameters
    ----------
    dry_run : bool
        Only report what would be removed.

    Returns
    -------
    list of str
        The ``/dev/shm`` entry names removed (or that would be), sorted.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    uid = os.getuid()
    for entry in entries:
        m = _CUDA_EVENT_FILE.fullmatch(entry)
        if m is None:
            continue
        path = os.path.join(SHM_DIR, entry)
        try:
            if os.stat(path).st_uid != uid or pid_alive(int(m.group(1), 16)):
                continue
        except FileNotFoundError:
            continue
        removed.append(entry)
        if not dry_run:
            _unlink(entry)
    if removed:
        logger.info("shm gc: %s %d CUDA event file%s: %s", "would remove" if dry_run else "removed",
                    len(removed), "" if len(removed) == 1 else "s", ", ".join(sorted(removed)))
    return sorted(removed)


def _unlink(entry: str) -> None:
    """Remove ``/dev/shm/<entry>`` (already gone: nothing to do)."""
    try:
        os.unlink(os.path.join(SHM_DIR, entry))
    except FileNotFoundError:
        pass
