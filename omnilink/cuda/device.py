"""Moving a decoded payload to a device (the receiver's ``get(..., device=...)``)."""

from __future__ import annotations

from typing import Any

from omnilink._errors import ConfigurationError, CudaError

__all__ = ["payload_to_device"]


def payload_to_device(obj: Any, device: Any) -> Any:
    """Return ``obj`` with every torch tensor moved to ``device`` (other leaves kept; a
    tensor already there is kept as it is).

    Raises
    ------
    ConfigurationError
        ``device`` is not a valid torch device string.
    CudaError
        A CUDA device was asked for where CUDA is unavailable.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"invalid device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CudaError(f"device {device!r} requested but CUDA is not available in this process")

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(dev, non_blocking=False)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, list):
            return [move(v) for v in x]
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        return x

    try:
        return move(obj)
    except RuntimeError as exc:
        raise CudaError(f"moving payload to {device!r} failed: {exc}") from exc
