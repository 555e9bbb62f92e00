"""Options of ``OmnilinkConnector`` (the stage config's ``extra`` dict) and their checks."""

from __future__ import annotations

from typing import Any

from omnilink._errors import ConfigurationError

#: The name stage configs use for this connector.
CONNECTOR_NAME = "OmnilinkConnector"
_BASE_MODULE = "vllm_omni.distributed.omni_connectors.connectors.base"
_FACTORY_MODULE = "vllm_omni.distributed.omni_connectors.factory"
_DIST = "vllm-omni"

DEFAULT_CHANNEL = "vllm-omni"
DEFAULT_PUT_TIMEOUT = 10.0
DEFAULT_PENDING_TTL = 1800.0
DEFAULT_MAX_TRACKED_KEYS = 65536
#: Seconds a request may hold a received payload's views before the adapter logs it
#: (once per request; ``None`` turns it off).
DEFAULT_HOLD_WARN_S = 120.0
#: vLLM-Omni's environment variable (and its default, 0.30.0) bounding how long a request
#: may wait for stage input before the scheduler fails it; 0 disables that deadline.
INPUT_WAIT_TIMEOUT_ENV = "VLLM_OMNI_INPUT_WAIT_TIMEOUT_S"
DEFAULT_INPUT_WAIT_TIMEOUT = 600.0
#: Seconds between two sweeps of the per-request index (a sweep is cheap; this only
#: keeps it off the per-call path).
_REAP_INTERVAL = 1.0
_ROLES = ("sender", "receiver", "dual")
#: keys of ``extra`` this adapter or vLLM-Omni owns; ``options`` must not repeat the
#: two the adapter sets itself
_RESERVED_OPTIONS = ("channel", "role")


def import_failure(exc: ImportError) -> str:
    """Say why vLLM-Omni could not be imported and what to install, from ``exc``.

    Three cases need three answers: the distribution is absent (install it); it is
    installed but one of its own dependencies is missing, typically after
    ``pip install --no-deps vllm-omni`` (install it with its dependencies: naming the
    package again would not help); or the missing module is vLLM-Omni's own (a broken or
    partial install: reinstall).
    """
    from importlib import metadata
    from importlib.util import find_spec

    missing = getattr(exc, "name", None)
    try:
        version: str | None = metadata.version(_DIST)
    except metadata.PackageNotFoundError:
        version = None
    try:
        present = find_spec("vllm_omni") is not None
    except (ImportError, ValueError):
        present = False
    if version is None and not present:
        return (
            f"vLLM-Omni is not installed ({exc}); install it where your vLLM-Omni "
            f"deployment runs: pip install {_DIST}"
        )
    pin = f"=={version}" if version else ""
    if missing and missing.split(".")[0] != "vllm_omni":
        return (
            f"vLLM-Omni{' ' + version if version else ''} is installed but only partly importable: "
            f"its dependency {missing.split('.')[0]!r} is missing ({exc}), as after "
            f"`pip install --no-deps {_DIST}`. Install its dependencies (vLLM among them): "
            f"pip install {_DIST}{pin}, without --no-deps. register() is meant for the "
            "processes vLLM-Omni runs in, where it imports in full"
        )
    return (
        f"vLLM-Omni{' ' + version if version else ''} is installed but importing it failed ({exc}); "
        f"the install looks incomplete: pip install --force-reinstall --no-deps {_DIST}{pin}"
    )


def _check_int(extra: dict[str, Any], name: str, minimum: int) -> None:
    value = extra.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"OmnilinkConnector: extra[{name!r}] must be an int >= {minimum}, got {value!r}")


def _seconds(extra: dict[str, Any], name: str, default: float | None, *, allow_none: bool) -> float | None:
    value = extra.get(name, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigurationError(
            f"OmnilinkConnector: extra[{name!r}] must be a number of seconds >= 0"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )
    return float(value)


def default_reclaim_after(environ: Any = None) -> float | None:
    """``reclaim_after`` when the stage config does not set it: the engine's input wait
    timeout, ``VLLM_OMNI_INPUT_WAIT_TIMEOUT_S`` (600 s when unset, as in vLLM-Omni).

    ``None`` (no reclaim) when it is 0: the engine then lets a request wait for its input
    forever, so no age proves a payload abandoned.

    Raises
    ------
    ConfigurationError
        The variable is not a finite number >= 0 (vLLM-Omni refuses to start then too).
    """
    import math
    import os

    env = os.environ if environ is None else environ
    raw = env.get(INPUT_WAIT_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_INPUT_WAIT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        # vLLM-Omni warns and falls back to its default: do the same.
        return DEFAULT_INPUT_WAIT_TIMEOUT
    if not math.isfinite(value) or value < 0:
        raise ConfigurationError(
            f"OmnilinkConnector: {INPUT_WAIT_TIMEOUT_ENV}={raw!r} must be a finite number of seconds >= 0 "
            "(or set extra['reclaim_after'])"
        )
    return None if value == 0 else value
