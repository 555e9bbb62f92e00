"""What a result was measured on: CPU, cores, memory, ``/dev/shm``, library versions.

The record is hostname-free on purpose: committed results must not leak machine names.
Nothing here initialises CUDA: CUDA devices are listed only when torch is already
importable and ``torch.cuda.is_available()`` says so.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

__all__ = ["cpu_model", "cuda_devices", "machine_record", "shm_usage", "versions"]

SHM_DIR = "/dev/shm"

_DISTRIBUTIONS = {
    "omnilink": "pyomnilink",  # the distribution; the import name is omnilink
    "torch": "torch",
    "numpy": "numpy",
    "msgspec": "msgspec",
    "pyzmq": "pyzmq",
    "posix_ipc": "posix_ipc",
}


def versions() -> dict[str, str | None]:
    """Installed versions of Python and of the libraries the transfers depend on.

    Read from the package metadata, so nothing is imported (``None`` when absent).
    """
    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in _DISTRIBUTIONS.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    if out["omnilink"] is None:
        # A source checkout run without installing: take the package's own version.
        import omnilink

        out["omnilink"] = omnilink.__version__
    try:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    except ImportError:
        out["libzmq"] = None
    return out


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def shm_usage(path: str = SHM_DIR) -> dict[str, int] | None:
    """``{"size_bytes", "free_bytes"}`` of the filesystem at ``path``, or ``None``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return {"size_bytes": st.f_frsize * st.f_blocks, "free_bytes": st.f_frsize * st.f_bavail}


def cuda_devices() -> list[dict[str, Any]]:
    """CUDA devices visible to torch; empty (and CUDA untouched) when there are none."""
    try:
        import torch
    except ImportError:
        return []
    # is_available() asks the driver for a device count without creating a context.
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "memory_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    return devices


def machine_record(*, include_cuda: bool = False) -> dict[str, Any]:
    """The machine a benchmark ran on (no hostname).

    Parameters
    ----------
    include_cuda : bool
        List CUDA devices (only the ``gpu`` scenario asks; the CPU scenarios leave CUDA
        alone).

    Returns
    -------
    dict
        ``cpu``, ``cores`` (logical), ``memory_bytes``, ``shm`` (size/free of
        ``/dev/shm``), ``os``, ``arch``, ``versions`` and, if asked, ``cuda_devices``.
    """
    rec: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "shm": shm_usage(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "implementation": sys.implementation.name,
        "versions": versions(),
    }
    if include_cuda:
        rec["cuda_devices"] = cuda_devices()
    return rec
