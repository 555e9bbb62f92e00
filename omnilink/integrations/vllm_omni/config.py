"""Options of ``OmnilinkConnector`` (the stage config's ``extra`` dict) and their checks."""

from __future__ import annotations

from typing import Any

from omnilink._errors import ConfigurationError

#: The name stage configs use for this connector.
CONNECTOR_NAME = "OmnilinkConnector"
_BASE_MODULE = "vllm_omni.distributed.omni_connectors.connectors.base"
_FACTORY_MODULE = "vllm_omni.distributed.omni_connectors.factory"
_INSTALL_HINT = "pip install vllm-omni (or, without vLLM, pip install --no-deps vllm-omni)"

DEFAULT_CHANNEL = "vllm-omni"
DEFAULT_PUT_TIMEOUT = 10.0
DEFAULT_PENDING_TTL = 1800.0
DEFAULT_MAX_TRACKED_KEYS = 65536
#: Seconds between two sweeps of the per-request index (a sweep is cheap; this only
#: keeps it off the per-call path).
_REAP_INTERVAL = 1.0
_ROLES = ("sender", "receiver", "dual")
#: keys of ``extra`` this adapter or vLLM-Omni owns; ``options`` must not repeat the
#: two the adapter sets itself
_RESERVED_OPTIONS = ("channel", "role")


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
