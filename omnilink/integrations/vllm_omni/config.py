"""Options of ``OmnilinkConnector`` (the stage config's ``extra`` dict) and their checks."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
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

#: Keys of ``extra`` this adapter reads (see the package docstring's table).
ADAPTER_KEYS = (
    "backend", "channel", "options", "put_timeout", "zero_copy", "device", "pending_ttl",
    "max_tracked_keys", "hold_warn_s", "reclaim_after", "pass_through",
    "codec_chunk_frames", "codec_left_context_frames", "initial_codec_chunk_frames",
)
#: Keys vLLM-Omni 0.30.0 puts into a connector's ``extra`` itself
#: (``resolve_connector_spec``, ``get_connectors_config_for_stage``).
INJECTED_KEYS = ("stage_id", "role", "from_stage", "to_stage")
#: Keys vLLM-Omni 0.30.0's stage input processors and code2wav models read from the
#: ``extra`` of the connector of their stage (``model_executor/stage_input_processors``,
#: ``audex_code2wav``): accepted as they are, vLLM-Omni checks their values. A key a
#: newer vLLM-Omni or a custom processor reads is named in ``extra["pass_through"]``.
VLLM_OMNI_KEYS = (
    "codec_chunk_adaptive", "codec_chunk_frames_at_begin", "codec_chunk_min_frames",
    "codec_chunk_ramp", "codec_chunk_ramp_delta_min", "codec_chunk_ramp_divisor",
    "codec_chunk_safety_margin_ms", "codec_max_chunk_frames", "codec_pre_lookahead_frames",
    "codec_right_holdback_frames", "codec_stream_scale_factor", "codec_token_offset",
    "codec_vocab_size", "crossfade_sec", "decoder_emit_chunk_frames", "fish_speech_tensor_codes",
    "initial_latent_chunk_size", "latent_chunk_size", "latent_left_context", "native_talker",
    "ref_code_context_frames",
)


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


@dataclass(frozen=True)
class ExtraSettings:
    """What ``check_extra`` made of a connector's ``extra``: every value checked."""

    role: str
    backend: str
    channel: str
    options: dict[str, Any]
    put_timeout: float | None
    pending_ttl: float | None
    hold_warn_s: float | None
    reclaim_after: float | None
    zero_copy: bool
    device: str | None
    max_tracked_keys: int


def _unknown_keys(extra: dict[str, Any]) -> None:
    passed = extra.get("pass_through", ())
    if passed is None:
        passed = ()
    if isinstance(passed, str) or not isinstance(passed, (list, tuple)) or not all(
        isinstance(k, str) for k in passed
    ):
        raise ConfigurationError(
            f"OmnilinkConnector: extra['pass_through'] must be a list of key names, got {passed!r}"
        )
    known = (*ADAPTER_KEYS, *INJECTED_KEYS, *VLLM_OMNI_KEYS, *passed)
    unknown = [k for k in extra if k not in known]
    if not unknown:
        return
    parts = []
    for key in unknown:
        if not isinstance(key, str):
            parts.append(f"{key!r} (keys are strings)")
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        parts.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise ConfigurationError(
        f"OmnilinkConnector: unknown key{'s' if len(unknown) > 1 else ''} in extra: {', '.join(parts)}. "
        f"OmnilinkConnector reads {', '.join(ADAPTER_KEYS)}; backend options go under extra['options']; "
        "a key vLLM-Omni itself reads that omnilink does not know goes into extra['pass_through'] "
        "(a list of names)"
    )


def _check_device(device: Any) -> str | None:
    """``device`` as a torch device string, refused where it could never be used."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise ConfigurationError(f"OmnilinkConnector: extra['device'] must be a device string, got {device!r}")
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigurationError(f"OmnilinkConnector: extra['device'] {device!r} is not a device: {exc}") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise ConfigurationError(
                f"OmnilinkConnector: extra['device'] is {device!r} but this process sees "
                f"{count} CUDA device(s); received payloads could never land there"
            )
    elif dev.type != "cpu":
        raise ConfigurationError(
            f"OmnilinkConnector: extra['device'] must be 'cpu' or a CUDA device, got {device!r}"
        )
    return device


def check_extra(extra: Any, *, environ: Any = None, probe: bool = True) -> ExtraSettings:
    """Check a whole ``extra`` dict of ``OmnilinkConnector``, backend options included.

    The one check of a connector's configuration: ``OmnilinkConnector`` runs it at
    construction, for every role, and ``omnilink check`` runs it on each omnilink edge of
    a deployment file. Nothing is opened.

    Parameters
    ----------
    extra : dict
        The stage config's ``extra`` (with what vLLM-Omni injects, or without).
    environ : mapping, optional
        Environment to read ``VLLM_OMNI_INPUT_WAIT_TIMEOUT_S`` from (default
        ``os.environ``).
    probe : bool
        Also refuse what cannot work in this process: a backend that cannot be loaded
        or used here (``cuda_ipc`` without CUDA), a ``device`` this process does not
        have. ``omnilink check`` reports those apart from the file's own errors.

    Returns
    -------
    ExtraSettings

    Raises
    ------
    ConfigurationError
        An unknown key (with "did you mean"), a value of the wrong type or range, an
        unknown backend or backend option, or a backend option value its constructor
        would refuse (checked by the backend's signature and ``check_options``, for each
        side this role opens), or, with ``probe``, a backend or device unusable here. The message names the key.
    """
    from omnilink._util import validate_channel
    from omnilink.connectors import available_backends, backend_unavailable, check_backend_options

    if not isinstance(extra, dict):
        raise ConfigurationError(f"OmnilinkConnector config must be a dict, got {type(extra).__name__}")
    _unknown_keys(extra)
    role = extra.get("role")
    if role in (None, "auto"):
        role = "dual"
    if role not in _ROLES:
        raise ConfigurationError(f"OmnilinkConnector: extra['role'] must be one of {_ROLES}, got {role!r}")
    for name in ("stage_id", "from_stage", "to_stage"):
        value = extra.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise ConfigurationError(f"OmnilinkConnector: extra[{name!r}] must be a stage id, got {value!r}")
    backend = extra.get("backend", "shm")
    if not isinstance(backend, str) or not backend:
        raise ConfigurationError(f"OmnilinkConnector: extra['backend'] must be a backend name, got {backend!r}")
    names = available_backends()
    if backend not in names:
        close = difflib.get_close_matches(backend, names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(
            f"OmnilinkConnector: unknown backend {backend!r}{hint} in extra['backend']; "
            f"available: {', '.join(names)}"
        )
    if probe:
        why = backend_unavailable(backend)
        if why is not None:
            raise ConfigurationError(f"OmnilinkConnector: extra['backend'] {backend!r} cannot be used here: {why}")
    prefix = extra.get("channel", DEFAULT_CHANNEL)
    try:
        validate_channel(prefix)
    except ConfigurationError as exc:
        raise ConfigurationError(f"OmnilinkConnector: extra['channel']: {exc}") from exc
    options = extra.get("options", {})
    if options is None:
        options = {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ConfigurationError(
            f"OmnilinkConnector: extra['options'] must be a dict of backend options, got {options!r}"
        )
    for name in _RESERVED_OPTIONS:
        if name in options:
            raise ConfigurationError(
                f"OmnilinkConnector: extra['options'] must not set {name!r}; it comes from the stage edge "
                f"(use extra['channel'] for the channel prefix)"
            )
    options = dict(options)
    put_timeout = _seconds(extra, "put_timeout", DEFAULT_PUT_TIMEOUT, allow_none=True)
    pending_ttl = _seconds(extra, "pending_ttl", DEFAULT_PENDING_TTL, allow_none=True)
    hold_warn_s = _seconds(extra, "hold_warn_s", DEFAULT_HOLD_WARN_S, allow_none=True)
    if "reclaim_after" in extra:
        reclaim_after = _seconds(extra, "reclaim_after", None, allow_none=True)
    else:
        reclaim_after = default_reclaim_after(environ)
    if backend == "shm":
        # The backend with an arena reclaims unread payloads of abandoned requests
        # itself, under pressure and only past the engine's input wait timeout.
        options.setdefault("reclaim_after", reclaim_after)
    # The backend's own schema (its signature) and value checks, for each side this
    # adapter opens (a "dual" stage opens both, one per edge direction): a receiver
    # whose options are wrong would otherwise fail at every get. Some checks depend on
    # the side (a zmq sender cannot connect to tcp://HOST:*, an nccl receiver cannot
    # host a store on port 0).
    for side in ("sender", "receiver") if role == "dual" else (role,):
        check_backend_options(backend, {**options, "role": side}, where="OmnilinkConnector: extra['options']: ")
    if backend == "shm":
        reclaim_after = options["reclaim_after"]
    else:
        reclaim_after = None
    zero_copy = extra.get("zero_copy", True)
    if not isinstance(zero_copy, bool):
        raise ConfigurationError(f"OmnilinkConnector: extra['zero_copy'] must be a bool, got {zero_copy!r}")
    device = _check_device(extra.get("device")) if probe else extra.get("device")
    if not probe and device is not None and not isinstance(device, str):
        raise ConfigurationError(f"OmnilinkConnector: extra['device'] must be a device string, got {device!r}")
    max_tracked = extra.get("max_tracked_keys", DEFAULT_MAX_TRACKED_KEYS)
    if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
        raise ConfigurationError(
            f"OmnilinkConnector: extra['max_tracked_keys'] must be an int >= 1, got {max_tracked!r}"
        )
    _check_int(extra, "codec_chunk_frames", 1)
    _check_int(extra, "codec_left_context_frames", 0)
    _check_int(extra, "initial_codec_chunk_frames", 1)
    return ExtraSettings(
        role=role, backend=backend, channel=prefix, options=options, put_timeout=put_timeout,
        pending_ttl=pending_ttl, hold_warn_s=hold_warn_s, reclaim_after=reclaim_after,
        zero_copy=zero_copy, device=device, max_tracked_keys=max_tracked,
    )


#: vLLM-Omni's plugin group; it loads every plugin of it that ``VLLM_PLUGINS`` allows.
PLUGIN_GROUP = "vllm_omni.general_plugins"
PLUGIN_NAME = "omnilink"
PLUGINS_ENV = "VLLM_PLUGINS"


def plugin_status(environ: Any = None) -> dict[str, Any]:
    """Whether vLLM-Omni would load omnilink's plugin (and so know ``OmnilinkConnector``).

    vLLM-Omni 0.30.0 (``vllm_omni.plugins.load_omni_plugins_by_group``) loads each
    entry point of ``vllm_omni.general_plugins`` whose name is in vLLM's
    ``VLLM_PLUGINS``: unset means all; otherwise the variable is split on commas and
    compared name by name, as written (``"omnilink,other"`` loads it, ``"other, omnilink"``
    does not: the space stays part of the name; an empty value loads none). Imports
    neither vLLM nor vLLM-Omni.

    Returns
    -------
    dict
        ``entry_point`` (``"omnilink = module:function"`` or ``None`` when omnilink is
        not installed as a distribution), ``vllm_plugins`` (the variable, or ``None``),
        ``loads`` (bool) and ``reason`` (one sentence saying why or why not).
    """
    import os
    from importlib.metadata import entry_points

    env = os.environ if environ is None else environ
    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    entry = f"{eps[0].name} = {eps[0].value}" if eps else None
    allowed = env.get(PLUGINS_ENV)
    if entry is None:
        loads = False
        reason = (f"omnilink's {PLUGIN_GROUP} entry point is not installed: pip install pyomnilink "
                  "(a source tree on PYTHONPATH has no entry points)")
    elif allowed is None:
        loads = True
        reason = f"{PLUGINS_ENV} is unset: vLLM-Omni loads every plugin, omnilink's among them"
    else:
        names = allowed.split(",")
        loads = PLUGIN_NAME in names
        if loads:
            reason = f"{PLUGINS_ENV}={allowed!r} names {PLUGIN_NAME!r}"
        elif PLUGIN_NAME in [n.strip() for n in names]:
            reason = (f"{PLUGINS_ENV}={allowed!r} names {PLUGIN_NAME!r} with spaces around it; vLLM compares "
                      f"names as written: write {','.join(n.strip() for n in names)!r}")
        else:
            reason = (f"{PLUGINS_ENV}={allowed!r} does not name {PLUGIN_NAME!r}: vLLM-Omni will not register "
                      f"OmnilinkConnector (\"Unknown connector\"); add it: "
                      f"{PLUGINS_ENV}={','.join([n for n in names if n] + [PLUGIN_NAME])}")
    return {"entry_point": entry, "vllm_plugins": allowed, "loads": loads, "reason": reason}
